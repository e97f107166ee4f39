"""Cost before work: what a planning request will need, from the request alone (``harts/plan_cost.h``).

:func:`estimate_cost` sizes a PlanCalls or PlanStep request (rows and replay rows of its call plans,
bytes the planner allocates, bytes of the response) from a segment tree, packed tokens or an
ingested batch without planning it; :func:`estimate_call_plans` gives the exact cost of the call
plans of a step plan's microbatches. Both return a :class:`PlanCost`, which
:meth:`PlanCost.check` compares with :class:`CostLimits` (ResourceLimitError naming the field).
The sidecar admits requests by these numbers; :func:`harts_planner.step_plan.plan_step_with_calls`
checks the call plans' cost before making them. Every public name is also importable from
:mod:`harts_planner` and from :mod:`harts_planner.step_plan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from harts_planner import _native, checks
from harts_planner.batch import PackedTokens, RolloutBatch, SegmentTree
from harts_planner.call_plan import DEFAULT_CHUNK_SIZE, DEFAULT_CONV_WIDTH, wire_bytes
from harts_planner.errors import cancel_token, invalid, resource_limit

__all__ = ["MAX_MESSAGE_BYTES", "CostLimits", "PlanCost", "estimate_call_plans", "estimate_cost"]

#: Step search options and their defaults (the same as ``harts_planner.step_plan.DEFAULT_OPTIONS``,
#: read from C++ here too so that this module does not import the step planner).
_DEFAULT_OPTIONS: dict[str, object] = _native.default_step_options()

#: The largest message protobuf serializes (2 GiB - 1): the default response limit.
MAX_MESSAGE_BYTES: int = 2**31 - 1
#: Framing of a response around its plans (message tags and lengths, PlanStats), at most.
_RESPONSE_FRAMING = 256
#: A StepPlan message beyond its arrays: scalars, objective, strings, each candidate and each phase
#: timing at most this many bytes.
_STEP_MESSAGE_FIXED, _CANDIDATE_BYTES, _PHASE_BYTES, _MAX_PHASES = 1024, 320, 96, 64


@dataclasses.dataclass(frozen=True)
class CostLimits:
    """Limits a request's :class:`PlanCost` is checked against (:meth:`PlanCost.check`); None leaves
    a quantity unlimited.

    Attributes
    ----------
    max_packed_rows : int or None
        The most packed rows (compact rows + replay rows, ``C + R``) of all the call plans of one
        request.
    max_peak_bytes : int or None
        The most bytes the planner may allocate for one request (ingestion, step planning and the
        call plans; the response's encoding is not included).
    max_response_bytes : int or None
        The most bytes of one response message; default 2 GiB - 1, what protobuf can serialize.
    """

    max_packed_rows: int | None = None
    max_peak_bytes: int | None = None
    max_response_bytes: int | None = MAX_MESSAGE_BYTES

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                object.__setattr__(self, f.name, checks.int64(value, f.name, 0))


@dataclasses.dataclass(frozen=True)
class PlanCost:
    """What a planning request will need, computed from the request alone (:func:`estimate_cost`).

    Every size is exact or an upper bound, never below what the plan really needs (bytes count
    every allocation of the C++ planner, ``harts/plan_cost.h``; tests compare them with real plans).

    Attributes
    ----------
    request : str
        ``"calls"`` (PlanCalls: one call plan) or ``"step"`` (PlanStep).
    exact : bool
        True when ``compact_tokens``, ``call_rows`` and ``replay_rows`` are the plan's own (a segment
        tree or an ingested batch and a PlanCalls request); False when they are bounds (packed
        tokens not yet ingested: ``C <= S``; a step's call plans, whose microbatches are not known
        yet).
    trajectories, semantic_tokens : int
        N and S of the batch.
    segments : int
        Segments of the batch's canonical forest (a bound, 2N, for packed tokens).
    compact_tokens : int
        C of the batch (a bound, S, for packed tokens).
    call_plans : int
        Call plans in the response: 1 for PlanCalls, at most N for a step with call plans, else 0.
    call_rows, replay_rows : int
        Sums over those call plans of their compact rows C and replay rows R (Equation 15).
    ingest_bytes, plan_bytes : int
        Bytes the planner allocates to build the batch (0 for an already ingested batch) and to plan.
    response_bytes : int
        Bytes of the response message (``PlanCallsResponse`` / ``PlanStepResponse``).
    field : str
        The request field a refusal names: ``microbatch`` or ``trajectories`` for PlanCalls,
        ``call_plans`` or ``trajectories`` for PlanStep.
    """

    request: str
    exact: bool
    trajectories: int
    semantic_tokens: int
    segments: int
    compact_tokens: int
    call_plans: int
    call_rows: int
    replay_rows: int
    ingest_bytes: int
    plan_bytes: int
    response_bytes: int
    field: str

    @property
    def packed_rows(self) -> int:
        """``call_rows + replay_rows``: the rows the call plans pack into their rounds."""
        return self.call_rows + self.replay_rows

    @property
    def peak_bytes(self) -> int:
        """``ingest_bytes + plan_bytes``: a bound on the planner's memory for the request."""
        return self.ingest_bytes + self.plan_bytes

    def check(self, limits: CostLimits | None = None) -> None:
        """Raise ResourceLimitError when a quantity exceeds its limit (default :class:`CostLimits`:
        only the 2 GiB response limit). The error's ``field`` is :attr:`field`; its message names the
        quantity, what is needed and the limit; it also carries ``limit`` (the limit's name),
        ``needed`` and ``maximum``. O(1)."""
        limits = CostLimits() if limits is None else limits
        for name, needed, maximum, what in (
            ("max_packed_rows", self.packed_rows, limits.max_packed_rows, "packed rows (compact + replay)"),
            ("max_peak_bytes", self.peak_bytes, limits.max_peak_bytes, "bytes of planner memory"),
            ("max_response_bytes", self.response_bytes, limits.max_response_bytes, "bytes of response"),
        ):
            if maximum is not None and needed > maximum:
                bound = "" if self.exact else "up to "
                err = resource_limit(
                    self.field, f"the plan needs {bound}{needed} {what}, over the limit {name} = {maximum}"
                )
                err.limit, err.needed, err.maximum = name, needed, maximum
                raise err


