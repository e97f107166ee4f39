"""`CallPlan`: the minimum-call plan of one microbatch and its compact physical layout.

Glossary (Section 3.3 and Section 4.2 of the paper; ``min_call.h`` and ``call_layout.h``):

* ``B`` (``chunk_size``): the linear-attention chunk size; anchors ``a(p) = B * (p // B)``.
  Positions are absolute 0-based positions in a trajectory.
* segment ``v = [s_v, e_v)``: a fork-free path of the microbatch's compact trie (it also ends
  where a trajectory ends). Segments are numbered in lexicographic preorder.
* row: a compact row of the *microbatch* (one unique prefix of its trajectories), numbered
  like the segments; :attr:`CallPlan.row_to_global` maps it to the batch's compact row
  (``RolloutBatch.compact_map`` numbering).
* round ``r`` (0-based; the paper's "Call r+1"): one packed varlen linear-attention call.
* sequence ``q``: one packed input of a round, a chain of direct continuations. It starts from
  the state ``S_b`` at its anchor ``b = a(s_head)`` (zero when ``b == 0``, else a state slot
  returned by a sequence of an earlier round), replays the ancestor rows at positions
  ``[b, s_head)`` (state updates only, no outputs), then outputs its own rows.
* physical row: the order shared by every layer. Own rows of a sequence are contiguous,
  sequences of a round adjacent, rounds in order.
* packed input of round ``r``: per sequence, its replay rows then its own rows.

The contract with a runtime
---------------------------
A plan has two parts, in these objects and in the wire message ``harts.planner.v1.CallPlan``:

* the *layout* (:class:`CallLayout`, :data:`SCALAR_FIELDS` + :data:`LAYOUT_FIELDS`: 8 scalars and
  27 arrays): everything a runtime reads to run the microbatch (``harts_runtime.layout`` accepts any
  object with these attributes; a :class:`CallPlan` is one);
* the *debug* part (:class:`CallPlanDebug`, :data:`DEBUG_FIELDS`: 19 arrays): Algorithm 1's internal
  choices (the dynamic program, the recovered chains, the slot producers), for tests, viewers and
  :meth:`CallPlan.to_dict`. A sidecar omits it on request (``omit_debug``; ``debug=False`` in
  :func:`plan_calls` and :meth:`harts_planner.Planner.plan_calls`).

A :class:`CallPlan` exposes every array of both parts under its wire name.
"""

from __future__ import annotations

import types
import warnings

import numpy as np

from harts_planner import _native, checks
from harts_planner.errors import HartsError, InvalidArgumentError, cancel_token, invalid, renamed
from harts_planner.fields import NativeField

MAX_CHUNK_SIZE: int = checks.MAX_CHUNK_SIZE
MAX_CONV_WIDTH: int = checks.MAX_CONV_WIDTH
#: Defaults of every ``chunk_size`` / ``conv_width`` argument (and of a request's unset field).
DEFAULT_CHUNK_SIZE: int = 64
DEFAULT_CONV_WIDTH: int = 4

_I32, _I64 = np.dtype("<i4"), np.dtype("<i8")

#: Scalars of a call plan (names of the native plan, of the wire message and of the attributes);
#: all of them belong to the layout.
SCALAR_FIELDS: tuple[str, ...] = (
    "chunk_size",
    "conv_width",
    "num_calls",
    "replay_tokens",
    "compact_tokens",
    "num_segments",
    "num_sequences",
    "num_state_slots",
)

#: The layout: the arrays a runtime reads (``harts_runtime.layout.CallLayoutArrays``). Name on the
#: native plan, field of the wire message ``harts.planner.v1.CallPlan`` and attribute of
#: :class:`CallLayout` / :class:`CallPlan` -> little-endian dtype.
LAYOUT_FIELDS: dict[str, np.dtype] = {
    # segment forest
    "segment_start": _I32,
    "segment_end": _I32,
    "segment_parent": _I32,
    "segment_child_offsets": _I64,
    "segment_children": _I32,
    "segment_roots": _I32,
    "segment_physical_begin": _I32,
    # rounds and state handoffs
    "round_sequence_offsets": _I32,
    "sequence_state_slot": _I32,
    "sequence_request_offsets": _I32,
    "request_sequence": _I32,
    "request_chunk": _I32,
    "request_slot": _I32,
    # physical layout
    "row_to_physical": _I32,
    "position_ids": _I32,
    "sequence_physical_offsets": _I32,
    "packed_offsets": _I64,
    "gather_index": _I32,
    "packed_output_row": _I32,
    "cu_offsets": _I32,
    "cu_seqlens": _I32,
    "own_conv_context": _I32,
    # links to the batch
    "trajectories": _I32,
    "row_to_global": _I32,
    "physical_to_global": _I32,
    "semantic_offsets": _I64,
    "semantic_to_physical": _I32,
}

