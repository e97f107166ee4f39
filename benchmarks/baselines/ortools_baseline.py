"""The OR-Tools planning baseline of Section 5.2 -- our reconstruction.

Tree Training's partitioner is not public (see ``shared/references/peers.md`` section 1): neither
its solver model, objective, time limit nor parameters. HARTS's paper describes the baseline as
(1) rollout trees to DP replicas by shard-level first-fit decreasing (FFD), (2) Tree Training's
OR-Tools partitioner run independently within each replica, (3) extra splits until every replica
has the same number of microbatches. This module implements that recipe as follows.

1. Shard-level FFD. A shard is one rollout tree (``batch.tree_ids``), sized by its compact tokens.
   Shards in descending size (ties by tree id) go to the first replica whose load stays within
   ``ceil(G_sum / D)`` (``G_sum`` = sum of shard sizes); a shard that fits nowhere goes to the least
   loaded replica (ties by index).
2. CP-SAT partition per replica (OR-Tools ``cp_model``), minimizing compact tokens under the
   capacity, with ``B`` bins = the bin count of the hint below. Following Tree Training ("partitioning
   runs only when a tree's unique tokens exceed the capacity"), a tree within ``T`` is one item; a
   larger tree is modelled per trajectory over the segments of its trie (the batch's segment forest;
   segment ``v`` has ``len_v = end_v - start_v`` tokens):

   * ``z[t, b]`` (small tree ``t`` in bin ``b``) and ``x[i, b]`` (trajectory ``i`` of a large tree in
     bin ``b``), each with ``sum_b = 1``;
   * ``y[v, b]`` (segment ``v`` of a large tree materialized in bin ``b``): ``x[i, b] => y[end(i), b]``
     and ``y[v, b] => y[parent(v), b]``, so ``sum_t C(t) z[t, b] + sum_v len_v y[v, b]`` is exactly the
     bin's compact work (distinct trees share no token);
   * capacity: that work ``<= T`` for every bin;
   * objective: minimize total compact tokens (the small trees' part is constant);
   * hint: every large tree cut by next-fit in lexicographic (DFS leaf) order, then first-fit
     decreasing of all items into bins of ``T``; this fixes ``B`` and is a complete feasible hint;
   * parameters: ``num_workers = 1``, ``random_seed = 0``, ``max_time_in_seconds`` = the time limit
     (default 10 s per replica), otherwise defaults. Empty bins are dropped. When the solver returns
     no solution within the limit, or one no better than the hint (CP-SAT's first incumbent need not
     be the hint), the hint is used (recorded in ``details``).
3. Equalizing splits (:func:`baselines.common.equalize_by_splitting`): a replica with fewer
   microbatches repeatedly splits the microbatch whose cheapest lexicographic cut adds the least
   compact work.
4. Slots: each replica runs its microbatches heaviest first (slot ``j`` = its ``j``-th heaviest); the
   replicas are scheduled independently, as the construction prescribes.

The time limit makes the solver's result depend on machine speed; the benchmark records the
solver status and objective per replica.

Variant ``per_tree=True`` ("or-tools-per-tree"): the same recipe with step 2 decomposed the way Tree
Training describes its partitioner ("partitioning runs only when a tree's unique tokens exceed the
capacity"): a tree within ``T`` stays whole; every larger tree gets its own CP-SAT model (the model
above restricted to its trajectories, with as many bins as its next-fit hint, same parameters and
time limit per tree), and the resulting pieces plus the whole trees are packed into microbatches by
first-fit decreasing of their compact work. Because distinct trees share no tokens and the bin
count is not part of the objective, this decomposition minimizes the same compact-token objective
with small exact models; it is the stronger of the two reconstructions.
"""

from __future__ import annotations

import time

import numpy as np

from baselines.common import (
    BaselinePlan,
    equalize_by_splitting,
    member_work,
    slots_by_descending_work,
    sorted_by_rank,
    tree_groups,
)
from harts_planner import RolloutBatch

DEFAULT_TIME_LIMIT_S = 10.0