def _step_message_bytes(n: int, options: dict) -> int:
    """Upper bound on a StepPlan message of N trajectories (K <= N microbatches)."""
    exact = options["search"] == "exact" or (options["search"] == "auto" and n <= options["exact_threshold"])
    candidates = min(max(options["max_sampled_k"], 0), n) + (n if exact else 0) + 64
    arrays = 8 * (n + 1) + 4 * n + 8 * n + 4 * n + 4 * n + 5 * 7
    return _STEP_MESSAGE_FIXED + arrays + candidates * _CANDIDATE_BYTES + _MAX_PHASES * _PHASE_BYTES


def _calls_field(microbatch) -> str:
    return "trajectories" if microbatch is None else "microbatch"


def estimate_cost(
    source,
    *,
    request: str = "calls",
    microbatch=None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    conv_width: int = DEFAULT_CONV_WIDTH,
    debug: bool = True,
    call_plans: bool = False,
    options: dict | None = None,
    cancel=None,
) -> PlanCost:
    """The rows, memory and response bytes a request will need, without planning it.

    Parameters
    ----------
    source : SegmentTree, PackedTokens or RolloutBatch
        The request's trajectories. A segment tree is validated (O(V + N)) and gives exact sizes;
        packed tokens are not ingested (only their offsets are checked, O(N)) and give bounds; an
        ingested batch gives exact sizes in O(k log k) for a microbatch of k trajectories.
    request : str
        ``"calls"``: one call plan (:func:`harts_planner.plan_calls`, the PlanCalls RPC) of
        ``microbatch`` (trajectory ids; None for the whole batch). ``"step"``: a step plan
        (:func:`harts_planner.plan_step`, PlanStep) with, when ``call_plans``, the call plans of all its
        microbatches, bounded over every possible partition (C <= S, ...).
    chunk_size, conv_width : int
        B and w of the call plans.
    debug : bool
        Whether the response carries the call plans' debug part.
    options : dict, optional
        Step search options (as :func:`harts_planner.plan_step`'s; they size the candidate search).
    cancel : CancelToken, optional

    Returns
    -------
    PlanCost
        Check it with :meth:`PlanCost.check` (a :class:`CostLimits`).

    Raises
    ------
    InvalidArgumentError
        A malformed tree or offsets, a bad microbatch, option or argument, naming the field as
        :meth:`RolloutBatch.from_segment_tree` / :func:`harts_planner.plan_calls` do.

    O(V + N + k) for a tree, O(N + k) for packed tokens, O(k log k) or O(V) for a batch; under
    10 ms for a ``swe-like`` step's tree. The GIL is released for the C++ part.
    """
    if request not in ("calls", "step"):
        raise invalid("request", f'must be "calls" or "step", got {request!r}')
    chunk_size = checks.chunk_size(chunk_size)
    conv_width = checks.conv_width(conv_width)
    debug = checks.boolean(debug, "debug")
    call_plans = checks.boolean(call_plans, "call_plans")
    cancel = cancel_token(cancel)
    merged: dict[str, Any] = dict(_DEFAULT_OPTIONS)  # values of each option's type (checks.step_options)
    merged.update(checks.step_options(options or {}, _DEFAULT_OPTIONS))
    if request == "step" and microbatch is not None:
        raise invalid(
            "microbatch", 'a step request plans every trajectory; give microbatch only with request="calls"'
        )
    ids = None if microbatch is None else checks.trajectory_ids(microbatch, "microbatch")
    step = request == "step"
    whole = ids is None or step
    tree: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    try:
        if isinstance(source, SegmentTree):
            tree = (source.parent, source.length, source.trajectory_end)
            shape, segments = _native.tree_call_shape(
                *tree, None if whole else ids, chunk_size, conv_width, cancel
            )
            n = source.num_trajectories
            total = shape if whole else None
            compact = int(source.length.sum(dtype=np.int64))
            semantic = shape.semantic_tokens if whole else None
            ingest = _native.tree_ingest_bytes(source.num_segments, n, segments)
            exact = True
            if step and call_plans:
                shape = _native.tree_partition_shape(*tree, chunk_size, conv_width, cancel)
        elif isinstance(source, PackedTokens):
            tokens = len(source.tokens)
            shape = _native.token_call_shape(
                tokens, source.offsets, None if whole else ids, chunk_size, conv_width
            )
            n = source.num_trajectories
            semantic, compact, segments = tokens, tokens, 2 * n
            total = shape if whole else None
            ingest = _native.token_ingest_bytes(n, tokens, tokens, 2 * n)
            exact = False
        elif isinstance(source, RolloutBatch):
            native = source._native
            shape = _native.batch_call_shape(native, None if whole else ids, chunk_size, conv_width, cancel)
            n, semantic, compact = source.num_trajectories, source.semantic_tokens, source.compact_tokens
            segments, ingest, exact, total = source.num_segments, 0, True, None
            if step and call_plans:
                shape = _native.batch_partition_shape(native, chunk_size, conv_width)
        else:
            raise invalid(
                "source", f"must be a SegmentTree, PackedTokens or RolloutBatch, got {type(source).__name__}"
            )
    except _native.HartsError as e:
        if e.field is not None and e.field.startswith("trajectories") and ids is not None:
            raise invalid("microbatch" + e.field[len("trajectories") :], str(e).split(": ", 1)[1]) from None
        raise
    if semantic is None:  # a tree's microbatch: S from the lengths of its trajectories' paths
        assert tree is not None  # only a tree's microbatch leaves it unknown above
        semantic = int(
            _native.tree_call_shape(*tree, None, chunk_size, conv_width, cancel)[0].semantic_tokens
        )

    if not step:
        retained, scratch = _native.call_plan_bytes(shape, chunk_size, conv_width)
        return PlanCost(
            request="calls",
            exact=exact,
            trajectories=n,
            semantic_tokens=semantic,
            segments=segments,
            compact_tokens=compact,
            call_plans=1,
            call_rows=shape.rows,
            replay_rows=shape.replay_rows,
            ingest_bytes=ingest,
            plan_bytes=retained + scratch,
            response_bytes=wire_bytes(shape, conv_width, debug) + _RESPONSE_FRAMING,
            field=_calls_field(microbatch),
        )
    plan_bytes = _native.step_plan_bytes(
        n, segments, merged["max_sampled_k"], merged["exact_threshold"], merged["search"]
    )
    response = _step_message_bytes(n, merged) + _RESPONSE_FRAMING
    if call_plans:
        # The worst single plan's scratch: that of the whole batch's plan (every size is at most its).
        whole_shape = total if total is not None else _whole_shape(source, chunk_size, conv_width)
        plan_bytes += _native.partition_retained_bytes(shape, n, chunk_size, conv_width)
        plan_bytes += _native.call_plan_bytes(whole_shape, chunk_size, conv_width)[1]
        response += wire_bytes(shape, conv_width, debug, plans=n) + 6 * n
    return PlanCost(
        request="step",
        exact=False,
        trajectories=n,
        semantic_tokens=semantic,
        segments=segments,
        compact_tokens=compact,
        call_plans=n if call_plans else 0,
        call_rows=shape.rows if call_plans else 0,
        replay_rows=shape.replay_rows if call_plans else 0,
        ingest_bytes=ingest,
        plan_bytes=plan_bytes,
        response_bytes=response,
        field="call_plans" if call_plans else "trajectories",
    )