#: The debug part: Algorithm 1's internal choices (the T_pre / T_in program, chains, slot producers),
#: name -> little-endian dtype as in :data:`LAYOUT_FIELDS`. No runtime needs them.
DEBUG_FIELDS: dict[str, np.dtype] = {
    "segment_row_begin": _I64,
    "t_pre": _I32,
    "t_in": _I32,
    "direct_child": _I32,
    "segment_sequence": _I32,
    "sequence_round": _I32,
    "sequence_chain_offsets": _I32,
    "sequence_chain": _I32,
    "sequence_anchor": _I32,
    "sequence_start": _I32,
    "sequence_end": _I32,
    "slot_producer": _I32,
    "slot_position": _I32,
    "slot_segment": _I32,
    "physical_to_row": _I32,
    "round_physical_offsets": _I32,
    "request_position": _I32,
    "sequence_replay_length": _I32,
    "conv_context": _I32,
}

#: Every array of a call plan (:data:`LAYOUT_FIELDS` then :data:`DEBUG_FIELDS`): equality and the
#: wire codec use this table.
ARRAY_FIELDS: dict[str, np.dtype] = {**LAYOUT_FIELDS, **DEBUG_FIELDS}


def _links(shape, n: int) -> int:
    return n if shape.batch_links else 0


#: Length of every array of :data:`ARRAY_FIELDS` from a plan's shape (``harts_planner._native.CallShape``,
#: ``harts/plan_cost.h``: V ``segments``, C ``rows``, R ``replay_rows``, Q ``sequences``, the
#: ``roots``, K ``rounds``, P ``state_slots``, k ``trajectories``, S_M ``semantic_tokens``) and the
#: convolution context ``w - 1``, as ``(part linear in the shape, constant per plan)``: the length is
#: ``linear(shape, context) + constant``, and for a sum of shapes over ``plans`` plans the summed
#: lengths are ``linear(sum, context) + plans * constant``. The batch links are empty for a bare
#: forest. For an exact shape every length is the plan's own, except those counted by K and P, and
#: ``segment_children`` (V - roots), which are bounds (tests/planner/test_cost.py).
ARRAY_LENGTHS: dict[str, tuple] = {
    "segment_start": (lambda s, c: s.segments, 0),
    "segment_end": (lambda s, c: s.segments, 0),
    "segment_parent": (lambda s, c: s.segments, 0),
    "segment_child_offsets": (lambda s, c: s.segments, 1),
    "segment_children": (lambda s, c: s.segments, 0),
    "segment_roots": (lambda s, c: s.roots, 0),
    "segment_physical_begin": (lambda s, c: s.segments, 0),
    "round_sequence_offsets": (lambda s, c: s.rounds, 1),
    "sequence_state_slot": (lambda s, c: s.sequences, 0),
    "sequence_request_offsets": (lambda s, c: s.sequences, 1),
    "request_sequence": (lambda s, c: s.state_slots, 0),
    "request_chunk": (lambda s, c: s.state_slots, 0),
    "request_slot": (lambda s, c: s.state_slots, 0),
    "row_to_physical": (lambda s, c: s.rows, 0),
    "position_ids": (lambda s, c: s.rows, 0),
    "sequence_physical_offsets": (lambda s, c: s.sequences, 1),
    "packed_offsets": (lambda s, c: s.rounds, 1),
    "gather_index": (lambda s, c: s.rows + s.replay_rows, 0),
    "packed_output_row": (lambda s, c: s.rows + s.replay_rows, 0),
    "cu_offsets": (lambda s, c: s.rounds, 1),
    "cu_seqlens": (lambda s, c: s.sequences + s.rounds, 0),
    "own_conv_context": (lambda s, c: s.sequences * c, 0),
    "trajectories": (lambda s, c: s.trajectories, 0),
    "row_to_global": (lambda s, c: _links(s, s.rows), 0),
    "physical_to_global": (lambda s, c: _links(s, s.rows), 0),
    "semantic_offsets": (lambda s, c: _links(s, s.trajectories + 1), 0),
    "semantic_to_physical": (lambda s, c: s.semantic_tokens, 0),
    "segment_row_begin": (lambda s, c: s.segments, 0),
    "t_pre": (lambda s, c: s.segments, 0),
    "t_in": (lambda s, c: s.segments, 0),
    "direct_child": (lambda s, c: s.segments, 0),
    "segment_sequence": (lambda s, c: s.segments, 0),
    "sequence_round": (lambda s, c: s.sequences, 0),
    "sequence_chain_offsets": (lambda s, c: s.sequences, 1),
    "sequence_chain": (lambda s, c: s.segments, 0),
    "sequence_anchor": (lambda s, c: s.sequences, 0),
    "sequence_start": (lambda s, c: s.sequences, 0),
    "sequence_end": (lambda s, c: s.sequences, 0),
    "slot_producer": (lambda s, c: s.state_slots, 0),
    "slot_position": (lambda s, c: s.state_slots, 0),
    "slot_segment": (lambda s, c: s.state_slots, 0),
    "physical_to_row": (lambda s, c: s.rows, 0),
    "round_physical_offsets": (lambda s, c: s.rounds, 1),
    "request_position": (lambda s, c: s.state_slots, 0),
    "sequence_replay_length": (lambda s, c: s.sequences, 0),
    "conv_context": (lambda s, c: s.sequences * c, 0),
}

