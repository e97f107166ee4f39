"""Asynchronous ``harts-rl`` (``max_staleness`` K): reward curves, seconds per step and their
generate / train / wait split, and the train / rollout mismatch per version lag, for K = 0, 1, 2
with and without importance correction, on one or more tasks and seeds, one process, CPU by default.

::

    OMP_NUM_THREADS=1 python benchmarks/async_rl.py --tasks token-set ragged-set --seeds 0 1 2 \\
        --out benchmarks/results/async_rl_cpu.json --plot benchmarks/results/async_rl_curves.png
    python benchmarks/async_rl.py --load benchmarks/results/async_rl_cpu.json --plot curves.png

Every run goes through :class:`~harts_runtime.rl.async_source.AsyncSource` (K = 0 included: it
equals the synchronous loop record for record, ``tests/rl/test_async_source.py``, and reports the
mismatch the synchronous loop does not carry). ``--task-args`` gives each task's keywords as JSON
(default: ``ragged-set`` with 3 turns, so that K = 1 switches versions inside the episode).

Each run keeps its per-step records (``records``: wall seconds, reward, the record's
``generate_seconds`` (the sampler thread's sampling), ``logprobs_seconds``, ``train_seconds``,
``sync_seconds``, ``wait_seconds`` (the trainer waiting for its batch), ``staleness_max`` and every
``mismatch/*`` metric). :func:`summarize_run` computes from them the run's means over the steps
after the first (``wall_per_step`` and the parts), ``reward_first3`` / ``reward_last3`` (mean
reward of the first / last three steps) and the means of the ``mismatch/*`` metrics over the steps
that report them; :func:`summarize` the mean, sample standard deviation, min and max over seeds of
``reward_last3`` and ``wall_per_step`` per (task, K, correction). ``--load`` recomputes both (and
the plot) from a results file's records without running anything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PARTS = ("generate_seconds", "logprobs_seconds", "train_seconds", "sync_seconds", "wait_seconds")
STEP_KEYS = ("reward_mean", "staleness_max", *PARTS)
DEFAULT_TASK_ARGS = {"ragged-set": {"turns": 3}}
FINAL = 3
"""Steps averaged for a run's first / final reward."""


def _round(v):
    return float(f"{v:.6g}") if isinstance(v, float) else v


def step_record(rec: dict, wall: float) -> dict:
    """What a run keeps of one step's record: its wall seconds, :data:`STEP_KEYS` and ``mismatch/*``
    (floats to 6 significant digits)."""
    out = {"step": int(rec["step"]), "wall": float(wall)}
    out.update({k: rec[k] for k in STEP_KEYS if k in rec})
    out.update({k: float(v) for k, v in rec.items() if k.startswith("mismatch/")})
    return {k: _round(v) for k, v in out.items()}


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_run(records: list[dict]) -> dict:
    """A run's summary from its per-step records (:func:`step_record`): the means over the steps after
    the first (all steps if there is one) of ``wall`` (as ``wall_per_step``) and each of :data:`PARTS`;
    the mean reward of the first and last :data:`FINAL` steps; the largest ``staleness_max``; and the
    mean of each ``mismatch/*`` key over the steps (after the first) that carry it."""
    if not records:
        raise ValueError("records: a run has at least one step, got none")
    warm = records[1:] or records
    out = {"steps": len(records), "wall_per_step": _mean([r["wall"] for r in warm])}
    for key in PARTS:
        out[key] = _mean([r[key] for r in warm if key in r])
    rewards = [r["reward_mean"] for r in records]
    out["reward_first3"] = _mean(rewards[:FINAL])
    out["reward_last3"] = _mean(rewards[-FINAL:])
    out["staleness_max"] = max(int(r.get("staleness_max", 0)) for r in records)
    keys = sorted({k for r in warm for k in r if k.startswith("mismatch/")})
    out.update({k: _mean([r[k] for r in warm if k in r]) for k in keys})
    return out


def _spread(values: list[float]) -> dict:
    m = sum(values) / len(values)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return {"mean": m, "std": sd, "min": min(values), "max": max(values)}


