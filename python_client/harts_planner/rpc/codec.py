"""Conversion between planner objects and the ``harts.planner.v1`` wire messages.

Arrays travel as packed little-endian bytes (``planner.proto``); the tables
:data:`harts_planner.call_plan.ARRAY_FIELDS` and :data:`harts_planner.step_plan.ARRAY_FIELDS`
name every array and its dtype, so a plan decoded here holds exactly the fields of the plan
that was encoded, and the two compare equal (``==``).

Errors raised while decoding a *request* are :class:`~harts_planner.InvalidArgumentError` /
:class:`~harts_planner.ResourceLimitError` whose ``field`` is the request field's path, e.g.
``trajectories.packed.offsets[3]`` or ``options.max_sampled_k``.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from harts_planner import batch as _batch
from harts_planner import call_plan as _call_plan
from harts_planner import checks
from harts_planner import step_plan as _step_plan
from harts_planner.batch import PackedTokens, RolloutBatch, SegmentTree
from harts_planner.call_plan import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_CONV_WIDTH,
    MAX_CHUNK_SIZE,
    MAX_CONV_WIDTH,
    CallPlan,
)
from harts_planner.errors import HartsError, invalid, renamed
from harts_planner.rpc import planner_pb2 as pb
from harts_planner.step_plan import DEFAULT_OPTIONS, StepPlan

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PlannerService"].full_name
PLAN_STEP = f"/{SERVICE_NAME}/PlanStep"
PLAN_CALLS = f"/{SERVICE_NAME}/PlanCalls"
PLAN_STEP_STREAM = f"/{SERVICE_NAME}/PlanStepStream"
PLAN_CALLS_STREAM = f"/{SERVICE_NAME}/PlanCallsStream"

I32, I64 = np.dtype("<i4"), np.dtype("<i8")

_SEARCH_TO_WIRE = {
    "auto": pb.SEARCH_MODE_AUTO,
    "exact": pb.SEARCH_MODE_EXACT,
    "heuristic": pb.SEARCH_MODE_HEURISTIC,
}
_SEARCH_FROM_WIRE = {pb.SEARCH_MODE_UNSPECIFIED: "auto", **{v: k for k, v in _SEARCH_TO_WIRE.items()}}
_INT_OPTIONS = [k for k, v in DEFAULT_OPTIONS.items() if isinstance(v, int) and not isinstance(v, bool)]
_BOOL_OPTIONS = [k for k, v in DEFAULT_OPTIONS.items() if isinstance(v, bool)]


# ---------------------------------------------------------------------------------------- arrays
def pack(values, dtype: np.dtype) -> bytes:
    """Little-endian bytes of a 1-D array (copied once)."""
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def unpack(data: bytes, dtype: np.dtype, field: str) -> np.ndarray:
    """A read-only native-endian array over ``data`` (zero copy on little-endian hosts).

    Raises InvalidArgumentError naming ``field`` when the byte count is not a whole number of values.
    """
    dtype = np.dtype(dtype)
    if len(data) % dtype.itemsize:
        raise invalid(
            field,
            f"{len(data)} bytes is not a whole number of {dtype.itemsize}-byte "
            f"little-endian {'int32' if dtype.itemsize == 4 else 'int64'} values",
        )
    arr = np.frombuffer(data, dtype=dtype)
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


# ---------------------------------------------------------------------------------- trajectories
def encode_trajectories(source: PackedTokens | SegmentTree) -> pb.Trajectories:
    """Wire form of packed tokens or a compacted tree."""
    msg = pb.Trajectories()
    if isinstance(source, SegmentTree):
        msg.tree.parent = pack(source.parent, I32)
        msg.tree.length = pack(source.length, I32)
        msg.tree.trajectory_end = pack(source.trajectory_end, I32)
    elif isinstance(source, PackedTokens):
        msg.packed.tokens = pack(source.tokens, I32)
        msg.packed.offsets = pack(source.offsets, I64)
    else:
        raise invalid("trajectories", f"must be PackedTokens or SegmentTree, got {type(source).__name__}")
    if source.tree_ids is not None:
        msg.tree_ids = pack(source.tree_ids, I64)
    return msg


PACKED_FIELDS = {
    "tokens": "trajectories.packed.tokens",
    "offsets": "trajectories.packed.offsets",
    "tree_ids": "trajectories.tree_ids",
    "trajectories": "trajectories",
}
TREE_FIELDS = {
    "parent": "trajectories.tree.parent",
    "length": "trajectories.tree.length",
    "trajectory_end": "trajectories.tree.trajectory_end",
    "tree_ids": "trajectories.tree_ids",
    "tree": "trajectories.tree",
}


def decode_trajectories(msg: pb.Trajectories) -> PackedTokens | SegmentTree:
    """Arrays of a request's trajectories (views of the message bytes, not yet validated)."""
    which = msg.WhichOneof("source")
    arrays = {}
    if which is not None:
        part = getattr(msg, which)
        arrays = {f.name: getattr(part, f.name) for f in part.DESCRIPTOR.fields}
    if msg.tree_ids:
        arrays["tree_ids"] = msg.tree_ids
    return trajectories_of(which, arrays, unpack)


