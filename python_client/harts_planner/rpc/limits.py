"""What one request may cost the sidecar, checked before any planning.

A request is refused with RESOURCE_EXHAUSTED, naming the request field to blame and the limit, when
its estimate exceeds one of the server's :class:`Limits`:

=========================  ==================================================  ========================
limit                      what it bounds                                      ``harts-planner serve``
=========================  ==================================================  ========================
``max_rows``               packed rows (compact + replay) of the call plans    ``--max-rows``
``max_plan_memory_bytes``  server memory of the plans running at once (est.)   ``--max-plan-memory-mb``
``max_response_bytes``     size of the response (estimate, then exact)         ``--max-response-mb``
``max_inflight_bytes``     request bytes held at once, queued or planning      ``--max-inflight-mb``
``max_queued``             requests waiting for a planner thread               ``--max-queued``
=========================  ==================================================  ========================

A request whose plan alone would need more than ``max_plan_memory_bytes`` is refused; one that fits
waits (first come, first served) until the plans running at once leave it room. The defaults fit a
24 GB machine whatever the number of planner threads.

The estimates are the planner's own (:func:`harts_planner.estimate_cost` from the request alone:
exact for a segment tree, upper bounds for packed tokens; :func:`harts_planner.estimate_call_plans`
exact once a step's microbatches are known; ``harts/plan_cost.h``). :func:`of_plan_cost` turns one into
the server's :class:`Cost`: rows are the packed rows, memory is what the planner allocates plus the
response twice (its message and its serialized bytes), response bytes are the response's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harts_planner.errors import ResourceLimitError

#: gRPC's own bound on a message (2^31 - 1 bytes) in whole MiB.
MAX_MESSAGE_MB = 2047
MiB = 1 << 20
#: Copies of a response the server holds besides the plan: the message and its serialized bytes.
RESPONSE_COPIES = 2


@dataclass(frozen=True)
class Limits:
    """The sidecar's per-request limits (see the module table). ``max_response_bytes`` None means
    the server's message-size limit."""

    max_rows: int = 1 << 27
    max_plan_memory_bytes: int = 8 << 30
    max_response_bytes: int | None = None
    max_inflight_bytes: int = 2 << 30
    max_queued: int = 64

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_response_bytes":
                continue
            lo = 0 if f.name == "max_queued" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"{f.name}: must be an integer >= {lo}, got {value!r}")

    def response_limit(self, max_message_bytes: int) -> int:
        """The response bound in force: ``max_response_bytes`` capped by the message-size limit."""
        if self.max_response_bytes is None:
            return max_message_bytes
        return min(self.max_response_bytes, max_message_bytes)


DEFAULT = Limits()


@dataclass(frozen=True)
class Cost:
    """What a request needs: ``rows`` of call plans (compact + replay), server ``memory_bytes``,
    ``response_bytes``; ``field`` is the request field that asks for it (named in a refusal) and
    ``hint`` what to do instead."""

    rows: int
    memory_bytes: int
    response_bytes: int
    field: str
    hint: str = ""

    def check(self, limits: Limits, max_message_bytes: int) -> None:
        """Raise ResourceLimitError on ``field`` when an estimate exceeds its limit (rows first,
        then response, then memory); the message names the limit and its ``serve`` flag."""
        response_limit = limits.response_limit(max_message_bytes)
        for amount, limit, what, flag in (
            (self.rows, limits.max_rows, "rows (compact + replay) of call plans", "--max-rows"),
            (self.response_bytes, response_limit, "response bytes", "--max-response-mb"),
            (
                self.memory_bytes,
                limits.max_plan_memory_bytes,
                "bytes of server memory",
                "--max-plan-memory-mb",
            ),
        ):
            if amount > limit:
                raise limit_error(
                    self.field,
                    f"this request needs about {amount:,} {what}, over the server's limit of {limit:,} "
                    f"({flag})" + (f"; {self.hint}" if self.hint else ""),
                )


#: What a step request that asks for too big call plans should do instead.
CALLS_HINT = "plan the microbatches' calls with PlanCalls, one microbatch per request"
#: PlanCost fields -> the request fields they stand for, and what to do instead.
_FIELDS = {"call_plans": "include_call_plans"}
_HINTS = {
    "microbatch": "plan a smaller microbatch",
    "trajectories": "set microbatch to plan part of the batch",
    "include_call_plans": CALLS_HINT,
}


def of_plan_cost(cost, *, tokens: bool = False) -> Cost:
    """The server's :class:`Cost` of a :class:`harts_planner.PlanCost` (``tokens``: the request sent
    packed tokens, which a segment tree would make cheaper)."""
    field = _FIELDS.get(cost.field, cost.field)
    hint = _HINTS.get(field, "") if cost.request == "calls" or field != "trajectories" else ""
    if tokens and not hint:
        hint = "send the step's compacted segment tree (trajectories.tree) instead"
    return Cost(
        rows=cost.packed_rows,
        memory_bytes=cost.peak_bytes + RESPONSE_COPIES * cost.response_bytes,
        response_bytes=cost.response_bytes,
        field=field,
        hint=hint,
    )


def limit_error(field: str, message: str) -> ResourceLimitError:
    """A ResourceLimitError on ``field`` (formatted like the planner's: ``"field: message"``)."""
    err = ResourceLimitError(f"{field}: {message}")
    err.field = field
    return err


__all__ = [
    "DEFAULT",
    "MAX_MESSAGE_MB",
    "MiB",
    "RESPONSE_COPIES",
    "Cost",
    "Limits",
    "limit_error",
    "of_plan_cost",
]
