"""Admission: the checks and the cost of one request before it waits for a planner thread.

:class:`Admission` (one per server: its limits and message-size bound) turns a received request into
a :class:`Job`, or refuses it with the status naming the field: its scalars, the vectorized checks
ingestion starts with (packed tokens), the planner's cost estimate from the request alone
(:func:`harts_planner.estimate_cost`; a segment tree is validated in O(V + N)) against
:class:`~harts_planner.rpc.limits.Limits`, a segment tree's batch (O(V + N log N)) and the step
planner's first checks. What the job holds beyond the request's bytes (aligned copies, the tree's
batch) is counted in the ledger (:class:`~harts_planner.rpc.ledger.Budget`) at once; a tiny plan
(at most :data:`EXPRESS_PLAN_BYTES` of planner memory, a few hundred trajectories) is marked
express: it is made at once on its call's thread. Used by the servicer
(:mod:`harts_planner.rpc.servicer`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import cast

import numpy as np

from harts_planner.errors import HartsError
from harts_planner.rpc import codec
from harts_planner.rpc import limits as _limits
from harts_planner.rpc.codec import PackedTokens, SegmentTree
from harts_planner.rpc.ledger import Budget
from harts_planner.step_plan import estimate_call_plans, estimate_cost

#: A plan whose planner memory is at most this (a few hundred trajectories) is made at once on the
#: call's own thread, without waiting for a planner thread behind long plans.
EXPRESS_PLAN_BYTES = 2 << 20


@dataclass
class Job:
    """An admitted request: its arguments, trajectories, what is known of its batch and its cost."""

    args: dict
    source: object
    batch: object | None  # the batch of a segment tree (built at admission), None for tokens
    cost: _limits.Cost
    plan_cost: object = None  # the planner's PlanCost
    held: int = 0  # request bytes it holds beyond what it received (aligned copies, the tree's batch)
    express: bool = False  # small enough to plan at once (EXPRESS_PLAN_BYTES)
    decode_s: float = 0.0  # request -> arrays
    ingest_s: float = 0.0  # arrays -> batch (a tree: at admission; tokens: on a planner thread)


class Admission:
    """The checks and costs of requests (one per server: its limits and message-size bound)."""

    def __init__(self, budget: Budget, stream_chunk: int):
        self.budget = budget
        self.limits = budget.limits
        self.max_message_bytes = budget.max_message_bytes
        self.stream_chunk = stream_chunk

    def check_cost(self, cost: _limits.Cost, record: dict, stream: bool) -> _limits.Cost:
        record["estimate"] = {
            "rows": cost.rows,
            "memory_bytes": cost.memory_bytes,
            "response_bytes": cost.response_bytes,
        }
        cost.check(self.limits, self.max_message_bytes, stream)
        return cost

    def source(self, which, arrays, record) -> tuple[object, float, int]:
        """The trajectories (views of the request bytes, aligned copies where needed); packed
        tokens get the checks ingestion starts with. Returns (source, seconds, bytes copied)."""
        from harts_planner.rpc import wire

        t0 = time.perf_counter()
        copied = [0]

        def read(view, dtype, field):
            arr = wire.array(view, dtype, field)
            if arr.size and not np.may_share_memory(arr, np.frombuffer(view, np.uint8)):
                copied[0] += arr.nbytes
            return arr

        source = codec.trajectories_of(which, arrays, read)
        record["input"] = "tree" if isinstance(source, SegmentTree) else "tokens"
        if isinstance(source, PackedTokens):
            codec.validate_packed(source)
            record.update(trajectories=source.num_trajectories, semantic_tokens=len(source.tokens))
        record["decode_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        return source, time.perf_counter() - t0, copied[0]

    def estimate(self, source, ctl, record, args: dict, *, step: bool, stream: bool):
        """What the request will cost (:func:`harts_planner.estimate_cost`: exact for a segment tree,
        which it validates in O(V + N); bounds for packed tokens, from their offsets), checked against
        the server's limits before any other work. A step's call plans depend on its microbatches:
        here they are checked against a floor (every compact row of a tree at least once), and
        exactly once the step is planned (:meth:`call_plans_cost`). Returns (Cost, PlanCost)."""
        try:
            cost = estimate_cost(
                source,
                request="step" if step else "calls",
                microbatch=None if step else args["microbatch"],
                chunk_size=args["chunk_size"],
                conv_width=args["conv_width"],
                debug=args["debug"],
                options=args["options"] if step else None,
                cancel=ctl.token,
            )
        except HartsError as e:
            fields = codec.TREE_FIELDS if isinstance(source, SegmentTree) else codec.PACKED_FIELDS
            raise codec.renamed(e, {**fields, **codec.OPTION_FIELDS}) from None
        tokens = isinstance(source, PackedTokens)
        server_cost = _limits.of_plan_cost(cost, tokens=tokens, stream=stream, chunk_bytes=self.stream_chunk)
        checked = self.check_cost(server_cost, record, stream)
        if step and args["call_plans"] and not tokens:
            floor = _limits.Cost(cost.compact_tokens, 0, 0, "include_call_plans", _limits.CALLS_HINT)
            floor.check(self.limits, self.max_message_bytes, stream)
        return checked, cost

    def call_plans_cost(self, plan, batch, job: Job, ctl, record, stream: bool) -> _limits.Cost:
        """The exact cost of a step's call plans once its microbatches are known, checked; the
        memory beyond the admission estimate is reserved at once."""
        args = job.args
        exact = estimate_call_plans(
            batch, plan.microbatches, args["chunk_size"], args["conv_width"], args["debug"], ctl.token
        )
        cost = _limits.of_plan_cost(exact, stream=stream, chunk_bytes=self.stream_chunk)
        total = self.check_cost(cost, record, stream)
        self.budget.reserve_more(ctl, total.memory_bytes - job.cost.memory_bytes)
        return total

    def ingest_tree(self, source, ctl, record):
        """A segment tree's batch (O(V + N log N), no per-row work), or None for packed tokens
        (ingested on a planner thread). Returns (batch, seconds)."""
        if not isinstance(source, SegmentTree):
            return None, 0.0
        t0 = time.perf_counter()
        batch = codec.ingest(source, wire=True, cancel=ctl.token)
        record.update(
            trajectories=batch.num_trajectories,
            semantic_tokens=batch.semantic_tokens,
            compact_tokens=batch.compact_tokens,
            segments=batch.num_segments,
            ingest_ms=round((time.perf_counter() - t0) * 1e3, 3),
        )
        return batch, time.perf_counter() - t0

    def _admit(self, args, which, arrays, ctl, record, *, step: bool, stream: bool) -> Job:
        source, decode_s, copied = self.source(which, arrays, record)
        cost, plan_cost = self.estimate(source, ctl, record, args, step=step, stream=stream)
        tokens = isinstance(source, PackedTokens)
        held = _limits.request_bytes(0, copied, plan_cost, tokens=tokens)
        received = record.get("request_bytes", 0) + record.get("parse_held_bytes", 0)
        record["request_held_bytes"] = received + held
        self.budget.hold(held, "trajectories", "bytes (the request's batch and array copies)")
        try:
            batch, ingest_s = self.ingest_tree(source, ctl, record)
            if step:
                # batch is None for packed tokens only (ingest_tree)
                lengths = batch.lengths if batch is not None else np.diff(cast(PackedTokens, source).offsets)
                try:
                    codec.check_step(lengths, args["dp_size"], args["capacity"], args["options"])
                except HartsError as e:
                    raise codec.renamed(e, codec.OPTION_FIELDS) from None
        except BaseException:
            self.budget.release(held)
            raise
        planner = plan_cost.plan_bytes + (plan_cost.ingest_bytes if tokens else 0)
        express = planner <= EXPRESS_PLAN_BYTES and not (step and args["call_plans"])
        return Job(args, source, batch, cost, plan_cost, held, express, decode_s, ingest_s)

    def step(self, request, which, arrays, ctl, record, stream: bool) -> Job:
        args = codec.decode_plan_step_request(request)
        return self._admit(args, which, arrays, ctl, record, step=True, stream=stream)

    def calls(self, request, which, arrays, ctl, record, stream: bool) -> Job:
        args = codec.decode_plan_calls_request(request)
        return self._admit(args, which, arrays, ctl, record, step=False, stream=stream)


__all__ = ["Admission", "EXPRESS_PLAN_BYTES", "Job"]
