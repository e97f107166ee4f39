"""A prefix-unaware packer: what a trajectory-wise trainer does when it sees only raw lengths.

1. Microbatches: trajectories in descending raw length (ties by index) go first-fit into
   microbatches whose raw tokens (sum of lengths) stay within ``T``; since compact work never exceeds
   raw tokens, every microbatch also fits ``T`` compact tokens.
2. ``K`` is raised to a multiple of ``D`` by splitting the microbatch with the most raw tokens (and
   at least two members) into two halves of alternate members, by descending length.
3. Replicas and slots by raw tokens: microbatches in descending raw tokens, blocks of ``D`` per slot,
   heavier microbatches to replicas with fewer raw tokens so far.

The benchmark scores the result in compact work ``C(M)``, i.e. as if each microbatch were executed
with prefix sharing inside it; the packer itself never looks at shared prefixes.
"""

from __future__ import annotations

import time

import numpy as np

from baselines.common import BaselinePlan, sorted_by_rank
from harts_planner import RolloutBatch


def plan(batch: RolloutBatch, dp_size: int, capacity: int) -> BaselinePlan:
    start = time.perf_counter()
    lengths = np.asarray(batch.lengths, dtype=np.int64)
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        li = int(lengths[i])
        b = next((b for b, load in enumerate(loads) if load + li <= capacity), None)
        if b is None:
            bins.append([])
            loads.append(0)
            b = len(bins) - 1
        bins[b].append(i)
        loads[b] += li
    while len(bins) % dp_size:
        b = max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: (loads[b], -b), default=None)
        if b is None:
            raise ValueError("cannot reach a multiple of D microbatches")
        members = bins.pop(b)
        loads.pop(b)
        for half in (members[0::2], members[1::2]):
            bins.append(half)
            loads.append(int(lengths[half].sum()))
    k = len(bins)
    by_load = sorted(range(k), key=lambda b: (-loads[b], b))
    replica = np.zeros(k, dtype=np.int32)
    slot = np.zeros(k, dtype=np.int32)
    cumulative = [0] * dp_size
    for j in range(k // dp_size):
        reps = sorted(range(dp_size), key=lambda d: (cumulative[d], d))
        for pos, b in enumerate(by_load[j * dp_size : (j + 1) * dp_size]):
            replica[b], slot[b] = reps[pos], j
            cumulative[reps[pos]] += loads[b]
    microbatches = [sorted_by_rank(batch, mb) for mb in bins]
    seconds = time.perf_counter() - start
    return BaselinePlan(
        "prefix-unaware",
        microbatches,
        replica,
        slot,
        seconds,
        {"raw_tokens_per_microbatch_max": int(max(loads))},
    )