def ffd_shards(sizes: dict[int, int], dp_size: int) -> list[list[int]]:
    """Shard-level first-fit decreasing of ``{shard: size}`` onto ``dp_size`` replicas."""
    cap = -(-sum(sizes.values()) // dp_size)
    loads = [0] * dp_size
    out: list[list[int]] = [[] for _ in range(dp_size)]
    for shard in sorted(sizes, key=lambda s: (-sizes[s], s)):
        target = next((d for d in range(dp_size) if loads[d] + sizes[shard] <= cap), None)
        if target is None:
            target = min(range(dp_size), key=lambda d: (loads[d], d))
        out[target].append(shard)
        loads[target] += sizes[shard]
    return out


def _segment_paths(batch: RolloutBatch):
    """End segment of every trajectory and the segment parent array."""
    end_seg = np.empty(batch.num_trajectories, dtype=np.int64)
    offs = batch.segment_end_offsets
    ending = batch.segment_ending
    for v in range(batch.num_segments):
        end_seg[ending[offs[v] : offs[v + 1]]] = v
    return end_seg, np.asarray(batch.segment_parent)


def next_fit(batch: RolloutBatch, ids_by_rank: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Contiguous next-fit packing of sorted trajectories into bins of <= capacity compact tokens."""
    bins, start = [], 0
    lengths = batch.lengths[ids_by_rank]
    work = 0
    for j in range(len(ids_by_rank)):
        add = (
            int(lengths[j])
            if j == start
            else int(lengths[j]) - batch.lcp(int(ids_by_rank[j - 1]), int(ids_by_rank[j]))
        )
        if j > start and work + add > capacity:
            bins.append(ids_by_rank[start:j])
            start, work = j, int(lengths[j])
        else:
            work += add
    bins.append(ids_by_rank[start:])
    return bins


def ffd_items(sizes: list[int], capacity: int) -> list[int]:
    """First-fit decreasing of item sizes into bins of ``capacity``; returns each item's bin."""
    order = sorted(range(len(sizes)), key=lambda j: (-sizes[j], j))
    loads: list[int] = []
    where = [0] * len(sizes)
    for j in order:
        b = next((b for b, load in enumerate(loads) if load + sizes[j] <= capacity), None)
        if b is None:
            loads.append(0)
            b = len(loads) - 1
        loads[b] += sizes[j]
        where[j] = b
    return where


def cpsat_partition(
    batch: RolloutBatch,
    trees: list[np.ndarray],
    capacity: int,
    end_seg,
    parent,
    time_limit_s: float,
    seed: int = 0,
) -> tuple[list[np.ndarray], dict]:
    """Step 2 of the module docstring for one replica's trees. Returns (bins, diagnostics)."""
    from ortools.sat.python import cp_model

    sizes = [member_work(batch, ids) for ids in trees]
    small = [t for t, w in enumerate(sizes) if w <= capacity]
    big = [t for t, w in enumerate(sizes) if w > capacity]
    # Hint: big trees cut by next-fit in lexicographic order, then FFD of all items.
    items: list[np.ndarray] = [trees[t] for t in small]
    for t in big:
        items.extend(next_fit(batch, trees[t], capacity))
    item_sizes = [member_work(batch, ids) for ids in items]
    item_bin = ffd_items(item_sizes, capacity)
    n_bins = max(item_bin) + 1
    hint_of_traj = {}
    for ids, b in zip(items, item_bin):
        for i in ids:
            hint_of_traj[int(i)] = b

    m = cp_model.CpModel()
    loads: list[list] = [[] for _ in range(n_bins)]
    z = {}
    for t in small:
        row = [m.NewBoolVar("") for _ in range(n_bins)]
        m.AddExactlyOne(row)
        hb = hint_of_traj[int(trees[t][0])]
        for b, var in enumerate(row):
            m.AddHint(var, int(b == hb))
            loads[b].append((sizes[t], var))
        z[t] = row
    # Big trees: trajectory and segment variables.
    x = {}
    y: dict[int, list] = {}
    seg_len = np.asarray(batch.segment_end) - np.asarray(batch.segment_start)
    hint_segs: dict[int, set] = {}
    for t in big:
        for i in trees[t]:
            i = int(i)
            hb = hint_of_traj[i]
            row = [m.NewBoolVar("") for _ in range(n_bins)]
            m.AddExactlyOne(row)
            for b, var in enumerate(row):
                m.AddHint(var, int(b == hb))
                x[i, b] = var
            v = int(end_seg[i])
            while v >= 0:  # the trajectory's path of segments
                hint_segs.setdefault(v, set()).add(hb)
                if v not in y:
                    y[v] = [m.NewBoolVar("") for _ in range(n_bins)]
                v = int(parent[v])
    for v, row in y.items():
        p = int(parent[v])
        for b, var in enumerate(row):
            m.AddHint(var, int(b in hint_segs.get(v, ())))
            if p >= 0:
                m.AddImplication(var, y[p][b])
            loads[b].append((int(seg_len[v]), var))
    for (i, b), var in x.items():
        m.AddImplication(var, y[int(end_seg[i])][b])
    for b in range(n_bins):
        m.Add(sum(w * var for w, var in loads[b]) <= capacity)
    m.Minimize(sum(int(seg_len[v]) * var for v, row in y.items() for var in row))

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.Solve(m)
    hint_bins = [[] for _ in range(n_bins)]
    for ids, b in zip(items, item_bin):
        hint_bins[b].extend(int(i) for i in ids)
    diag = {
        "status": solver.StatusName(status),
        "bins": n_bins,
        "small_trees": len(small),
        "big_trees": len(big),
        "variables": len(z) * n_bins + len(x) + len(y) * n_bins,
        "hint_work": int(sum(member_work(batch, sorted_by_rank(batch, mb)) for mb in hint_bins if mb)),
        "solver_seconds": solver.WallTime(),
    }
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        diag["used_hint"] = True
        return [sorted_by_rank(batch, mb) for mb in hint_bins if mb], diag
    const = sum(sizes[t] for t in small)
    diag["objective"] = int(solver.ObjectiveValue()) + const
    diag["best_bound"] = int(solver.BestObjectiveBound()) + const
    if diag["objective"] >= diag["hint_work"]:  # the solver's incumbent is no better than its hint
        diag["used_hint"] = True
        return [sorted_by_rank(batch, mb) for mb in hint_bins if mb], diag
    bins = [[] for _ in range(n_bins)]
    for t, row in z.items():
        b = next(b for b, var in enumerate(row) if solver.Value(var))
        bins[b].extend(int(i) for i in trees[t])
    for (i, b), var in x.items():
        if solver.Value(var):
            bins[b].append(i)
    return [sorted_by_rank(batch, mb) for mb in bins if mb], diag


def per_tree_partition(
    batch: RolloutBatch,
    trees: list[np.ndarray],
    capacity: int,
    end_seg,
    parent,
    time_limit_s: float,
    seed: int = 0,
) -> tuple[list[np.ndarray], dict]:
    """Step 2 of the ``per_tree`` variant for one replica's trees. Returns (bins, diagnostics)."""
    items: list[np.ndarray] = []
    statuses = []
    for ids in trees:
        if member_work(batch, ids) <= capacity:
            items.append(ids)
            continue
        pieces, diag = cpsat_partition(batch, [ids], capacity, end_seg, parent, time_limit_s, seed)
        statuses.append(diag["status"])
        items.extend(pieces)
    where = ffd_items([member_work(batch, ids) for ids in items], capacity)
    bins = [[] for _ in range(max(where) + 1)]
    for ids, b in zip(items, where):
        bins[b].extend(int(i) for i in ids)
    return [sorted_by_rank(batch, mb) for mb in bins], {
        "bins": len(bins),
        "big_trees": len(statuses),
        "statuses": sorted(set(statuses)),
    }


def plan(
    batch: RolloutBatch,
    dp_size: int,
    capacity: int,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    seed: int = 0,
    per_tree: bool = False,
) -> BaselinePlan:
    """The OR-Tools planning baseline (module docstring)."""
    start = time.perf_counter()
    trees = tree_groups(batch)
    sizes = {t: member_work(batch, ids) for t, ids in trees.items()}
    shards = ffd_shards(sizes, dp_size)
    end_seg, parent = _segment_paths(batch)
    per_replica, diags = [], []
    for d in range(dp_size):
        if not shards[d]:
            raise ValueError(f"replica {d} received no rollout tree (fewer trees than replicas)")
        partition = per_tree_partition if per_tree else cpsat_partition
        bins, diag = partition(
            batch, [trees[t] for t in shards[d]], capacity, end_seg, parent, time_limit_s, seed
        )
        per_replica.append(bins)
        diags.append(diag)
    splits = equalize_by_splitting(batch, per_replica)
    microbatches, replica, slot = slots_by_descending_work(batch, per_replica)
    seconds = time.perf_counter() - start
    return BaselinePlan(
        "or-tools-per-tree" if per_tree else "or-tools",
        microbatches,
        replica,
        slot,
        seconds,
        {
            "replicas": diags,
            "equalizing_splits": splits,
            "time_limit_s": time_limit_s,
            "shard_loads": [int(sum(sizes[t] for t in s)) for s in shards],
        },
    )