#: Protobuf framing of one ``bytes`` field (a tag of at most 2 bytes, a length of at most 5) and of
#: one ``int64`` or ``bool`` scalar (tag and varint, at most 11 bytes).
_BYTES_FIELD_FRAMING, _SCALAR_FRAMING = 7, 11


def wire_bytes(shape, conv_width: int, debug: bool = True, plans: int = 1) -> int:
    """Upper bound on the serialized size of the ``harts.planner.v1.CallPlan`` message(s) of a plan
    of ``shape``, or of ``plans`` plans whose shapes sum to ``shape``: every array's bytes
    (:data:`ARRAY_LENGTHS` times its dtype's size; the debug arrays only when ``debug``) and
    framing, the scalars and ``debug_omitted``. O(1)."""
    context = conv_width - 1
    fields = ARRAY_FIELDS if debug else LAYOUT_FIELDS
    payload = sum(
        (ARRAY_LENGTHS[name][0](shape, context) + plans * ARRAY_LENGTHS[name][1]) * dtype.itemsize
        for name, dtype in fields.items()
    )
    framing = len(fields) * _BYTES_FIELD_FRAMING + (len(SCALAR_FIELDS) + 1) * _SCALAR_FRAMING
    return payload + plans * framing


def debug_omitted(name: str) -> InvalidArgumentError:
    """The error raised on reading the debug part of a plan received without it (field ``debug``)."""
    return invalid(
        "debug",
        f"this plan was received without its debug part (omit_debug), so {name} is not available; "
        "request the plan with debug=True",
    )


class _LayoutOnly:
    """Stand-in for a native plan whose debug arrays were omitted: holds the scalars and the layout
    arrays; reading a debug array raises :func:`debug_omitted`."""

    def __init__(self, fields: dict):
        self.__dict__.update(fields)

    @classmethod
    def of(cls, native) -> _LayoutOnly:
        return cls({f: getattr(native, f) for f in (*SCALAR_FIELDS, *LAYOUT_FIELDS)})

    def __getattr__(self, name: str):  # only called for names not set: the omitted debug arrays
        if name in DEBUG_FIELDS:
            raise debug_omitted(name)
        raise AttributeError(name)


class _PlanPart:
    """A view of some of a native plan's attributes (``_FIELDS``), compared field by field."""

    __slots__ = ("_native",)
    _FIELDS: tuple[str, ...] = ()

    def __init__(self, native):
        self._native = native

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(np.array_equal(getattr(self, f), getattr(other, f)) for f in self._FIELDS)

    # Unhashable (the data model's spelling); typeshed types object.__hash__ as a method only.
    __hash__ = None  # pyright: ignore[reportAssignmentType]


