"""Context-parallel split of one microbatch between C ranks (``harts/cp_split.h``).

Glossary
--------
* row: a compact row of the microbatch, numbered as :func:`harts_planner.plan_calls` numbers the
  rows of the same trajectories (lexicographic DFS preorder; ``CallPlan.row_to_global`` maps them to
  batch rows). ``pos(x)`` is the row's position on its path; its *predecessor* is the row before it
  on that path (``x - 1`` inside a segment, the parent segment's last row at a fork).
* rank ``r``: one of the C ranks; it holds the contiguous rows
  ``[rank_row_offsets[r], rank_row_offsets[r + 1])`` (possibly none).
* the chunk grid: every interior cut ``x`` has ``pos(x) % B == 0``, so a path cut between ranks is cut
  on a chunk boundary and the state handed on is a chunk-boundary state.
* cost: row ``x`` costs ``linear_cost + attention_cost * (pos(x) + 1)`` (linear work per row plus causal
  attention over the path); the split minimizes the largest rank cost exactly over every legal split.
* receive ``i``: rank ``receive_rank[i]`` enters rows (``entry_rows``) whose predecessor
  ``receive_row[i]`` lives on an earlier rank. It starts them from the state ``S_a``,
  ``a = receive_anchor[i]`` (state ``receive_state[i]``, -1 = zero state), replays the path's rows at
  positions ``[a, pos(u) + 1)`` (``replay_rows``) and reads ``w - 1`` conv-context rows before ``a``:
  exactly what one process's packed sequence does.
* state ``k``: ``S_{state_position[k]}``, after row ``state_row[k]``, produced by ``state_rank[k]`` (an
  earlier rank than every consumer) and handed to the ranks ``state_consumers(k)``.
"""

from __future__ import annotations

import numpy as np

from harts_planner import _native, checks
from harts_planner.call_plan import DEFAULT_CHUNK_SIZE, DEFAULT_CONV_WIDTH
from harts_planner.errors import HartsError, cancel_token, invalid, renamed
from harts_planner.fields import NativeField

MAX_CP_SIZE: int = _native.MAX_CP_SIZE
MAX_CP_COST: int = _native.MAX_CP_COST
#: Defaults of the cost model (``harts::CpSplitOptions``): attention's pair work equals a row's linear
#: work at a context of 8192 rows.
DEFAULT_LINEAR_COST: int = 8192
DEFAULT_ATTENTION_COST: int = 1

#: Arrays of a split: name -> dtype.
ARRAY_FIELDS: dict[str, np.dtype] = {
    "rank_row_offsets": np.dtype("<i8"),
    "rank_cost": np.dtype("<i8"),
    **{
        name: np.dtype("<i4")
        for name in (
            "receive_offsets",
            "send_offsets",
            "receive_rank",
            "receive_row",
            "receive_anchor",
            "receive_state",
            "receive_replay_offsets",
            "replay_rows",
            "receive_conv_context",
            "receive_entry_offsets",
            "entry_rows",
            "state_row",
            "state_position",
            "state_rank",
            "state_consumer_offsets",
            "state_consumer_rank",
        )
    },
}
SCALAR_FIELDS: tuple[str, ...] = (
    "cp_size",
    "chunk_size",
    "conv_width",
    "linear_cost",
    "attention_cost",
    "num_rows",
    "total_cost",
    "max_cost",
)


