"""Compact work when verl dispatches the step: verl's own DP balancing vs the harts backend's routes.

verl balances a step over its DP ranks (``RayPPOTrainer._balance_batch``: Karmarkar-Karp on
``calculate_workload(seqlen)``, equal trajectory counts per rank) and dispatches each rank its share
before an engine sees it, which separates trajectories that share a prefix. On a synthetic
``swe-like`` step (``harts_planner.synth``; seeds, D and T below), planned on the CPU (no model runs):

* ``trajectory``        -- trajectory-wise execution: S rows (every token of every trajectory);
* ``verl-balance``      -- verl's balancing, then each rank plans *its own* rows with HARTS
                           (``plan_step`` at D = 1): prefixes shared across ranks run once per rank;
* ``verl-uid-groups``   -- verl's PrefixGrouper balancing (``get_group_balanced_partitions``, uid = the
                           rollout tree), then each rank plans its rows: trees stay whole, balanced
                           by raw lengths;
* ``harts-allgather``   -- the backend's route: token ids all-gathered over DP, the whole step planned
                           at D (``plan_step``), every rank its replica's microbatches;
* ``harts-at-balance``  -- the planner's replica assignment used where verl balances (same plan, so
                           the same rows); verl's dispatch needs equal trajectory counts per rank,
                           which the planner's replicas do not have (reported).

For each: rows executed (the sum of every microbatch's compact work), the busiest rank's rows,
trees split over ranks, and the all-gather's volume (token ids per rank). Needs verl installed (its
balancing functions are called as they are).

    python benchmarks/verl_balance.py                    # seeds 0-2, D = 2, 4, 8, T = 65,536
    python benchmarks/verl_balance.py --seeds 0 --dp 4   # quick look

Writes ``benchmarks/results/verl_balance.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python_client"))

import harts_planner as hp  # noqa: E402
from harts_planner import synth  # noqa: E402


def sub_batch(batch: synth.SynthBatch, traj: np.ndarray) -> hp.RolloutBatch:
    off = batch.offsets
    lens = off[traj + 1] - off[traj]
    tokens = np.concatenate([batch.tokens[off[i] : off[i + 1]] for i in traj])
    return hp.RolloutBatch.from_arrays(tokens, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))


def local_plans(batch, parts, capacity, chunk):
    """Each rank plans its own trajectories (D = 1): ``(rows per rank, microbatches per rank)``."""
    rows, mbs = [], []
    for part in parts:
        part = np.sort(np.asarray(part, dtype=np.int64))
        sub = sub_batch(batch, part)
        plan = hp.plan_step(sub, 1, capacity, chunk)
        rows.append(sum(int(sub.subset_work(np.asarray(m))) for m in plan.microbatches))
        mbs.append(len(plan.microbatches))
    return rows, mbs


def trees_split(tree_ids, parts) -> int:
    owner = {}
    split = set()
    for r, part in enumerate(parts):
        for t in tree_ids[np.asarray(part, dtype=np.int64)].tolist():
            if owner.setdefault(t, r) != r:
                split.add(t)
    return len(split)


def measure(seed: int, dps, capacity: int, chunk: int) -> list[dict]:
    import torch
    from verl.utils.seqlen_balancing import (
        calculate_workload,
        get_group_balanced_partitions,
        get_seqlen_balanced_partitions,
    )

    t0 = time.perf_counter()
    batch = synth.generate("swe-like", seed)
    gen_s = time.perf_counter() - t0
    out = []
    for dp in dps:
        # verl's dispatch needs equal trajectory counts per rank, its PrefixGrouper equal group counts:
        # keep the most leading trees for which both divide by D (the same step for every method)
        ends = np.flatnonzero(np.diff(batch.tree_ids)) + 1  # first trajectory of each later tree
        ends = np.concatenate([ends, [len(batch.tree_ids)]])
        k = next(k for k in range(len(ends), 0, -1) if k % dp == 0 and ends[k - 1] % dp == 0)
        n = int(ends[k - 1])
        sb = synth.SynthBatch(
            batch.tokens[: batch.offsets[n]], batch.offsets[: n + 1], batch.tree_ids[:n], "swe-like", seed, 0
        )
        whole = hp.RolloutBatch.from_arrays(sb.tokens, sb.offsets)
        lengths = np.diff(sb.offsets)
        s = int(sb.offsets[-1])
        rec = {
            "seed": seed,
            "dp": dp,
            "capacity": capacity,
            "trajectories": n,
            "trees": int(len(np.unique(sb.tree_ids))),
            "semantic_tokens": s,
            "compact_tokens": int(whole.compact_tokens),
            "allgather_token_ids_per_rank": s,
            "methods": {},
        }
        rec["methods"]["trajectory"] = {"rows": s}
        # verl's _balance_batch (default branch)
        workload = calculate_workload(torch.as_tensor(lengths)).tolist()
        parts = get_seqlen_balanced_partitions(workload, k_partitions=dp, equal_size=True)
        rows, mbs = local_plans(sb, parts, capacity, chunk)
        rec["methods"]["verl-balance"] = {
            "rows": int(sum(rows)),
            "max_rank_rows": int(max(rows)),
            "microbatches": int(sum(mbs)),
            "trees_split": trees_split(sb.tree_ids, parts),
            "rank_trajectories": [len(p) for p in parts],
        }
        # verl's PrefixGrouper branch: uid = tree
        gparts = get_group_balanced_partitions(lengths.tolist(), sb.tree_ids.tolist(), dp)
        rows, mbs = local_plans(sb, gparts, capacity, chunk)
        rec["methods"]["verl-uid-groups"] = {
            "rows": int(sum(rows)),
            "max_rank_rows": int(max(rows)),
            "microbatches": int(sum(mbs)),
            "trees_split": trees_split(sb.tree_ids, gparts),
            "rank_trajectories": [len(p) for p in gparts],
        }
        # the backend: whole step planned at D
        t1 = time.perf_counter()
        plan = hp.plan_step(whole, dp, capacity, chunk)
        plan_s = time.perf_counter() - t1
        work = [int(whole.subset_work(np.asarray(m))) for m in plan.microbatches]
        rep = np.asarray(plan.replica)
        per = [sum(w for w, r in zip(work, rep) if r == d) for d in range(dp)]
        reps = [
            np.concatenate([np.asarray(m) for m, r in zip(plan.microbatches, rep) if r == d] or [[]])
            for d in range(dp)
        ]
        harts = {
            "rows": int(sum(work)),
            "max_rank_rows": int(max(per)),
            "microbatches": len(work),
            "trees_split": trees_split(sb.tree_ids, [p.astype(np.int64) for p in reps]),
            "rank_trajectories": [len(p) for p in reps],
            "plan_seconds": plan_s,
        }
        rec["methods"]["harts-allgather"] = harts
        rec["methods"]["harts-at-balance"] = dict(
            harts, equal_counts=len(set(harts["rank_trajectories"])) == 1
        )
        rec["generate_seconds"] = gen_s
        out.append(rec)
        m = rec["methods"]
        print(
            f"seed {seed} D={dp}: S={s:,} C={rec['compact_tokens']:,} | verl-balance {m['verl-balance']['rows']:,} "
            f"(max {m['verl-balance']['max_rank_rows']:,}, {m['verl-balance']['trees_split']} trees split) | "
            f"uid-groups {m['verl-uid-groups']['rows']:,} (max {m['verl-uid-groups']['max_rank_rows']:,}) | "
            f"harts {harts['rows']:,} (max {harts['max_rank_rows']:,}, {harts['trees_split']} split, plan {plan_s:.2f} s)",
            flush=True,
        )
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--capacity", type=int, default=hp.DEFAULT_CAPACITY)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--out", default=str(HERE / "results" / "verl_balance.json"))
    args = ap.parse_args(argv)
    import verl

    runs = []
    for seed in args.seeds:
        runs += measure(seed, args.dp, args.capacity, args.chunk_size)
    summary = {}
    for dp in args.dp:
        rs = [r for r in runs if r["dp"] == dp]
        summary[str(dp)] = {
            name: {
                "rows": int(sum(r["methods"][name]["rows"] for r in rs)),
                "rows_over_harts": sum(r["methods"][name]["rows"] for r in rs)
                / sum(r["methods"]["harts-allgather"]["rows"] for r in rs),
            }
            for name in rs[0]["methods"]
        }
    doc = {
        "benchmark": "verl_balance",
        "preset": "swe-like",
        "platform": platform.platform(),
        "verl": verl.__version__,
        "runs": runs,
        "summary": summary,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