class CallLayout(_PlanPart):
    """The layout of a call plan: what a runtime reads (:attr:`CallPlan.layout`).

    The 8 scalars of :data:`SCALAR_FIELDS` and the 27 arrays of :data:`LAYOUT_FIELDS`, nothing else:
    read-only numpy views of the plan's memory (no copies). Shapes use ``V`` segments, ``C`` compact
    rows, ``Q`` sequences, ``K`` rounds (= :attr:`num_calls`), ``P`` state slots, ``R`` replayed rows,
    ``k`` microbatch trajectories, ``w`` the convolution width. Two layouts compare equal (``==``)
    when every field is equal.
    """

    __slots__ = ()
    _FIELDS = (*SCALAR_FIELDS, *LAYOUT_FIELDS)

    # ------------------------------------------------------------------ scalars
    chunk_size = NativeField("B.")
    conv_width = NativeField("w: causal-convolution width used for the convolution contexts.")
    num_calls = NativeField(
        "K: number of rounds (packed calls), the maximum of ``T_pre(root)`` over the trees."
    )
    replay_tokens = NativeField(
        "R (Equation 15): replayed state-update positions, independent of the choices."
    )
    compact_tokens = NativeField("C: compact rows of the microbatch (Equation 5 on its trajectories).")
    num_segments = NativeField("V.")
    num_sequences = NativeField("Q.")
    num_state_slots = NativeField(
        "P: boundary states handed from one round to a later one (size of a state buffer)."
    )

    # ------------------------------------------------------------------ segment forest
    segment_start = NativeField("int32 [V]: s_v.")
    segment_end = NativeField("int32 [V]: e_v.")
    segment_parent = NativeField("int32 [V]: parent segment, -1 for a root.")
    segment_child_offsets = NativeField("int64 [V + 1]: CSR offsets into :attr:`segment_children`.")
    segment_children = NativeField("int32: children of each segment in the fixed child order of Algorithm 1.")
    segment_roots = NativeField("int32: root segments (one per tree of the microbatch).")
    segment_physical_begin = NativeField(
        "int32 [V]: first physical row of each segment (its rows are contiguous)."
    )

    # ------------------------------------------------------------------ rounds and state handoffs
    round_sequence_offsets = NativeField(
        "int32 [K + 1]: the sequences of round r are ``[offsets[r], offsets[r + 1])``."
    )
    sequence_state_slot = NativeField(
        "int32 [Q]: state-consume table, the slot each sequence starts from; -1 = zero state."
    )
    sequence_request_offsets = NativeField(
        "int32 [Q + 1]: CSR offsets of each sequence's rows in the request table."
    )
    request_sequence = NativeField("int32 [P]: state-request table, producing sequence (sorted).")
    request_chunk = NativeField(
        "int32 [P]: the requested boundary as a chunk index of the producer's packed sequence, "
        "``(position - anchor) / B`` (>= 1)."
    )
    request_slot = NativeField("int32 [P]: slot id into a state buffer of :attr:`num_state_slots` entries.")

    # ------------------------------------------------------------------ physical layout
    row_to_physical = NativeField("int32 [C]: physical row of each microbatch row.")
    position_ids = NativeField("int32 [C]: absolute trajectory position of every physical row (for RoPE).")
    sequence_physical_offsets = NativeField(
        "int32 [Q + 1]: own rows of sequence q are physical ``[offsets[q], offsets[q + 1])``."
    )
    packed_offsets = NativeField(
        "int64 [K + 1]: round r's packed rows are ``[offsets[r], offsets[r + 1])`` of "
        ":attr:`gather_index` / :attr:`packed_output_row`; total ``C + R``."
    )
    gather_index = NativeField(
        "int32 [C + R]: physical row read by every packed row, all rounds concatenated "
        "(replay rows read their ancestor's physical row)."
    )
    packed_output_row = NativeField(
        "int32 [C + R]: physical row each packed output is written to; -1 for replay rows."
    )
    cu_offsets = NativeField(
        "int32 [K + 1]: round r's cu_seqlens are ``cu_seqlens[cu_offsets[r]:cu_offsets[r+1]]``."
    )
    cu_seqlens = NativeField(
        "int32 [Q + K]: every round's cu_seqlens (from 0, replay rows included), concatenated."
    )

    @property
    def own_conv_context(self) -> np.ndarray:
        """int32 [Q, w - 1]: physical rows of the w - 1 true ancestors before each sequence's first
        *own* row (positions ``[start - w + 1, start)``), oldest first; -1 where the position would
        be negative. For a runtime that convolves only own rows and gathers the replay rows'
        existing post-convolution results (Section 4.2)."""
        n = self._native
        return n.own_conv_context.reshape(n.num_sequences, n.conv_width - 1)

    # ------------------------------------------------------------------ links to the batch
    trajectories = NativeField("int32 [k]: the microbatch's trajectory ids, in the caller's order.")
    row_to_global = NativeField(
        "int32 [C]: batch compact row of each microbatch row (empty for a bare forest)."
    )
    physical_to_global = NativeField(
        "int32 [C]: batch compact row of each physical row, to gather hidden states."
    )
    semantic_offsets = NativeField("int64 [k + 1]: prefix sums of the trajectories' lengths.")
    semantic_to_physical = NativeField(
        "int32 [sum of lengths]: physical row of position p of ``trajectories[j]`` at "
        "``semantic_offsets[j] + p``."
    )

    def __repr__(self) -> str:
        return (
            f"CallLayout(num_calls={self.num_calls}, compact_tokens={self.compact_tokens}, "
            f"replay_tokens={self.replay_tokens}, sequences={self.num_sequences})"
        )


