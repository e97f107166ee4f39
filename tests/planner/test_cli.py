"""The `harts-planner` CLI and RolloutBatch save/load."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

import harts_planner as hp
from harts_planner import cli, synth


def test_demo_json_reports_what_ingestion_found(capsys):
    assert cli.main(["demo", "--preset", "small", "--seed", "3", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    syn = synth.generate("small", seed=3)
    assert out["trajectories"] == len(syn.offsets) - 1
    assert out["semantic_tokens"] == syn.semantic_tokens
    assert out["compact_tokens"] == syn.compact_tokens_expected
    assert out["compression"] == pytest.approx(syn.semantic_tokens / syn.compact_tokens_expected)
    assert out["max_fanout"] >= 2 and out["max_depth_segments"] >= 2
    plan = out["plan"]  # the step plan covers every trajectory once: work >= C, each <= T
    assert plan["step_compact_tokens"] >= out["compact_tokens"]
    assert (
        plan["microbatches"] % plan["dp_size"] == 0
        and plan["slots"] == plan["microbatches"] // plan["dp_size"]
    )
    assert plan["kda_calls_total"] >= plan["microbatches"] and plan["kda_calls_max"] >= 1


def test_demo_table(capsys):
    assert cli.main(["demo", "--preset", "tiny", "--quiet", "--model-steps", "0"]) == 0
    text = capsys.readouterr().out
    for label in (
        "trajectories",
        "semantic tokens S",
        "compact tokens C",
        "compression S/C",
        "tree depth",
        "fan-out",
        "step plan",
        "KDA call plans",
        "time",
    ):
        assert label in text
    assert "debug hybrid model" not in text  # --model-steps 0: no model step


@pytest.mark.parametrize(
    "preset, runtime_preset", [("tiny", "tiny"), ("small", "demo"), ("swe-like", "demo")]
)
def test_demo_model_step_calls_the_runtime_demo(monkeypatch, preset, runtime_preset):
    """The model step is ``harts_runtime.model_demo`` on a CPU-sized batch (a stand-in module here:
    the planner tests need no torch)."""
    calls = []
    fake = types.ModuleType("harts_runtime")
    fake.model_demo = lambda **kwargs: calls.append(kwargs) or []
    monkeypatch.setitem(sys.modules, "harts_runtime", fake)
    assert cli.main(["demo", "--preset", preset, "--quiet", "--model-steps", "3"]) == 0
    assert calls == [{"preset": runtime_preset, "steps": 3, "seed": 0}]


def test_demo_reports_every_stage_in_a_log(capsys):
    """Not on a terminal (a log, a pipe), each stage still reports: one plain line per stage, the
    step plan and the call plans included."""
    assert cli.main(["demo", "--preset", "small", "--model-steps", "0"]) == 0
    err = capsys.readouterr().err.splitlines()
    for stage in ("generate", "ingest", "step plan", "call plans"):
        assert [line for line in err if line.startswith(stage) and "\r" not in line], (stage, err)


def test_demo_without_the_runtime_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "harts_runtime", None)  # import harts_runtime raises ImportError
    assert cli.main(["demo", "--preset", "tiny", "--quiet", "--model-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "model step skipped (harts_runtime is not installed): pip install '.[runtime]'" in out


@pytest.mark.slow
def test_demo_trains_the_model_compact_and_trajectory_wise(capsys):
    # the whole pipeline: the debug model trained compact and trajectory-wise from the same weights
    pytest.importorskip("torch")  # harts_runtime imports without torch; its demo needs it
    pytest.importorskip("harts_runtime")
    assert cli.main(["demo", "--preset", "tiny", "--quiet", "--model-steps", "2"]) == 0
    text = capsys.readouterr().out
    assert "measured on a GPU (NVIDIA H200" in text and "faster compact than trajectory-wise" in text
    diffs = [
        float(line.rsplit("=", 1)[1])
        for line in text.splitlines()
        if "|loss(compact) - loss(trajectory)|" in line
    ]
    assert len(diffs) == 2 and diffs[0] < 1e-5 and diffs[1] < 1e-3, diffs


@pytest.mark.parametrize("suffix", [".hrb", ".jsonl"])
def test_synth_then_load_round_trip(tmp_path, suffix, capsys):
    path = tmp_path / f"batch{suffix}"
    assert cli.main(["synth", str(path), "--preset", "tiny", "--seed", "5", "--quiet"]) == 0
    loaded = hp.RolloutBatch.load(path)
    syn = synth.generate("tiny", seed=5)
    assert np.array_equal(loaded.tokens, syn.tokens) and np.array_equal(loaded.offsets, syn.offsets)
    assert np.array_equal(loaded.tree_ids, syn.tree_ids)
    again = tmp_path / f"again{suffix}"
    loaded.save(again)
    assert hp.RolloutBatch.load(again).compact_tokens == loaded.compact_tokens


def test_cli_reports_bad_input_without_traceback(capsys):
    assert cli.main(["demo", "--preset", "nope", "--quiet"]) == 2
    assert "preset" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- plan, show, bench
@pytest.fixture
def small_file(tmp_path):
    path = tmp_path / "small.hrb"
    assert cli.main(["synth", str(path), "--preset", "small", "--seed", "1", "--quiet"]) == 0
    return path


def test_plan_table_and_json(small_file, capsys):
    capsys.readouterr()
    assert cli.main(["plan", str(small_file), "--dp", "2", "--capacity", "30000", "--call-plans"]) == 0
    text = capsys.readouterr().out
    for label in (
        "microbatches K",
        "J (total, slot-critical, max replica)",
        "slot imbalance",
        "replica",
        "calls",
    ):
        assert label in text
    assert cli.main(["plan", str(small_file), "--dp", "2", "--capacity", "30000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = hp.plan_step(hp.RolloutBatch.load(small_file), 2, 30000)
    assert out["microbatches"] == [m.tolist() for m in expected.microbatches]
    assert out["objective"]["total_work"] == expected.total_work


def test_plan_errors_are_clear(small_file, capsys):
    assert cli.main(["plan", str(small_file), "--capacity", "3"]) == 2
    assert "capacity T = 3" in capsys.readouterr().err


def test_show_writes_a_page(small_file, tmp_path, capsys):
    out = tmp_path / "plan.html"
    assert cli.main(["show", str(small_file), "--dp", "2", "--capacity", "30000", "-o", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "Microbatches by replica and slot" in page
    assert "How to read a tree" in page and "T_pre" in page.split("How to read a tree")[1]
    assert "1 microbatches" not in capsys.readouterr().out


def test_show_counts_in_words(tmp_path, capsys):
    path = tmp_path / "one.jsonl"
    hp.RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4]]).save(path)
    assert cli.main(["show", str(path), "-o", str(tmp_path / "one.html")]) == 0
    assert "wrote" in (line := capsys.readouterr().out) and ": 1 microbatch, 3 segments" in line
    page = (tmp_path / "one.html").read_text()
    assert "1 microbatches" not in page and "1 trajectories" not in page and "1 calls" not in page


def test_bench_defaults_are_a_quick_run():
    """The default bench sends the compacted tree (KBs), not the packed tokens (229 MB per swe-like
    request); its help says how to run the heavy comparison."""
    parser = cli.build_parser()
    args = parser.parse_args(["bench"])
    assert (args.request, args.requests, args.transport) == ("tree", 10, "both")
    bench = next(a for a in parser._actions if a.dest == "command").choices["bench"]
    assert "--request both --requests 20" in " ".join(bench.description.split())


def test_bench_in_process_and_grpc(small_file, tmp_path, capsys):
    report = tmp_path / "bench.json"
    assert (
        cli.main(
            [
                "bench",
                "--batch",
                str(small_file),
                "--dp",
                "2",
                "--capacity",
                "30000",
                "--clients",
                "2",
                "--requests",
                "4",
                "--warmup",
                "1",
                "--workers",
                "2",
                "--request",
                "both",
                "--json",
                str(report),
                "--quiet",
            ]
        )
        == 0
    )
    data = json.loads(report.read_text())
    rows = {(r["transport"], r["request"]) for r in data["results"]}
    assert rows == {(t, k) for t in ("inprocess", "grpc") for k in ("tokens", "tree")}
    for r in data["results"]:
        assert r["mismatches"] == 0 and r["requests"] == 4 and r["clients"] == 2
        assert 0 < r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"] <= r["max_ms"] and r["throughput_per_s"] > 0
    assert set(data["grpc_over_inprocess"]) == {"tokens", "tree"}
    assert "gRPC / in-process (tree)" in capsys.readouterr().out