def plan_cp(
    batch,
    microbatch,
    cp_size: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    conv_width: int = DEFAULT_CONV_WIDTH,
    linear_cost: int = DEFAULT_LINEAR_COST,
    attention_cost: int = DEFAULT_ATTENTION_COST,
    cancel=None,
) -> CpSplit:
    """Split one microbatch between ``cp_size`` ranks (see the module docstring).

    Parameters
    ----------
    batch : RolloutBatch
    microbatch : array_like of int or None
        Distinct trajectory indices (None: every trajectory), e.g. ``StepPlan.microbatches[m]``.
    cp_size : int
        C in ``[1, MAX_CP_SIZE]``.
    chunk_size, conv_width : int
        B (the grid) and w (the conv context of each receive).
    linear_cost, attention_cost : int
        The cost model, each in ``[0, MAX_CP_COST]``, not both 0.
    cancel : CancelToken, optional

    Raises InvalidArgumentError naming the argument (``microbatch[j]`` for a bad index),
    ResourceLimitError naming ``attention_cost`` when the rows' total cost exceeds 2^62,
    PlanCancelledError. O(V + C_M / B + k log k); the GIL is released.
    """
    if not isinstance(getattr(batch, "_native", None), _native.CompactBatch):
        raise invalid("batch", f"must be a RolloutBatch, got {type(batch).__name__}")
    cp_size = checks.integer(cp_size, "cp_size", 1, MAX_CP_SIZE)
    chunk_size = checks.chunk_size(chunk_size)
    conv_width = checks.conv_width(conv_width)
    linear_cost = checks.integer(linear_cost, "linear_cost", 0, MAX_CP_COST)
    attention_cost = checks.integer(attention_cost, "attention_cost", 0, MAX_CP_COST)
    ids = None if microbatch is None else checks.trajectory_ids(microbatch, "microbatch")
    try:
        native = _native.plan_cp(
            batch._native,
            ids,
            cp_size,
            chunk_size,
            conv_width,
            linear_cost,
            attention_cost,
            cancel_token(cancel),
        )
    except HartsError as e:
        raise (e if ids is None else renamed(e, {"trajectories": "microbatch"})) from None
    return CpSplit(native)