class CallPlanDebug(_PlanPart):
    """The debug part of a call plan: Algorithm 1's internal choices (:attr:`CallPlan.debug`).

    The 19 arrays of :data:`DEBUG_FIELDS` (read-only views; shapes as in :class:`CallLayout`) and the
    helpers that read only them. A runtime needs none of it; tests, viewers and
    :meth:`CallPlan.to_dict` do. Two debug parts compare equal when every array is equal.
    """

    __slots__ = ()
    _FIELDS = tuple(DEBUG_FIELDS)

    # ------------------------------------------------------------------ segment rows
    segment_row_begin = NativeField("int64 [V]: segment v holds rows ``[row_begin, row_begin + e_v - s_v)``.")

    # ------------------------------------------------------------------ dynamic program
    t_pre = NativeField("int32 [V]: T_pre (Equation 14).")
    t_in = NativeField("int32 [V]: T_in (Equation 13).")
    direct_child = NativeField("int32 [V]: the chosen direct continuation, -1 for a leaf.")
    segment_sequence = NativeField("int32 [V]: the sequence that outputs each segment.")

    # ------------------------------------------------------------------ sequences
    sequence_round = NativeField("int32 [Q]: round of each sequence (non-decreasing).")
    sequence_chain_offsets = NativeField("int32 [Q + 1]: CSR offsets into :attr:`sequence_chain`.")
    sequence_chain = NativeField("int32 [V]: each sequence's segments (direct continuations), head first.")
    sequence_anchor = NativeField(
        "int32 [Q]: b, the position of the initial state; the replay is ``[b, start)``."
    )
    sequence_start = NativeField("int32 [Q]: s_head, the first own position.")
    sequence_end = NativeField("int32 [Q]: end position of the chain's leaf.")
    sequence_replay_length = NativeField(
        "int32 [Q]: ``start - anchor`` (= start mod B), the replay rows of each sequence."
    )

    def chain(self, q: int) -> np.ndarray:
        """Segments of sequence ``q``, ``0 <= q < Q`` (InvalidArgumentError naming ``q`` otherwise)."""
        q = checks.index(q, "q", self._native.num_sequences)
        o = self.sequence_chain_offsets
        return self.sequence_chain[o[q] : o[q + 1]]

    # ------------------------------------------------------------------ state slots
    slot_producer = NativeField("int32 [P]: producing sequence of each slot.")
    slot_position = NativeField("int32 [P]: absolute position of each slot's state.")
    slot_segment = NativeField("int32 [P]: the producer's segment holding position ``slot_position - 1``.")
    request_position = NativeField("int32 [P]: absolute chunk-boundary position of each requested state.")

    # ------------------------------------------------------------------ physical layout
    physical_to_row = NativeField("int32 [C]: microbatch row stored at each physical row.")
    round_physical_offsets = NativeField(
        "int32 [K + 1]: own rows of round r are physical ``[offsets[r], offsets[r + 1])``."
    )

    @property
    def conv_context(self) -> np.ndarray:
        """int32 [Q, w - 1]: physical rows of the w - 1 true ancestors before each sequence's first
        *packed* row (positions ``[anchor - w + 1, anchor)``), oldest first; -1 where the position
        would be negative."""
        n = self._native
        return n.conv_context.reshape(n.num_sequences, n.conv_width - 1)