def _whole_shape(source, chunk_size: int, conv_width: int):
    if isinstance(source, RolloutBatch):
        return _native.batch_call_shape(source._native, None, chunk_size, conv_width)
    if isinstance(source, SegmentTree):
        return _native.tree_call_shape(
            source.parent, source.length, source.trajectory_end, None, chunk_size, conv_width
        )[0]
    return _native.token_call_shape(len(source.tokens), source.offsets, None, chunk_size, conv_width)


def estimate_call_plans(
    batch: RolloutBatch,
    microbatches: Sequence,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    conv_width: int = DEFAULT_CONV_WIDTH,
    debug: bool = True,
    cancel=None,
) -> PlanCost:
    """The exact cost of the call plans of the given microbatches of ``batch`` (a step plan's,
    :attr:`StepPlan.microbatches`), before making any: their rows and replay rows, the bytes they
    allocate together (every plan kept, as :func:`harts_planner.step_plan.plan_step_with_calls` keeps them) and their share
    of a PlanStep response. O(sum of k log k). ``field`` is ``call_plans``."""
    chunk_size = checks.chunk_size(chunk_size)
    conv_width = checks.conv_width(conv_width)
    cancel = cancel_token(cancel)
    rows = replay = retained = scratch = response = 0
    for mb in microbatches:
        shape = _native.batch_call_shape(
            batch._native, checks.trajectory_ids(mb, "microbatch"), chunk_size, conv_width, cancel
        )
        kept, temporary = _native.call_plan_bytes(shape, chunk_size, conv_width)
        rows += shape.rows
        replay += shape.replay_rows
        retained += kept
        scratch = max(scratch, temporary)
        response += wire_bytes(shape, conv_width, debug) + 6
    return PlanCost(
        request="step",
        exact=True,
        trajectories=batch.num_trajectories,
        semantic_tokens=batch.semantic_tokens,
        segments=batch.num_segments,
        compact_tokens=batch.compact_tokens,
        call_plans=len(microbatches),
        call_rows=rows,
        replay_rows=replay,
        ingest_bytes=0,
        plan_bytes=retained + scratch,
        response_bytes=response,
        field="call_plans",
    )