def summarize(runs: list[dict]) -> list[dict]:
    """Per (task, K, correction), in the order first met: the seeds, and the mean / sample std / min /
    max over seeds of each run's ``reward_last3``, ``reward_first3`` and ``wall_per_step`` and the
    mean over seeds of the parts and of ``mismatch/k3`` per lag (each recomputed from the run's
    records by :func:`summarize_run`). A run that failed (``error``) counts in ``failed`` only."""
    groups: dict[tuple, list[dict]] = {}
    failed: dict[tuple, list] = {}
    for run in runs:
        key = (run["task"], run["max_staleness"], run["is_correction"])
        groups.setdefault(key, [])
        failed.setdefault(key, [])
        if "error" in run:
            failed[key].append({"seed": run["seed"], "steps": len(run["records"]), "error": run["error"]})
        else:
            groups[key].append({"seed": run["seed"], **summarize_run(run["records"])})
    rows = []
    for (task, k, corr), sums in groups.items():
        row = {"task": task, "max_staleness": k, "is_correction": corr, "seeds": [s["seed"] for s in sums]}
        row["failed"] = failed[(task, k, corr)]
        if not sums:
            rows.append(row)
            continue
        for key in ("reward_last3", "reward_first3", "wall_per_step"):
            row[key] = _spread([s[key] for s in sums])
        for key in PARTS:
            vals = [s[key] for s in sums if s[key] is not None]
            row[key] = _mean(vals)
        k3 = sorted({key for s in sums for key in s if key.startswith("mismatch/") and key.endswith("/k3")})
        for key in ["mismatch/k3", *[x for x in k3 if x != "mismatch/k3"]]:
            vals = [s[key] for s in sums if s.get(key) is not None]
            if vals:
                row[key] = _mean(vals)
        rows.append(row)
    return rows


def _failed(row: dict) -> str:
    return "; ".join(f"seed {f['seed']} failed at {f['error']}" for f in row.get("failed", []))


def _k3_by_lag(row: dict) -> list[tuple[int, float]]:
    """``(lag, mean mismatch/k3)`` of a summary row, by lag."""
    return sorted(
        (int(k.split("/")[1][3:]), v)
        for k, v in row.items()
        if k.startswith("mismatch/lag") and k.endswith("/k3")
    )


def summary_line(row: dict) -> str:
    head = f"{row['task']:<10} K={row['max_staleness']} {row['is_correction']:<9} "
    if not row["seeds"]:
        return head + _failed(row)
    r, w = row["reward_last3"], row["wall_per_step"]
    lags = _k3_by_lag(row)
    k3 = ", ".join(f"lag{d} {v:.3f}" for d, v in lags) or "-"
    return (
        head + f"reward last{FINAL} {r['mean']:.3f} +- {r['std']:.3f} [{r['min']:.3f}, {r['max']:.3f}]  "
        f"s/step {w['mean']:.3f} +- {w['std']:.3f}  gen {row['generate_seconds']:.3f} "
        f"train {row['train_seconds']:.3f} wait {row['wait_seconds']:.3f}  k3 {k3}  (n={len(row['seeds'])})"
        + (f"  {_failed(row)}" if row.get("failed") else "")
    )


BEGIN, END = "<!-- async_rl:begin -->", "<!-- async_rl:end -->"


