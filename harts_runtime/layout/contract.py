"""What the runtime reads from a microbatch's call plan: the *layout* part of the planner contract.

The planner's wire ``CallPlan`` carries 8 scalars and 46 arrays. The runtime reads the 8 scalars and
exactly 27 of the arrays, the layout (the names are the wire field names and the attribute names of
``harts_planner.CallPlan``); the other 19 arrays record Algorithm 1's internal choices (recovery,
chains, slot producers) and are for debugging and viewing only. :class:`CallLayoutArrays` states
the layout as a ``typing.Protocol``: :mod:`harts_runtime.layout` accepts any object that has these
attributes (a ``harts_planner.CallPlan`` does), and reads nothing else from it.

Notation: ``C`` physical rows, ``S`` semantic positions of the microbatch's ``N`` trajectories,
``V`` segments (``R`` of them roots), ``Q`` packed sequences over ``K = num_calls`` rounds, ``P``
requested states, ``L`` replay rows (``replay_tokens``), ``w = conv_width``. Arrays are 1-D integer arrays (numpy or anything ``np.asarray`` accepts).

============================== ======= ================================================================
name                           length  meaning
============================== ======= ================================================================
segment forest
segment_start, segment_end     V       token range of each segment on its trajectories
segment_parent                 V       parent segment (-1: a root)
segment_child_offsets          V + 1   CSR offsets into ``segment_children``
segment_children               V - R   children of each segment, in order
segment_roots                  R       root segments
segment_physical_begin         V       first physical row of each segment
rounds and state handoffs
round_sequence_offsets         K + 1   round r packs sequences ``[o[r], o[r + 1])``
sequence_state_slot            Q       state slot each sequence starts from (-1: zero state)
sequence_request_offsets       Q + 1   sequence q requests states ``[o[q], o[q + 1])``
request_sequence               P       sequence of each requested state
request_chunk                  P       chunk boundary on that sequence's grid
request_slot                   P       slot the returned state goes to
physical layout
row_to_physical                C       physical row of each compact row (microbatch row order)
position_ids                   C       absolute trajectory position of each physical row (RoPE)
sequence_physical_offsets      Q + 1   sequence q owns physical rows ``[o[q], o[q + 1])``
packed_offsets                 K + 1   round r's packed rows are ``[o[r], o[r + 1])``
gather_index                   C + L   physical row read by each packed row (replay rows included)
packed_output_row              C + L   physical row each packed row writes (-1: a replay row)
cu_offsets                     K + 1   round r's cu_seqlens are ``cu_seqlens[cu_offsets[r]:cu_offsets[r + 1]]``
cu_seqlens                     Q + K   every round's packed-sequence boundaries, concatenated
own_conv_context               Q x w-1 physical rows of the w - 1 true ancestors before each sequence's
                                       first own row, oldest first, -1 = none ([Q, w - 1] or flat)
links to the batch
trajectories                   N       the microbatch's trajectory ids (batch numbering)
row_to_global                  C       batch compact row of each microbatch row (increasing)
physical_to_global             C       batch compact row of each physical row
semantic_offsets               N + 1   trajectory j owns semantic positions ``[o[j], o[j + 1])``
semantic_to_physical           S       physical row of each semantic position
============================== ======= ================================================================
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from harts_runtime.errors import InvalidInputError

__all__ = ["LAYOUT_ARRAYS", "LAYOUT_SCALARS", "CallLayoutArrays", "check_call_layout"]

LAYOUT_SCALARS = (
    "chunk_size",
    "conv_width",
    "num_calls",
    "replay_tokens",
    "compact_tokens",
    "num_segments",
    "num_sequences",
    "num_state_slots",
)
"""The 8 scalars of a call plan (all of them are in the layout)."""

LAYOUT_ARRAYS = (
    # segment forest
    "segment_start",
    "segment_end",
    "segment_parent",
    "segment_child_offsets",
    "segment_children",
    "segment_roots",
    "segment_physical_begin",
    # rounds and state handoffs
    "round_sequence_offsets",
    "sequence_state_slot",
    "sequence_request_offsets",
    "request_sequence",
    "request_chunk",
    "request_slot",
    # physical layout
    "row_to_physical",
    "position_ids",
    "sequence_physical_offsets",
    "packed_offsets",
    "gather_index",
    "packed_output_row",
    "cu_offsets",
    "cu_seqlens",
    "own_conv_context",
    # links to the batch
    "trajectories",
    "row_to_global",
    "physical_to_global",
    "semantic_offsets",
    "semantic_to_physical",
)
"""The 27 arrays of a call plan the runtime reads (wire field names = attribute names)."""


@runtime_checkable
class CallLayoutArrays(Protocol):
    """The layout of one microbatch's call plan: 8 scalars and 27 arrays (module docstring).

    ``isinstance(obj, CallLayoutArrays)`` checks that every name is an attribute of ``obj``;
    :func:`check_call_layout` also names the first missing one.
    """

    chunk_size: int
    conv_width: int
    num_calls: int
    replay_tokens: int
    compact_tokens: int
    num_segments: int
    num_sequences: int
    num_state_slots: int

    segment_start: np.ndarray
    segment_end: np.ndarray
    segment_parent: np.ndarray
    segment_child_offsets: np.ndarray
    segment_children: np.ndarray
    segment_roots: np.ndarray
    segment_physical_begin: np.ndarray

    round_sequence_offsets: np.ndarray
    sequence_state_slot: np.ndarray
    sequence_request_offsets: np.ndarray
    request_sequence: np.ndarray
    request_chunk: np.ndarray
    request_slot: np.ndarray

    row_to_physical: np.ndarray
    position_ids: np.ndarray
    sequence_physical_offsets: np.ndarray
    packed_offsets: np.ndarray
    gather_index: np.ndarray
    packed_output_row: np.ndarray
    cu_offsets: np.ndarray
    cu_seqlens: np.ndarray
    own_conv_context: np.ndarray

    trajectories: np.ndarray
    row_to_global: np.ndarray
    physical_to_global: np.ndarray
    semantic_offsets: np.ndarray
    semantic_to_physical: np.ndarray


def check_call_layout(plan, name: str = "call_plan") -> None:
    """Raise :class:`~harts_runtime.errors.InvalidInputError` (``field="<name>.<attribute>"``) for
    the first layout scalar or array that ``plan`` lacks; O(1)."""
    for attr in LAYOUT_SCALARS + LAYOUT_ARRAYS:
        if not hasattr(plan, attr):
            raise InvalidInputError(
                f"{name}.{attr}",
                f"missing: a call layout needs the {len(LAYOUT_SCALARS)} scalars and "
                f"{len(LAYOUT_ARRAYS)} arrays of harts_runtime.layout.CallLayoutArrays "
                f"({type(plan).__name__} has not this one)",
            )