def trajectories_of(which: str | None, arrays: dict, read=None) -> PackedTokens | SegmentTree:
    """The trajectories of a request from its raw arrays: ``which`` is the ``source`` oneof member
    set (``"packed"``, ``"tree"`` or None) and ``arrays`` its bytes fields by name (plus
    ``tree_ids``), read by ``read(buffer, dtype, field)`` (default :func:`unpack`). Raises
    InvalidArgumentError naming the field (none set; a byte count that is not whole values)."""
    read = unpack if read is None else read
    if which is None:
        raise invalid(
            "trajectories",
            "required: set trajectories.packed (tokens and offsets) or "
            "trajectories.tree (a compacted segment tree)",
        )
    empty = b""
    ids = arrays.get("tree_ids", empty)
    tree_ids = read(ids, I64, "trajectories.tree_ids") if len(ids) else None
    if which == "packed":
        return PackedTokens(
            read(arrays.get("tokens", empty), I32, "trajectories.packed.tokens"),
            read(arrays.get("offsets", empty), I64, "trajectories.packed.offsets"),
            tree_ids,
        )
    return SegmentTree(
        read(arrays.get("parent", empty), I32, "trajectories.tree.parent"),
        read(arrays.get("length", empty), I32, "trajectories.tree.length"),
        read(arrays.get("trajectory_end", empty), I32, "trajectories.tree.trajectory_end"),
        tree_ids,
    )


def ingest(source: PackedTokens | SegmentTree, *, wire: bool = False, cancel=None) -> RolloutBatch:
    """The batch of packed tokens or of a compacted tree. With ``wire``, error fields are
    request paths (``trajectories.tree.parent[4]``). ``cancel``: a CancelToken the ingestion polls.
    With ``wire`` the arrays are views of a request's bytes, which nothing writes to: the batch
    keeps them without a copy."""
    try:
        return _batch.ingest(source, cancel=cancel, take=wire)
    except HartsError as e:
        if not wire:
            raise
        raise renamed(e, TREE_FIELDS if isinstance(source, SegmentTree) else PACKED_FIELDS) from None


def _limit_error(field: str, message: str) -> HartsError:
    from harts_planner.rpc.limits import limit_error

    return limit_error(field, message)


