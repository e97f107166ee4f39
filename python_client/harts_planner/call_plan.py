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
"""

from __future__ import annotations

import numpy as np

from harts_planner import _native
from harts_planner.errors import invalid

MAX_CHUNK_SIZE: int = _native.MAX_CHUNK_SIZE
MAX_CONV_WIDTH: int = _native.MAX_CONV_WIDTH

_I32, _I64 = np.dtype("<i4"), np.dtype("<i8")

#: Scalars of a call plan (names of the native plan, of the wire message and of the properties).
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

#: Every array of a call plan: name on the native plan (and field of the wire message
#: ``harts.planner.v1.CallPlan``) -> little-endian dtype. Equality and the wire codec use this table.
ARRAY_FIELDS: dict[str, np.dtype] = {
    "segment_start": _I32,
    "segment_end": _I32,
    "segment_parent": _I32,
    "segment_child_offsets": _I64,
    "segment_children": _I32,
    "segment_roots": _I32,
    "segment_row_begin": _I64,
    "t_pre": _I32,
    "t_in": _I32,
    "direct_child": _I32,
    "segment_sequence": _I32,
    "round_sequence_offsets": _I32,
    "sequence_round": _I32,
    "sequence_chain_offsets": _I32,
    "sequence_chain": _I32,
    "sequence_anchor": _I32,
    "sequence_start": _I32,
    "sequence_end": _I32,
    "sequence_state_slot": _I32,
    "sequence_request_offsets": _I32,
    "slot_producer": _I32,
    "slot_position": _I32,
    "slot_segment": _I32,
    "physical_to_row": _I32,
    "row_to_physical": _I32,
    "position_ids": _I32,
    "segment_physical_begin": _I32,
    "sequence_physical_offsets": _I32,
    "round_physical_offsets": _I32,
    "packed_offsets": _I64,
    "gather_index": _I32,
    "packed_output_row": _I32,
    "cu_offsets": _I32,
    "cu_seqlens": _I32,
    "request_sequence": _I32,
    "request_position": _I32,
    "request_chunk": _I32,
    "request_slot": _I32,
    "sequence_replay_length": _I32,
    "conv_context": _I32,
    "own_conv_context": _I32,
    "trajectories": _I32,
    "row_to_global": _I32,
    "physical_to_global": _I32,
    "semantic_offsets": _I64,
    "semantic_to_physical": _I32,
}


def _check_int(value, field: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise invalid(field, f"must be an integer, got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        raise invalid(field, f"must be in [{lo}, {hi}], got {value}")
    return value


def _int32_ids(values, field: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise invalid(field, f"must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        raise invalid(field, "a microbatch needs at least one trajectory")
    if arr.dtype.kind not in "iu":
        raise invalid(field, f"must hold integers, got dtype {arr.dtype}")
    info = np.iinfo(np.int32)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < info.min or hi > info.max:
        j = int(np.argmax((arr < info.min) | (arr > info.max)))
        raise invalid(f"{field}[{j}]", f"trajectory index {int(arr[j])} is out of range")
    return np.ascontiguousarray(arr, dtype=np.int32)


class CallPlan:
    """The rounds, sequences, state handoffs and physical layout of one microbatch.

    Build one with :func:`plan_calls` (or :func:`plan_segment_forest`, or a
    :class:`harts_planner.Planner`). Every array property is a read-only numpy view of memory owned
    by the C++ plan (no copies), or of the response bytes for a plan received from a sidecar.
    Shapes use ``V`` segments, ``C`` compact rows, ``Q`` sequences, ``K`` rounds
    (= :attr:`num_calls`), ``P`` state slots, ``w`` the convolution width.

    Two plans compare equal (``==``) when every scalar of :data:`SCALAR_FIELDS` and every array of
    :data:`ARRAY_FIELDS` is equal.
    """

    def __init__(self, native):
        self._native = native

    def __eq__(self, other) -> bool:
        if not isinstance(other, CallPlan):
            return NotImplemented
        a, b = self._native, other._native
        return all(getattr(a, f) == getattr(b, f) for f in SCALAR_FIELDS) and all(
            np.array_equal(getattr(a, f), getattr(b, f)) for f in ARRAY_FIELDS
        )

    __hash__ = None  # mutable-looking value object: equality by content, no hashing

    # ------------------------------------------------------------------ scalars
    @property
    def num_calls(self) -> int:
        """K: number of rounds (packed calls), the maximum of ``T_pre(root)`` over the trees."""
        return self._native.num_calls

    @property
    def replay_tokens(self) -> int:
        """R (Equation 15): replayed state-update positions, independent of the choices."""
        return self._native.replay_tokens

    @property
    def compact_tokens(self) -> int:
        """C: compact rows of the microbatch (Equation 5 on its trajectories)."""
        return self._native.compact_tokens

    @property
    def chunk_size(self) -> int:
        """B."""
        return self._native.chunk_size

    @property
    def conv_width(self) -> int:
        """w: causal-convolution width used for :attr:`conv_context`."""
        return self._native.conv_width

    @property
    def num_segments(self) -> int:
        """V."""
        return self._native.num_segments

    @property
    def num_sequences(self) -> int:
        """Q."""
        return self._native.num_sequences

    @property
    def num_state_slots(self) -> int:
        """P: boundary states handed from one round to a later one (size of a state buffer)."""
        return self._native.num_state_slots

    # ------------------------------------------------------------------ segment forest
    @property
    def segment_start(self) -> np.ndarray:
        """int32 [V]: s_v."""
        return self._native.segment_start

    @property
    def segment_end(self) -> np.ndarray:
        """int32 [V]: e_v."""
        return self._native.segment_end

    @property
    def segment_parent(self) -> np.ndarray:
        """int32 [V]: parent segment, -1 for a root."""
        return self._native.segment_parent

    @property
    def segment_child_offsets(self) -> np.ndarray:
        """int64 [V + 1]: CSR offsets into :attr:`segment_children`."""
        return self._native.segment_child_offsets

    @property
    def segment_children(self) -> np.ndarray:
        """int32: children of each segment in the fixed child order of Algorithm 1."""
        return self._native.segment_children

    @property
    def segment_roots(self) -> np.ndarray:
        """int32: root segments (one per tree of the microbatch)."""
        return self._native.segment_roots

    @property
    def segment_row_begin(self) -> np.ndarray:
        """int64 [V]: segment v holds rows ``[row_begin, row_begin + e_v - s_v)``."""
        return self._native.segment_row_begin

    def children(self, v: int) -> np.ndarray:
        """Children of segment ``v``."""
        o = self.segment_child_offsets
        return self.segment_children[o[v] : o[v + 1]]

    # ------------------------------------------------------------------ dynamic program
    @property
    def t_pre(self) -> np.ndarray:
        """int32 [V]: T_pre (Equation 14)."""
        return self._native.t_pre

    @property
    def t_in(self) -> np.ndarray:
        """int32 [V]: T_in (Equation 13)."""
        return self._native.t_in

    @property
    def direct_child(self) -> np.ndarray:
        """int32 [V]: the chosen direct continuation, -1 for a leaf."""
        return self._native.direct_child

    @property
    def segment_sequence(self) -> np.ndarray:
        """int32 [V]: the sequence that outputs each segment."""
        return self._native.segment_sequence

    # ------------------------------------------------------------------ sequences
    @property
    def round_sequence_offsets(self) -> np.ndarray:
        """int32 [K + 1]: the sequences of round r are ``[offsets[r], offsets[r + 1])``."""
        return self._native.round_sequence_offsets

    @property
    def sequence_round(self) -> np.ndarray:
        """int32 [Q]: round of each sequence (non-decreasing)."""
        return self._native.sequence_round

    @property
    def sequence_chain_offsets(self) -> np.ndarray:
        """int32 [Q + 1]: CSR offsets into :attr:`sequence_chain`."""
        return self._native.sequence_chain_offsets

    @property
    def sequence_chain(self) -> np.ndarray:
        """int32 [V]: each sequence's segments (direct continuations), head first."""
        return self._native.sequence_chain

    def chain(self, q: int) -> np.ndarray:
        """Segments of sequence ``q``."""
        o = self.sequence_chain_offsets
        return self.sequence_chain[o[q] : o[q + 1]]

    @property
    def sequence_anchor(self) -> np.ndarray:
        """int32 [Q]: b, the position of the initial state; the replay is ``[b, start)``."""
        return self._native.sequence_anchor

    @property
    def sequence_start(self) -> np.ndarray:
        """int32 [Q]: s_head, the first own position."""
        return self._native.sequence_start

    @property
    def sequence_end(self) -> np.ndarray:
        """int32 [Q]: end position of the chain's leaf."""
        return self._native.sequence_end

    @property
    def sequence_replay_length(self) -> np.ndarray:
        """int32 [Q]: ``start - anchor`` (= start mod B), the replay rows of each sequence."""
        return self._native.sequence_replay_length

    @property
    def sequence_state_slot(self) -> np.ndarray:
        """int32 [Q]: state-consume table, the slot each sequence starts from; -1 = zero state."""
        return self._native.sequence_state_slot

    @property
    def sequence_request_offsets(self) -> np.ndarray:
        """int32 [Q + 1]: CSR offsets of each sequence's rows in the request table."""
        return self._native.sequence_request_offsets

    # ------------------------------------------------------------------ state handoff
    @property
    def request_sequence(self) -> np.ndarray:
        """int32 [P]: state-request table, producing sequence (sorted)."""
        return self._native.request_sequence

    @property
    def request_position(self) -> np.ndarray:
        """int32 [P]: absolute chunk-boundary position of the requested state."""
        return self._native.request_position

    @property
    def request_chunk(self) -> np.ndarray:
        """int32 [P]: the same boundary as a chunk index of the producer's packed sequence,
        ``(position - anchor) / B`` (>= 1)."""
        return self._native.request_chunk

    @property
    def request_slot(self) -> np.ndarray:
        """int32 [P]: slot id into a state buffer of :attr:`num_state_slots` entries."""
        return self._native.request_slot

    @property
    def slot_producer(self) -> np.ndarray:
        """int32 [P]: producing sequence of each slot."""
        return self._native.slot_producer

    @property
    def slot_position(self) -> np.ndarray:
        """int32 [P]: absolute position of each slot's state."""
        return self._native.slot_position

    @property
    def slot_segment(self) -> np.ndarray:
        """int32 [P]: the producer's segment holding position ``slot_position - 1``."""
        return self._native.slot_segment

    # ------------------------------------------------------------------ physical layout
    @property
    def physical_to_row(self) -> np.ndarray:
        """int32 [C]: microbatch row stored at each physical row."""
        return self._native.physical_to_row

    @property
    def row_to_physical(self) -> np.ndarray:
        """int32 [C]: inverse of :attr:`physical_to_row`."""
        return self._native.row_to_physical

    @property
    def position_ids(self) -> np.ndarray:
        """int32 [C]: absolute trajectory position of every physical row (for RoPE)."""
        return self._native.position_ids

    @property
    def row_to_global(self) -> np.ndarray:
        """int32 [C]: batch compact row of each microbatch row (empty for a bare forest)."""
        return self._native.row_to_global

    @property
    def physical_to_global(self) -> np.ndarray:
        """int32 [C]: batch compact row of each physical row, to gather hidden states."""
        return self._native.physical_to_global

    @property
    def segment_physical_begin(self) -> np.ndarray:
        """int32 [V]: first physical row of each segment (its rows are contiguous)."""
        return self._native.segment_physical_begin

    @property
    def sequence_physical_offsets(self) -> np.ndarray:
        """int32 [Q + 1]: own rows of sequence q are physical ``[offsets[q], offsets[q + 1])``."""
        return self._native.sequence_physical_offsets

    @property
    def round_physical_offsets(self) -> np.ndarray:
        """int32 [K + 1]: own rows of round r are physical ``[offsets[r], offsets[r + 1])``."""
        return self._native.round_physical_offsets

    # ------------------------------------------------------------------ packed calls
    @property
    def packed_offsets(self) -> np.ndarray:
        """int64 [K + 1]: round r's packed rows are ``[offsets[r], offsets[r + 1])`` of
        :attr:`gather_index` / :attr:`packed_output_row`; total ``C + R``."""
        return self._native.packed_offsets

    @property
    def gather_index(self) -> np.ndarray:
        """int32 [C + R]: physical row read by every packed row, all rounds concatenated
        (replay rows read their ancestor's physical row)."""
        return self._native.gather_index

    @property
    def packed_output_row(self) -> np.ndarray:
        """int32 [C + R]: physical row each packed output is written to; -1 for replay rows."""
        return self._native.packed_output_row

    @property
    def cu_offsets(self) -> np.ndarray:
        """int32 [K + 1]: round r's cu_seqlens are ``cu_seqlens[cu_offsets[r]:cu_offsets[r+1]]``."""
        return self._native.cu_offsets

    @property
    def cu_seqlens(self) -> np.ndarray:
        """int32 [Q + K]: every round's cu_seqlens, concatenated (round r: :meth:`round_cu_seqlens`)."""
        return self._native.cu_seqlens

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
        if not 0 <= r < self.num_calls:
            raise invalid("round", f"must be in [0, {self.num_calls}), got {r}")

    # ------------------------------------------------------------------ convolution
    @property
    def conv_context(self) -> np.ndarray:
        """int32 [Q, w - 1]: physical rows of the w - 1 true ancestors before each sequence's
        first *packed* row (positions ``[anchor - w + 1, anchor)``), oldest first; -1 where
        the position would be negative."""
        return self._native.conv_context.reshape(self.num_sequences, self.conv_width - 1)

    @property
    def own_conv_context(self) -> np.ndarray:
        """int32 [Q, w - 1]: the same before each sequence's first *own* row (positions
        ``[start - w + 1, start)``), for a runtime that convolves only own rows and gathers the
        replay rows' existing post-convolution results (Section 4.2)."""
        return self._native.own_conv_context.reshape(self.num_sequences, self.conv_width - 1)

    # ------------------------------------------------------------------ semantic positions
    @property
    def trajectories(self) -> np.ndarray:
        """int32 [k]: the microbatch's trajectory ids, in the caller's order."""
        return self._native.trajectories

    @property
    def semantic_offsets(self) -> np.ndarray:
        """int64 [k + 1]: prefix sums of the trajectories' lengths."""
        return self._native.semantic_offsets

    @property
    def semantic_to_physical(self) -> np.ndarray:
        """int32 [sum of lengths]: physical row of position p of ``trajectories[j]`` at
        ``semantic_offsets[j] + p``."""
        return self._native.semantic_to_physical

    # ------------------------------------------------------------------ description
    def sequence_dict(self, q: int) -> dict:
        """JSON-able description of sequence ``q``."""
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
        one entry per segment (start, end, parent, T_pre, T_in, sequence)."""
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


def plan_calls(batch, chunk_size: int = 64, trajectories=None, conv_width: int = 4) -> CallPlan:
    """Minimum-call plan and compact physical layout of one microbatch (Algorithm 1).

    Parameters
    ----------
    batch : RolloutBatch
        The ingested batch.
    chunk_size : int
        B, in ``[1, MAX_CHUNK_SIZE]`` (2^20).
    trajectories : array_like of int, shape [k], optional
        The microbatch: distinct trajectory indices of ``batch`` (any order; the order is kept
        for :attr:`CallPlan.semantic_to_physical`). ``None`` plans the whole batch.
    conv_width : int
        w, in ``[1, MAX_CONV_WIDTH]``; sets the shape of :attr:`CallPlan.conv_context`.

    Returns
    -------
    CallPlan

    Raises
    ------
    InvalidArgumentError
        ``batch`` not a RolloutBatch; ``chunk_size`` or ``conv_width`` out of range or not an
        integer; ``trajectories``
        empty, not 1-D integers, an index out of range (``trajectories[j]``) or repeated.
    ResourceLimitError
        A round packs more than 2^31 - 1 rows.
    """
    if not isinstance(getattr(batch, "_native", None), _native.CompactBatch):
        raise invalid("batch", f"must be a RolloutBatch, got {type(batch).__name__}")
    chunk_size = _check_int(chunk_size, "chunk_size", 1, MAX_CHUNK_SIZE)
    conv_width = _check_int(conv_width, "conv_width", 1, MAX_CONV_WIDTH)
    ids = None if trajectories is None else _int32_ids(trajectories, "trajectories")
    return CallPlan(_native.plan_calls(batch._native, chunk_size, ids, conv_width))


def plan_segment_forest(parent, start, end, chunk_size: int = 64, conv_width: int = 4) -> CallPlan:
    """Plan an already compacted segment forest (no token batch): per segment its parent
    (-1 for a root), start and end positions. Children follow increasing id; rows are numbered
    in DFS preorder. The batch links (:attr:`CallPlan.row_to_global`, semantic maps) are empty.

    Raises InvalidArgumentError naming ``parent[i]``, ``start[i]``, ``end[i]``, ``chunk_size``
    or ``conv_width`` (a root must start at 0; a child starts at its parent's end)."""
    chunk_size = _check_int(chunk_size, "chunk_size", 1, MAX_CHUNK_SIZE)
    conv_width = _check_int(conv_width, "conv_width", 1, MAX_CONV_WIDTH)
    arrays = []
    for name, values in (("parent", parent), ("start", start), ("end", end)):
        arr = np.asarray(values)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise invalid(name, f"must be a one-dimensional integer array, got {arr.dtype} {arr.shape}")
        if arr.size and (int(arr.min()) < np.iinfo(np.int32).min or int(arr.max()) > np.iinfo(np.int32).max):
            raise invalid(name, "values must fit int32")
        arrays.append(np.ascontiguousarray(arr, dtype=np.int32))
    return CallPlan(_native.plan_segment_forest(*arrays, chunk_size, conv_width))


__all__ = [
    "CallPlan",
    "plan_calls",
    "plan_segment_forest",
    "MAX_CHUNK_SIZE",
    "MAX_CONV_WIDTH",
    "ARRAY_FIELDS",
    "SCALAR_FIELDS",
]
