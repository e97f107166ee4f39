"""What one request may cost the sidecar, checked before any planning.

A request is refused with RESOURCE_EXHAUSTED, naming the request field to blame and the limit, when
its estimate exceeds one of the server's :class:`Limits`:

=========================  ==================================================  ========================
limit                      what it bounds                                      ``harts-planner serve``
=========================  ==================================================  ========================
``max_rows``               packed rows (compact + replay) of the call plans    ``--max-rows``
``max_plan_memory_bytes``  server memory of the plans running at once and of   ``--max-plan-memory-mb``
                           their responses until delivered (estimated)
``max_response_bytes``     size of the response (estimate, then exact)         ``--max-response-mb``
``max_request_bytes``      size of a request (a ``*Stream`` request, whole)    ``--max-request-mb``
``max_inflight_bytes``     request bytes held at once: being received (each    ``--max-inflight-mb``
                           stream reserves what its next message may be),
                           queued or planning, with what admission built
``max_queued``             requests waiting for a planner thread               ``--max-queued``
``receive_timeout``        seconds a request message (or one chunk) may take   ``--receive-timeout``
                           to arrive
``min_receive_rate``       bytes/s a request must arrive at once its           ``--min-receive-rate-mb``
                           ``receive_timeout`` has passed: a request of ``n``
                           bytes has ``receive_timeout + n / rate`` seconds
``send_timeout``           seconds a response may go unread                    ``--send-timeout``
``min_send_rate``          bytes/s a response must be read at once its         ``--min-send-rate-mb``
                           ``send_timeout`` has passed (the total send
                           deadline: ``send_timeout + n / rate``)
=========================  ==================================================  ========================

A unary call carries its request and its response in one gRPC message each, so both are also
bounded by the server's message-size limit (``--max-message-mb``); the ``*Stream`` calls carry them
in chunks (:mod:`harts_planner.rpc.wire`) and only the limits above apply. A request whose plan alone
would need more than ``max_plan_memory_bytes`` is refused; one that fits waits (first come, first
served; a small one may pass a big one that does not fit yet) until the plans running at once and the
responses not yet delivered leave it room. The defaults fit a 24 GB machine whatever the number of
planner threads: at most 2 GiB of requests and 8 GiB of plans and responses.

The estimates are the planner's own (:func:`harts_planner.estimate_cost` from the request alone:
exact for a segment tree, upper bounds for packed tokens; :func:`harts_planner.estimate_call_plans`
exact once a step's microbatches are known; ``harts/plan_cost.h``). :func:`of_plan_cost` turns one into
the server's :class:`Cost`: rows are the packed rows; memory is what the planner allocates (the
ingestion of packed tokens too, which runs on a planner thread) plus the copies of the response the
server makes while sending it (:func:`response_copies`) and a call's fixed overhead
(:data:`CALL_OVERHEAD_BYTES`); response bytes are the response's. What the
request itself holds (its bytes, the aligned copies of arrays it could not be read in place from, a
segment tree's batch built at admission) counts against ``max_inflight_bytes``
(:func:`request_bytes`). Their sum bounds the server's memory for the request (tested against
measured peaks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harts_planner.errors import ResourceLimitError
from harts_planner.plan_cost import PlanCost

#: gRPC's own bound on a message (2^31 - 1 bytes) in whole MiB.
MAX_MESSAGE_MB = 2047
MiB = 1 << 20
#: Default largest gRPC message either way (a unary request or response, one chunk of a stream).
DEFAULT_MAX_MESSAGE_BYTES = 8 << 20
#: Default largest request and response of a ``*Stream`` call (a 59M-token step is 236 MB of tokens).
DEFAULT_MAX_TRANSFER_BYTES = 1 << 30
#: Copies of a unary response the server holds while sending it: its bytes and gRPC's own copy.
RESPONSE_COPIES = 2
#: Chunks of a ``*Stream`` response held at once: the one being filled and the one gRPC sends.
STREAM_CHUNKS = 2
#: Bytes a stream reserves per message it may receive: gRPC's receive buffer and Python's copy.
RECEIVE_COPIES = 2
#: Default minimum rate of a transfer once its timeout has passed (bytes/s): a 1 GiB request has
#: ``--receive-timeout`` + 1,024 s to arrive.
DEFAULT_MIN_RATE = float(1 << 20)
#: Memory of one call beyond its plan and response: Python objects, gRPC's call state, the
#: thread's stack pages, allocator slack (measured: about 1.5 MB on the whole swe-like PlanCalls).
CALL_OVERHEAD_BYTES = 4 << 20


def _positive_seconds(value, name: str) -> None:
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value > 0
        or value == float("inf")
    ):
        raise ValueError(
            f"{name}: must be a finite number > 0 (seconds; bytes/s for a rate) or None, got {value!r}"
        )


@dataclass(frozen=True)
class Limits:
    """The sidecar's per-request limits (see the module table). ``max_response_bytes`` and
    ``max_request_bytes`` None mean :data:`DEFAULT_MAX_TRANSFER_BYTES`; a timeout None means none."""

    max_rows: int = 1 << 27
    max_plan_memory_bytes: int = 8 << 30
    max_response_bytes: int | None = None
    max_inflight_bytes: int = 2 << 30
    max_queued: int = 64
    max_request_bytes: int | None = None
    receive_timeout: float | None = 10.0
    send_timeout: float | None = 60.0
    min_receive_rate: float | None = DEFAULT_MIN_RATE
    min_send_rate: float | None = DEFAULT_MIN_RATE

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_timeout") or f.name.endswith("_rate"):
                _positive_seconds(value, f.name)
                continue
            if value is None and f.name in ("max_response_bytes", "max_request_bytes"):
                continue
            lo = 0 if f.name == "max_queued" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"{f.name}: must be an integer >= {lo}, got {value!r}")

    def response_limit(self, max_message_bytes: int, stream: bool = False) -> int:
        """The response bound in force: ``max_response_bytes``, for a unary call also capped by the
        message-size limit."""
        limit = DEFAULT_MAX_TRANSFER_BYTES if self.max_response_bytes is None else self.max_response_bytes
        return limit if stream else min(limit, max_message_bytes)

    def request_limit(self, max_message_bytes: int, stream: bool = False) -> int:
        """The request bound in force (as :meth:`response_limit`)."""
        limit = DEFAULT_MAX_TRANSFER_BYTES if self.max_request_bytes is None else self.max_request_bytes
        return limit if stream else min(limit, max_message_bytes)

    def transfer_deadline(self, size: int, phase: str) -> float | None:
        """Seconds a transfer of ``size`` bytes has in all (``phase`` ``"receive"`` or ``"send"``):
        its timeout + ``size`` / its minimum rate; None without a timeout (or rate: no total)."""
        timeout, rate = (
            (self.receive_timeout, self.min_receive_rate)
            if phase == "receive"
            else (self.send_timeout, self.min_send_rate)
        )
        if timeout is None or rate is None:
            return None
        return timeout + size / rate

    def receive_reservation(self, max_message_bytes: int) -> int:
        """Bytes a stream reserves against ``max_inflight_bytes`` before it reads a message: gRPC
        lets a client send up to a whole message (``max_message_bytes``) once the server reads, and
        Python copies it once more."""
        return RECEIVE_COPIES * max_message_bytes


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

    def check(self, limits: Limits, max_message_bytes: int, stream: bool = False) -> None:
        """Raise ResourceLimitError on ``field`` when an estimate exceeds its limit (rows first,
        then response, then memory); the message names the limit and its ``serve`` flag."""
        response_limit = limits.response_limit(max_message_bytes, stream)
        unary_cap = not stream and response_limit < limits.response_limit(max_message_bytes, True)
        response_flag = (
            "--max-message-mb; the *Stream RPCs send larger ones" if unary_cap else "--max-response-mb"
        )
        for amount, limit, what, flag in (
            (self.rows, limits.max_rows, "rows (compact + replay) of call plans", "--max-rows"),
            (self.response_bytes, response_limit, "response bytes", response_flag),
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


def response_copies(response_bytes: int, stream: bool, chunk_bytes: int) -> int:
    """Bytes the server holds besides the plan while it sends a response: a unary response's bytes
    and gRPC's copy of them; a stream's chunk being filled and the one gRPC sends."""
    if stream:
        return STREAM_CHUNKS * min(chunk_bytes, response_bytes)
    return RESPONSE_COPIES * response_bytes


def of_plan_cost(
    cost: PlanCost, *, tokens: bool = False, stream: bool = False, chunk_bytes: int = 1 << 20
) -> Cost:
    """The server's :class:`Cost` of a :class:`harts_planner.PlanCost` (``tokens``: the request sent
    packed tokens, which a segment tree would make cheaper, and which are ingested on a planner
    thread; ``stream``: the response goes out in chunks of ``chunk_bytes``). The ingestion of a
    segment tree happens at admission and counts with the request (:func:`request_bytes`)."""
    field = _FIELDS.get(cost.field, cost.field)
    hint = _HINTS.get(field, "") if cost.request == "calls" or field != "trajectories" else ""
    if tokens and not hint:
        hint = "send the step's compacted segment tree (trajectories.tree) instead"
    planner = cost.plan_bytes + (cost.ingest_bytes if tokens else 0)
    return Cost(
        rows=cost.packed_rows,
        memory_bytes=planner
        + response_copies(cost.response_bytes, stream, chunk_bytes)
        + CALL_OVERHEAD_BYTES,
        response_bytes=cost.response_bytes,
        field=field,
        hint=hint,
    )


def request_bytes(received: int, copied: int, cost=None, *, tokens: bool = False) -> int:
    """Bytes a request holds while it waits and plans: the ``received`` bytes, the ``copied`` bytes
    of arrays that could not be read in place, and a segment tree's batch (built at admission:
    ``cost.ingest_bytes`` of its :class:`harts_planner.PlanCost`)."""
    return received + copied + (0 if cost is None or tokens else cost.ingest_bytes)


def limit_error(field: str, message: str) -> ResourceLimitError:
    """A ResourceLimitError on ``field`` (formatted like the planner's: ``"field: message"``)."""
    err = ResourceLimitError(f"{field}: {message}")
    err.field = field
    return err


__all__ = [
    "CALL_OVERHEAD_BYTES",
    "DEFAULT",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_MAX_TRANSFER_BYTES",
    "DEFAULT_MIN_RATE",
    "MAX_MESSAGE_MB",
    "MiB",
    "RECEIVE_COPIES",
    "RESPONSE_COPIES",
    "STREAM_CHUNKS",
    "Cost",
    "Limits",
    "limit_error",
    "of_plan_cost",
    "request_bytes",
    "response_copies",
]
