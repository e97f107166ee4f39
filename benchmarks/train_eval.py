"""GPU evaluation of the model and train step: Table 4 (speedup), Table 5 (fidelity), Figure 4
(replay ablation) and a time breakdown (Section 5.3), on one device.

Sections (each catches its own errors; JSON and a markdown table are rewritten after each one):

* ``speedup``: a slice of a synthetic ``swe-like`` step (the trajectories of ``--slice-microbatches``
  HARTS microbatches of the planned step, those with median compression) at capacity T; ``ling-tiny`` (``--layers`` of its pattern) with
  full-layer recomputation; one warm-up microbatch per mode, then ``--repeats`` timed steps per
  mode. Reports non-replay row compression, F/B/Grad and Core speedups, and the ideal work
  compression (``harts_runtime.flops``), with F/B/Grad speedup / ideal.
* ``fidelity``: on a smaller slice, mean token-wise full-vocabulary logit cosine (and the largest
  absolute logit difference) compact vs trajectory next to trajectory self-rerun, with and without
  recomputation; absolute loss difference; cosine of the flattened parameter gradients. Runs keep
  only their final hidden rows; logits are formed and compared a row chunk at a time (at most
  ``--compare-mib`` of float32 temporaries), so memory is O(chunk * V) whatever S is. Each
  recomputation setting catches its own errors (the no-recomputation runs hold every layer's
  activations of a ``--fidelity-rows`` microbatch; ``--fidelity-recompute`` picks the settings).
* ``replay``: SymKL and mean |dNLL| against trajectory run A by state-handoff depth d = 0..5 (the
  segment depth of the position's segment in the batch trie) for rerun, replay and no-replay.
* ``microbatches``: every microbatch of the speedup slice timed alone, warm, both modes: rows,
  trees, rounds, replay, capacity fill, host layout and F/B/Grad seconds, µs per packed row and
  executed TFLOP/s; the median and the slowest compact microbatch (for ``breakdown``), and the
  step's F/B/Grad if every microbatch ran at its median one's rate.
* ``first``: the process's first compact microbatch (imports and model init before it), with what
  compiled, loaded from Triton's cache or autotuned inside it (``benchmarks/compile_trace.py``).
* ``newshapes``: a never-seen step (the slice of ``--seed + 1``) after the kernels are warm: its
  first compact pass against its warm repeat, with what compiled inside the first pass.
* ``breakdown``: ``torch.profiler`` over one compact microbatch (after ``microbatches``, its median
  one and its slowest one) (forward + backward with
  recomputation), device time per ``harts.*`` range (KDA core / gathers / state stacking,
  attention views / core, MoE, LM head, layout), the replay share of KDA core time, kernel count,
  device-busy share of wall time (union of kernel intervals / wall; CUDA), and planner time from
  ``speedup``.

Run on the GPU machine (about 5-7 minutes with the defaults)::

    python benchmarks/train_eval.py --out benchmarks/results/train_eval --budget-s 420

The whole-step benchmark (eight microbatches of a step, each one's profile; 24 layers)::

    python benchmarks/train_eval.py --layers 24 --slice-microbatches 8 --repeats 1 \
        --sections speedup,microbatches,newshapes,breakdown --out DIR

CPU smoke test: ``python benchmarks/train_eval.py --device cpu --flavor debug --tiny --out DIR``;
``--tiny`` with another flavor (``ling-tiny``, ``qwen3.5-35b-a3b``) keeps its layer pattern and
options (mixers, shared experts and their gate, zero-centred norms, GDN projections) at tiny widths
in float32 (:func:`tiny_config`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

PROCESS_START = time.perf_counter()
if "--fast-autotune" in sys.argv:
    # Short device leases: compile one config per Triton kernel (ours and fla's) instead of
    # benchmarking every candidate. Both executions use the same kernels, so ratios stay fair;
    # absolute times may be slower than tuned ones. Must run before fla is imported.
    from harts_kernels.tuning import use_first_config_only

    use_first_config_only()

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The runtime and kernels from this checkout (pure Python) win over an installed copy; the planner
# needs its compiled extension, so an installed harts_planner is used when there is one.
for extra in (os.path.join(ROOT, "kernels"), ROOT):
    sys.path.insert(0, extra)
sys.path.append(os.path.join(ROOT, "python_client"))
sys.path.append(os.path.join(ROOT, "benchmarks"))  # compile_trace, when loaded from elsewhere

from compile_trace import CompileTrace

import harts_planner as hp
from harts_planner import synth
from harts_runtime import (
    HybridModel,
    StepInputs,
    apply_recompute,
    make_microbatch,
    model_config,
    plan_microbatches,
    run_microbatch,
    train_step,
)
from harts_runtime.flops import layer_costs, work_compression
from harts_runtime.layers.attention import CompactAttentionBase
from harts_runtime.ops.attention import resolve_backend

DEPTHS = 6
#: every section, in the order the markdown lists them (``--sections`` picks and orders the runs)
SECTIONS = ("speedup", "microbatches", "first", "newshapes", "fidelity", "replay", "breakdown")
GRAD_SAMPLE = 16_000_000  # gradient entries kept per run for the gradient cosine


MIXER_CODES = {"kda": "K", "mla": "M", "gqa": "A", "gdn": "G", "gated_attention": "GA"}  # meta["model"]


def log(msg: str) -> None:
    print(f"[train_eval {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ------------------------------------------------------------------------------ data
def tiny_config(cfg):
    """``cfg``'s layer pattern and options (mixers, FFNs, routing, shared experts and their gate,
    zero-centred norms, GDN projection layout, GQA / MLA structure) at CPU smoke widths, float32."""
    gqa = cfg.num_kv_heads is not None
    return cfg.replace(
        vocab_size=512,
        hidden_size=32,
        num_heads=2,
        kda=dict(num_heads=None, head_k_dim=8, head_v_dim=8),
        chunk_size=8,
        mla=dict(
            kv_lora_rank=16,
            q_lora_rank=None if cfg.mla.q_lora_rank is None else 16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
        ),
        num_kv_heads=1 if gqa else None,
        gated_attention=dict(head_dim=None if cfg.gated_attention.head_dim is None else 16),
        gdn=dict(
            num_k_heads=2,
            num_v_heads=4 if cfg.gdn.num_v_heads > cfg.gdn.num_k_heads else 2,
            head_k_dim=8,
            head_v_dim=8,
        ),
        dense_intermediate=64,
        moe=dict(
            num_experts=8,
            top_k=2,
            intermediate_size=16,
            shared_intermediate_size=None if cfg.moe.shared_intermediate_size is None else 16,
            num_expert_groups=2 if cfg.moe.num_expert_groups > 1 else 1,
            topk_groups=1,
        ),
        dtype="float32",
        lm_head_rows=16,
    )


def make_slice(
    args,
    capacity: int,
    max_len: int | None,
    microbatches: int,
    seed: int,
    vocab: int,
    pick: str = "median",
    preset: str | None = None,
) -> StepInputs:
    """A slice of a synthetic step that HARTS would actually execute: plan the whole step at
    ``capacity`` (``plan_step``, D = 1) and keep the trajectories of ``microbatches`` microbatches
    whose compression S/C is around the step's median (``pick="median"``) or the highest
    (``pick="max"``: the most sharing, hence the most state handoffs, for fidelity)."""
    over = {"vocab_size": vocab}
    if args.tiny:
        over["trees"] = (8, 8)
    if max_len is not None:
        over["max_trajectory_tokens"] = max_len
    preset = preset or args.preset
    sb = synth.generate(preset, seed, **over)
    full = hp.RolloutBatch.from_arrays(sb.tokens, sb.offsets, sb.tree_ids)
    plan = hp.plan_step(full, 1, capacity, args.chunk_size)
    lengths = np.asarray(full.lengths, dtype=np.int64)
    ratio = np.array([lengths[m].sum() / w for m, w in zip(plan.microbatches, plan.work)])
    order = np.argsort(ratio, kind="stable")
    lo = max(0, min(len(order) - microbatches, len(order) // 2 - microbatches // 2))
    if pick == "max":
        lo = max(0, len(order) - microbatches)
    traj = np.sort(
        np.concatenate([plan.microbatches[i] for i in order[lo : lo + microbatches]]).astype(np.int64)
    )
    off = np.asarray(sb.offsets, dtype=np.int64)
    toks = np.concatenate([sb.tokens[off[i] : off[i + 1]] for i in traj])
    offsets = np.concatenate([[0], np.cumsum(off[traj + 1] - off[traj])]).astype(np.int64)
    batch = hp.RolloutBatch.from_arrays(toks.astype(np.int32), offsets, np.asarray(sb.tree_ids)[traj])
    step = StepInputs.synthetic(batch, seed, vocab_size=vocab)
    step._cache["source"] = {
        "preset": preset,
        "seed": seed,
        "step_trajectories": full.num_trajectories,
        "step_semantic_tokens": full.semantic_tokens,
        "step_compression": full.compression,
        "step_microbatches": plan.num_microbatches,
        "slice_microbatches": microbatches,
        "capacity": capacity,
        "max_trajectory_tokens": max_len,
    }
    return step


def batch_info(step: StepInputs) -> dict:
    b = step.batch
    return {
        "trajectories": b.num_trajectories,
        "semantic_tokens": b.semantic_tokens,
        "compact_tokens": b.compact_tokens,
        "compression": b.compression,
        "max_trajectory": int(np.max(b.lengths)),
        "source": step._cache.get("source"),
    }


# ------------------------------------------------------------------------------ sections
def section_speedup(args, model, dev, shared):
    cfg = model.config
    step = make_slice(args, args.capacity, None, args.slice_microbatches, args.seed, cfg.vocab_size)
    shared["speedup_step"] = step
    info = batch_info(step)
    log(f"speedup slice: {info}")
    mbs, plans, plan_s = plan_microbatches(step, "compact", args.capacity, cfg)
    work = work_compression(cfg, step.batch.lengths, [p.position_ids for p in plans])
    shared["ideal_work_compression"] = work["ideal_work_compression"]
    tmbs, _, _ = plan_microbatches(step, "trajectory", args.capacity, cfg)
    keep = _keep(args)
    apply_recompute(model, keep=keep)  # block recomputation (keeping the regions of --keep)
    # warm-up: one microbatch per mode (compilation, autotuning), recomputation on
    first_s, first_trace = {}, {}
    for mode, first in (("compact", mbs[0]), ("trajectory", tmbs[0])):
        t = time.perf_counter()
        with CompileTrace() as trace:
            run_microbatch(model, step, first, mode, call_plan=plans[0] if mode == "compact" else None)
            sync(dev)
        model.zero_grad(set_to_none=True)
        first_s[mode] = time.perf_counter() - t
        first_trace[mode] = trace.summary()
        log(f"warm-up {mode}: {first_s[mode]:.1f}s ({_trace_line(first_trace[mode])})")
    runs = {"compact": [], "trajectory": []}
    per_mb = shared.setdefault("speedup_microbatch_seconds", {})  # best F/B/Grad seconds per microbatch
    for _ in range(args.repeats):
        for mode in ("compact", "trajectory"):
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            marks = []

            def mark(done, total, marks=marks):  # a sync after each microbatch: ~no cost at 2-3 s each
                sync(dev)
                marks.append(time.perf_counter())

            alloc0 = _allocator_counts(dev)
            sync(dev)
            t0 = time.perf_counter()
            with CompileTrace() as trace:
                r = train_step(model, None, step, None, mode, capacity=args.capacity, progress=mark)
            secs = np.diff([t0, *marks]).tolist()
            per_mb[mode] = [min(a, b) for a, b in zip(per_mb[mode], secs)] if mode in per_mb else secs
            model.zero_grad(set_to_none=True)
            d = r.to_dict()
            d["peak_memory_gib"] = (
                torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
            )
            # what the pass did besides its work: per-microbatch seconds, compiles, allocator growth
            d["microbatch_seconds"] = secs
            d["compiles"] = trace.summary()
            d["allocator"] = {k: v - alloc0.get(k, 0) for k, v in _allocator_counts(dev).items()}
            runs[mode].append(d)
            log(
                f"{mode}: fbg {r.fbg_seconds:.2f}s plan {r.plan_seconds * 1e3:.1f}ms microbatches "
                f"{r.num_microbatches} rows {r.rows:,} loss {r.loss:.6f}"
            )
    best = {m: min(runs[m], key=lambda d: d["fbg_seconds"]) for m in runs}
    c, t = best["compact"], best["trajectory"]
    fbg_speedup = t["fbg_seconds"] / c["fbg_seconds"]
    core_speedup = t["fbg_seconds"] / (c["plan_seconds"] + c["fbg_seconds"])
    return {
        "batch": info,
        "capacity": args.capacity,
        "recompute": True,
        "non_replay_row_compression": t["rows"] / c["rows"],
        "fbg_speedup": fbg_speedup,
        "core_speedup": core_speedup,
        "ideal_work_compression": work["ideal_work_compression"],
        "fbg_speedup_over_ideal": fbg_speedup / work["ideal_work_compression"],
        "target_fbg_over_ideal": 0.9,
        "work": work,
        "runs": runs,
        "planner_seconds_first": plan_s,
        # the first microbatch of a new shape (compiling, autotuning; Triton cache as found) against
        # a warm microbatch of the same mode (best step's F/B/Grad / its microbatches)
        "first_microbatch_seconds": first_s,
        "warm_microbatch_seconds": {m: best[m]["fbg_seconds"] / best[m]["num_microbatches"] for m in best},
        "first_microbatch_overhead_seconds": {
            m: first_s[m] - best[m]["fbg_seconds"] / best[m]["num_microbatches"] for m in best
        },
        "first_microbatch_compiles": first_trace,
        "keep": sorted(keep),
        "executed_flops": {m: executed_flops(cfg, work, m, keep) for m in ("compact", "trajectory")},
        "tflops": {
            m: executed_flops(cfg, work, m, keep) / best[m]["fbg_seconds"] / 1e12
            for m in ("compact", "trajectory")
        },
        "tflops_note": "executed FLOPs (model FLOPs = 3 x forward, plus the recomputed forward: all of it, "
        "less the attention cores when --keep attention, the KDA/GDN chunk cores' forward less the "
        "WY + state-scan recomputation of their backward when --keep linear_attention) / F/B/Grad seconds",
        "mfu_tflops": {
            m: work[f"{m}_flops"] / best[m]["fbg_seconds"] / 1e12 for m in ("compact", "trajectory")
        },
        "mfu_tflops_note": "model FLOPs (3 x forward, no recomputation counted) / F/B/Grad seconds",
    }


def _allocator_counts(dev) -> dict:
    """The CUDA caching allocator's cumulative counters that show growth: device allocations and
    frees (``cudaMalloc`` / ``cudaFree``), retries after a failed allocation (each frees cached
    blocks and synchronises), segments allocated; empty off CUDA."""
    if dev.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(dev)
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "segment.all.allocated")
    return {k: int(stats.get(k, 0)) for k in keys}


def _trace_line(summary: dict) -> str:
    """One log line of a :class:`CompileTrace` summary: count and seconds per kind."""
    kinds = summary.get("kinds") or {}
    return (
        ", ".join(f"{k} {v['count']} / {v['seconds']:.1f}s" for k, v in sorted(kinds.items()))
        or "nothing compiled"
    )


def _time_microbatch(model, step, traj, mode, plan, dev) -> tuple[float, float, dict]:
    """(host layout seconds, F/B/Grad seconds, stats) of one microbatch, synchronised on each side;
    gradients accumulate as in ``train_step``."""
    sync(dev)
    t0 = time.perf_counter()
    mb = make_microbatch(model, step, traj, mode, plan)
    sync(dev)
    t1 = time.perf_counter()
    _, st = run_microbatch(model, step, mode=mode, microbatch=mb)
    sync(dev)
    return t1 - t0, time.perf_counter() - t1, st


def section_microbatches(args, model, dev, shared):
    """Per microbatch of the speedup slice, both modes: rows, trees, rounds, replay, capacity fill,
    host layout and F/B/Grad seconds, microseconds per packed row and executed TFLOP/s (warm: run
    after ``speedup``, best of ``--repeats`` passes; trajectory microbatches keep the speedup
    section's per-microbatch timings, host layout included, when it ran). Names the median and the slowest (lowest
    executed TFLOP/s) compact microbatch, which ``breakdown`` profiles, and what the step's F/B/Grad
    would be if every microbatch of a mode ran at its median microbatch's TFLOP/s."""
    cfg = model.config
    step = shared.get("speedup_step") or make_slice(
        args, args.capacity, None, args.slice_microbatches, args.seed, cfg.vocab_size
    )
    keep = _keep(args)
    apply_recompute(model, keep=keep)
    lengths = np.asarray(step.batch.lengths, dtype=np.int64)
    trees = np.asarray(step.batch.tree_ids)
    out = {}
    for mode in ("compact", "trajectory"):
        mbs, plans, _ = plan_microbatches(step, mode, args.capacity, cfg)
        rows = []
        for i, traj in enumerate(mbs):
            plan = plans[i] if plans else None
            w = work_compression(cfg, lengths[traj], [plan.position_ids] if plan is not None else [])
            packed = (
                plan.compact_tokens + plan.replay_tokens if plan is not None else int(lengths[traj].sum())
            )
            rows.append(
                {
                    "index": i,
                    "trajectories": int(len(traj)),
                    "trees": int(np.unique(trees[traj]).size),
                    "semantic_tokens": int(lengths[traj].sum()),
                    "rows": plan.compact_tokens if plan is not None else int(lengths[traj].sum()),
                    "replay_tokens": plan.replay_tokens if plan is not None else 0,
                    "rounds": plan.num_calls if plan is not None else 1,
                    "sequences": plan.num_sequences if plan is not None else int(len(traj)),
                    "state_slots": plan.num_state_slots if plan is not None else 0,
                    "fill": packed / args.capacity,
                    "ideal_work_compression": w["ideal_work_compression"] if plan is not None else 1.0,
                    "executed_flops": executed_flops(cfg, w, mode, keep),
                    "layout_s": float("inf"),
                    "fbg_s": float("inf"),
                }
            )
        timed = shared.get("speedup_microbatch_seconds", {}).get(mode)
        if mode == "trajectory" and timed is not None and len(timed) == len(rows):
            for r, sec in zip(rows, timed):  # the speedup section's timings (layout included)
                r["fbg_s"], r["layout_s"] = sec, None
        else:
            for _ in range(max(args.repeats, 1)):
                for i, traj in enumerate(mbs):
                    lay, fbg, _ = _time_microbatch(model, step, traj, mode, plans[i] if plans else None, dev)
                    r = rows[i]
                    r["layout_s"], r["fbg_s"] = min(r["layout_s"], lay), min(r["fbg_s"], fbg)
                model.zero_grad(set_to_none=True)
        for r in rows:
            r["us_per_packed_row"] = r["fbg_s"] / (r["rows"] + r["replay_tokens"]) * 1e6
            r["tflops"] = r["executed_flops"] / r["fbg_s"] / 1e12
        by_tflops = sorted(range(len(rows)), key=lambda i: rows[i]["tflops"])
        med = by_tflops[len(by_tflops) // 2]
        total = sum(r["fbg_s"] for r in rows)
        at_median = sum(r["executed_flops"] for r in rows) / (rows[med]["tflops"] * 1e12)
        out[mode] = {
            "microbatches": rows,
            "fixed_cost": fixed_cost(rows),
            "median_index": med,
            "slowest_index": by_tflops[0],
            "fbg_s_sum": total,
            "layout_s_sum": sum(r["layout_s"] or 0.0 for r in rows),
            "fbg_s_at_median_tflops": at_median,
            "tflops_step": sum(r["executed_flops"] for r in rows) / total / 1e12,
        }
        log(
            f"microbatches {mode}: {len(rows)}, F/B/Grad {total:.2f}s (at the median microbatch's TFLOP/s "
            f"{at_median:.2f}s), TFLOP/s min/median/max {rows[by_tflops[0]]['tflops']:.0f}/"
            f"{rows[med]['tflops']:.0f}/{rows[by_tflops[-1]]['tflops']:.0f}"
        )
    c, t = out["compact"], out["trajectory"]
    ideal = shared.get("ideal_work_compression")
    out["summary"] = {
        "fbg_speedup_sum_of_microbatches": t["fbg_s_sum"] / c["fbg_s_sum"],
        "fbg_speedup_if_every_compact_at_its_median": t["fbg_s_sum"] / c["fbg_s_at_median_tflops"],
        "ideal_work_compression": ideal,
    }
    shared["profile_microbatches"] = {"median": c["median_index"], "slowest": c["slowest_index"]}
    return out


def fixed_cost(rows: list[dict]) -> dict | None:
    """Least squares ``F/B/Grad seconds = fixed + executed FLOPs / rate`` over a mode's microbatches:
    the time every microbatch costs beside its work. ``microbatch_cost_tokens`` puts it in the
    planner's unit (``plan_step(microbatch_cost=...)``): the fixed seconds over the variable seconds
    per compact row of these microbatches. None with fewer than three microbatches or no spread of
    work (the intercept is then not identified)."""
    if len(rows) < 3:
        return None
    f = np.array([r["executed_flops"] for r in rows]) / 1e12
    t = np.array([r["fbg_s"] for r in rows])
    if f.max() - f.min() < 0.2 * f.mean():
        return None
    a = np.vstack([np.ones_like(f), f]).T
    (fixed, per_tflop), *_ = np.linalg.lstsq(a, t, rcond=None)
    pred = a @ np.array([fixed, per_tflop])
    r2 = 1.0 - float(((t - pred) ** 2).sum() / max(((t - t.mean()) ** 2).sum(), 1e-30))
    variable = max(float(t.sum() - fixed * len(rows)), 1e-30)
    tokens = sum(r["rows"] for r in rows)
    return {
        "fixed_s": float(fixed),
        "marginal_tflops": float(1.0 / per_tflop) if per_tflop > 0 else None,
        "r2": r2,
        "microbatch_cost_tokens": int(round(max(float(fixed), 0.0) / (variable / tokens))),
    }


def section_newshapes(args, model, dev, shared):
    """Steps the process has never seen (the slices of seeds ``--seed + 1 .. --seed +
    --newshape-steps``, same preset, capacity and size), one after the other, after the kernels
    are warm from the speedup step: each one's first compact pass against its warm repeat, with
    what compiled, loaded or autotuned during the first pass (:class:`CompileTrace`). The top-level
    figures are the last step's (the kernels of the earlier never-seen steps are warm by then, as
    in training); ``steps`` has every one."""
    steps = [
        _newshape_step(args, model, dev, args.seed + k) for k in range(1, max(args.newshape_steps, 1) + 1)
    ]
    return {**steps[-1], "steps": steps}


def _newshape_step(args, model, dev, seed):
    cfg = model.config
    step = make_slice(args, args.capacity, None, args.slice_microbatches, seed, cfg.vocab_size)
    apply_recompute(model, keep=_keep(args))
    with CompileTrace() as trace:
        first = train_step(model, None, step, None, "compact", capacity=args.capacity)
    model.zero_grad(set_to_none=True)
    warm = []
    for _ in range(max(args.repeats, 1)):
        warm.append(train_step(model, None, step, None, "compact", capacity=args.capacity).fbg_seconds)
        model.zero_grad(set_to_none=True)
    summary = trace.summary()
    log(
        f"new shapes (seed {seed}): first {first.fbg_seconds:.2f}s, warm {min(warm):.2f}s ({_trace_line(summary)})"
    )
    return {
        "seed": seed,
        "batch": batch_info(step),
        "microbatches": first.num_microbatches,
        "first_fbg_s": first.fbg_seconds,
        "warm_fbg_s": min(warm),
        "warm_runs_s": warm,
        "overhead": first.fbg_seconds / min(warm) - 1.0,
        "target_overhead": 0.02,
        "compiles": summary,
    }


def section_first(args, model, dev, shared):
    """A process's first compact microbatch (the speedup slice's first, recomputation as in
    ``speedup``) with what it compiled, loaded or autotuned, against its warm repeat; and the
    seconds from the process start to that microbatch (imports, model init)."""
    cfg = model.config
    step = shared.get("speedup_step") or make_slice(
        args, args.capacity, None, args.slice_microbatches, args.seed, cfg.vocab_size
    )
    shared["speedup_step"] = step
    mbs, plans, _ = plan_microbatches(step, "compact", args.capacity, cfg)
    apply_recompute(model, keep=_keep(args))
    before = time.perf_counter() - PROCESS_START
    prof = None
    if args.first_profile:  # attribution, not timing: cProfile slows the host side
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()  # the tracer's own imports (triton, FA4's cutlass) count as first-use cost
    with CompileTrace() as trace:
        lay, fbg, _ = _time_microbatch(model, step, mbs[0], "compact", plans[0], dev)
    first_s = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    model.zero_grad(set_to_none=True)
    lay_w, fbg_w, _ = _time_microbatch(model, step, mbs[0], "compact", plans[0], dev)
    model.zero_grad(set_to_none=True)
    summary = trace.summary()
    log(f"first microbatch {first_s:.1f}s, warm {lay_w + fbg_w:.2f}s ({_trace_line(summary)})")
    return {
        "rows": plans[0].compact_tokens,
        "process_seconds_before": before,
        "first_s": first_s,
        "first_layout_s": lay,
        "first_fbg_s": fbg,
        "warm_s": lay_w + fbg_w,
        "target_first_s": 10.0,
        "compiles": summary,
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
        "profiled": prof is not None,
        "host_profile": _host_profile(prof) if prof is not None else None,
    }


def _host_profile(prof, top: int = 30) -> dict:
    """The functions a cProfile'd block spent its host time in: the ``top`` by cumulative and by
    own time (seconds, calls, ``file:line(name)`` with the path cut to its last three parts)."""
    import pstats

    def name(fn):
        path, line, func = fn
        return f"{'/'.join(path.split('/')[-3:])}:{line}({func})"

    rows = [
        {"function": name(fn), "calls": nc, "own_s": tt, "cumulative_s": ct}
        for fn, (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()
    ]
    return {
        "by_cumulative": sorted(rows, key=lambda r: -r["cumulative_s"])[:top],
        "by_own": sorted(rows, key=lambda r: -r["own_s"])[:top],
    }


def attention_backends(model, name: str, dev) -> dict:
    """The attention backend each full-attention mixer kind of ``model`` runs (``auto`` resolved
    for the layer's head dims and dtype, as ``compact_attention`` resolves it per call)."""
    dtype = getattr(torch, model.config.dtype)
    return {
        b.mixer_kind: resolve_backend(name, dev, *b.mixer.head_dims, dtype)
        for b in model.blocks
        if isinstance(b.mixer, CompactAttentionBase)
    }


def _keep(args) -> tuple[str, ...]:
    return tuple(k for k in (args.keep or "").split(",") if k)


def executed_flops(cfg, work: dict, mode: str, keep) -> float:
    """FLOPs a recomputed training pass executes: ``work``'s model FLOPs (3 x forward) plus the
    forward once more, less the attention cores when they are kept (``keep``). A kept
    ``"linear_attention"`` region skips the KDA / GDN chunk cores' second forward, but its
    backward recomputes their WY factors and state scan (a recomputed core saves those,
    ``harts_runtime.ops.keep.saves_are_transient``): less the difference."""
    fwd = work[f"{mode}_flops"] / 3
    costs = layer_costs(cfg)
    attn = work[f"{mode}_keys"] * costs["attn_per_key"] if "attention" in keep else 0.0
    linear = 0.0
    if "linear_attention" in keep:
        linear = work[f"{mode}_rows"] * (costs["linear_core"] - costs["linear_core_recompute"])
    return work[f"{mode}_flops"] + fwd - attn - linear


def _run_collect(model, step, mode, recompute, capacity, no_replay=False, grad=True):
    """Run every microbatch; returns hidden rows [rows, D], row of each target [P], labels [P],
    loss, (when ``grad``) a strided sample of the flattened gradient, and the device's peak memory
    during the run (GiB; CUDA). No logits are kept: :func:`_compare` forms them a chunk at a time."""
    cfg = model.config
    mbs, plans, _ = plan_microbatches(step, mode, capacity, cfg)
    apply_recompute(model, recompute)
    dev = model.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    rowmap = torch.empty(step.num_targets, dtype=torch.int64, device=dev)
    labels = torch.empty(step.num_targets, dtype=torch.int64, device=dev)
    hidden, base, loss = [], 0, 0.0
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        for i, traj in enumerate(mbs):
            mb = make_microbatch(model, step, traj, mode, plans[i] if plans else None)
            ls, st = run_microbatch(
                model,
                step,
                mode=mode,
                microbatch=mb,
                no_replay=no_replay,
                backward=grad,
                return_hidden=True,
            )
            loss += float(ls)
            hidden.append(st["hidden"])
            rowmap[st["target_index"]] = st["row_index"] + base
            labels[st["target_index"]] = st["labels"]
            base += st["hidden"].shape[0]
            del mb, st
    g = None
    if grad:  # a fixed strided subsample of every parameter's gradient (bounded memory)
        total = sum(p.numel() for p in model.parameters())
        stride = max(1, total // GRAD_SAMPLE)
        g = torch.cat([p.grad.flatten()[::stride].float() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    return {
        "hidden": torch.cat(hidden),
        "rowmap": rowmap,
        "labels": labels,
        "loss": loss,
        "grad": g,
        "peak_memory_gib": peak,
    }


def compare_rows(vocab: int, budget_mib: float, cap: int = 2048) -> int:
    """Target rows per comparison chunk: at most ``cap``, and few enough that the chunk's float32
    temporaries (about four ``[rows, V]`` arrays live at once) fit in ``budget_mib``."""
    return max(1, min(cap, int(budget_mib * 2**20) // (4 * 4 * max(vocab, 1))))


@torch.no_grad()
def _compare(model, a, x, depth=None, chunk=None, budget_mib=4096.0):
    """Per-token metrics of run x against run a over all targets, a row chunk of logits at a time
    (memory O(chunk * V); nothing of size P x V is ever held): mean logit cosine and the largest
    absolute logit difference, and per depth (when ``depth`` [P] is given) SymKL, mean |dNLL| and
    counts."""
    w = model.lm_head.weight
    p = a["rowmap"].numel()
    chunk = chunk or compare_rows(w.shape[0], budget_mib)
    cos_sum = 0.0
    max_abs = torch.zeros((), dtype=torch.float32, device=w.device)
    nd = DEPTHS
    kl = torch.zeros(nd + 1, dtype=torch.float64, device=w.device)
    dnll = torch.zeros_like(kl)
    cnt = torch.zeros_like(kl)
    for s in range(0, p, chunk):
        za = (a["hidden"][a["rowmap"][s : s + chunk]] @ w.t()).float()
        zx = (x["hidden"][x["rowmap"][s : s + chunk]] @ w.t()).float()
        cos_sum += float(torch.nn.functional.cosine_similarity(za, zx, dim=-1).double().sum())
        diff = za - zx
        max_abs = torch.maximum(max_abs, diff.abs_().amax())
        del diff
        if depth is not None:
            la = za.log_softmax(-1)
            del za
            lx = zx.log_softmax(-1)
            del zx
            y = a["labels"][s : s + chunk, None]
            dn = (la.gather(1, y) - lx.gather(1, y)).abs()[:, 0]
            # SymKL = 0.5 * (sum pa (la - lx) + sum px (lx - la)) = 0.5 * sum (pa - px)(la - lx)
            dl = la - lx
            pd = la.exp_().sub_(lx.exp_())
            del lx
            sym = 0.5 * (pd.mul_(dl)).sum(-1)
            del pd, dl, la
            d = depth[s : s + chunk].clamp_max(nd)
            kl.index_add_(0, d, sym.double())
            dnll.index_add_(0, d, dn.double())
            cnt.index_add_(0, d, torch.ones_like(dn, dtype=torch.float64))
        else:
            del za, zx
    out = {"mean_cos": cos_sum / max(p, 1), "max_abs_logit_diff": float(max_abs), "chunk_rows": chunk}
    if depth is not None:
        c = cnt.clamp_min(1)
        out["by_depth"] = [
            {
                "depth": d if d < nd else f">={nd}",
                "tokens": int(cnt[d]),
                "symkl": float(kl[d] / c[d]),
                "mean_abs_dnll": float(dnll[d] / c[d]),
            }
            for d in range(nd + 1)
        ]
    return out


def _grad_cos(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(a["grad"][None].double(), b["grad"][None].double())[0])


def _fidelity_step(args, model) -> StepInputs:
    # One microbatch of --fidelity-rows compact rows from a preset whose trajectories fit it
    # whole (default `small`: real branching trees, forks everywhere on the chunk grid), picking
    # the most-shared microbatch, so that handoffs at every depth are measured.
    cap = args.fidelity_rows
    return make_slice(
        args,
        cap,
        None if args.tiny else cap,
        1,
        args.seed + 1,
        model.config.vocab_size,
        pick="max",
        preset="tiny" if args.tiny else args.fidelity_preset,
    )


def _repack_capacity(args, step) -> int:
    # A second ordinary execution packed differently (capacity of a few trajectories): a
    # deterministic GPU rerun of the same packing is bit-identical, so packing is where ordinary
    # execution noise comes from (different GEMM shapes, bf16 rounding, near-tie router flips).
    return max(int(np.max(step.batch.lengths)), args.fidelity_rows // 4)


def _release(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _fidelity_setting(args, model, dev, step, rc: bool, keep: dict | None) -> dict:
    """One recomputation setting: trajectory run A, then each other run compared against A as
    soon as it exists (its logits a chunk at a time) and dropped unless ``keep`` wants its hidden
    rows (the replay section reuses the no-recomputation runs)."""
    budget = args.compare_mib
    a = _run_collect(model, step, "trajectory", rc, args.fidelity_rows)
    peaks = {"trajectory_A": a["peak_memory_gib"]}
    res = {}
    runs = (
        ("B", "trajectory", args.fidelity_rows, "rerun"),
        ("P", "trajectory", _repack_capacity(args, step), "repack"),
        ("R", "compact", args.fidelity_rows, "harts"),
    )
    for key, mode, cap, name in runs:
        x = _run_collect(model, step, mode, rc, cap)
        peaks[f"{mode}_{key}"] = x["peak_memory_gib"]
        res[name] = _compare(model, a, x, budget_mib=budget)
        res[name]["abs_loss_diff"] = abs(a["loss"] - x["loss"])
        res[name]["grad_cos"] = _grad_cos(a, x)
        x["grad"] = None
        if keep is not None:
            keep[key] = x
        del x
        _release(dev)
    a["grad"] = None
    if keep is not None:
        keep["A"] = a
    r, p, h = res["rerun"], res["repack"], res["harts"]
    return {
        "baseline_self_rerun_cos": r["mean_cos"],
        "baseline_repack_cos": p["mean_cos"],
        "harts_cos": h["mean_cos"],
        "abs_loss_diff": h["abs_loss_diff"],
        "baseline_rerun_abs_loss_diff": r["abs_loss_diff"],
        "baseline_repack_abs_loss_diff": p["abs_loss_diff"],
        "grad_cos_harts": h["grad_cos"],
        "grad_cos_rerun": r["grad_cos"],
        "grad_cos_repack": p["grad_cos"],
        "harts_max_abs_logit_diff": h["max_abs_logit_diff"],
        "baseline_rerun_max_abs_logit_diff": r["max_abs_logit_diff"],
        "baseline_repack_max_abs_logit_diff": p["max_abs_logit_diff"],
        "compare_chunk_rows": h["chunk_rows"],
        "peak_memory_gib": peaks,
    }


def section_fidelity(args, model, dev, shared):
    step = _fidelity_step(args, model)
    shared["fidelity_step"] = step
    out = {"batch": batch_info(step)}
    settings = {"off": (False,), "on": (True,), "both": (False, True)}[args.fidelity_recompute]
    failed = []
    for rc in settings:
        key = "recompute" if rc else "no_recompute"
        keep = {} if not rc else None
        try:
            out[key] = _fidelity_setting(args, model, dev, step, rc, keep)
            if keep is not None:
                shared["fidelity_runs"] = keep
        except Exception as e:  # noqa: BLE001 - one setting (e.g. out of memory) must not lose the other
            out[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            failed.append(key)
            model.zero_grad(set_to_none=True)
            _release(dev)
        log(f"fidelity {key}: {out[key]}")
    if failed and len(failed) == len(settings):
        out["error"] = f"every setting failed: {', '.join(failed)} (see their tracebacks)"
    out["target_cos"] = 0.9997
    return out


def handoff_depth(batch) -> torch.Tensor:
    """int64 [P]: segment depth (state handoffs) of every target's position in the batch trie."""
    parent = np.asarray(batch.segment_parent, dtype=np.int64)
    depth = np.zeros(len(parent), dtype=np.int64)
    for v in range(len(parent)):  # preorder: parents first
        if parent[v] >= 0:
            depth[v] = depth[parent[v]] + 1
    seg = np.asarray(batch.row_segment, dtype=np.int64)[np.asarray(batch.compact_map, dtype=np.int64)]
    off = np.asarray(batch.offsets, dtype=np.int64)
    keep = np.ones(batch.semantic_tokens, dtype=bool)
    keep[off[1:] - 1] = False
    return torch.from_numpy(depth[seg[keep]])


def section_replay(args, model, dev, shared):
    step = shared.get("fidelity_step") or _fidelity_step(args, model)
    runs = shared.get("fidelity_runs") or {}
    depth = handoff_depth(step.batch).to(dev)
    out = {"batch": batch_info(step)}
    fresh = {  # forward-only runs (no activations kept) for whatever fidelity did not leave
        "A": ("trajectory", args.fidelity_rows, False),
        "B": ("trajectory", args.fidelity_rows, False),
        "P": ("trajectory", _repack_capacity(args, step), False),
        "R": ("compact", args.fidelity_rows, False),
        "N": ("compact", args.fidelity_rows, True),
    }

    def get(key):
        if key in runs:
            return runs[key]
        mode, cap, no_replay = fresh[key]
        return _run_collect(model, step, mode, False, cap, no_replay=no_replay, grad=False)

    a = get("A")
    for name, key in (("rerun", "B"), ("repack", "P"), ("replay", "R"), ("no_replay", "N")):
        x = get(key)
        out[name] = _compare(model, a, x, depth, budget_mib=args.compare_mib)["by_depth"]
        runs.pop(key, None)
        del x
    shared.pop("fidelity_runs", None)
    return out


def section_breakdown(args, model, dev, shared):
    """The profile of one compact microbatch: after ``microbatches``, its median one (top-level
    keys) and its slowest one (``"slowest"``); otherwise the slice's first."""
    cfg = model.config
    step = shared.get("speedup_step") or make_slice(args, args.capacity, None, 1, args.seed, cfg.vocab_size)
    mbs, plans, plan_s = plan_microbatches(step, "compact", args.capacity, cfg)
    pick = shared.get("profile_microbatches") or {"median": 0}
    out = _profile_microbatch(args, model, dev, step, mbs[pick["median"]], plans[pick["median"]], plan_s)
    out["microbatch"]["index"] = pick["median"]
    if pick.get("slowest") is not None and pick["slowest"] != pick["median"]:
        slow = _profile_microbatch(
            args, model, dev, step, mbs[pick["slowest"]], plans[pick["slowest"]], plan_s
        )
        slow["microbatch"]["index"] = pick["slowest"]
        out["slowest"] = slow
    return out


def _profile_microbatch(args, model, dev, step, traj, plan, plan_s):
    from torch.profiler import ProfilerActivity, profile

    cfg = model.config
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sync(dev)
    t = time.perf_counter()
    apply_recompute(model, keep=_keep(args))
    with profile(activities=acts) as prof:
        mb = make_microbatch(model, step, traj, "compact", plan)
        run_microbatch(model, step, mode="compact", microbatch=mb)
        sync(dev)
    wall = time.perf_counter() - t
    model.zero_grad(set_to_none=True)
    # the same work again without the profiler (which adds host time per kernel): the wall that
    # device_busy is judged against; kernels are warm now
    sync(dev)
    t = time.perf_counter()
    mb = make_microbatch(model, step, traj, "compact", plan)
    run_microbatch(model, step, mode="compact", microbatch=mb)
    sync(dev)
    wall_plain = time.perf_counter() - t
    model.zero_grad(set_to_none=True)
    ranges, kernels, kernel_s = {}, 0, 0.0
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "cuda_time_total", 0)
        if e.key.startswith("harts."):
            r = ranges.setdefault(e.key, {"calls": 0, "device_s": 0.0, "cpu_s": 0.0})
            r["calls"] += e.count
            r["device_s"] += dev_us / 1e6
            r["cpu_s"] += e.cpu_time_total / 1e6
        self_dev = getattr(e, "self_device_time_total", None)
        if self_dev is None:
            self_dev = getattr(e, "self_cuda_time_total", 0)
        if (
            self_dev
            and not e.key.startswith("harts.")
            and getattr(e, "device_type", None) is not None
            and str(e.device_type).endswith("CUDA")
        ):
            kernels += e.count
            kernel_s += self_dev / 1e6
    p = plan
    replay_share = p.replay_tokens / max(p.replay_tokens + p.compact_tokens, 1)
    core = ranges.get("harts.kda.core", {}).get("device_s" if dev.type == "cuda" else "cpu_s", 0.0)
    busy = _busy_seconds(prof) if dev.type == "cuda" else None
    return {
        "microbatch": {
            "rows": p.compact_tokens,
            "replay_tokens": p.replay_tokens,
            "calls": p.num_calls,
            "state_slots": p.num_state_slots,
            "sequences": p.num_sequences,
        },
        "wall_s": wall,
        "wall_unprofiled_s": wall_plain,
        "ranges": ranges,
        "device_kernels": kernels,
        "device_kernel_s": kernel_s,
        "host_overhead_s": max(wall - kernel_s, 0.0) if dev.type == "cuda" else None,
        "device_busy_s": busy,
        "device_busy": min(busy / wall_plain, 1.0) if busy is not None and wall_plain > 0 else None,
        "device_busy_profiled": busy / wall if busy is not None and wall > 0 else None,
        "kda_replay_share_of_packed_rows": replay_share,
        "kda_replay_s_estimate": core * replay_share,
        "state_bytes_per_kda_layer": p.num_state_slots * _state_bytes(cfg),
        "planner_s": plan_s,
        "note": "ranges nest (harts.mixer.kda contains harts.kda.*; harts.mixer.mla contains harts.attn.*); "
        "backward recompute re-enters the forward ranges; KDA backward kernels are outside ranges; "
        "device_busy = union of device kernel intervals (profiler on) / wall of the same microbatch run again "
        "without the profiler (device_busy_profiled: / the profiled wall); the GDN core runs in harts.kda.*",
    }


def _state_bytes(cfg) -> int:
    """fp32 bytes of one boundary state of the model's linear-attention layers (KDA: H K V; GDN:
    Hv K V; the largest when both occur)."""
    sizes = [0]
    if "kda" in cfg.mixers:
        sizes.append((cfg.kda.num_heads or cfg.num_heads) * cfg.kda.head_k_dim * cfg.kda.head_v_dim)
    if "gdn" in cfg.mixers:
        sizes.append(cfg.gdn.num_v_heads * cfg.gdn.head_k_dim * cfg.gdn.head_v_dim)
    return max(sizes) * 4


def _busy_seconds(prof) -> float:
    """Seconds during which at least one device kernel ran (union of the kernels' intervals)."""
    spans = []
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start:
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s0, e0 in spans:
        if cur_e is None or s0 > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s0, e0
        else:
            cur_e = max(cur_e, e0)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy / 1e6


# ------------------------------------------------------------------------------ report
def markdown(res: dict) -> str:
    lines = [f"# train_eval ({res['meta']['device']}, {res['meta']['model']})", ""]
    s = res.get("speedup")
    if isinstance(s, dict) and "fbg_speedup" in s:
        b = s["batch"]
        lines += [
            "## Speedup (Table 4)",
            "",
            (
                f"Slice: {b['trajectories']} trajectories, S = {b['semantic_tokens']:,}, C = {b['compact_tokens']:,}, "
                f"T = {s['capacity']:,}, recomputation on"
                + (f" (kept: {', '.join(s['keep'])})." if s.get("keep") else ".")
                + (
                    " With one timed step, every microbatch shape but the warmed-up first is new to the process: "
                    "this is the step's first pass (compiles included); the Microbatches section times it warm."
                    if len(s["runs"]["compact"]) == 1 and s["runs"]["compact"][0]["num_microbatches"] > 1
                    else ""
                )
            ),
            "",
            "| non-replay row compression | ideal work compression | F/B/Grad speedup | Core speedup | F/B/Grad / ideal |",
            "|---:|---:|---:|---:|---:|",
            (
                f"| {s['non_replay_row_compression']:.3f}x | {s['ideal_work_compression']:.3f}x | {s['fbg_speedup']:.3f}x | "
                f"{s['core_speedup']:.3f}x | {s['fbg_speedup_over_ideal']:.3f} |"
            ),
            "",
        ]
        c, t = (min(s["runs"][m], key=lambda d: d["fbg_seconds"]) for m in ("compact", "trajectory"))
        lines += [
            "| mode | microbatches | rows | replay | F/B/Grad s | planner s | TFLOP/s (executed) | TFLOP/s (model) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        mfu = s.get("mfu_tflops") or {}
        for m, d in (("compact", c), ("trajectory", t)):
            lines.append(
                f"| {m} | {d['num_microbatches']} | {d['rows']:,} | {d['replay_tokens']:,} | {d['fbg_seconds']:.3f} | "
                f"{d['plan_seconds']:.3f} | {s['tflops'][m]:.1f} | "
                + (f"{mfu[m]:.1f} |" if m in mfu else "— |")
            )
        lines.append("")
        if s.get("first_microbatch_seconds"):
            fm, wm = s["first_microbatch_seconds"], s["warm_microbatch_seconds"]
            lines += [
                "First microbatch of the run (compilation and autotuning, Triton cache as found) against a warm one: "
                + "; ".join(f"{m} {fm[m]:.1f} s vs {wm[m]:.2f} s" for m in ("compact", "trajectory")),
                "",
            ]
        first_runs = {m: s["runs"][m][0] for m in ("compact", "trajectory") if s["runs"].get(m)}
        if any("microbatch_seconds" in d for d in first_runs.values()):
            lines += [
                "First timed step, per mode: "
                + "; ".join(
                    f"{m} microbatches {', '.join(f'{x:.2f}' for x in d['microbatch_seconds'])} s "
                    f"({_trace_line(d.get('compiles') or {})}"
                    + "".join(f", {k} +{v}" for k, v in (d.get("allocator") or {}).items())
                    + ")"
                    for m, d in first_runs.items()
                    if "microbatch_seconds" in d
                ),
                "",
            ]
    f = res.get("fidelity")
    if isinstance(f, dict) and ("no_recompute" in f or "recompute" in f):
        lines += [
            "## Fidelity (Table 5)",
            "",
            "Trajectory runs packed at T = --fidelity-rows (the compact microbatch's size); the repacked "
            "baseline packs at about a quarter of that.",
            "",
            "| recompute | baseline self-rerun cos | baseline repacked cos | HARTS cos | abs loss diff "
            "(HARTS / repacked) | grad cos HARTS | grad cos rerun | grad cos repacked | max abs logit diff "
            "(HARTS / repacked) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for k in ("no_recompute", "recompute"):
            d = f.get(k)
            if isinstance(d, dict) and "harts_cos" in d:
                lines.append(
                    f"| {k} | {d['baseline_self_rerun_cos']:.8f} | {d['baseline_repack_cos']:.8f} | "
                    f"{d['harts_cos']:.8f} | {d['abs_loss_diff']:.3e} / {d['baseline_repack_abs_loss_diff']:.3e} | "
                    f"{d['grad_cos_harts']:.6f} | {d['grad_cos_rerun']:.6f} | {d['grad_cos_repack']:.6f} | "
                    f"{d.get('harts_max_abs_logit_diff', float('nan')):.3e} / "
                    f"{d.get('baseline_repack_max_abs_logit_diff', float('nan')):.3e} |"
                )
            elif isinstance(d, dict) and "error" in d:
                lines.append(f"| {k} | failed: `{d['error'][:200]}` | | | | | | | |")
        lines.append("")
    r = res.get("replay")
    if isinstance(r, dict) and "replay" in r:
        lines += [
            "## Replay ablation (Figure 4)",
            "",
            (
                "| d | tokens | SymKL rerun | SymKL repacked | SymKL replay | "
                "SymKL no-replay | |dNLL| rerun | |dNLL| repacked | |dNLL| replay | |dNLL| no-replay |"
            ),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for i in range(DEPTHS + 1):
            a, p, b, c = r["rerun"][i], r["repack"][i], r["replay"][i], r["no_replay"][i]
            lines.append(
                f"| {a['depth']} | {a['tokens']:,} | {a['symkl']:.3e} | {p['symkl']:.3e} | {b['symkl']:.3e} | "
                f"{c['symkl']:.3e} | {a['mean_abs_dnll']:.3e} | {p['mean_abs_dnll']:.3e} | "
                f"{b['mean_abs_dnll']:.3e} | {c['mean_abs_dnll']:.3e} |"
            )
        lines.append("")
    m = res.get("microbatches")
    if isinstance(m, dict) and "compact" in m:
        lines += _microbatches_md(m)
    for name, title in (
        ("first", "First microbatch of the process"),
        ("newshapes", "A step of never-seen shapes"),
    ):
        d = res.get(name)
        if isinstance(d, dict) and "compiles" in d:
            lines += _compiles_md(name, title, d)
    k = res.get("breakdown")
    if isinstance(k, dict) and "ranges" in k:
        for title, d in (("median", k), ("slowest", k.get("slowest"))):
            if isinstance(d, dict) and "ranges" in d:
                lines += _breakdown_md(title, d)
    for name in SECTIONS:
        if isinstance(res.get(name), dict) and "error" in res[name]:
            lines.append(f"**{name} failed:** `{res[name]['error']}`")
    return "\n".join(lines) + "\n"


def _breakdown_md(title: str, k: dict) -> list[str]:
    mb = k["microbatch"]
    lines = [
        f"## Breakdown ({title} compact microbatch"
        + (f" #{mb['index']}" if "index" in mb else "")
        + f": {mb['rows']:,} rows, {mb['calls']} rounds, forward + backward, recompute)",
        "",
        (
            f"wall {k['wall_s']:.3f} s profiled, {k.get('wall_unprofiled_s', float('nan')):.3f} s without "
            f"the profiler; device kernels {k['device_kernels']} taking {k['device_kernel_s']:.3f} s"
            + (
                f" (device busy {k['device_busy']:.1%} of the unprofiled wall, "
                f"{k.get('device_busy_profiled') or 0:.1%} of the profiled one)"
                if k.get("device_busy") is not None
                else ""
            )
            + "; "
            f"planner {k['planner_s']:.3f} s; KDA replay share of packed rows {k['kda_replay_share_of_packed_rows']:.4f} "
            f"(~{k['kda_replay_s_estimate']:.3f} s of KDA core)"
        ),
        "",
        "| range | calls | device s | cpu s |",
        "|---|---:|---:|---:|",
    ]
    for name, d in sorted(k["ranges"].items()):
        lines.append(f"| {name} | {d['calls']} | {d['device_s']:.4f} | {d['cpu_s']:.4f} |")
    lines.append("")
    return lines


def _microbatches_md(m: dict) -> list[str]:
    c, t, sm = m["compact"], m["trajectory"], m.get("summary") or {}
    ideal = sm.get("ideal_work_compression")
    lines = [
        "## Microbatches of the slice (warm, each timed alone)",
        "",
        *(
            [
                f"Fixed cost of a compact microbatch (least squares of F/B/Grad on executed FLOPs): "
                f"{fc['fixed_s']:.3f} s beside {fc['marginal_tflops'] or float('nan'):.0f} TFLOP/s of work "
                f"(R^2 {fc['r2']:.3f}), about {fc['microbatch_cost_tokens']:,} compact tokens: the planner's "
                f"`microbatch_cost`.",
                "",
            ]
            if (fc := c.get("fixed_cost"))
            else []
        ),
        (
            f"Compact: {len(c['microbatches'])} microbatches, F/B/Grad {c['fbg_s_sum']:.3f} s "
            f"({c['tflops_step']:.1f} TFLOP/s executed; {c['fbg_s_at_median_tflops']:.3f} s if each ran at the "
            f"median microbatch's TFLOP/s), host layout {c['layout_s_sum']:.3f} s. Trajectory: "
            f"{len(t['microbatches'])} microbatches, {t['fbg_s_sum']:.3f} s ({t['tflops_step']:.1f} TFLOP/s; "
            f"{t['fbg_s_at_median_tflops']:.3f} s at its median). Speedup of the sums "
            f"{sm.get('fbg_speedup_sum_of_microbatches', float('nan')):.3f}x"
            + (
                f" ({sm['fbg_speedup_sum_of_microbatches'] / ideal:.3f} of the ideal {ideal:.3f}x)"
                if ideal
                else ""
            )
            + f"; with every compact microbatch at its median {sm.get('fbg_speedup_if_every_compact_at_its_median', float('nan')):.3f}x."
        ),
        "",
        "| # | trajectories | trees | rows | replay | rounds | fill | ideal work compression | layout s | F/B/Grad s | µs / packed row | TFLOP/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in c["microbatches"]:
        tag = (
            " (median)"
            if r["index"] == c["median_index"]
            else " (slowest)"
            if r["index"] == c["slowest_index"]
            else ""
        )
        lines.append(
            f"| {r['index']}{tag} | {r['trajectories']} | {r['trees']} | {r['rows']:,} | {r['replay_tokens']:,} | "
            f"{r['rounds']} | {r['fill']:.2f} | {r['ideal_work_compression']:.3f}x | {r['layout_s']:.3f} | "
            f"{r['fbg_s']:.3f} | {r['us_per_packed_row']:.2f} | {r['tflops']:.1f} |"
        )
    tr = sorted(t["microbatches"], key=lambda r: r["tflops"])
    lines += [
        "",
        f"Trajectory microbatches: TFLOP/s min / median / max {tr[0]['tflops']:.1f} / "
        f"{tr[len(tr) // 2]['tflops']:.1f} / {tr[-1]['tflops']:.1f}; µs per row "
        f"{min(r['us_per_packed_row'] for r in tr):.2f}-{max(r['us_per_packed_row'] for r in tr):.2f}.",
        "",
    ]
    return lines


def _compiles_md(name: str, title: str, d: dict) -> list[str]:
    c = d["compiles"]
    if name == "first":
        head = (
            f"{d['first_s']:.2f} s against {d['warm_s']:.3f} s warm ({d['rows']:,} rows; target "
            f"{d['target_first_s']:.0f} s); {d['process_seconds_before']:.1f} s of imports and model init before it; "
            f"TRITON_CACHE_DIR {d.get('triton_cache_dir') or 'unset'}."
        )
    else:
        head = (
            " ".join(
                f"Seed {x.get('seed', '+1')}: {x['microbatches']} compact microbatches, first pass {x['first_fbg_s']:.3f} s "
                f"against {x['warm_fbg_s']:.3f} s warm: {x['overhead']:+.1%}"
                + (
                    f" ({x['compiles']['kinds'].get('triton_compile', {}).get('count', 0)} Triton compiles)."
                    if x.get("compiles")
                    else "."
                )
                for x in d.get("steps") or [d]
            )
            + f" Target {d['target_overhead']:+.0%}; the table is the last step's."
        )
    if name == "first" and d.get("host_profile"):
        head += " Under cProfile (attribution only; the timing is from a run without it)."
    lines = [f"## {title}", "", head, ""]
    kinds = c.get("kinds") or {}
    lines.append(
        "Inside it: "
        + (
            ", ".join(f"{k} {v['count']} ({v['seconds']:.2f} s)" for k, v in sorted(kinds.items()))
            or "nothing compiled"
        )
        + " (autotune seconds contain their compiles)."
    )
    if c.get("top"):
        lines += ["", "| kind | kernel | events | distinct keys | seconds |", "|---|---|---:|---:|---:|"]
        for r in c["top"][:12]:
            lines.append(
                f"| {r['kind']} | `{r['name']}` | {r['count']} | {r['distinct_keys']} | {r['seconds']:.2f} |"
            )
    hp = d.get("host_profile")
    if hp:
        lines += [
            "",
            "| host function (by cumulative time) | calls | cumulative s | own s |",
            "|---|---:|---:|---:|",
        ]
        for r in hp["by_cumulative"][:20]:
            lines.append(f"| `{r['function']}` | {r['calls']} | {r['cumulative_s']:.2f} | {r['own_s']:.2f} |")
    lines.append("")
    return lines


def write(out_dir: str, res: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    clean = json.loads(json.dumps(res, default=lambda o: None))
    with open(os.path.join(out_dir, "train_eval.json"), "w") as fh:
        json.dump(clean, fh, indent=1)
    with open(os.path.join(out_dir, "train_eval.md"), "w") as fh:
        fh.write(markdown(clean))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "train_eval"))
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip sections that would start after this")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--flavor", default="ling-tiny")
    ap.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="a transformers checkpoint folder (harts_runtime.load_pretrained) instead of --flavor/--layers",
    )
    ap.add_argument(
        "--layers", type=int, default=8, help="first N layers of the flavor's pattern (ling-tiny: 24 = full)"
    )
    ap.add_argument("--preset", default="swe-like")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacity", type=int, default=hp.DEFAULT_CAPACITY, help="T")
    ap.add_argument(
        "--slice-microbatches",
        type=int,
        default=1,
        help="HARTS microbatches (at T) of the swe-like step kept for the speedup slice",
    )
    ap.add_argument(
        "--fidelity-rows",
        type=int,
        default=16_384,
        help="capacity and trajectory cap of the fidelity/replay slice (one microbatch)",
    )
    ap.add_argument(
        "--fidelity-preset",
        default="small",
        help="synthetic preset of the fidelity/replay slice (its trajectories must fit --fidelity-rows)",
    )
    ap.add_argument(
        "--fidelity-recompute",
        choices=("both", "off", "on"),
        default="both",
        help="fidelity settings: without recomputation (off: every layer's activations of a "
        "--fidelity-rows microbatch are kept), with it (on), or both",
    )
    ap.add_argument(
        "--compare-mib",
        type=float,
        default=4096.0,
        help="float32 logit temporaries of one comparison chunk (rows per chunk = this / (16 V))",
    )
    ap.add_argument(
        "--keep",
        default="attention,linear_attention",
        help="comma-separated op regions kept instead of recomputed in the speedup and breakdown sections "
        "(harts_runtime.ops.keep.KEEPABLE; '' = full-block recomputation). Measured on the H200, 24-layer "
        "ling-tiny, 65k rows: both kept 2.981 s at 78.5 GB peak, attention alone 3.044 s at 50.1 GB",
    )
    ap.add_argument(
        "--attn-backend",
        default="auto",
        help="attention backend (harts_runtime.ops.attention.BACKENDS, or auto)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per mode")
    ap.add_argument(
        "--first-profile",
        action="store_true",
        help="run the first section's microbatch under cProfile and report where its host time went "
        "(attribution only: the profiler slows the host side, so time it in a run without this flag)",
    )
    ap.add_argument(
        "--newshape-steps",
        type=int,
        default=2,
        help="never-seen steps the newshapes section runs one after the other (seeds --seed + 1, + 2, ...)",
    )
    ap.add_argument(
        "--sections",
        default="speedup,fidelity,replay,breakdown",
        help=f"comma-separated sections to run, in order (known: {', '.join(SECTIONS)}); the whole-step "
        "benchmark is --slice-microbatches 8 --sections speedup,microbatches,newshapes,breakdown",
    )
    ap.add_argument(
        "--fast-autotune",
        action="store_true",
        help="one Triton config per kernel (no autotuning); recorded in the output",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU smoke sizes (preset tiny, T = 64)")
    args = ap.parse_args(argv)
    unknown = [x for x in (t.strip() for t in args.sections.split(",")) if x and x not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {unknown} (known: {', '.join(SECTIONS)})")
    if args.tiny:
        args.preset, args.capacity, args.slice_microbatches, args.fidelity_rows, args.repeats = (
            "tiny",
            64,
            2,
            64,
            1,
        )
        args.layers = min(args.layers, 4)
    start = time.perf_counter()
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    if args.model is not None:
        from harts_runtime import load_pretrained

        model = load_pretrained(
            args.model,
            dtype="float32" if dev.type == "cpu" else None,
            device=dev,
            attn_backend=args.attn_backend,
        )
        cfg, args.flavor = model.config, args.model
    else:
        cfg = model_config(args.flavor, args.layers)
        if args.tiny and args.flavor != "debug":
            cfg = tiny_config(cfg)
        if dev.type == "cpu" and cfg.dtype == "bfloat16":
            cfg = cfg.replace(dtype="float32")
        model = HybridModel(cfg.replace(attn_backend=args.attn_backend), device=dev)
    args.chunk_size = cfg.chunk_size
    res = {
        "meta": {
            "device": torch.cuda.get_device_name(dev)
            if dev.type == "cuda"
            else platform.processor() or "cpu",
            "model": f"{args.flavor}{' at tiny widths' if args.tiny and args.model is None and args.flavor != 'debug' else ''} "
            f"({cfg.num_layers} layers: {' '.join(MIXER_CODES.get(m, m) for m in cfg.mixers)})",
            "params": sum(p.numel() for p in model.parameters()),
            "dtype": cfg.dtype,
            "attention_backend": attention_backends(model, args.attn_backend, dev),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "args": vars(args),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    }
    write(args.out, res)
    shared: dict = {}
    funcs = {name: globals()[f"section_{name}"] for name in SECTIONS}
    for name in [s.strip() for s in args.sections.split(",") if s.strip()]:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            res[name] = {"skipped": f"budget: {elapsed:.0f}s elapsed > {args.budget_s:.0f}s"}
            log(f"skip {name}")
            write(args.out, res)
            continue
        log(f"section {name} (elapsed {elapsed:.0f}s)")
        t = time.perf_counter()
        try:
            res[name] = funcs[name](args, model, dev, shared)
            res[name]["seconds"] = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - every section reports its own failure
            res[name] = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
                "seconds": time.perf_counter() - t,
            }
            log(f"{name} failed: {e}")
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        write(args.out, res)
    res["meta"]["total_seconds"] = time.perf_counter() - start
    write(args.out, res)
    sys.stdout.write(markdown(json.loads(json.dumps(res, default=lambda o: None))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
