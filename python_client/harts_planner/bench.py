"""Planning-latency benchmark: the same step planned in-process and over gRPC, by N concurrent
clients, as packed tokens or as a compacted segment tree.

Used by ``harts-planner bench`` and ``benchmarks/service.py``. Every client owns one
:class:`~harts_planner.Planner` (for gRPC: one channel); clients pull requests from a shared
counter until ``requests`` are done. Latency is the client-observed time of one
``Planner.plan_step`` call, including ingestion (tokens: compact trie; tree: index only) and, for
gRPC, serialization and transfer both ways. Every plan is compared with a reference plan.
"""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Callable

import numpy as np

from harts_planner import checks
from harts_planner.batch import PackedTokens, RolloutBatch
from harts_planner.errors import invalid
from harts_planner.planner import Planner

REQUEST_KINDS = ("tokens", "tree")
TRANSPORTS = ("inprocess", "grpc")


def payload(batch: RolloutBatch, kind: str):
    """What a client sends for ``kind``: PackedTokens (``tokens``) or the batch's SegmentTree (``tree``)."""
    if kind == "tokens":
        if batch.tokens is None:
            raise invalid("request", "a batch built from a segment tree has no tokens to send")
        return PackedTokens(batch.tokens, batch.offsets, batch.tree_ids)
    if kind == "tree":
        return batch.segment_tree()
    raise invalid("request", f"must be one of {REQUEST_KINDS}, got {kind!r}")


def percentiles(seconds: list[float]) -> dict:
    """p50/p95/p99/mean/min/max in milliseconds (``numpy.percentile``, linear)."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p95_ms": float(np.percentile(ms, 95)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "min_ms": float(ms.min()),
        "max_ms": float(ms.max()),
    }


def run(
    make_planner: Callable[[], Planner],
    request,
    dp_size: int,
    capacity: int,
    *,
    clients: int = 1,
    requests: int = 20,
    warmup: int = 1,
    reference=None,
    progress=None,
    **plan_kwargs,
) -> dict:
    """Time ``requests`` calls of ``plan_step(request, dp_size, capacity, **plan_kwargs)`` issued by
    ``clients`` threads; ``warmup`` untimed calls per client first.

    Returns percentiles (ms), ``throughput_per_s`` (plans per second of wall time), ``wall_s`` and
    ``mismatches`` (plans different from ``reference``; the first plan when ``reference`` is None).
    """
    clients = checks.integer(clients, "clients", 1)
    requests = checks.integer(requests, "requests", 1)
    warmup = checks.integer(warmup, "warmup", 0)
    planners = [make_planner() for _ in range(clients)]
    try:
        if reference is None:
            reference = planners[0].plan_step(request, dp_size, capacity, **plan_kwargs)
        for p in planners:
            for _ in range(warmup):
                p.plan_step(request, dp_size, capacity, **plan_kwargs)
        lock = threading.Lock()
        state = {"issued": 0, "done": 0, "mismatches": 0}
        latencies: list[float] = []
        errors: list[BaseException] = []

        def client(p: Planner) -> None:
            while True:
                with lock:
                    if state["issued"] >= requests or errors:
                        return
                    state["issued"] += 1
                t0 = time.perf_counter()
                try:
                    plan = p.plan_step(request, dp_size, capacity, **plan_kwargs)
                except BaseException as e:  # reported after the run
                    with lock:
                        errors.append(e)
                    return
                dt = time.perf_counter() - t0
                with lock:
                    latencies.append(dt)
                    state["done"] += 1
                    state["mismatches"] += plan != reference
                    if progress is not None:
                        progress(state["done"], requests)

        threads = [threading.Thread(target=client, args=(p,), daemon=True) for p in planners]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        if errors:
            raise errors[0]
    finally:
        for p in planners:
            p.close()
    return {
        "clients": clients,
        "requests": requests,
        **percentiles(latencies),
        "throughput_per_s": requests / wall,
        "wall_s": wall,
        "mismatches": state["mismatches"],
        "num_microbatches": reference.num_microbatches,
        "total_work": reference.total_work,
    }


def machine() -> dict:
    """Where a benchmark ran."""
    import os

    return {
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


__all__ = ["REQUEST_KINDS", "TRANSPORTS", "payload", "percentiles", "run", "machine"]