def validate_packed(source: PackedTokens) -> None:
    """The checks that ingesting packed tokens starts with (``ValidateTrajectories`` of
    ``harts/rollout_batch.h``), in the same order, with the same messages and with request field paths,
    in O(S) vectorized numpy and no allocation beyond O(N) (so that a bad tokens request is refused
    before it waits for a planner thread; tested against the C++ checks).

    Raises InvalidArgumentError / ResourceLimitError naming ``trajectories.packed.offsets[i]``,
    ``trajectories.packed.tokens[s]``, ``trajectories.tree_ids[i]``, ...
    """
    tokens, offsets, tree_ids = source.tokens, source.offsets, source.tree_ids
    f_off, f_tok, f_ids = "trajectories.packed.offsets", "trajectories.packed.tokens", "trajectories.tree_ids"
    if len(offsets) < 2:
        raise invalid(f_off, f"needs N + 1 >= 2 entries (at least one trajectory), got {len(offsets)}")
    n = len(offsets) - 1
    if n > _batch._native.MAX_TRAJECTORIES:
        raise _limit_error(f_off, f"{n} trajectories exceed the limit of {_batch._native.MAX_TRAJECTORIES}")
    if len(tokens) > _batch._native.MAX_SEMANTIC_TOKENS:
        raise _limit_error(
            f_tok, f"{len(tokens)} semantic tokens exceed the limit of {_batch._native.MAX_SEMANTIC_TOKENS}"
        )
    if offsets[0] != 0:
        raise invalid(f"{f_off}[0]", f"must be 0, got {int(offsets[0])}")
    steps = np.diff(offsets)
    bad = np.flatnonzero(steps <= 0)
    if len(bad):
        i = int(bad[0])
        raise invalid(
            f"{f_off}[{i + 1}]",
            f"trajectory {i} is empty"
            if steps[i] == 0
            else f"offsets must be strictly increasing, got {int(offsets[i + 1])} after {int(offsets[i])}",
        )
    if offsets[n] != len(tokens):
        raise invalid(f"{f_off}[{n}]", f"must equal len(tokens) = {len(tokens)}, got {int(offsets[n])}")
    if len(tokens) and tokens.min() < 0:
        s = int(np.argmax(tokens < 0))
        i = int(np.searchsorted(offsets, s, side="right")) - 1
        raise invalid(
            f"{f_tok}[{s}]",
            f"token ids must be >= 0, got {int(tokens[s])} (trajectory {i}, position {s - int(offsets[i])})",
        )
    if tree_ids is not None:
        if len(tree_ids) != n:
            raise invalid(f_ids, f"needs one entry per trajectory ({n}), got {len(tree_ids)}")
        if len(tree_ids) and tree_ids.min() < 0:
            i = int(np.argmax(tree_ids < 0))
            raise invalid(f"{f_ids}[{i}]", f"must be >= 0, got {int(tree_ids[i])}")


#: Context-parallel limits (``harts/cp_split.h``): C in ``[1, MAX_CP_SIZE]``, C x T <= MAX_CP_ROWS.
MAX_CP_SIZE: int = checks.MAX_CP_SIZE
MAX_CP_ROWS: int = 2**62

#: Least value of each integer option (``ValidatePlannerOptions`` of ``harts/step_plan.h``).
OPTION_MINIMUMS = {
    "exact_threshold": 0,
    "max_sampled_k": 2,
    "refine_window": 0,
    "refine_sweeps": 0,
    "max_anchors": 0,
    "repair_window": 0,
    "repair_iterations": 0,
    "microbatch_cost": 0,
}


def check_step(lengths: np.ndarray, dp_size: int, capacity: int, options: dict) -> None:
    """The checks ``PlanStep`` starts with (``ValidatePlannerOptions``, ``CheckTrajectoriesFit`` against
    ``cp_size x capacity`` and N >= D in ``harts/step_plan.h``), in the same order, with the same errors and
    fields (``max_sampled_k``, ``cp_size``, ``trajectories[i]``, ``dp_size``), from the trajectory lengths alone: O(N),
    so that the sidecar answers them before a planner thread is taken (tested against the planner)."""
    from harts_planner.errors import InfeasibleError

    for name, value in (("dp_size", dp_size), ("capacity", capacity)):
        if value < 1:
            raise invalid(name, f"must be >= 1, got {value}")
    merged = {**DEFAULT_OPTIONS, **options}
    for name, lo in OPTION_MINIMUMS.items():
        if merged[name] < lo:
            raise invalid(name, f"must be >= {lo}, got {merged[name]}")
        if name == "microbatch_cost" and merged[name] > capacity:
            raise invalid(name, f"must be <= capacity T = {capacity}, got {merged[name]}")
    cp_size = merged["cp_size"]
    if not 1 <= cp_size <= MAX_CP_SIZE:
        raise invalid("cp_size", f"must be in [1, {MAX_CP_SIZE}], got {cp_size}")
    if capacity > MAX_CP_ROWS // cp_size:
        raise invalid(
            "cp_size",
            f"capacity x cp_size = {capacity} x {cp_size} exceeds the limit of {MAX_CP_ROWS} compact rows "
            "per microbatch",
        )
    if merged["search"] not in _SEARCH_TO_WIRE:
        raise invalid("search", f'must be "auto", "exact" or "heuristic", got "{merged["search"]}"')
    over = np.flatnonzero(lengths > capacity * cp_size)
    if len(over):
        i = int(over[0])
        if cp_size == 1:
            limit = f"T = {capacity}"
        else:
            limit = f"C x T = {cp_size} x {capacity} = {cp_size * capacity} (cp_size x capacity)"
        raise invalid(
            f"trajectories[{i}]",
            f"trajectory {i} has {int(lengths[i])} tokens, more than the microbatch capacity {limit}; "
            "a trajectory cannot be split between microbatches",
        )
    n = len(lengths)
    if n < dp_size:
        err = InfeasibleError(
            f"dp_size: the batch has {n} trajectories but D = {dp_size} replicas each need at least one "
            "non-empty microbatch (N >= D is required)"
        )
        err.field = "dp_size"
        raise err