class CallPlan(CallLayout, CallPlanDebug):
    """The rounds, sequences, state handoffs and physical layout of one microbatch.

    Build one with :func:`plan_calls` (or :func:`plan_segment_forest`, or a
    :class:`harts_planner.Planner`). Every array attribute is a read-only numpy view of memory owned
    by the C++ plan (no copies), or of the response bytes for a plan received from a sidecar.
    Shapes use ``V`` segments, ``C`` compact rows, ``Q`` sequences, ``K`` rounds
    (= :attr:`num_calls`), ``P`` state slots, ``w`` the convolution width.

    The plan is its :attr:`layout` (what a runtime reads) and its :attr:`debug` part (Algorithm 1's
    choices); every array of both is also an attribute of the plan itself, by its wire name. A plan
    received with ``debug=False`` has no debug part: :attr:`debug`, its arrays and the descriptions
    that read them (:meth:`to_dict`) raise :class:`~harts_planner.InvalidArgumentError` on field
    ``debug``.

    Two plans compare equal (``==``) when both have the debug part or neither has, and every scalar
    of :data:`SCALAR_FIELDS` and every array of :data:`ARRAY_FIELDS` they have is equal.
    """

    #: The sidecar's statistics of the call (``PlanStats`` fields), on a plan received from one only.
    server_stats: dict

    def __init__(self, native):
        self._native = native

    @classmethod
    def from_fields(cls, fields: dict) -> CallPlan:
        """A plan over already decoded values (the wire codec's): every scalar of
        :data:`SCALAR_FIELDS` and array of :data:`LAYOUT_FIELDS`, and either every array of
        :data:`DEBUG_FIELDS` or none of them (a plan without its debug part). Arrays are used as
        given (they should be read-only, of the tables' dtypes); own_conv_context and conv_context
        flat, ``Q * (w - 1)`` values. Raises ValueError naming a missing field."""
        missing = [f for f in (*SCALAR_FIELDS, *LAYOUT_FIELDS) if f not in fields]
        debug = [f for f in DEBUG_FIELDS if f in fields]
        if not missing and debug and len(debug) < len(DEBUG_FIELDS):
            missing = [f for f in DEBUG_FIELDS if f not in fields]
        if missing:
            raise ValueError(f"{missing[0]}: missing from the plan's fields")
        return cls(types.SimpleNamespace(**fields) if debug else _LayoutOnly(dict(fields)))

    def __eq__(self, other) -> bool:
        if not isinstance(other, CallPlan):
            return NotImplemented
        if self.has_debug != other.has_debug:
            return False
        a, b = self._native, other._native
        arrays = ARRAY_FIELDS if self.has_debug else LAYOUT_FIELDS
        return all(getattr(a, f) == getattr(b, f) for f in SCALAR_FIELDS) and all(
            np.array_equal(getattr(a, f), getattr(b, f)) for f in arrays
        )

    __hash__ = None  # mutable-looking value object: equality by content, no hashing

    # ------------------------------------------------------------------ parts
    @property
    def layout(self) -> CallLayout:
        """The layout (:class:`CallLayout`): the 8 scalars and 27 arrays a runtime reads."""
        return CallLayout(self._native)

    @property
    def has_debug(self) -> bool:
        """False for a plan received from a sidecar with ``debug=False`` (``omit_debug``)."""
        return not isinstance(self._native, _LayoutOnly)

    @property
    def debug(self) -> CallPlanDebug:
        """The debug part (:class:`CallPlanDebug`): Algorithm 1's internal choices.

        Raises InvalidArgumentError (field ``debug``) for a plan received without it."""
        if not self.has_debug:
            raise debug_omitted("CallPlan.debug")
        return CallPlanDebug(self._native)

    def without_debug(self) -> CallPlan:
        """The same plan without its debug part, as a sidecar returns it for ``omit_debug``
        (the layout arrays are shared, not copied)."""
        return self if not self.has_debug else CallPlan(_LayoutOnly.of(self._native))

    # ------------------------------------------------------------------ helpers over the layout
    def children(self, v: int) -> np.ndarray:
        """Children of segment ``v``, ``0 <= v < V`` (InvalidArgumentError naming ``v`` otherwise)."""
        v = checks.index(v, "v", self.num_segments)
        o = self.segment_child_offsets
        return self.segment_children[o[v] : o[v + 1]]

    def round_cu_seqlens(self, r: int) -> np.ndarray:
        """int32 [n_r + 1]: cu_seqlens of round ``r`` (starting at 0, replay rows included)."""
        self._check_round(r)
        o = self.cu_offsets
        return self.cu_seqlens[o[r] : o[r + 1]]

    def round_gather_index(self, r: int) -> np.ndarray:
        """int32: physical rows forming round ``r``'s packed input."""
        self._check_round(r)
        o = self.packed_offsets
        return self.gather_index[o[r] : o[r + 1]]

    def round_output_row(self, r: int) -> np.ndarray:
        """int32: physical row written by each packed row of round ``r`` (-1 for replay)."""
        self._check_round(r)
        o = self.packed_offsets
        return self.packed_output_row[o[r] : o[r + 1]]

    def _check_round(self, r: int) -> None:
        checks.index(r, "round", self.num_calls)

    # ------------------------------------------------------------------ description
    def sequence_dict(self, q: int) -> dict:
        """JSON-able description of sequence ``q``, ``0 <= q < Q`` (reads the debug part)."""
        q = checks.index(q, "q", self.num_sequences)
        slot = int(self.sequence_state_slot[q])
        ro = self.sequence_request_offsets
        requests = [
            {
                "slot": int(self.request_slot[i]),
                "position": int(self.request_position[i]),
                "chunk": int(self.request_chunk[i]),
            }
            for i in range(int(ro[q]), int(ro[q + 1]))
        ]
        return {
            "id": q,
            "round": int(self.sequence_round[q]),
            "segments": [int(v) for v in self.chain(q)],
            "positions": [int(self.sequence_start[q]), int(self.sequence_end[q])],
            "initial_state": None
            if slot < 0
            else {
                "slot": slot,
                "source_sequence": int(self.slot_producer[slot]),
                "position": int(self.slot_position[slot]),
            },
            "replay": [int(self.sequence_anchor[q]), int(self.sequence_start[q])],
            "replay_tokens": int(self.sequence_replay_length[q]),
            "own_tokens": int(self.sequence_physical_offsets[q + 1] - self.sequence_physical_offsets[q]),
            "returns": requests,
        }

    def to_dict(self, segments: bool = True) -> dict:
        """JSON-able description: scalars, rounds with their sequences and, when ``segments``,
        one entry per segment (start, end, parent, T_pre, T_in, sequence). Reads the debug part."""
        rounds = []
        so = self.round_sequence_offsets
        for r in range(self.num_calls):
            seqs = [self.sequence_dict(q) for q in range(int(so[r]), int(so[r + 1]))]
            rounds.append(
                {
                    "round": r,
                    "sequences": seqs,
                    "packed_tokens": int(self.packed_offsets[r + 1] - self.packed_offsets[r]),
                    "replay_tokens": sum(s["replay_tokens"] for s in seqs),
                }
            )
        out = {
            "chunk_size": self.chunk_size,
            "conv_width": self.conv_width,
            "num_calls": self.num_calls,
            "replay_tokens": self.replay_tokens,
            "compact_tokens": self.compact_tokens,
            "num_sequences": self.num_sequences,
            "num_state_slots": self.num_state_slots,
            "rounds": rounds,
        }
        if segments:
            out["segments"] = [
                {
                    "id": v,
                    "start": int(self.segment_start[v]),
                    "end": int(self.segment_end[v]),
                    "parent": int(self.segment_parent[v]),
                    "t_pre": int(self.t_pre[v]),
                    "t_in": int(self.t_in[v]),
                    "sequence": int(self.segment_sequence[v]),
                }
                for v in range(self.num_segments)
            ]
        return out

    def __repr__(self) -> str:
        return (
            f"CallPlan(num_calls={self.num_calls}, replay_tokens={self.replay_tokens}, "
            f"compact_tokens={self.compact_tokens}, sequences={self.num_sequences}, "
            f"chunk_size={self.chunk_size})"
        )


