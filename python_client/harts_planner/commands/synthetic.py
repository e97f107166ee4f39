"""`harts-planner demo` and `harts-planner synth`: synthetic rollout steps.

* ``demo``: generate the built-in SWE-like synthetic step, ingest it, plan it (step plan and KDA
  call plans) and print what was found; then, with the runtime extra (torch), a few training steps
  of the debug model, compact vs trajectory-wise: the runtime's step, found through the
  ``harts.demo`` entry-point group (this package never imports the runtime).
* ``synth``: write a synthetic batch to a file (``.hrb`` binary or ``.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from harts_planner._progress import Progress


def _ingest_with_progress(tokens, offsets, tree_ids, quiet: bool):
    from harts_planner.batch import RolloutBatch

    bar = Progress("ingest", enabled=not quiet)
    bar(0, 1)
    batch = RolloutBatch.from_arrays(tokens, offsets, tree_ids)
    bar(1, 1)
    return batch, bar.close()


def _demo_plans(batch, args) -> dict:
    """Step plan (Section 3.2) and per-microbatch minimum-call plans (Section 3.3) of the demo step."""
    from harts_planner.step_plan import plan_step

    longest = int(np.max(batch.lengths))
    capacity = max(args.capacity, longest)  # small presets: T never below one trajectory
    bar = Progress("step plan", enabled=not args.quiet)
    bar(0, 1)
    plan = plan_step(batch, args.dp, capacity, args.chunk_size)
    bar(1, 1)
    step_s = bar.close()
    bar = Progress("call plans", enabled=not args.quiet)
    call_plans = plan.call_plans(progress=bar)
    calls_s = bar.close()
    calls = [int(cp.num_calls) for cp in call_plans]
    replay = sum(int(cp.replay_tokens) for cp in call_plans)
    m = plan.metrics
    return {
        "dp_size": args.dp,
        "capacity": capacity,
        "chunk_size": args.chunk_size,
        "microbatches": plan.num_microbatches,
        "slots": plan.num_slots,
        "step_compact_tokens": plan.total_work,
        "step_compression": batch.semantic_tokens / plan.total_work,
        "slot_critical_work": plan.slot_critical_work,
        "max_replica_work": plan.max_replica_work,
        "slot_imbalance_p95": m.get("slot_imbalance_p95"),
        "step_imbalance": plan.step_imbalance,
        "step_plan_seconds": step_s,
        "kda_calls_total": int(sum(calls)),
        "kda_calls_max": max(calls),
        "replay_tokens": replay,
        "call_plan_seconds": calls_s,
    }


DEMO_STEPS = "harts.demo"
"""The entry-point group in which an installed package registers the demo's model step, by name
(the runtime: ``model = "harts_runtime:model_demo"``, ``[project.entry-points."harts.demo"]`` in
pyproject.toml). The planner looks it up there and imports nothing of the runtime itself."""


def _model_step():
    """``(the registered model step, None)``, or ``(None, why not)`` when no package registers one or
    it cannot be imported (the base install has no torch)."""
    from importlib.metadata import entry_points

    found = list(entry_points(group=DEMO_STEPS, name="model"))
    if not found:
        return None, "harts_runtime is not installed"
    try:
        return found[0].load(), None
    except ImportError as e:
        return None, f"{e.name or e} is not installed"


def _demo_model(args) -> None:
    """Training steps of the `debug` hybrid model on a few trees, compact and trajectory-wise side by
    side from the same weights, then the GPU speedup measured on an H200 (the runtime's
    ``harts_runtime.model_demo``, registered as the ``model`` entry point of :data:`DEMO_STEPS`;
    seconds on a CPU; needs the runtime extra: torch)."""
    model_demo, why = _model_step()
    if model_demo is None:  # the base install has no torch: say how to get the model step
        print(
            f"model step skipped ({why}): pip install '.[runtime]' torch==2.13.0, "
            "then harts-planner demo or harts-train"
        )
        return
    sys.stdout.flush()
    preset = "tiny" if args.preset == "tiny" else "demo"  # CPU-sized: a few trees (DEMO_TREES)
    model_demo(preset=preset, steps=args.model_steps, seed=0)


def cmd_demo(args: argparse.Namespace) -> int:
    from harts_planner import synth

    t0 = time.perf_counter()
    bar = Progress("generate", enabled=not args.quiet)
    syn = synth.generate(args.preset, seed=args.seed, progress=bar)
    gen_s = bar.close()
    batch, ingest_s = _ingest_with_progress(syn.tokens, syn.offsets, syn.tree_ids, args.quiet)
    stats = batch.stats()
    stats.update(
        preset=args.preset,
        seed=args.seed,
        generate_seconds=gen_s,
        ingest_seconds=ingest_s,
        ingest_tokens_per_second=batch.semantic_tokens / ingest_s if ingest_s else None,
    )
    plans = _demo_plans(batch, args)
    stats["plan"] = plans
    stats["total_seconds"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        p = plans
        rows = [
            ("preset", f"{args.preset} (seed {args.seed})"),
            ("trajectories", f"{stats['trajectories']:,}"),
            ("rollout trees", f"{stats['trees']:,}"),
            ("semantic tokens S", f"{stats['semantic_tokens']:,}"),
            ("compact tokens C", f"{stats['compact_tokens']:,}"),
            ("compression S/C", f"{stats['compression']:.2f}x"),
            ("segments", f"{stats['segments']:,}"),
            (
                "tree depth",
                f"{stats['max_depth_segments']} segments max, "
                f"{stats['max_trajectory_tokens']:,} tokens max "
                f"({stats['mean_trajectory_tokens']:,.0f} mean per trajectory)",
            ),
            (
                "fan-out",
                f"{stats['forks']:,} forks, max {stats['max_fanout']}, "
                f"mean {stats['mean_fanout_at_forks']:.2f} at forks",
            ),
            (
                "step plan",
                f"D = {p['dp_size']}, T = {p['capacity']:,}: {p['microbatches']} microbatches in "
                f"{p['slots']} slots, {p['step_compact_tokens']:,} compact tokens "
                f"(S / work = {p['step_compression']:.2f}x), step imbalance {p['step_imbalance']:.2%}",
            ),
            (
                "KDA call plans",
                f"chunk {p['chunk_size']}: {p['kda_calls_total']:,} calls in all, at most "
                f"{p['kda_calls_max']} per microbatch, replay {p['replay_tokens']:,} tokens "
                f"({p['replay_tokens'] / max(p['step_compact_tokens'], 1):.3%} of the work)",
            ),
            (
                "time",
                f"generate {gen_s:.2f}s, ingest {ingest_s:.2f}s "
                f"({stats['ingest_tokens_per_second'] / 1e6:.1f}M tokens/s), step plan "
                f"{p['step_plan_seconds']:.2f}s, call plans {p['call_plan_seconds']:.2f}s",
            ),
        ]
        width = max(len(k) for k, _ in rows)
        print("HARTS demo: synthetic rollout step -> compact trie -> step plan -> KDA call plans")
        for k, v in rows:
            print(f"  {k:<{width}}  {v}")
    if args.model_steps > 0 and not args.json:
        sys.stdout.flush()
        _demo_model(args)
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from harts_planner import synth
    from harts_planner.batch_io import save_batch

    bar = Progress("generate", enabled=not args.quiet)
    syn = synth.generate(args.preset, seed=args.seed, progress=bar)
    bar.close()
    save_batch(args.output, syn.tokens, syn.offsets, syn.tree_ids)
    print(f"wrote {args.output}: {len(syn.offsets) - 1:,} trajectories, {len(syn.tokens):,} tokens")
    return 0


__all__ = ["cmd_demo", "cmd_synth"]
