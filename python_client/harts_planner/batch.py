"""`RolloutBatch`: a batch of trajectories ingested into its compact form.

Glossary (Sections 2.1, 3.1 and 3.2 of the paper):

* trajectory ``i``: ``tokens[offsets[i]:offsets[i+1]]``, a root-to-leaf path of a rollout tree.
* semantic position ``s``: flat index ``offsets[i] + p`` of token ``p`` of trajectory ``i``;
  ``S = semantic_tokens``.
* compact row ``c``: one unique token prefix; positions with the same actual token prefix share
  a row whichever tree they came from. ``C = compact_tokens``. Rows are numbered in the
  lexicographic DFS preorder of the compact trie.
* rank: position in the stable lexicographic order of the trajectories.
* segment: a maximal fork-free path of the compact trie (no fork and no trajectory end strictly
  inside), positions ``[start, end)`` of every trajectory through it; numbered in preorder.

A batch comes from tokens (:meth:`RolloutBatch.from_arrays`) or from an already compacted
:class:`SegmentTree` (:meth:`RolloutBatch.from_segment_tree`): per segment its parent and token
count, per trajectory the segment it ends at. The tree of a batch (:meth:`RolloutBatch.segment_tree`)
rebuilds that batch exactly, without its tokens, so it can stand for them on the wire.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence

import numpy as np

from harts_planner import _native, checks
from harts_planner.errors import cancel_token, invalid, resource_limit
from harts_planner.fields import NativeField


@dataclasses.dataclass(frozen=True, eq=False)
class PackedTokens:
    """Trajectories as packed tokens: trajectory ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``.

    Attributes
    ----------
    tokens : np.ndarray, int32 [S]
        Token ids >= 0.
    offsets : np.ndarray, int64 [N + 1]
        ``offsets[0] = 0``, strictly increasing, ``offsets[N] = S``.
    tree_ids : np.ndarray or None, int64 [N]
        Optional rollout-tree id of each trajectory.

    The arrays are converted (zero copy when the dtype already matches) but not validated here;
    :meth:`RolloutBatch.from_arrays` validates them.
    """

    tokens: np.ndarray
    offsets: np.ndarray
    tree_ids: np.ndarray | None = None

    def __post_init__(self):
        object.__setattr__(self, "tokens", checks.int_array(self.tokens, np.int32, "tokens"))
        object.__setattr__(self, "offsets", checks.int_array(self.offsets, np.int64, "offsets"))
        if self.tree_ids is not None:
            object.__setattr__(self, "tree_ids", checks.int_array(self.tree_ids, np.int64, "tree_ids"))

    @property
    def num_trajectories(self) -> int:
        """N (from the offsets)."""
        return max(len(self.offsets) - 1, 0)


@dataclasses.dataclass(frozen=True, eq=False)
class SegmentTree:
    """An already compacted segment tree: a batch's prefix structure without its tokens.

    Segment ``v`` is a fork-free run of ``length[v]`` tokens below segment ``parent[v]`` (-1 for a
    root). Siblings are distinct and ordered by increasing id (roots likewise): that order stands for
    their lexicographic order. Trajectory ``i`` is the path from a root down to the end of segment
    ``trajectory_end[i]``, so its length is the sum of ``length`` along that path.

    Attributes
    ----------
    parent : np.ndarray, int32 [V]
        Parent segment in ``[0, V)`` or -1; no cycles.
    length : np.ndarray, int32 [V]
        Tokens per segment, >= 1.
    trajectory_end : np.ndarray, int32 [N]
        Segment at whose end each trajectory ends; every leaf segment must end one.
    tree_ids : np.ndarray or None, int64 [N]
        Optional rollout-tree id of each trajectory.

    Validation happens in :meth:`RolloutBatch.from_segment_tree` (errors name ``parent[v]``,
    ``length[v]``, ``trajectory_end[i]``...).
    """

    parent: np.ndarray
    length: np.ndarray
    trajectory_end: np.ndarray
    tree_ids: np.ndarray | None = None

    def __post_init__(self):
        for name in ("parent", "length", "trajectory_end"):
            object.__setattr__(self, name, checks.int_array(getattr(self, name), np.int32, name))
        if self.tree_ids is not None:
            object.__setattr__(self, "tree_ids", checks.int_array(self.tree_ids, np.int64, "tree_ids"))

    @property
    def num_segments(self) -> int:
        """V."""
        return len(self.parent)

    @property
    def num_trajectories(self) -> int:
        """N."""
        return len(self.trajectory_end)


class RolloutBatch:
    """A batch of trajectories and its compact trie, LCP/RMQ index and segment forest.

    Build one with :meth:`from_arrays`, :meth:`from_token_lists`, :meth:`from_segment_tree` or
    :meth:`load`. All array properties are read-only numpy views: of memory owned by the C++ core,
    and for :attr:`tokens`, :attr:`offsets` and the input tree ids of arrays only the batch holds
    (writing to the caller's arrays after ingestion cannot change a batch). A batch built from a
    segment tree has no tokens (:attr:`tokens` is None).
    """

    def __init__(
        self,
        native: _native.CompactBatch,
        tokens: np.ndarray | None,
        offsets: np.ndarray,
        tree_ids: np.ndarray | None,
    ):
        self._native = native
        self._tokens = tokens
        self._offsets = offsets
        self._input_tree_ids = tree_ids

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_arrays(cls, tokens, offsets, tree_ids=None, cancel=None) -> RolloutBatch:
        """Ingest a packed batch.

        Parameters
        ----------
        tokens : array_like of int, shape [S]
            All trajectories concatenated; ids >= 0.
        offsets : array_like of int, shape [N + 1]
            ``offsets[0] = 0``, strictly increasing, ``offsets[N] = S``.
        tree_ids : array_like of int, shape [N], optional
            Rollout-tree id of each trajectory (metadata; sharing follows actual tokens).
        cancel : CancelToken, optional
            Stops the ingestion within milliseconds once cancelled or past its deadline.

        The batch keeps read-only copies of the arrays (one copy, fused with the dtype conversion
        when there is one), so the caller may refill or free its buffers at once. An array nothing
        can write to any more is kept without a copy: a read-only array over ``bytes`` (such as
        ``np.frombuffer(data, np.int32)``), through any chain of read-only views.

        Raises
        ------
        InvalidArgumentError
            Empty trajectories, bad offsets, negative token ids, wrong dtypes or shapes;
            the message names the field (``"offsets[3]: trajectory 2 is empty"``).
        ResourceLimitError
            More than ``MAX_TRAJECTORIES`` trajectories or ``MAX_SEMANTIC_TOKENS`` tokens.
        PlanCancelledError
            ``cancel`` fired (``field`` ``"cancelled"`` or ``"deadline"``).

        The GIL is released while ingesting.
        """
        return cls._ingest(tokens, offsets, tree_ids, cancel, take=False)

    @classmethod
    def _ingest(cls, tokens, offsets, tree_ids, cancel, *, take: bool) -> RolloutBatch:
        """:meth:`from_arrays`; with ``take`` the caller hands its arrays over (it made them and
        writes to them no more): they are marked read-only and kept without a copy."""
        cancel = cancel_token(cancel)
        tokens = _held(tokens, np.int32, "tokens", take)
        offsets = _held(offsets, np.int64, "offsets", take)
        if tree_ids is not None:
            tree_ids = _held(tree_ids, np.int64, "tree_ids", take)
        native = _native.ingest(tokens, offsets, tree_ids, cancel)
        return cls(native, tokens, offsets, tree_ids)

    @classmethod
    def from_token_lists(
        cls, trajectories: Iterable[Sequence[int]], tree_ids=None, cancel=None
    ) -> RolloutBatch:
        """Ingest a list of token lists (one per trajectory). Same errors as :meth:`from_arrays`;
        a trajectory that is not a non-empty sequence of token ids in ``[0, 2^31)`` is reported on
        its field ``trajectories[i]``."""
        if isinstance(trajectories, (str, bytes)) or not isinstance(trajectories, Iterable):
            raise invalid(
                "trajectories", f"must be an iterable of token lists, got {type(trajectories).__name__}"
            )
        trajectories = list(trajectories)
        if not trajectories:
            raise invalid("trajectories", "a batch needs at least one trajectory")
        pieces = []
        for i, t in enumerate(trajectories):
            field = f"trajectories[{i}]"
            try:
                shape_ok = np.ndim(t) == 1
            except ValueError:  # a ragged nesting
                shape_ok = False
            if not shape_ok or isinstance(t, (str, bytes)):
                raise invalid(field, f"must be a sequence of token ids, got {type(t).__name__}")
            piece = checks.int_array(t, np.int32, field)
            if piece.size == 0:
                raise invalid(field, "trajectory is empty")
            if piece.min() < 0:
                p = int(np.argmax(piece < 0))
                raise invalid(field, f"token ids must be >= 0, got {int(piece[p])} at position {p}")
            pieces.append(piece)
        offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in pieces], out=offsets[1:])
        return cls._ingest(np.concatenate(pieces), offsets, tree_ids, cancel, take=True)

    @classmethod
    def from_segment_tree(cls, tree: SegmentTree, cancel=None) -> RolloutBatch:
        """Build the batch a compacted :class:`SegmentTree` stands for, without tokens.

        O(V + N log N): no per-token work until a per-row array (:attr:`compact_map`,
        :attr:`multiplicity`, ...) is first read. The batch equals, array for array, the one
        ingested from tokens with that tree; in particular
        ``RolloutBatch.from_segment_tree(b.segment_tree())`` plans exactly like ``b``.

        Raises
        ------
        InvalidArgumentError
            ``parent[v]`` out of range or on a cycle, ``length[v] < 1``, ``trajectory_end[i]`` out of
            range, a leaf segment no trajectory ends at (``trajectory_end``), no segments or no
            trajectories, arrays of different lengths, bad ``tree_ids``.
        ResourceLimitError
            More than ``MAX_TRAJECTORIES`` trajectories, ``2 * MAX_TRAJECTORIES`` segments, or
            ``MAX_SEMANTIC_TOKENS`` semantic tokens in all.
        PlanCancelledError
            ``cancel`` (a :class:`CancelToken`) fired.

        The GIL is released while building.
        """
        if not isinstance(tree, SegmentTree):
            raise invalid("tree", f"must be a harts_planner.SegmentTree, got {type(tree).__name__}")
        cancel = cancel_token(cancel)
        native = _native.ingest_segment_tree(
            tree.parent, tree.length, tree.trajectory_end, tree.tree_ids, cancel
        )
        offsets = np.zeros(native.num_trajectories + 1, dtype=np.int64)
        np.cumsum(native.lengths, out=offsets[1:])
        return cls(native, None, offsets, tree.tree_ids)

    def segment_tree(self) -> SegmentTree:
        """The compacted tree of this batch: its segment forest's parents and lengths, the segment
        each trajectory ends at, and the input tree ids (if any). O(V + N)."""
        end_offsets = self.segment_end_offsets
        trajectory_end = np.empty(self.num_trajectories, dtype=np.int32)
        trajectory_end[self.segment_ending] = np.repeat(
            np.arange(self.num_segments, dtype=np.int32), np.diff(end_offsets)
        )
        length = (self.segment_end - self.segment_start).astype(np.int32)
        return SegmentTree(self.segment_parent, length, trajectory_end, self._input_tree_ids)

    @property
    def has_tokens(self) -> bool:
        """False for a batch built from a segment tree."""
        return self._tokens is not None

    @classmethod
    def load(cls, path: str | os.PathLike) -> RolloutBatch:
        """Load a batch saved by :meth:`save` (``.hrb`` binary or ``.jsonl``)."""
        from harts_planner.batch_io import load_batch

        tokens, offsets, tree_ids = load_batch(path)
        return cls._ingest(tokens, offsets, tree_ids, None, take=True)

    def save(self, path: str | os.PathLike) -> None:
        """Save the input trajectories (format from the extension: ``.hrb`` or ``.jsonl``)."""
        from harts_planner.batch_io import save_batch

        if self._tokens is None:
            raise invalid("tokens", "a batch built from a segment tree has no tokens to save")
        save_batch(path, self._tokens, self._offsets, self._input_tree_ids)

    # ------------------------------------------------------------------ sizes
    num_trajectories = NativeField("N, the number of trajectories.")
    semantic_tokens = NativeField("S, the number of semantic positions (sum of trajectory lengths).")
    compact_tokens = NativeField("C, the number of compact rows (unique token prefixes) of the whole batch.")
    num_segments = NativeField("V, the number of segments of the segment forest.")

    @property
    def compression(self) -> float:
        """S / C."""
        return self.semantic_tokens / self.compact_tokens

    # ------------------------------------------------------------------ inputs
    @property
    def tokens(self) -> np.ndarray | None:
        """int32 [S]: the input token buffer (None for a batch built from a segment tree)."""
        return self._tokens

    @property
    def offsets(self) -> np.ndarray:
        """int64 [N + 1]: the input offsets (the prefix sums of :attr:`lengths`)."""
        return self._offsets

    lengths = NativeField("int64 [N]: trajectory lengths |x_i|.")
    tree_ids = NativeField(
        "int64 [N]: the given tree ids, or (if none were given) the index of the trajectory's compact "
        "component (its rollout tree as recovered from shared tokens)."
    )
    component = NativeField(
        "int32 [N]: index into :attr:`segment_roots` of the trajectory's compact component."
    )

    def trajectory(self, i: int) -> np.ndarray:
        """int32 view of trajectory ``i``'s tokens, ``0 <= i < N``. Raises InvalidArgumentError for
        an index out of range (field ``i``; negative indices are refused, not counted from the
        end) and for a batch without tokens."""
        i = _index(i, "i", self.num_trajectories, "trajectory")
        if self._tokens is None:
            raise invalid("tokens", "a batch built from a segment tree has no tokens")
        return self._tokens[self._offsets[i] : self._offsets[i + 1]]

    # ------------------------------------------------------------------ order and LCP
    order = NativeField(
        "int32 [N]: ``order[r]`` is the trajectory of rank ``r`` (stable lexicographic order)."
    )
    rank = NativeField("int32 [N]: inverse of :attr:`order`.")
    adjacent_lcp = NativeField(
        "int32 [N]: ``adjacent_lcp[r] = LCP(x[order[r-1]], x[order[r]])``; entry 0 is 0."
    )

    def lcp(self, i: int, j: int) -> int:
        """LCP(x_i, x_j) of two trajectory indices in ``[0, N)``, O(1) by RMQ (|x_i| when ``i == j``).
        InvalidArgumentError (field ``i`` or ``j``) for an index out of range."""
        n = self.num_trajectories
        return self._native.lcp(_index(i, "i", n, "trajectory"), _index(j, "j", n, "trajectory"))

    def interval_work(self, lo: int, hi: int) -> int:
        """W: compact work of the trajectories of ranks ``[lo, hi)`` (Equation 5), O(1), for
        ``0 <= lo < hi <= N``. InvalidArgumentError (field ``lo, hi``, or ``lo`` / ``hi`` for a value
        outside int64) otherwise."""
        return self._native.interval_work(checks.int64(lo, "lo"), checks.int64(hi, "hi"))

    def subset_work(self, trajectories) -> int:
        """Compact work C(M) of a set of distinct trajectory indices (Equation 5 after sorting).

        Raises InvalidArgumentError for an index out of range or repeated."""
        return self._native.subset_work(checks.int_array(trajectories, np.int32, "trajectories"))

    # ------------------------------------------------------------------ compact trie
    compact_map = NativeField("int32 [S]: m, the compact row of every semantic position (Equation 3).")
    multiplicity = NativeField("int32 [C]: q_c, semantic positions per compact row; sums to S (Equation 20).")
    row_parent = NativeField("int32 [C]: parent row of each compact row, -1 for a first token.")
    row_depth = NativeField("int32 [C]: position of each row in its trajectories (0-based).")
    row_segment = NativeField("int32 [C]: segment containing each compact row.")

    # ------------------------------------------------------------------ segment forest
    segment_start = NativeField("int32 [V]: first position s_v of each segment.")
    segment_end = NativeField("int32 [V]: exclusive end position e_v of each segment.")
    segment_parent = NativeField("int32 [V]: parent segment, -1 for a root (one root per compact component).")
    segment_subtree_end = NativeField(
        "int32 [V]: the subtree of v is the preorder id range ``[v, segment_subtree_end[v])``."
    )
    segment_row_begin = NativeField(
        "int64 [V]: segment v holds compact rows ``[row_begin, row_begin + end - start)``."
    )
    segment_multiplicity = NativeField("int32 [V]: number of trajectories through each segment.")
    segment_child_offsets = NativeField("int64 [V + 1]: CSR offsets into :attr:`segment_children`.")
    segment_children = NativeField("int32 [V - roots]: children of each segment, lexicographic order, CSR.")
    segment_end_offsets = NativeField("int64 [V + 1]: CSR offsets into :attr:`segment_ending`.")
    segment_ending = NativeField("int32 [N]: trajectories ending at each segment's end, rank order, CSR.")
    segment_roots = NativeField("int32 [R]: root segments (one per compact component), lexicographic order.")

    def children(self, v: int) -> np.ndarray:
        """Children of segment ``v``, ``0 <= v < V`` (InvalidArgumentError naming ``v`` otherwise)."""
        v = _index(v, "v", self.num_segments, "segment")
        o = self.segment_child_offsets
        return self.segment_children[o[v] : o[v + 1]]

    def ending(self, v: int) -> np.ndarray:
        """Trajectories ending at the end of segment ``v``, ``0 <= v < V`` (InvalidArgumentError
        naming ``v`` otherwise)."""
        v = _index(v, "v", self.num_segments, "segment")
        o = self.segment_end_offsets
        return self.segment_ending[o[v] : o[v + 1]]

    # ------------------------------------------------------------------ summaries
    def stats(self) -> dict:
        """Shape summary: sizes, compression, tree depth (segments and tokens) and fan-out."""
        parent = self.segment_parent
        depth = np.zeros(len(parent), dtype=np.int64)
        for v in range(len(parent)):  # preorder: parents first
            if parent[v] >= 0:
                depth[v] = depth[parent[v]] + 1
        fanout = np.diff(self.segment_child_offsets)
        forks = fanout[fanout >= 2]
        return {
            "trajectories": self.num_trajectories,
            "trees": int(len(self.segment_roots)),
            "semantic_tokens": self.semantic_tokens,
            "compact_tokens": self.compact_tokens,
            "compression": self.compression,
            "segments": self.num_segments,
            "max_depth_segments": int(depth.max()) + 1 if len(depth) else 0,
            "max_trajectory_tokens": int(self.lengths.max()),
            "mean_trajectory_tokens": float(self.lengths.mean()),
            "forks": int(len(forks)),
            "max_fanout": int(fanout.max()) if len(fanout) else 0,
            "mean_fanout_at_forks": float(forks.mean()) if len(forks) else 0.0,
        }

    def __repr__(self) -> str:
        return (
            f"RolloutBatch(trajectories={self.num_trajectories}, semantic_tokens={self.semantic_tokens}, "
            f"compact_tokens={self.compact_tokens}, segments={self.num_segments})"
        )


def _index(value, field: str, size: int, what: str) -> int:
    """An integer in ``[0, size)``: InvalidArgumentError naming ``field`` otherwise, worded as the C++
    core's ("trajectory index 5 is out of range [0, 2)"); negative indices are refused."""
    value = checks.integer(value, field)
    if not 0 <= value < size:
        raise invalid(field, f"{what} index {value} is out of range [0, {size})")
    return value


def _immutable(arr: np.ndarray) -> bool:
    """Whether nothing can write to ``arr``'s memory: read-only views all the way down to a
    ``bytes`` object (a writable base, a ``bytearray``, an ``mmap`` or any other owner: False)."""
    base = arr
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return False
        base = base.base
    while isinstance(base, memoryview):
        if not base.readonly:
            return False
        base = base.obj
    return type(base) is bytes


def _held(values, dtype, field: str, take: bool) -> np.ndarray:
    """``values`` as the read-only C-contiguous ``dtype`` array a batch keeps (checked as
    :func:`checks.int_array` does): ``values`` itself when it is immutable (or handed over with
    ``take``), a copy otherwise."""
    arr = checks.int_array(values, dtype, field)
    # numpy allocated ``arr`` here (a conversion, or a list's values): nobody else holds it
    fresh = arr is not values and arr.flags.owndata and isinstance(values, (np.ndarray, list, tuple))
    if not (fresh or take or _immutable(arr)):
        try:
            arr = arr.copy()
        except MemoryError:
            raise resource_limit(
                field,
                f"no memory for the batch's copy of its {arr.nbytes} bytes (an array over immutable "
                "bytes, np.frombuffer(data), is kept without one)",
            ) from None
    arr.flags.writeable = False
    return arr


def ingest(source: PackedTokens | SegmentTree, cancel=None, *, take: bool = False) -> RolloutBatch:
    """The batch of packed tokens (:meth:`RolloutBatch.from_arrays`) or of a compacted tree
    (:meth:`RolloutBatch.from_segment_tree`); raises as those do, with their field names.
    ``cancel`` (a :class:`CancelToken`) as there. With ``take`` the caller hands the packed arrays
    over (nothing writes to them any more): they are kept read-only without a copy."""
    if isinstance(source, SegmentTree):
        return RolloutBatch.from_segment_tree(source, cancel)
    if isinstance(source, PackedTokens):
        return RolloutBatch._ingest(source.tokens, source.offsets, source.tree_ids, cancel, take=take)
    raise invalid("trajectories", f"must be PackedTokens or SegmentTree, got {type(source).__name__}")