# ---------------------------------------------------------------------------------- options
def encode_options(options: dict) -> pb.StepOptions:
    """StepOptions with every given option set (names as in ``DEFAULT_OPTIONS``; the checks of
    :func:`harts_planner.checks.step_options`, and ``search`` one of the SearchMode names)."""
    msg = pb.StepOptions()
    for name, value in checks.step_options(options, DEFAULT_OPTIONS).items():
        if name == "search":
            if value not in _SEARCH_TO_WIRE:
                raise invalid("search", f"must be one of {sorted(_SEARCH_TO_WIRE)}, got {value!r}")
            msg.search = _SEARCH_TO_WIRE[value]
        else:
            setattr(msg, name, value)
    return msg


def decode_options(msg: pb.StepOptions, prefix: str = "options.") -> dict:
    """The options set in ``msg`` (unset ones are left to the defaults)."""
    out: dict = {}
    for name in _INT_OPTIONS + _BOOL_OPTIONS:
        if msg.HasField(name):
            out[name] = getattr(msg, name)
    if msg.search not in _SEARCH_FROM_WIRE:
        raise invalid(prefix + "search", f"unknown SearchMode value {msg.search}")
    if msg.search != pb.SEARCH_MODE_UNSPECIFIED:
        out["search"] = _SEARCH_FROM_WIRE[msg.search]
    return out


OPTION_FIELDS = {name: "options." + name for name in DEFAULT_OPTIONS}


# ---------------------------------------------------------------------------------- requests
def plan_step_request(
    source: PackedTokens | SegmentTree,
    dp_size: int,
    capacity: int,
    chunk_size: int,
    options: dict,
    call_plans: bool,
    conv_width: int,
    debug: bool = True,
) -> pb.PlanStepRequest:
    """The PlanStep request of a client call (``debug=False`` sets ``omit_debug``)."""
    return pb.PlanStepRequest(
        trajectories=encode_trajectories(source),
        dp_size=checks.int64(dp_size, "dp_size", 1),
        capacity=checks.int64(capacity, "capacity", 1),
        chunk_size=checks.chunk_size(chunk_size),
        options=encode_options(options),
        include_call_plans=checks.boolean(call_plans, "call_plans"),
        conv_width=checks.conv_width(conv_width),
        omit_debug=not checks.boolean(debug, "debug"),
    )


def plan_calls_request(
    source: PackedTokens | SegmentTree, microbatch, chunk_size: int, conv_width: int, debug: bool = True
) -> pb.PlanCallsRequest:
    """The PlanCalls request of a client call (``microbatch`` None = every trajectory;
    ``debug=False`` sets ``omit_debug``)."""
    msg = pb.PlanCallsRequest(
        trajectories=encode_trajectories(source),
        chunk_size=checks.chunk_size(chunk_size),
        conv_width=checks.conv_width(conv_width),
        omit_debug=not checks.boolean(debug, "debug"),
    )
    if microbatch is not None:
        msg.microbatch = pack(checks.trajectory_ids(microbatch, "microbatch"), I32)
    return msg