def markdown(result: dict) -> str:
    """The README block of a results file: one table row per :func:`summarize` row."""
    tasks = ", ".join(
        f"`{t}`" + (f" ({', '.join(f'{k} {v}' for k, v in a.items())})" if a else "")
        for t, a in result["tasks"].items()
    )
    lines = [
        BEGIN,
        f"{result['flavor']}, {tasks}, {result['prompts']} prompts, {result['steps']} steps, lr {result['lr']}, "
        f"seeds {', '.join(str(s) for s in sorted({r['seed'] for r in result['runs']}))}, {result['device']} "
        f"({result['torch_threads']} torch thread, {result['cpus']} cores). Reward: mean over seeds of the last "
        f"{FINAL} steps' mean reward, +- the sample std over seeds [min, max]; seconds: means over steps 2 to "
        f"{result['steps']}, then over seeds; `mismatch/k3` by the tokens' version lag.",
        "",
        "| task | K | correction | reward, first 3 | reward, last 3 | s/step | generate | train | trainer waits "
        "| `mismatch/k3` by lag |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["summary"]:
        if not row["seeds"]:
            lines.append(f"| {row['task']} | {row['max_staleness']} | {row['is_correction']} |" + " - |" * 7)
            continue
        r, w = row["reward_last3"], row["wall_per_step"]
        lags = _k3_by_lag(row)
        k3 = ", ".join(f"{d}: {v:.3f}" for d, v in lags) or "-"
        lines.append(
            f"| {row['task']} | {row['max_staleness']} | {row['is_correction']} | {row['reward_first3']['mean']:.3f} "
            f"| {r['mean']:.3f} +- {r['std']:.3f} [{r['min']:.2f}, {r['max']:.2f}] | {w['mean']:.3f} +- {w['std']:.3f} "
            f"| {row['generate_seconds']:.3f} | {row['train_seconds']:.3f} | {row['wait_seconds']:.3f} | {k3} |"
        )
    fails = [
        f"{row['task']} K = {row['max_staleness']} {row['is_correction']}, {_failed(row)}"
        for row in result["summary"]
        if row.get("failed")
    ]
    if fails:
        lines += ["", "Failed runs (left out of the rows above): " + "; ".join(fails) + "."]
    lines.append(END)
    return "\n".join(lines)


def one_run(args, task: str, task_args: dict, k: int, correction: str, seed: int) -> dict:
    from harts_runtime.rl import RLConfig
    from harts_runtime.rl.async_source import AsyncSource
    from harts_runtime.rl.run import RLRun

    cfg = RLConfig(
        flavor=args.flavor,
        layers=args.layers,
        device=args.device,
        task=task,
        task_args=dict(task_args),
        steps=args.steps,
        prompts=args.prompts,
        seed=seed,
        max_staleness=k,
    )
    loss = {"kl_coef": 0.0, "loss_agg_mode": "token-mean", "is_correction": correction}
    with tempfile.TemporaryDirectory() as out:
        run = RLRun(cfg, {"lr": args.lr, "loss_config": loss}, out)
        if not isinstance(run.source, AsyncSource):  # K = 0: the same loop, with the versions
            src = AsyncSource(cfg)
            src.trained_chunk_size = run.source.trained_chunk_size
            src.attach(run.engine)
            run.source = src
        records, error = [], None
        try:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                rec = run.run_step()
                records.append(step_record(rec, time.perf_counter() - t0))
        except Exception as e:  # recorded with the steps before it; the next run goes on
            error = f"step {len(records) + 1}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"{task} K={k} {correction} seed {seed} failed: {error}", file=sys.stderr, flush=True)
        finally:
            run.source.close()
    out = {"task": task, "max_staleness": k, "is_correction": correction, "seed": seed, "records": records}
    if error is not None:
        out["error"] = error
    return out


def plot(runs: list[dict], path: str) -> bool:
    """The reward curves (mean over seeds, min-max band) per task (rows) and K (columns), one line per
    correction, as a PNG at ``path``; False (with a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed; no plot written", file=sys.stderr)
        return False
    runs = [r for r in runs if "error" not in r]  # a failed run's curve stops early
    tasks = list(dict.fromkeys(r["task"] for r in runs))
    ks = sorted({r["max_staleness"] for r in runs})
    corrs = list(dict.fromkeys(r["is_correction"] for r in runs))
    fig, axes = plt.subplots(len(tasks), len(ks), figsize=(3.6 * len(ks), 2.8 * len(tasks)), squeeze=False)
    for i, task in enumerate(tasks):
        for j, k in enumerate(ks):
            ax = axes[i][j]
            for c, corr in enumerate(corrs):
                curves = [
                    [s["reward_mean"] for s in r["records"]]
                    for r in runs
                    if (r["task"], r["max_staleness"], r["is_correction"]) == (task, k, corr)
                ]
                if not curves:
                    continue
                n = min(len(x) for x in curves)
                steps = list(range(1, n + 1))
                cols = [[x[t] for x in curves] for t in range(n)]
                color = f"C{c}"
                ax.plot(
                    steps, [sum(v) / len(v) for v in cols], color=color, label=f"{corr} ({len(curves)} seeds)"
                )
                ax.fill_between(steps, [min(v) for v in cols], [max(v) for v in cols], color=color, alpha=0.2)
            ax.set_title(f"{task}, K = {k}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
            if i == len(tasks) - 1:
                ax.set_xlabel("step", fontsize=8)
            if j == 0:
                ax.set_ylabel("reward (mean of the batch)", fontsize=8)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return True


def _write(path: str, result: dict) -> None:
    """``result`` as JSON, each step record on one line (the runs last)."""
    head = json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1)
    runs = ",\n".join(
        "  {"
        + "".join(f"{json.dumps(k)}: {json.dumps(v)}, " for k, v in run.items() if k != "records")
        + '"records": [\n'
        + ",\n".join("   " + json.dumps(rec) for rec in run["records"])
        + "\n  ]}"
        for run in result["runs"]
    )
    with open(path, "w") as f:
        f.write(head[:-2] + (",\n" if len(head) > 2 else "\n") + ' "runs": [\n' + runs + "\n ]\n}\n")


def _task_args(ap, text: str | None) -> dict:
    if text is None:
        return dict(DEFAULT_TASK_ARGS)
    try:
        val = json.loads(text)
    except json.JSONDecodeError as e:
        ap.error(f"--task-args: not JSON ({e})")
    if not isinstance(val, dict) or not all(isinstance(v, dict) for v in val.values()):
        ap.error(
            f'--task-args: a JSON object of task -> keywords, e.g. {{"ragged-set": {{"turns": 3}}}}, got {text!r}'
        )
    return val


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="kimi-linear-tiny")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tasks", nargs="+", default=["token-set"])
    ap.add_argument(
        "--task-args", default=None, help="JSON: task -> its keywords (default: ragged-set turns 3)"
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--corrections", nargs="+", default=["none", "token-tis"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--plot", default=None, help="write the reward curves as a PNG here (needs matplotlib)")
    ap.add_argument(
        "--readme", default=None, help="put the table between the async_rl markers of this README"
    )
    ap.add_argument("--load", default=None, help="summarize (and plot) this results file instead of running")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps: at least 1, got {args.steps}")
    if args.load:
        try:
            with open(args.load) as f:
                result = json.load(f)
            runs = result["runs"]
            if not all("records" in r for r in runs):
                raise KeyError("records")
            for r in runs:  # as a run records them (step_record)
                r["records"] = [{k: _round(v) for k, v in rec.items()} for rec in r["records"]]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            ap.error(
                f"--load: {args.load!r} is not a results file with per-step records ({type(e).__name__}: {e})"
            )
    else:
        task_args = _task_args(ap, args.task_args)
        import torch

        from harts_runtime.errors import InvalidInputError

        runs: list[dict] = []
        result = {
            "flavor": args.flavor,
            "layers": args.layers,
            "device": args.device,
            "tasks": {t: task_args.get(t, {}) for t in args.tasks},
            "steps": args.steps,
            "prompts": args.prompts,
            "lr": args.lr,
            "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "runs": runs,
        }
        for task in args.tasks:
            for seed in args.seeds:
                for k in args.staleness:
                    for corr in args.corrections:
                        try:
                            r = one_run(args, task, task_args.get(task, {}), k, corr, seed)
                        except InvalidInputError as e:
                            ap.error(str(e))
                        runs.append(r)
                        head = {k_: r[k_] for k_ in ("task", "max_staleness", "is_correction", "seed")}
                        s = summarize_run(r["records"]) if r["records"] else {}
                        print(
                            json.dumps(head | s | ({"error": r["error"]} if "error" in r else {})), flush=True
                        )
                        if args.out:  # what is done so far, should a later run stop the process
                            _write(args.out, dict(result, summary=summarize(runs)))
    result["summary"] = summarize(result["runs"])
    for row in result["summary"]:
        print(summary_line(row))
    if args.out:
        _write(args.out, result)
    if args.plot:
        plot(result["runs"], args.plot)
    if args.readme:
        from pathlib import Path

        from readme_blocks import update_readme

        update_readme(Path(args.readme), markdown(result), BEGIN, END, "Asynchronous RL: `async_rl.py`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
