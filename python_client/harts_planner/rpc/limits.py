"""What one request may cost the sidecar, estimated from the request before any planning.

A request is refused with RESOURCE_EXHAUSTED, naming the request field to blame and the limit, when
its estimate exceeds one of the server's :class:`Limits`:

=========================  ================================================  ========================
limit                      what it bounds                                    ``harts-planner serve``
=========================  ================================================  ========================
``max_rows``               rows (compact + replay) of the call plans asked   ``--max-rows``
``max_plan_memory_bytes``  server memory of the plans running at once (est.)  ``--max-plan-memory-mb``
``max_response_bytes``     size of the response (estimate, then exact)       ``--max-response-mb``
``max_inflight_bytes``     request bytes held at once, queued or planning    ``--max-inflight-mb``
``max_queued``             requests waiting for a planner thread             ``--max-queued``
=========================  ================================================  ========================

A request whose plan alone would need more than ``max_plan_memory_bytes`` is refused; one that fits
waits (first come, first served) until the plans running at once leave it room. The defaults fit a
24 GB machine whatever the number of planner threads.

Estimates (:func:`call_plan_cost`, :func:`step_cost`, :func:`tokens_ingest_cost`) are upper bounds
built from what a request states: trajectory and segment counts, the compact rows ``C`` and
semantic positions ``S`` of the trajectories planned (for a segment tree ``C`` is exact from the
request; for one microbatch ``C`` is its compact work, O(k log k) from the batch index), the chunk
size and the convolution width. They count the arrays of the response (:mod:`harts_planner.call_plan`
lists them: per row, per packed row, per semantic position, per segment), and memory as a multiple of
the response (the native plan and its temporaries, the response message and its serialized bytes,
measured at 4.4x to 5.6x) plus the batch's per-row arrays. They cost O(1) once ``C`` and ``S`` are
known; nothing is allocated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harts_planner.errors import ResourceLimitError

#: gRPC's own bound on a message (2^31 - 1 bytes) in whole MiB.
MAX_MESSAGE_MB = 2047
MiB = 1 << 20


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

#: Memory of a plan as a multiple of its response: the native plan and its temporaries, the response
#: message, its serialized bytes (4.4x measured on a one-segment 2^26-row plan, 5.6x on a whole
#: ``swe-like`` batch; rounded up).
MEMORY_PER_RESPONSE_BYTE = 6
#: Per-row arrays of a batch, built on first use for a batch from a segment tree
#: (row_of_position: 4 bytes per semantic position; row parent, depth, segment, multiplicity, ...).
BATCH_BYTES_PER_ROW = 40
BATCH_BYTES_PER_POSITION = 4
#: Ingesting packed tokens: 6.3 bytes per token measured beyond the request (compact map and rows);
#: rows are at most the tokens, so 4 + 24 per token bounds it.
INGEST_BYTES_PER_TOKEN = 28
#: Step planning (orders, partitions, candidates): per trajectory and per segment, generous.
STEP_BYTES_PER_TRAJECTORY = 512
STEP_BYTES_PER_SEGMENT = 64


@dataclass(frozen=True)
class Cost:
    """An estimate of what a request needs: ``rows`` of call plans, server ``memory_bytes``,
    ``response_bytes``; ``field`` is the request field that asks for it (named in a refusal) and
    ``hint`` what to do instead."""

    rows: int
    memory_bytes: int
    response_bytes: int
    field: str
    hint: str = ""

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.rows + other.rows,
            self.memory_bytes + other.memory_bytes,
            self.response_bytes + other.response_bytes,
            self.field,
            self.hint,
        )

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


def limit_error(field: str, message: str) -> ResourceLimitError:
    """A ResourceLimitError on ``field`` (formatted like the planner's: ``"field: message"``)."""
    err = ResourceLimitError(f"{field}: {message}")
    err.field = field
    return err


def call_plan_response_bytes(
    rows: int, positions: int, trajectories: int, segments: int, chunk_size: int, conv_width: int, debug: bool
) -> tuple[int, int]:
    """(rows + replay bound, response bytes bound) of one call plan over ``rows`` compact rows,
    ``positions`` semantic positions, ``trajectories`` trajectories and at most ``segments`` segments.

    Replay: each sequence replays fewer than B rows and there are at most ``segments`` sequences,
    rounds and state slots. Bytes per array as in :data:`harts_planner.call_plan.ARRAY_FIELDS`.
    """
    replay = min(segments * (chunk_size - 1), positions)
    packed = rows + replay
    w1 = conv_width - 1
    per_row = 16 + (
        4 if debug else 0
    )  # row_to_physical, position_ids, row/physical_to_global (+ physical_to_row)
    per_segment = 80 + 4 * w1 + ((72 + 4 * w1) if debug else 0)  # forest, sequences, slots, rounds
    size = (
        per_row * rows
        + 8 * packed  # gather_index, packed_output_row
        + 4 * positions  # semantic_to_physical
        + per_segment * (segments + 1)
        + 12 * (trajectories + 1)  # trajectories, semantic_offsets
        + 6 * 64  # field headers
    )
    return packed, size


def call_plan_cost(
    rows: int,
    positions: int,
    trajectories: int,
    segments: int,
    chunk_size: int,
    conv_width: int,
    debug: bool,
    *,
    field: str,
    hint: str = "",
) -> Cost:
    """The cost of one call plan (see :func:`call_plan_response_bytes`)."""
    packed, size = call_plan_response_bytes(
        rows, positions, trajectories, segments, chunk_size, conv_width, debug
    )
    return Cost(packed, MEMORY_PER_RESPONSE_BYTE * size, size, field, hint)


def batch_rows_cost(compact_tokens: int, semantic_tokens: int, field: str) -> Cost:
    """The per-row arrays a batch from a segment tree builds for its first call plan."""
    memory = BATCH_BYTES_PER_ROW * compact_tokens + BATCH_BYTES_PER_POSITION * semantic_tokens
    return Cost(0, memory, 0, field)


def step_cost(trajectories: int, segments: int, field: str = "trajectories") -> Cost:
    """Step planning without call plans: memory O(N + V), a response O(N + K) with K <= N."""
    response = 32 * trajectories + 4096
    memory = STEP_BYTES_PER_TRAJECTORY * trajectories + STEP_BYTES_PER_SEGMENT * segments + 2 * response
    return Cost(0, memory, response, field)


def tokens_ingest_cost(tokens: int, trajectories: int) -> Cost:
    """Ingesting packed tokens into a batch (the compact trie): O(S) memory."""
    return Cost(
        0,
        INGEST_BYTES_PER_TOKEN * tokens + 64 * trajectories,
        0,
        "trajectories.packed.tokens",
        "send the step's compacted segment tree (trajectories.tree) instead",
    )


__all__ = [
    "DEFAULT",
    "MAX_MESSAGE_MB",
    "Cost",
    "Limits",
    "batch_rows_cost",
    "call_plan_cost",
    "call_plan_response_bytes",
    "limit_error",
    "step_cost",
    "tokens_ingest_cost",
]