# ------------------------------------------------------------------ fast serialization
# A request's trajectories are written in protobuf wire format by hand, straight from the numpy
# buffers (one copy, in the final join), and appended to the protobuf bytes of the other fields.
# Setting a bytes field and serializing would copy a step's 200+ MB of tokens three times. The
# result parses to exactly the message the *_request functions build (tested).
def varint(n: int) -> bytes:
    """``n`` >= 0 as a protobuf base-128 varint."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def header(number: int, length: int) -> bytes:
    """Tag and length of a length-delimited field."""
    return varint(number << 3 | 2) + varint(length)


def _bytes_fields(fields) -> list:
    parts = []
    for number, values, dtype in fields:
        buf = np.ascontiguousarray(values, dtype=dtype).data.cast("B")
        if len(buf):
            parts += [header(number, len(buf)), buf]
    return parts


def _trajectories_parts(source: PackedTokens | SegmentTree) -> list:
    if isinstance(source, SegmentTree):
        number, inner = 2, [(1, source.parent, I32), (2, source.length, I32), (3, source.trajectory_end, I32)]
    elif isinstance(source, PackedTokens):
        number, inner = 1, [(1, source.tokens, I32), (2, source.offsets, I64)]
    else:
        raise invalid("trajectories", f"must be PackedTokens or SegmentTree, got {type(source).__name__}")
    body = _bytes_fields(inner)
    parts = [header(number, sum(len(p) for p in body)), *body]
    if source.tree_ids is not None:
        parts += _bytes_fields([(3, source.tree_ids, I64)])
    return [header(1, sum(len(p) for p in parts)), *parts]  # field 1 of both requests


def _empty_tree() -> SegmentTree:
    """A request head's placeholder trajectories (cleared before the arrays are appended)."""
    empty = np.zeros(0, np.int32)
    return SegmentTree(empty, empty, empty)


def serialize_plan_step_request(
    source, dp_size, capacity, chunk_size, options, call_plans, conv_width, debug=True
) -> bytes:
    """Wire bytes of :func:`plan_step_request` with the arrays copied once."""
    head = plan_step_request(
        _empty_tree(), dp_size, capacity, chunk_size, options, call_plans, conv_width, debug
    )
    head.ClearField("trajectories")
    return b"".join([head.SerializeToString(), *_trajectories_parts(source)])


def serialize_plan_calls_request(source, microbatch, chunk_size, conv_width, debug=True) -> bytes:
    """Wire bytes of :func:`plan_calls_request` with the arrays copied once."""
    head = plan_calls_request(_empty_tree(), microbatch, chunk_size, conv_width, debug)
    head.ClearField("trajectories")
    return b"".join([head.SerializeToString(), *_trajectories_parts(source)])


def _required_positive(value: int, field: str) -> int:
    if value == 0:
        raise invalid(field, "required: must be >= 1 (0 means unset)")
    if value < 0:
        raise invalid(field, f"must be >= 1, got {value}")
    return value


def _defaulted(value: int, default: int, field: str, hi: int) -> int:
    value = default if value == 0 else value
    if not 1 <= value <= hi:
        raise invalid(field, f"must be in [1, {hi}] (0 means {default}), got {value}")
    return value


def decode_plan_step_request(req: pb.PlanStepRequest) -> dict:
    """Validated scalar arguments of a PlanStep request: dp_size, capacity, chunk_size,
    conv_width, call_plans, debug, options (the trajectories are decoded by :func:`decode_trajectories`)."""
    return {
        "dp_size": _required_positive(req.dp_size, "dp_size"),
        "capacity": _required_positive(req.capacity, "capacity"),
        "chunk_size": _defaulted(req.chunk_size, DEFAULT_CHUNK_SIZE, "chunk_size", MAX_CHUNK_SIZE),
        "conv_width": _defaulted(req.conv_width, DEFAULT_CONV_WIDTH, "conv_width", MAX_CONV_WIDTH),
        "call_plans": req.include_call_plans,
        "debug": not req.omit_debug,
        "options": decode_options(req.options),
    }


def decode_plan_calls_request(req: pb.PlanCallsRequest) -> dict:
    """Validated scalar arguments of a PlanCalls request: chunk_size, conv_width, microbatch, debug."""
    microbatch = unpack(req.microbatch, I32, "microbatch") if req.microbatch else None
    return {
        "chunk_size": _defaulted(req.chunk_size, DEFAULT_CHUNK_SIZE, "chunk_size", MAX_CHUNK_SIZE),
        "conv_width": _defaulted(req.conv_width, DEFAULT_CONV_WIDTH, "conv_width", MAX_CONV_WIDTH),
        "microbatch": microbatch,
        "debug": not req.omit_debug,
    }


# ---------------------------------------------------------------------------------- plans
def encode_call_plan(plan: CallPlan, debug: bool = True) -> pb.CallPlan:
    """The wire form of a call plan: its layout and, when ``debug`` and the plan has it, its debug
    part (otherwise ``debug_omitted`` is set and the debug arrays stay empty)."""
    native = plan._native
    scalars: dict[str, Any] = {f: int(getattr(native, f)) for f in _call_plan.SCALAR_FIELDS}
    msg = pb.CallPlan(**scalars)
    for name, dtype in _call_plan.LAYOUT_FIELDS.items():
        setattr(msg, name, pack(getattr(native, name), dtype))
    if debug and plan.has_debug:
        for name, dtype in _call_plan.DEBUG_FIELDS.items():
            setattr(msg, name, pack(getattr(native, name), dtype))
    else:
        msg.debug_omitted = True
    return msg


