"""Planning quality and planning time: HARTS against peer baselines (paper Section 5.2, Tables 2-3).

For each synthetic ``swe-like`` step (seeds 0-9 by default) and each DP degree D (2 and 4), at
microbatch capacity T = 65,536 compact tokens, the script plans the step with

* ``harts``             -- ``harts_planner.plan_step`` with its defaults;
* ``harts-paper``       -- the same with ``component_greedy=False, contiguous_optimum=False`` (exactly the paper's candidates);
* ``or-tools``          -- Section 5.2's OR-Tools baseline, our reconstruction
                           (``baselines/ortools_baseline.py``; CP-SAT, 1 worker, seed 0, time limit
                           per replica);
* ``or-tools-per-tree`` -- the same recipe with the CP-SAT partition decomposed per rollout tree;
* ``areal-dta``         -- AReaL-DTA's binary-searched contiguous DP balancer, adapted
                           (``baselines/dta_balancer.py``);
* ``prefix-unaware``    -- first-fit decreasing by raw length (``baselines/prefix_unaware.py``),

checks every plan's guarantees (``verify_schedule``), and scores it: compact tokens (sum of
microbatch compact work), scheduled slots K / D, Equation (23) imbalance within every slot and of
the step totals, and planning time (after ingestion; HARTS: the C++ planner's own clock, best of
``--repeats``; baselines: one wall-clock run). The process is pinned to one core.

    python benchmarks/planner_quality.py                      # full run, ~15-20 minutes
    python benchmarks/planner_quality.py --seeds 0 --dp 2 --methods harts areal-dta   # quick look

Writes ``benchmarks/results/planner_quality.json`` and replaces the generated block of
``benchmarks/README.md`` (between the ``planner_quality`` markers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baselines import dta_balancer, ortools_baseline, prefix_unaware
from readme_blocks import update_readme

from harts_planner import DEFAULT_CAPACITY, RolloutBatch, plan_step, synth
from harts_planner.step_plan import schedule_metrics, verify_schedule

METHODS = ["harts", "harts-paper", "or-tools", "or-tools-per-tree", "areal-dta", "prefix-unaware"]
BEGIN, END = "<!-- planner_quality:begin -->", "<!-- planner_quality:end -->"


def run_method(name: str, batch: RolloutBatch, dp: int, capacity: int, args) -> dict:
    if name.startswith("harts"):
        opts = {"component_greedy": False, "contiguous_optimum": False} if name == "harts-paper" else {}
        best = None
        for _ in range(args.repeats):
            plan = plan_step(batch, dp, capacity, **opts)
            if best is None or plan.planning_seconds < best[1]:
                best = (plan, plan.planning_seconds)
        plan, seconds = best
        mbs, replica, slot = plan.microbatches, plan.replica, plan.slot
        details = {
            "source": plan.source,
            "natural_k": plan.natural_k,
            "k_range": list(plan.k_range),
            "phase_seconds": plan.phase_seconds,
            "candidates": len(plan.candidates),
        }
    else:
        if name == "or-tools":
            bp = ortools_baseline.plan(batch, dp, capacity, time_limit_s=args.ortools_time_limit)
        elif name == "or-tools-per-tree":
            bp = ortools_baseline.plan(
                batch, dp, capacity, time_limit_s=args.ortools_time_limit, per_tree=True
            )
        elif name == "areal-dta":
            bp = dta_balancer.plan(batch, dp, capacity)
        elif name == "prefix-unaware":
            bp = prefix_unaware.plan(batch, dp, capacity)
        else:
            raise ValueError(f"unknown method {name}")
        mbs, replica, slot, seconds, details = (
            bp.microbatches,
            bp.replica,
            bp.slot,
            bp.planning_seconds,
            bp.details,
        )
    work = verify_schedule(batch, mbs, replica, slot, dp, capacity)
    m = schedule_metrics(work, replica, slot, dp)
    return {
        "compact_tokens": m["total_work"],
        "microbatches": len(mbs),
        "slots": m["num_slots"],
        "slot_critical_work": m["slot_critical_work"],
        "max_replica_work": m["max_replica_work"],
        "slot_imbalance": [round(v, 7) for v in m["slot_imbalance"]],
        "step_imbalance": m["step_imbalance"],
        "planning_seconds": seconds,
        "details": details,
    }


def summarize(steps: list[dict], methods: list[str], dps: list[int]) -> dict:
    out = {}
    for dp in dps:
        rows = [s for s in steps if s["dp"] == dp]
        ref = sum(s["methods"]["harts"]["compact_tokens"] for s in rows) if "harts" in methods else None
        ref_t = sum(s["methods"]["harts"]["planning_seconds"] for s in rows) if "harts" in methods else None
        out[str(dp)] = {}
        for name in methods:
            r = [s["methods"][name] for s in rows]
            compact = sum(x["compact_tokens"] for x in r)
            seconds = sum(x["planning_seconds"] for x in r)
            slot_imb = [v for x in r for v in x["slot_imbalance"]]
            step_imb = [x["step_imbalance"] for x in r]
            out[str(dp)][name] = {
                "steps": len(r),
                "paths": sum(s["paths"] for s in rows),
                "raw_tokens": sum(s["raw_tokens"] for s in rows),
                "compact_tokens": compact,
                "compact_ratio_vs_harts": compact / ref if ref else None,
                "compression": sum(s["raw_tokens"] for s in rows) / compact,
                "slots": sum(x["slots"] for x in r),
                "slot_imbalance_p50": float(np.percentile(slot_imb, 50)),
                "slot_imbalance_p95": float(np.percentile(slot_imb, 95)),
                "step_imbalance_p50": float(np.percentile(step_imb, 50)),
                "step_imbalance_max": float(np.max(step_imb)),
                "planning_seconds": seconds,
                "planning_ratio_vs_harts": seconds / ref_t if ref_t else None,
                "planning_seconds_max_step": max(x["planning_seconds"] for x in r),
            }
    return out


def _fmt_int(x: int) -> str:
    return f"{x:,}"


def markdown(result: dict) -> str:
    cfg = result["config"]
    methods = cfg["methods"]
    lines = [
        BEGIN,
        "",
        (
            f"Generated by `benchmarks/planner_quality.py` on {cfg['date']} ({cfg['machine']}); "
            f"preset `{cfg['preset']}`, seeds {cfg['seeds'][0]}-{cfg['seeds'][-1]}, "
            f"T = {cfg['capacity']:,}, OR-Tools time limit {cfg['ortools_time_limit_s']:g} s per CP-SAT model, "
            "one core. Ratios are method / HARTS (above 1: HARTS is better). Imbalance is Equation (23): "
            "slot P50/P95 pool every slot of all steps, step-total P50/max are over the steps."
        ),
        "",
    ]
    for dp, summ in result["summary"].items():
        lines += [
            (
                f"**Summary, D = {dp}** ({len(cfg['seeds'])} steps: {next(iter(summ.values()))['paths']:,} paths, "
                f"{_fmt_int(next(iter(summ.values()))['raw_tokens'])} raw tokens)"
            ),
            "",
            (
                "| method | compact tokens | compact / HARTS | raw / compact | scheduled slots | slot imb. P50 | "
                "slot imb. P95 | step imb. P50 | step imb. max | planning time (sum) | planning / HARTS |"
            ),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name in methods:
            s = summ[name]
            lines.append(
                f"| {name} | {_fmt_int(s['compact_tokens'])} | {s['compact_ratio_vs_harts']:.4f} | "
                f"{s['compression']:.2f} | {s['slots']} | {100 * s['slot_imbalance_p50']:.3f}% | "
                f"{100 * s['slot_imbalance_p95']:.3f}% | {100 * s['step_imbalance_p50']:.3f}% | "
                f"{100 * s['step_imbalance_max']:.3f}% | {s['planning_seconds']:.3f} s | "
                f"{s['planning_ratio_vs_harts']:.1f}x |"
            )
        lines.append("")
    # Table 2 style, per step.
    for dp in result["summary"]:
        rows = [s for s in result["steps"] if str(s["dp"]) == dp]
        others = [m for m in methods if m != "harts"]
        head = (
            "| step (seed) | paths | raw tokens | HARTS compact | "
            + " | ".join(f"{m} compact / HARTS" for m in others)
            + " | HARTS planning | OR-Tools planning / HARTS |"
        )
        lines += [
            f"**Per step, D = {dp}** (Table 2 style)",
            "",
            head,
            "|" + "---|" * (5 + len(others)) + "---|",
        ]
        for s in rows:
            h = s["methods"]["harts"]
            ratios = " | ".join(
                f"{s['methods'][m]['compact_tokens'] / h['compact_tokens']:.4f}" for m in others
            )
            orr = (
                f"{s['methods']['or-tools']['planning_seconds'] / h['planning_seconds']:.0f}x"
                if "or-tools" in s["methods"]
                else "-"
            )
            lines.append(
                f"| {s['seed']} | {s['paths']:,} | {_fmt_int(s['raw_tokens'])} | "
                f"{_fmt_int(h['compact_tokens'])} | {ratios} | {1e3 * h['planning_seconds']:.1f} ms | {orr} |"
            )
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="swe-like")
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--capacity", type=int, default=DEFAULT_CAPACITY)
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument("--ortools-time-limit", type=float, default=ortools_baseline.DEFAULT_TIME_LIMIT_S)
    p.add_argument("--repeats", type=int, default=3, help="HARTS runs per step (best time kept)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "planner_quality.json")
    p.add_argument("--readme", type=Path, default=HERE / "README.md")
    p.add_argument("--no-readme", action="store_true")
    args = p.parse_args(argv)
    if "harts" not in args.methods:
        args.methods = ["harts", *args.methods]
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    steps = []
    for seed in args.seeds:
        syn = synth.generate(args.preset, seed=seed)
        t0 = time.perf_counter()
        batch = RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids)
        ingest = time.perf_counter() - t0
        for dp in args.dp:
            step = {
                "seed": seed,
                "dp": dp,
                "paths": batch.num_trajectories,
                "raw_tokens": batch.semantic_tokens,
                "batch_compact_tokens": batch.compact_tokens,
                "ingest_seconds": ingest,
                "methods": {},
            }
            for name in args.methods:
                r = run_method(name, batch, dp, args.capacity, args)
                step["methods"][name] = r
                print(
                    f"seed {seed} D={dp} {name:18s} compact {r['compact_tokens']:>11,} slots {r['slots']:4d} "
                    f"step-imb {100 * r['step_imbalance']:7.3f}% plan {r['planning_seconds']:8.3f} s",
                    flush=True,
                )
            steps.append(step)
    result = {
        "config": {
            "preset": args.preset,
            "seeds": args.seeds,
            "dp": args.dp,
            "capacity": args.capacity,
            "methods": args.methods,
            "ortools_time_limit_s": args.ortools_time_limit,
            "harts_repeats": args.repeats,
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {platform.processor() or platform.platform()}, "
            f"Python {platform.python_version()}",
        },
        "steps": steps,
        "summary": summarize(steps, args.methods, args.dp),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    block = markdown(result)
    print(block)
    if not args.no_readme:
        update_readme(args.readme, block, BEGIN, END, "Planner quality (Tables 2-3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
