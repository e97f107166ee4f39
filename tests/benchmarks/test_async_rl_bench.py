"""``benchmarks/async_rl.py``'s summaries come from its per-step records: :func:`summarize_run` and
:func:`summarize` on synthetic records against sums written out here, the committed results file's
summary recomputed from its own records, and ``--load``'s output and its refusals (no model run)."""

import importlib
import json
import os
import statistics
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
RESULTS = os.path.join(BENCH, "results", "async_rl_cpu.json")


def _load():
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return importlib.import_module("async_rl")


ar = _load()


def _records(rewards, walls, *, lag=None, k3=None):
    out = []
    for i, (r, w) in enumerate(zip(rewards, walls)):
        rec = {
            "step": i + 1,
            "wall": w,
            "reward_mean": r,
            "staleness_max": 0 if lag is None else lag,
            "generate_seconds": 0.1 * (i + 1),
            "logprobs_seconds": 0.01,
            "train_seconds": 0.2,
            "sync_seconds": 0.05,
            "wait_seconds": 0.0 if i % 2 else 0.3,
        }
        if k3 is not None:
            rec["mismatch/k3"] = k3[i]
            rec[f"mismatch/lag{lag}/k3"] = k3[i]
        out.append(rec)
    return out


def test_a_runs_summary_is_its_records_means_after_the_first_step():
    recs = _records([0.1, 0.2, 0.3, 0.4, 0.5], [9.0, 1.0, 2.0, 3.0, 4.0], lag=1, k3=[5.0, 0.1, 0.2, 0.3, 0.4])
    recs[2].pop("mismatch/lag1/k3")  # a step without a lag-1 token does not count in that lag's mean
    s = ar.summarize_run(recs)
    assert s["steps"] == 5
    assert s["wall_per_step"] == pytest.approx((1 + 2 + 3 + 4) / 4)  # step 1 (9 s: the warm-up) left out
    assert s["generate_seconds"] == pytest.approx((0.2 + 0.3 + 0.4 + 0.5) / 4)
    assert s["wait_seconds"] == pytest.approx((0.0 + 0.3 + 0.0 + 0.3) / 4)
    assert s["reward_first3"] == pytest.approx(0.2) and s["reward_last3"] == pytest.approx(0.4)
    assert s["staleness_max"] == 1
    assert s["mismatch/k3"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.4) / 4)
    assert s["mismatch/lag1/k3"] == pytest.approx((0.1 + 0.3 + 0.4) / 3)


def test_a_one_step_run_uses_its_only_step_and_an_empty_run_is_refused():
    s = ar.summarize_run(_records([0.7], [2.5]))
    assert s["wall_per_step"] == 2.5 and s["reward_first3"] == s["reward_last3"] == 0.7
    with pytest.raises(ValueError, match="records"):
        ar.summarize_run([])


def test_summary_groups_by_task_k_and_correction_with_mean_and_spread_over_seeds():
    runs = []
    finals = {0: [0.3, 0.6, 0.9], 1: [0.2, 0.2, 0.5]}
    for corr, lag in (("none", 0), ("token-tis", 1)):
        for seed in (0, 1, 2):
            last = finals[lag][seed]
            rewards = [0.0, 0.0, last, last, last]
            walls = [5.0] + [1.0 + seed + lag] * 4
            recs = _records(rewards, walls, lag=lag, k3=[0.01 * (seed + 1)] * 5)
            runs.append(
                {"task": "t", "max_staleness": lag, "is_correction": corr, "seed": seed, "records": recs}
            )
    rows = ar.summarize(runs)
    assert [(r["task"], r["max_staleness"], r["is_correction"]) for r in rows] == [
        ("t", 0, "none"),
        ("t", 1, "token-tis"),
    ]
    for row, lag in zip(rows, (0, 1)):
        assert row["seeds"] == [0, 1, 2]
        fin = finals[lag]
        assert row["reward_last3"]["mean"] == pytest.approx(statistics.mean(fin))
        assert row["reward_last3"]["std"] == pytest.approx(statistics.stdev(fin))
        assert (row["reward_last3"]["min"], row["reward_last3"]["max"]) == pytest.approx((min(fin), max(fin)))
        walls = [1.0 + s + lag for s in (0, 1, 2)]
        assert row["wall_per_step"]["mean"] == pytest.approx(statistics.mean(walls))
        assert row["wall_per_step"]["std"] == pytest.approx(statistics.stdev(walls))
        assert row["reward_first3"]["mean"] == pytest.approx(statistics.mean(f / 3 for f in fin))
        assert row[f"mismatch/lag{lag}/k3"] == pytest.approx(0.02)
        assert "lag" in ar.summary_line(row) and "n=3" in ar.summary_line(row)


def test_the_committed_results_summary_is_its_records_summary():
    with open(RESULTS) as f:
        result = json.load(f)
    assert result["summary"] == ar.summarize(result["runs"])
    assert {r["task"] for r in result["runs"]} == set(result["tasks"])
    for run in result["runs"]:
        n = result["steps"] if "error" not in run else len(run["records"])
        assert [r["step"] for r in run["records"]] == list(range(1, n + 1))
        if "error" in run:  # a failed run keeps the steps before its failure, and counts only as failed
            assert n < result["steps"] and run["error"].startswith(f"step {n + 1}: ")
            row = next(
                r
                for r in result["summary"]
                if (r["task"], r["max_staleness"], r["is_correction"])
                == (run["task"], run["max_staleness"], run["is_correction"])
            )
            assert run["seed"] not in row["seeds"] and run["seed"] in [f["seed"] for f in row["failed"]]


def test_load_resummarizes_a_results_file_and_refuses_one_without_records(tmp_path, capsys):
    runs = [
        {
            "task": "t",
            "max_staleness": 0,
            "is_correction": "none",
            "seed": s,
            "records": _records([0.1, 0.2], [1, 2]),
        }
        for s in (0, 1)
    ]
    src, out = tmp_path / "in.json", tmp_path / "out.json"
    src.write_text(json.dumps({"runs": runs, "summary": "stale"}))
    assert ar.main(["--load", str(src), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["summary"] == ar.summarize(runs)
    assert "K=0 none" in capsys.readouterr().out
    src.write_text(json.dumps({"runs": [{"task": "t"}]}))
    with pytest.raises(SystemExit) as e:
        ar.main(["--load", str(src)])
    assert e.value.code == 2 and "--load" in capsys.readouterr().err


def test_bad_task_args_and_steps_exit_2_naming_the_flag(capsys):
    for argv, flag in (
        (["--task-args", "{"], "--task-args"),
        (["--task-args", "[1]"], "--task-args"),
        (["--steps", "0"], "--steps"),
    ):
        with pytest.raises(SystemExit) as e:
            ar.main(argv)
        assert e.value.code == 2 and flag in capsys.readouterr().err


def test_the_readme_table_is_the_committed_results():
    with open(RESULTS) as f:
        result = json.load(f)
    block = ar.markdown(result)
    assert block.count("\n| ") == 2 + len(result["summary"])  # the header, its separator, one row each
    with open(os.path.join(BENCH, "README.md")) as f:
        assert block in f.read(), "benchmarks/README.md is stale: run async_rl.py --load <results> --readme"