def plan_calls(
    batch,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    microbatch=None,
    conv_width: int = DEFAULT_CONV_WIDTH,
    cancel=None,
    *,
    debug: bool = True,
    trajectories=None,
) -> CallPlan:
    """Minimum-call plan and compact physical layout of one microbatch (Algorithm 1).

    Parameters
    ----------
    batch : RolloutBatch
        The ingested batch.
    chunk_size : int
        B, in ``[1, MAX_CHUNK_SIZE]`` (2^20).
    microbatch : array_like of int, shape [k], optional
        The microbatch: distinct trajectory indices of ``batch`` (any order; the order is kept
        for :attr:`CallPlan.semantic_to_physical`). ``None`` plans the whole batch. The same name as
        :meth:`harts_planner.Planner.plan_calls`, :func:`harts_planner.estimate_cost` and the
        PlanCalls request.
    conv_width : int
        w, in ``[1, MAX_CONV_WIDTH]``; sets the shape of :attr:`CallPlan.conv_context`.
    cancel : CancelToken, optional
        Stops the planning within milliseconds once cancelled or past its deadline.
    debug : bool, default True
        False returns the plan without its debug part (:meth:`CallPlan.without_debug`: the layout a
        runtime reads), as ``Planner.plan_calls(..., debug=False)`` does.
    trajectories : array_like of int, optional
        Deprecated spelling of ``microbatch`` (a DeprecationWarning; not both).

    Returns
    -------
    CallPlan

    Raises
    ------
    InvalidArgumentError
        ``batch`` not a RolloutBatch; ``chunk_size`` or ``conv_width`` out of range or not an
        integer; ``microbatch`` empty, not 1-D integers, an index out of range (``microbatch[j]``)
        or repeated; ``cancel`` not a CancelToken; ``debug`` not a bool.
    ResourceLimitError
        A round packs more than 2^31 - 1 rows (``chunk_size``), or the plan would allocate more
        than :func:`max_plan_bytes` (``microbatch``, or ``trajectories`` for the whole batch;
        :func:`harts_planner.estimate_cost` tells beforehand).
    PlanCancelledError
        ``cancel`` fired.

    Costs O(k log k + C + R + S_M) for the microbatch's k trajectories, C rows, R replay rows and
    S_M tokens, whatever the size of the batch. The GIL is released while planning.
    """
    if trajectories is not None:
        if microbatch is not None:
            raise invalid("trajectories", "is the old name of microbatch; pass microbatch alone")
        warnings.warn(
            "plan_calls(trajectories=...) is deprecated: pass microbatch=...",
            DeprecationWarning,
            stacklevel=2,
        )
        microbatch = trajectories
    if not isinstance(getattr(batch, "_native", None), _native.CompactBatch):
        raise invalid("batch", f"must be a RolloutBatch, got {type(batch).__name__}")
    chunk_size = checks.chunk_size(chunk_size)
    conv_width = checks.conv_width(conv_width)
    debug = checks.boolean(debug, "debug")
    ids = None if microbatch is None else checks.trajectory_ids(microbatch, "microbatch")
    try:
        plan = CallPlan(_native.plan_calls(batch._native, chunk_size, ids, conv_width, cancel_token(cancel)))
    except HartsError as e:
        # The core names a microbatch's element ``trajectories[j]``; here it is ``microbatch[j]``.
        raise (e if ids is None else renamed(e, {"trajectories": "microbatch"})) from None
    return plan if debug else plan.without_debug()