def decode_call_plan(msg: pb.CallPlan) -> CallPlan:
    """The call plan of a wire message (views of its bytes); without its debug part when
    ``msg.debug_omitted``. Raises InvalidArgumentError naming ``plan.<field>`` for a misaligned array."""
    fields: dict[str, Any] = {f: int(getattr(msg, f)) for f in _call_plan.SCALAR_FIELDS}
    arrays = _call_plan.LAYOUT_FIELDS if msg.debug_omitted else _call_plan.ARRAY_FIELDS
    for name, dtype in arrays.items():
        fields[name] = unpack(getattr(msg, name), dtype, f"plan.{name}")
    return CallPlan.from_fields(fields)


def _objective(msg: pb.Objective) -> tuple[int, int, int]:
    return (msg.total_work, msg.slot_critical_work, msg.max_replica_work)


def encode_step_plan(plan: StepPlan, arrays: bool = True) -> pb.StepPlan:
    """The wire form of a step plan (without its five arrays when not ``arrays``: the server sends
    those from the plan's own buffers, :mod:`harts_planner.rpc.wire`)."""
    n = plan._native
    msg = pb.StepPlan(
        dp_size=n.dp_size,
        capacity=n.capacity,
        chunk_size=plan.chunk_size,
        num_trajectories=n.num_trajectories,
        source=n.source,
        search_mode=n.search_mode,
        natural_k=n.natural_k,
        k_min=n.k_min,
        k_max=n.k_max,
        compact_tokens=n.compact_tokens,
        selected=n.selected,
        planning_seconds=n.planning_seconds,
        options=encode_options(plan.options),
    )
    for name, dtype in _step_plan.ARRAY_FIELDS.items() if arrays else ():
        setattr(msg, name, pack(getattr(n, name), dtype))
    msg.objective.CopyFrom(
        pb.Objective(**dict(zip(("total_work", "slot_critical_work", "max_replica_work"), n.objective)))
    )
    for c in n.candidates:
        cand = msg.candidates.add(source=c["source"], k=c["k"])
        t, s, r = c["objective"]
        cand.objective.CopyFrom(pb.Objective(total_work=t, slot_critical_work=s, max_replica_work=r))
    for name, seconds in n.phase_seconds.items():
        msg.phase_seconds[name] = seconds
    return msg


def decode_step_plan(msg: pb.StepPlan, call_plans: list[CallPlan] | None, wall_seconds: float) -> StepPlan:
    fields = {
        name: unpack(getattr(msg, name), dtype, f"plan.{name}")
        for name, dtype in _step_plan.ARRAY_FIELDS.items()
    }
    native = types.SimpleNamespace(
        dp_size=msg.dp_size,
        capacity=msg.capacity,
        num_trajectories=msg.num_trajectories,
        num_microbatches=len(fields["work"]),
        objective=_objective(msg.objective),
        source=msg.source,
        search_mode=msg.search_mode,
        natural_k=msg.natural_k,
        k_min=msg.k_min,
        k_max=msg.k_max,
        compact_tokens=msg.compact_tokens,
        selected=msg.selected,
        planning_seconds=msg.planning_seconds,
        phase_seconds=dict(msg.phase_seconds),
        candidates=[
            {"source": c.source, "k": c.k, "objective": _objective(c.objective)} for c in msg.candidates
        ],
        **fields,
    )
    options = dict(DEFAULT_OPTIONS)
    options.update(decode_options(msg.options))
    return StepPlan(native, None, msg.chunk_size, options, wall_seconds, call_plans)


def stats_message(batch: RolloutBatch | None, **seconds) -> pb.PlanStats:
    msg = pb.PlanStats(**{k: v for k, v in seconds.items()})
    if batch is not None:
        msg.trajectories = batch.num_trajectories
        msg.semantic_tokens = batch.semantic_tokens
        msg.compact_tokens = batch.compact_tokens
        msg.segments = batch.num_segments
    return msg


def stats_dict(msg: pb.PlanStats) -> dict:
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}
