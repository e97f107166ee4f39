"""Minimum-call planning time versus segment-tree size (issue 3: Algorithm 1 is O(|V| + |E|)).

Synthetic segment forests are built directly as (parent, start, end) arrays and planned
through the C++ entry point for bare forests, phase by phase: building the forest (validation,
child CSR, row numbering), planning (Equations 12-14 and recovery), and the physical layout
(C + R packed rows). Shapes:

* ``random``: random recursive tree (parent uniform among earlier segments), depth O(log V),
  renumbered in DFS preorder as ``RolloutBatch`` numbers segments.
* ``random_shuffled``: the same tree in insertion order (ids not preorder): the planner then
  walks it breadth-first and pays cache misses on scattered ids.
* ``caterpillar``: a spine of V/2 segments, each with one leaf beside it (depth V/2).
* ``chain``: V unary segments in one path (depth V; where trajectories end on a path).
* ``bushy``: complete 8-ary tree.

Segment lengths are uniform in [1, B]. Also times ``plan_calls`` on whole batches of the
``swe-like`` synthetic preset (token batch -> microbatch forest -> plan -> layout).

    python benchmarks/min_call.py --out benchmarks/results/min_call.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np

SHAPES = ("random", "random_shuffled", "caterpillar", "chain", "bushy")


def preorder_renumber(parent: np.ndarray) -> np.ndarray:
    """The same tree with ids in DFS preorder (children by increasing old id)."""
    n = len(parent)
    order = np.argsort(parent[1:], kind="stable") + 1  # children grouped by parent, by id
    counts = np.bincount(parent[1:], minlength=n)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    new_id = np.empty(n, dtype=np.int64)
    stack = [0]
    nxt = 0
    children = order.tolist()
    off = offsets.tolist()
    while stack:
        u = stack.pop()
        new_id[u] = nxt
        nxt += 1
        stack.extend(reversed(children[off[u] : off[u + 1]]))
    renumbered = np.empty(n, dtype=np.int64)
    renumbered[new_id] = np.where(parent < 0, -1, new_id[np.maximum(parent, 0)])
    return renumbered


def make_forest(shape: str, n: int, chunk: int, rng: np.random.Generator):
    """(parent, start, end) int32 arrays of an n-segment forest with parent[v] < v."""
    v = np.arange(n, dtype=np.int64)
    if shape in ("random", "random_shuffled"):
        parent = np.floor(rng.random(n) * v).astype(np.int64)
    elif shape == "caterpillar":
        # Even ids form the spine; odd id 2i+1 is a leaf beside spine segment 2i.
        parent = np.where(v % 2 == 0, v - 2, v - 1)
        parent[v == 1] = 0
    elif shape == "chain":
        parent = v - 1
    elif shape == "bushy":
        parent = (v - 1) // 8
    else:
        raise ValueError(shape)
    parent[0] = -1
    if shape == "random":
        parent = preorder_renumber(parent)
    lengths = rng.integers(1, chunk + 1, size=n, dtype=np.int64)
    start = np.zeros(n, dtype=np.int64)
    end = np.zeros(n, dtype=np.int64)
    # parent < child: one pass in id order (vectorised by depth level would be faster; not timed).
    par = parent.tolist()
    ln = lengths.tolist()
    st = [0] * n
    en = [0] * n
    for i in range(n):
        s = 0 if par[i] < 0 else en[par[i]]
        st[i] = s
        en[i] = s + ln[i]
    start[:] = st
    end[:] = en
    assert end.max() < 2**31
    return parent.astype(np.int32), start.astype(np.int32), end.astype(np.int32)


def time_forest(shape: str, n: int, chunk: int, repeats: int, seed: int) -> dict:
    from harts_planner import _native

    parent, start, end = make_forest(shape, n, chunk, np.random.default_rng(seed))
    runs = [_native.time_plan_segment_forest(parent, start, end, chunk) for _ in range(repeats)]
    best = {k: min(r[k] for r in runs) for k in ("forest_seconds", "plan_seconds", "layout_seconds")}
    total = min(r["forest_seconds"] + r["plan_seconds"] + r["layout_seconds"] for r in runs)
    r0 = runs[0]
    return {
        "shape": shape,
        "segments": n,
        "compact_tokens": r0["compact_tokens"],
        "packed_tokens": r0["packed_tokens"],
        "num_calls": r0["num_calls"],
        "replay_tokens": r0["replay_tokens"],
        "num_sequences": r0["num_sequences"],
        "num_state_slots": r0["num_state_slots"],
        **{f"{k}_best": v for k, v in best.items()},
        "total_seconds_best": total,
        "plan_ns_per_segment": best["plan_seconds"] / n * 1e9,
        "total_ns_per_segment": total / n * 1e9,
        "repeats": repeats,
    }


def time_preset(preset: str, seed: int, chunk: int, repeats: int) -> dict:
    from harts_planner import RolloutBatch, plan_calls, synth

    syn = synth.generate(preset, seed=seed)
    batch = RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids)
    times = []
    plan = None
    for _ in range(repeats):
        del plan
        t0 = time.perf_counter()
        plan = plan_calls(batch, chunk)
        times.append(time.perf_counter() - t0)
    return {
        "preset": preset,
        "seed": seed,
        "trajectories": batch.num_trajectories,
        "semantic_tokens": batch.semantic_tokens,
        "compact_tokens": plan.compact_tokens,
        "segments": plan.num_segments,
        "num_calls": plan.num_calls,
        "replay_tokens": plan.replay_tokens,
        "num_sequences": plan.num_sequences,
        "plan_calls_seconds_best": min(times),
        "plan_calls_seconds_all": times,
    }


def loglog_slope(xs, ys) -> float:
    lx, ly = np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float))
    return float(np.polyfit(lx, ly, 1)[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes", type=int, nargs="+", default=[1_000, 3_000, 10_000, 30_000, 100_000, 300_000, 1_000_000]
    )
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--presets", nargs="*", default=["swe-like"])
    p.add_argument("--preset-seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/min_call.json")
    args = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    runs = []
    for shape in args.shapes:
        for n in args.sizes:
            repeats = args.repeats if n < 300_000 else max(2, args.repeats // 2)
            r = time_forest(shape, n, args.chunk_size, repeats, args.seed)
            runs.append(r)
            print(
                f"{shape:12s} V={n:>9,} calls={r['num_calls']:>3} C={r['compact_tokens']:>11,} "
                f"R={r['replay_tokens']:>10,} plan={r['plan_seconds_best'] * 1e3:8.2f} ms "
                f"({r['plan_ns_per_segment']:6.1f} ns/seg) total={r['total_seconds_best'] * 1e3:8.2f} ms "
                f"({r['total_ns_per_segment']:6.1f} ns/seg)",
                flush=True,
            )
    slopes = {}
    for shape in args.shapes:
        rs = [r for r in runs if r["shape"] == shape and r["segments"] >= 10_000]
        if len(rs) >= 2:
            slopes[shape] = {
                "plan": loglog_slope([r["segments"] for r in rs], [r["plan_seconds_best"] for r in rs]),
                "total": loglog_slope([r["segments"] for r in rs], [r["total_seconds_best"] for r in rs]),
            }
            print(
                f"log-log slope ({shape}, V >= 1e4): plan {slopes[shape]['plan']:.3f}, "
                f"total {slopes[shape]['total']:.3f}  (1.0 = linear)"
            )
    presets = []
    for preset in args.presets:
        for seed in args.preset_seeds:
            r = time_preset(preset, seed, args.chunk_size, 3)
            presets.append(r)
            print(
                f"{preset} seed {seed}: N={r['trajectories']:,} V={r['segments']:,} "
                f"C={r['compact_tokens']:,} calls={r['num_calls']} R={r['replay_tokens']:,} "
                f"plan_calls={r['plan_calls_seconds_best'] * 1e3:.2f} ms",
                flush=True,
            )
    result = {
        "benchmark": "min_call",
        "machine": {"platform": platform.platform(), "cores_used": 1, "python": platform.python_version()},
        "chunk_size": args.chunk_size,
        "note": "best-of-repeats wall time of the C++ phases; slopes fit log(time) vs log(V) for V >= 1e4",
        "runs": runs,
        "loglog_slopes": slopes,
        "presets": presets,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}", file=sys.stderr)
    if any(not math.isfinite(s["plan"]) for s in slopes.values()):
        sys.exit("non-finite slope")


if __name__ == "__main__":
    main()