def plan_segment_forest(
    parent,
    start,
    end,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    conv_width: int = DEFAULT_CONV_WIDTH,
    cancel=None,
) -> CallPlan:
    """Plan an already compacted segment forest (no token batch): per segment its parent
    (-1 for a root), start and end positions. Children follow increasing id; rows are numbered
    in DFS preorder. The batch links (:attr:`CallPlan.row_to_global`, semantic maps) are empty.

    Raises InvalidArgumentError naming ``parent[i]``, ``start[i]``, ``end[i]``, ``chunk_size``
    or ``conv_width`` (a root must start at 0; a child starts at its parent's end);
    ResourceLimitError naming ``end`` for a plan over :func:`max_plan_bytes`; PlanCancelledError
    when ``cancel`` (a CancelToken) fires. Releases the GIL."""
    chunk_size = checks.chunk_size(chunk_size)
    conv_width = checks.conv_width(conv_width)
    cancel = cancel_token(cancel)
    parent_a, start_a, end_a = (
        checks.int_array(v, np.int32, name)
        for name, v in (("parent", parent), ("start", start), ("end", end))
    )
    return CallPlan(_native.plan_segment_forest(parent_a, start_a, end_a, chunk_size, conv_width, cancel))


def max_plan_bytes() -> int:
    """The most bytes one call plan may allocate (default 16 GiB): :func:`plan_calls` and
    :func:`plan_segment_forest` refuse a larger plan with ResourceLimitError before allocating it
    (the C++ backstop of ``harts/plan_cost.h``; :func:`harts_planner.estimate_cost` computes the
    same bound from a request)."""
    return _native.max_plan_bytes()


def set_max_plan_bytes(limit: int) -> int:
    """Set :func:`max_plan_bytes` for the whole process (``limit >= 1``); returns the previous
    limit. InvalidArgumentError (field ``max_plan_bytes``) for a bad value."""
    return _native.set_max_plan_bytes(checks.int64(limit, "max_plan_bytes", 1))


__all__ = [
    "CallLayout",
    "CallPlan",
    "CallPlanDebug",
    "plan_calls",
    "plan_segment_forest",
    "max_plan_bytes",
    "set_max_plan_bytes",
    "wire_bytes",
    "ARRAY_LENGTHS",
    "MAX_CHUNK_SIZE",
    "MAX_CONV_WIDTH",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_CONV_WIDTH",
    "ARRAY_FIELDS",
    "DEBUG_FIELDS",
    "LAYOUT_FIELDS",
    "SCALAR_FIELDS",
]