class CpSplit:
    """The split of one microbatch between C ranks (returned by :func:`plan_cp`). Arrays are read-only
    numpy views owned by the C++ split; ``==`` compares every field."""

    def __init__(self, native):
        self._native = native

    cp_size = NativeField("C.")
    chunk_size = NativeField("B: interior cuts sit at positions that are multiples of B.")
    conv_width = NativeField("w: each receive reads w - 1 conv-context rows.")
    linear_cost = NativeField("Cost of every row.")
    attention_cost = NativeField("Cost of each (query, key) pair of causal attention along a path.")
    num_rows = NativeField("C_M, compact rows of the microbatch.")
    total_cost = NativeField("Sum of the row costs.")
    max_cost = NativeField("The largest rank cost: the least over every legal split.")
    rank_row_offsets = NativeField("int64 [C + 1]: rank r holds rows [offsets[r], offsets[r + 1]).")
    rank_cost = NativeField("int64 [C]: cost of each rank's rows.")
    receive_offsets = NativeField("int32 [C + 1]: CSR, the receives of rank r.")
    send_offsets = NativeField("int32 [C + 1]: CSR, the states rank r produces.")
    receive_rank = NativeField("int32 [R]: the receiving rank.")
    receive_row = NativeField("int32 [R]: the predecessor row u (on an earlier rank).")
    receive_anchor = NativeField("int32 [R]: a = B floor((pos(u) + 1) / B), the state's position.")
    receive_state = NativeField("int32 [R]: the state S_a, -1 for the zero state.")
    receive_replay_offsets = NativeField("int32 [R + 1]: CSR into replay_rows.")
    replay_rows = NativeField("int32: rows at positions [a, pos(u) + 1) of u's path, per receive.")
    receive_conv_context = NativeField("int32 [R * (w - 1)]: rows at positions [a - w + 1, a), -1 below 0.")
    receive_entry_offsets = NativeField("int32 [R + 1]: CSR into entry_rows.")
    entry_rows = NativeField("int32: rows of the receiving rank whose predecessor is u.")
    state_row = NativeField("int32 [P]: the row after which the state holds (increasing).")
    state_position = NativeField("int32 [P]: its position, a multiple of B.")
    state_rank = NativeField("int32 [P]: the producing rank.")
    state_consumer_offsets = NativeField("int32 [P + 1]: CSR into state_consumer_rank.")
    state_consumer_rank = NativeField("int32: the ranks each state is handed to, ascending.")

    @property
    def num_receives(self) -> int:
        return len(self.receive_row)

    @property
    def num_states(self) -> int:
        return len(self.state_row)

    def rank_rows(self, r: int) -> range:
        """Rows of rank ``r``."""
        r = checks.index(r, "r", self.cp_size)
        return range(int(self.rank_row_offsets[r]), int(self.rank_row_offsets[r + 1]))

    def rank_of(self, rows) -> np.ndarray:
        """The rank holding each row (int64 array)."""
        rows = np.asarray(rows, dtype=np.int64)
        return np.searchsorted(self.rank_row_offsets, rows, side="right") - 1

    def replay(self, i: int) -> np.ndarray:
        """Replay rows of receive ``i``."""
        return self.replay_rows[self.receive_replay_offsets[i] : self.receive_replay_offsets[i + 1]]

    def entries(self, i: int) -> np.ndarray:
        """Entering rows of receive ``i``."""
        return self.entry_rows[self.receive_entry_offsets[i] : self.receive_entry_offsets[i + 1]]

    def conv_context(self, i: int) -> np.ndarray:
        """Conv-context rows of receive ``i`` (``w - 1``, oldest first, -1 below position 0)."""
        w = self.conv_width - 1
        return self.receive_conv_context[i * w : (i + 1) * w]

    def state_consumers(self, k: int) -> np.ndarray:
        """Ranks state ``k`` is handed to."""
        return self.state_consumer_rank[self.state_consumer_offsets[k] : self.state_consumer_offsets[k + 1]]

    def rank(self, r: int) -> dict:
        """What rank ``r`` runs: its rows and cost, its receives (predecessor row, anchor, state and its
        producing rank, replay, conv context, entering rows) and the states it hands on (state, row,
        position, consumer ranks)."""
        r = checks.index(r, "r", self.cp_size)
        receives = []
        for i in range(int(self.receive_offsets[r]), int(self.receive_offsets[r + 1])):
            k = int(self.receive_state[i])
            receives.append(
                {
                    "row": int(self.receive_row[i]),
                    "anchor": int(self.receive_anchor[i]),
                    "state": k,
                    "from_rank": int(self.state_rank[k]) if k >= 0 else -1,
                    "replay_rows": self.replay(i).tolist(),
                    "conv_context": self.conv_context(i).tolist(),
                    "entry_rows": self.entries(i).tolist(),
                }
            )
        sends = [
            {
                "state": k,
                "row": int(self.state_row[k]),
                "position": int(self.state_position[k]),
                "to_ranks": self.state_consumers(k).tolist(),
            }
            for k in range(int(self.send_offsets[r]), int(self.send_offsets[r + 1]))
        ]
        rows = self.rank_rows(r)
        return {
            "rows": [rows.start, rows.stop],
            "cost": int(self.rank_cost[r]),
            "receives": receives,
            "sends": sends,
        }

    def to_dict(self) -> dict:
        """Every scalar and, per rank, :meth:`rank` (JSON-serializable)."""
        return {
            **{f: int(getattr(self, f)) for f in SCALAR_FIELDS},
            "ranks": [self.rank(r) for r in range(self.cp_size)],
        }

    def __eq__(self, other) -> bool:
        if not isinstance(other, CpSplit):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in SCALAR_FIELDS) and all(
            np.array_equal(getattr(self, f), getattr(other, f)) for f in ARRAY_FIELDS
        )

    # Unhashable (the data model's spelling); typeshed types object.__hash__ as a method only.
    __hash__ = None  # pyright: ignore[reportAssignmentType]

    def __repr__(self) -> str:
        costs = ", ".join(str(int(c)) for c in self.rank_cost)
        return (
            f"CpSplit(C={self.cp_size}, B={self.chunk_size}, rows={self.num_rows}, rank_cost=[{costs}], "
            f"receives={self.num_receives}, states={self.num_states})"
        )


__all__ = ["CpSplit", "plan_cp", "MAX_CP_SIZE", "MAX_CP_COST", "ARRAY_FIELDS", "SCALAR_FIELDS"]
