"""Full attention under the *states* mode of context parallelism: each CP rank holds a contiguous
range of a microbatch's rows through the whole model, and an attention layer computes, for the
rank's query rows ``[lo, hi)``, exactly the one-process compact attention output of those rows
(``docs/parallel.md``, "Context parallelism", "Attention under states mode").

Rows
----
The rows of one microbatch are numbered as the planner's CP split numbers them
(:func:`harts_planner.plan_cp`: the call plan's rows, lexicographic DFS preorder), so every
ancestor of a row has a smaller number; rank ``r`` holds rows ``[cuts[r], cuts[r + 1])``
(``CpSplit.rank_row_offsets``). A query row sees its tree ancestors and itself (the tree's
visibility, not a causal prefix).

What is gathered
----------------
Rank ``r`` needs, from the earlier ranks, the rows below ``lo = cuts[r]`` that are ancestors of
one of its rows (:func:`needed_rows`). In DFS preorder every subtree is a contiguous row range,
so that set is exactly the *strict ancestors of row lo*: one root path, at most the longest
trajectory minus one rows, whatever the number of rows below ``lo``. (Any numbering with
``parent[x] < x`` is accepted; the set is then the union of the ancestor paths of the rank's
rows, computed a run of consecutive rows at a time.) Rank ``r`` receives from rank ``s < r`` the
rows of that set in ``[cuts[s], cuts[s + 1])``, every rank computes every rank's sets from the
tree alone (deterministic, O(C N) host work per microbatch, no communication).

* GQA / MHA (:class:`~harts_runtime.layers.attention.CompactAttention`) and gated attention
  (:class:`~harts_runtime.layers.gated_attention.CompactGatedAttention`): each rank projects its
  rows (q / k norms and RoPE at the source), and the needed rows' K and V (``2 Hkv Dh`` values
  a row) move in one ``all_to_all_single_autograd`` with per-rank split sizes;
* MLA (:class:`~harts_runtime.layers.mla.CompactMLA`): the latent ``kv_a`` (``r_kv + rope``
  values a row, 576 in DeepSeek / Ling) moves instead of K / V, and every rank expands the
  gathered and local latents with ``kv_b_proj`` (RoPE of the shared key at the key rows'
  positions), as the heads mode does.

The backward of the all-to-all is the reverse all-to-all: every gathered row's gradient goes back
to its owner and is summed into its projection there (with the local queries' own use of it).
Then the rank runs the backends of :func:`harts_runtime.ops.attention.compact_attention`
(:func:`rank_attention`) over its *key rows* ``need[r] ++ [lo, hi)`` with views re-indexed to them
(:meth:`StatesAttentionPlan.rank_views`: one branch per run of consecutive local rows, ancestors
among the key rows). The gathered rows carry no query: view backends (every ``auto`` choice) pack
the local queries only; the tree-mask backends (``flex_tree``, ``dense_tree``) need a query per key
row and get zero queries for the gathered rows (``m x Hq x Dqk`` more memory, their outputs dropped).

Bytes per layer and microbatch (forward; backward the same again, and again under recomputation):
rank ``r`` receives ``|need[r]| x b`` bytes with ``b = 2 Hkv Dh x dtype`` (GQA / gated) or
``(r_kv + d_rope) x dtype`` (MLA); in preorder ``|need[r]| = depth(cuts[r])``, the position of the
rank's first row. The heads mode moves ``2 (C - 1) / C N D`` elements a rank instead.

Memory and 1M rows
------------------
The gathered rows are bounded by the ancestors, not by the rows: a forest of short trees cut
between ranks gathers a few rows; a deep single path (one 1M-token trajectory over C ranks)
gathers all earlier rows, ``(C - 1) / C N`` rows at the last rank: at ``N = 2^20``,
Qwen3.5-35B-A3B's gated attention (2 KV heads x 256, bf16) is 2 KiB a row, 1.75 GiB a layer at
C = 8; MLA's latent 1,152 B a row, 0.98 GiB. That is transient under block recomputation (the gather runs
again in backward) and is kept per attention layer without it. Where it does not fit, the plan is
a ring over source ranks: process the needed rows one source rank's block at a time, merging
partial softmax outputs by their log-sum-exp, so only one block of K / V is live; it needs a
backend that returns the log-sum-exp (flash / fa4 / te do, the PyTorch paths here do not) and is
not built.

Interface (what the states-mode integrator calls)
-------------------------------------------------
* ``needed_rows(parent, cuts) -> list[np.ndarray]``: per rank, sorted rows below its range that
  its queries see (pure numpy);
* ``StatesAttentionPlan.build(parent, cuts, *, positions=None, end=None)`` or
  ``StatesAttentionPlan.from_call_plan(batch, call_plan, split)``: once per microbatch, shared by
  every attention layer; ``recv_rows(r, s)``, ``send_counts(s)``, ``recv_counts(r)``,
  ``gathered_rows(r)``, ``rank_views(r, device)``, ``key_positions(r, device)``;
* ``gather_needed(t_local, plan, group) -> t_need``: the rows of ``need[rank]`` of any row-wise
  tensor ``t_local`` [n_local, ...] (differentiable; a collective every rank of ``group`` calls);
* ``rank_attention(q, k, v, plan, rank, *, backend="reference", scale=None) -> o``: the core alone
  (local queries over gathered + local keys), for callers that project themselves;
* ``states_attention(layer, x_local, plan, group, backend=None) -> y_local``: the layer's output
  on the rank's rows, ``x_local`` the rank's rows of the layer input ``[hi - lo, D]`` in row
  (split) order, not a call plan's physical order; the plan's ``positions`` give RoPE positions.
  Every rank of ``group`` calls it for every attention layer and runs its backward.

``group`` is a process group or a 1-D device mesh (its group); the rank's place in it is its CP
rank. Under tensor parallelism call it inside the TP region: the layers read their head counts
from their (local) weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.profiler import record_function

from harts_runtime.errors import InvalidInputError
from harts_runtime.layers.attention import CompactAttentionBase
from harts_runtime.layers.gated_attention import CompactGatedAttention
from harts_runtime.layers.mla import CompactMLA
from harts_runtime.layout.views import AttentionViews, Branches, TreeOrder, build_views
from harts_runtime.ops.attention import BACKENDS, compact_attention, resolve_backend
from harts_runtime.ops.keep import kept

__all__ = [
    "StatesAttentionPlan",
    "gather_needed",
    "needed_rows",
    "rank_attention",
    "states_attention",
]


# ---------------------------------------------------------------------------------- host plan
def _check_tree(parent, cuts) -> tuple[np.ndarray, np.ndarray]:
    parent = np.asarray(parent, dtype=np.int64)
    cuts = np.asarray(cuts, dtype=np.int64)
    n = len(parent)
    if parent.ndim != 1:
        raise InvalidInputError("parent", f"must be one-dimensional, got shape {parent.shape}")
    rows = np.arange(n, dtype=np.int64)
    bad = np.nonzero((parent >= rows) | (parent < -1))[0]
    if bad.size:
        x = int(bad[0])
        raise InvalidInputError(
            "parent",
            f"row {x} has parent {int(parent[x])}; need -1 <= parent[x] < x (rows numbered so that "
            "every ancestor comes first, as plan_cp numbers them)",
        )
    if cuts.ndim != 1 or len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != n or (np.diff(cuts) < 0).any():
        raise InvalidInputError(
            "cuts",
            f"must be non-decreasing offsets from 0 to the {n} rows (C + 1 entries), got {cuts.tolist()}",
        )
    return parent, cuts


def _run_starts(parent: np.ndarray) -> np.ndarray:
    idx = np.arange(len(parent), dtype=np.int64)
    breaks = parent != idx - 1
    if len(parent):
        breaks[0] = True
    return np.maximum.accumulate(np.where(breaks, idx, 0))


def _ancestors_below(parent: np.ndarray, run_start: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Sorted rows ``< lo`` that are ancestors of a row in ``[lo, hi)``. The marked set is closed
    under ancestors, so a run's first row being marked means the whole path above it is; each step
    marks a new run (or stops)."""
    if lo == 0 or hi == lo:
        return np.zeros(0, dtype=np.int64)
    p = parent[lo:hi]
    entries = np.unique(p[(p >= 0) & (p < lo)])
    mark = np.zeros(lo, dtype=bool)
    for x in entries[::-1].tolist():
        while x >= 0 and not mark[x]:
            s = int(run_start[x])
            done = bool(mark[s])
            mark[s : x + 1] = True
            if done:
                break
            x = int(parent[s])
    return np.nonzero(mark)[0]


def needed_rows(parent, cuts) -> list[np.ndarray]:
    """Per rank ``r``, the sorted rows below ``cuts[r]`` that are ancestors of one of its rows
    ``[cuts[r], cuts[r + 1])`` (what its queries see on earlier ranks; int64).

    ``parent`` [N]: each row's parent (-1 for a first token), ``parent[x] < x``; ``cuts`` [C + 1]:
    the ranks' row offsets. In DFS preorder the set is the strict ancestors of ``cuts[r]`` (for a
    rank holding rows). Raises :class:`InvalidInputError` naming ``parent`` or ``cuts``.
    O(C + N + gathered rows) numpy work, a Python step per run of consecutive rows walked."""
    parent, cuts = _check_tree(parent, cuts)
    run_start = _run_starts(parent)
    return [_ancestors_below(parent, run_start, int(cuts[r]), int(cuts[r + 1])) for r in range(len(cuts) - 1)]


@dataclass(frozen=True, eq=False)
class StatesAttentionPlan:
    """What every rank of a CP group gathers for full attention in one microbatch (the module
    docstring); built once per microbatch on the host, identical on every rank, shared by every
    attention layer.

    Attributes
    ----------
    parent : np.ndarray, int64 [N]
        Parent row of each row (-1 for a first token), ``parent[x] < x``.
    cuts : np.ndarray, int64 [C + 1]
        Rank ``r`` holds rows ``[cuts[r], cuts[r + 1])``.
    need : tuple of np.ndarray
        Per rank, :func:`needed_rows`.
    positions : np.ndarray or None, int64 [N]
        Absolute trajectory position of each row (RoPE); needed by :func:`states_attention`.
    end : np.ndarray or None, int64 [N]
        One past the last row of each row's subtree when the rows are in DFS preorder (the views'
        tree order is then read from it; otherwise computed from ``parent`` on the key rows).
    """

    parent: np.ndarray
    cuts: np.ndarray
    need: tuple
    positions: np.ndarray | None = None
    end: np.ndarray | None = None
    cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, parent, cuts, *, positions=None, end=None) -> StatesAttentionPlan:
        """From the rows' parents and the ranks' cuts (see the attributes); checks the shapes."""
        parent, cuts = _check_tree(parent, cuts)
        n = len(parent)
        for name, a in (("positions", positions), ("end", end)):
            if a is not None and np.asarray(a).shape != (n,):
                raise InvalidInputError(
                    name, f"needs {n} entries (one per row), got shape {np.asarray(a).shape}"
                )
        positions = None if positions is None else np.asarray(positions, dtype=np.int64)
        end = None if end is None else np.asarray(end, dtype=np.int64)
        return cls(parent, cuts, tuple(needed_rows(parent, cuts)), positions, end)

    @classmethod
    def from_call_plan(cls, batch, call_plan, split) -> StatesAttentionPlan:
        """For the microbatch of ``call_plan`` (``harts_planner.plan_calls``) split by ``split``
        (``harts_planner.plan_cp`` of the same trajectories): parents, positions and subtree ends in
        the call plan's row numbering (``row_to_global``), cuts ``split.rank_row_offsets``."""
        r2g = np.asarray(call_plan.row_to_global, dtype=np.int64)
        n = len(r2g)
        if int(split.num_rows) != n:
            raise InvalidInputError(
                "split", f"splits {int(split.num_rows)} rows, the call plan has {n} (not the same microbatch)"
            )
        gp = np.asarray(batch.row_parent, dtype=np.int64)[r2g]
        parent = np.where(gp < 0, -1, np.searchsorted(r2g, np.maximum(gp, 0)))
        end = np.searchsorted(r2g, TreeOrder.from_batch(batch).end[r2g])
        positions = np.asarray(call_plan.position_ids, dtype=np.int64)[
            np.asarray(call_plan.row_to_physical, dtype=np.int64)
        ]
        return cls.build(parent, np.asarray(split.rank_row_offsets), positions=positions, end=end)

    # --------------------------------------------------------------------- who sends what
    @property
    def cp_size(self) -> int:
        return len(self.cuts) - 1

    @property
    def num_rows(self) -> int:
        return len(self.parent)

    def rank_rows(self, r: int) -> tuple[int, int]:
        """``(lo, hi)`` of rank ``r``."""
        return int(self.cuts[r]), int(self.cuts[r + 1])

    def recv_rows(self, r: int, s: int) -> np.ndarray:
        """Rows (global numbers, ascending) that rank ``r`` receives from rank ``s`` (= what ``s``
        sends ``r``); empty unless ``s < r``."""
        need = self.need[r]
        lo, hi = self.rank_rows(s)
        return need[np.searchsorted(need, lo) : np.searchsorted(need, hi)]

    def recv_counts(self, r: int) -> list[int]:
        """Rows rank ``r`` receives from each rank (the all-to-all's output split sizes)."""
        need = self.need[r]
        return np.diff(np.searchsorted(need, self.cuts)).tolist()

    def send_counts(self, s: int) -> list[int]:
        """Rows rank ``s`` sends each rank (the all-to-all's input split sizes)."""
        lo, hi = self.rank_rows(s)
        return [int(np.searchsorted(nd, hi) - np.searchsorted(nd, lo)) for nd in self.need]

    def send_index(self, s: int) -> np.ndarray:
        """Local indices (``row - lo``) of the rows rank ``s`` sends, destination by destination."""
        lo, _ = self.rank_rows(s)
        parts = [self.recv_rows(r, s) - lo for r in range(self.cp_size)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def exchange(
        self, s: int, device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor, list[int], list[int]]:
        """Rank ``s``'s all-to-all, cached per device: ``(send_index`` on ``device``,
        ``recv_counts(s)``, ``send_counts(s))``."""
        key = ("exchange", s, str(torch.device(device)))
        if key not in self.cache:
            index = torch.from_numpy(self.send_index(s)).to(device)
            self.cache[key] = (index, self.recv_counts(s), self.send_counts(s))
        return self.cache[key]

    def gathered_rows(self, r: int) -> int:
        """Rows rank ``r`` receives (its bound: the strict ancestors of its first row)."""
        return len(self.need[r])

    # --------------------------------------------------------------------- rank-local views
    def key_rows(self, r: int) -> np.ndarray:
        """Rank ``r``'s key rows: ``need[r]`` then its own rows (ascending, closed under ancestors)."""
        lo, hi = self.rank_rows(r)
        return np.concatenate([self.need[r], np.arange(lo, hi, dtype=np.int64)])

    def _host_views(self, r: int) -> AttentionViews:
        keys = self.key_rows(r)
        k, m = len(keys), len(self.need[r])
        gp = self.parent[keys]
        parent = np.where(gp < 0, -1, np.searchsorted(keys, np.maximum(gp, 0)))
        missing = np.nonzero((gp >= 0) & (keys[np.minimum(np.maximum(parent, 0), max(k - 1, 0))] != gp))[0]
        if missing.size:  # need[r] not closed under ancestors: a hand-made plan
            x = int(keys[missing[0]])
            raise InvalidInputError(
                "need", f"rank {r} lacks row {int(self.parent[x])}, the parent of its key row {x}"
            )
        local = np.arange(m, k, dtype=np.int64)
        starts = local[(parent[local] != local - 1) | (local == m)]
        branches = Branches(local, np.append(starts, k) - m)
        if self.end is not None:
            tree = TreeOrder(np.arange(k, dtype=np.int64), np.searchsorted(keys, self.end[keys]))
        else:
            tree = TreeOrder.from_parent(parent)
        return build_views(parent, branches, tree)

    def rank_views(self, r: int, device: str | torch.device = "cpu") -> AttentionViews:
        """Views over rank ``r``'s key rows (:meth:`key_rows`) whose queries are its own rows (the
        last ``hi - lo`` key rows; the gathered rows have none), cached per device."""
        key = ("views", r, str(torch.device(device)))
        if key not in self.cache:
            host = self.cache.setdefault(("views", r), self._host_views(r))
            self.cache[key] = host if torch.device(device).type == "cpu" else host.to(device)
        return self.cache[key]

    def rank_queries(self, r: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_index, q_inverse)`` of rank ``r``, int64, cached per device: the local row (``row -
        lo``) of each packed query of :meth:`rank_views`, and the packed position of each local row."""
        key = ("queries", r, str(torch.device(device)))
        if key not in self.cache:
            views = self.rank_views(r)
            q_index = views.q_index - self.gathered_rows(r)
            q_inverse = torch.empty_like(q_index)
            q_inverse[q_index] = torch.arange(q_index.numel())
            self.cache[key] = (q_index.to(device), q_inverse.to(device))
        return self.cache[key]

    def key_positions(self, r: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """Positions (int64) of rank ``r``'s key rows, cached per device."""
        if self.positions is None:
            raise InvalidInputError("positions", "this plan has none; build it with positions=")
        key = ("positions", r, str(torch.device(device)))
        if key not in self.cache:
            self.cache[key] = torch.from_numpy(self.positions[self.key_rows(r)]).to(device)
        return self.cache[key]

    def stats(self) -> dict:
        """Rows per rank, gathered rows per rank and their sum."""
        g = [self.gathered_rows(r) for r in range(self.cp_size)]
        return {
            "rows": np.diff(self.cuts).tolist(),
            "gathered_rows": g,
            "gathered_total": int(sum(g)),
            "gathered_max": int(max(g, default=0)),
        }


# ---------------------------------------------------------------------------------- collectives
def _group(group):
    return group.get_group() if hasattr(group, "get_group") else group


def gather_needed(t_local: torch.Tensor, plan: StatesAttentionPlan, group) -> torch.Tensor:
    """The rows ``plan.need[rank]`` of a row-wise tensor held by their owners: ``t_local``
    ``[hi - lo, ...]`` is this rank's rows; returns ``[len(need[rank]), ...]`` in ascending row order.
    One ``all_to_all_single_autograd`` over ``group`` with per-rank split sizes (every rank calls it);
    its backward sends each row's gradient back to its owner, where ``index_select``'s backward sums
    it into the row."""
    pg = _group(group)
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    if size != plan.cp_size:
        raise InvalidInputError("group", f"has {size} ranks, the plan splits the rows between {plan.cp_size}")
    lo, hi = plan.rank_rows(rank)
    if t_local.shape[0] != hi - lo:
        raise InvalidInputError(
            "t_local", f"rank {rank} holds rows [{lo}, {hi}) ({hi - lo}), got {t_local.shape[0]} rows"
        )
    tail = tuple(t_local.shape[1:])
    flat = t_local.reshape(hi - lo, math.prod(tail))
    index, recv, send_sizes = plan.exchange(rank, flat.device)
    out = all_to_all_single_autograd(flat.index_select(0, index), recv, send_sizes, pg)
    return out.view(out.shape[0], *tail)


# ---------------------------------------------------------------------------------- attention
def rank_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: StatesAttentionPlan,
    rank: int,
    *,
    backend: str = "reference",
    scale: float | None = None,
) -> torch.Tensor:
    """The attention core of rank ``rank``: its queries ``q`` [n, Hq, Dqk] (its rows ``[lo, hi)``)
    over its key rows (:meth:`StatesAttentionPlan.key_rows`: the ``m`` gathered rows, then its own)
    ``k`` [m + n, Hkv, Dqk], ``v`` [m + n, Hkv, Dv] -> [n, Hq, Dv], with the backends of
    :func:`~harts_runtime.ops.attention.compact_attention` (``backend`` a key of ``BACKENDS`` or
    ``"auto"``; ``scale`` default ``Dqk ** -0.5``). View backends (every ``auto`` choice) read the
    packed queries of the rank's rows only; the tree-mask backends (``flex_tree``, ``dense_tree``)
    run over all key rows, the gathered ones with zero queries whose outputs are dropped. The call
    is the kept region ``"attention"``, as in one process."""
    n, m = q.shape[0], k.shape[0] - q.shape[0]
    if m < 0 or k.shape[0] != v.shape[0]:
        raise InvalidInputError(
            "k/v", f"need the {n} query rows plus the gathered rows, got {k.shape[0]}/{v.shape[0]}"
        )
    if n == 0:  # no local rows: keep the (empty) gathered rows in the graph, so that this rank's
        # backward runs the all-to-all's too (a zero-row core output would be a constant)
        return q.new_zeros(0, q.shape[1], v.shape[-1]) + 0 * (k.sum() + v.sum())
    name = resolve_backend(backend, q.device, q.shape[-1], v.shape[-1], q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    views = plan.rank_views(rank, q.device)
    if m != plan.gathered_rows(rank) or views.num_rows != m + n:
        raise InvalidInputError(
            "k/v",
            f"rank {rank}'s key rows are {views.num_rows} ({plan.gathered_rows(rank)} gathered), got {m + n}",
        )
    if BACKENDS[name].kind == "tree":
        q_all = torch.cat([q.new_zeros((m, *q.shape[1:])), q]) if m else q
        return compact_attention(q_all, k, v, views, backend=name, scale=scale)[m:]
    q_index, q_inverse = plan.rank_queries(rank, q.device)
    with record_function("harts.attn.views"):
        qp = q.index_select(0, q_index)  # [Lq = n, Hq, Dqk]
        kp = k.index_select(0, views.kv_index)  # [Lk, Hkv, Dqk]
        vp = v.index_select(0, views.kv_index)  # [Lk, Hkv, Dv]
    with record_function("harts.attn.core"):
        out = kept("attention", BACKENDS[name].fn, qp, kp, vp, views, scale)
    with record_function("harts.attn.views"):
        return out.index_select(0, q_inverse)


def _core(layer, q, k, v, plan, rank, backend):
    return rank_attention(q, k, v, plan, rank, backend=backend or layer.backend, scale=layer.scale)


def states_attention(
    layer: nn.Module, x_local: torch.Tensor, plan: StatesAttentionPlan, group, backend: str | None = None
) -> torch.Tensor:
    """The output of attention layer ``layer`` (GQA / MHA, gated attention or MLA) on this rank's
    rows: ``x_local`` ``[hi - lo, D]`` (the layer's input, rows ``[lo, hi)`` of ``plan``) ->
    ``[hi - lo, D]``, equal to the one-process layer's output on these rows. Gathers the needed
    rows' K / V (MLA: latent) from the ranks holding them (:func:`gather_needed`, a collective every
    rank of ``group`` calls); ``backend`` defaults to the layer's. Raises
    :class:`InvalidInputError` for a layer it does not know or a plan without positions."""
    pg = _group(group)
    rank = dist.get_rank(pg)
    lo, hi = plan.rank_rows(rank)
    keys_pos = plan.key_positions(rank, x_local.device)
    pos = keys_pos[keys_pos.shape[0] - (hi - lo) :]
    if isinstance(layer, CompactMLA):
        q = layer.queries(x_local, pos)
        kv_a = layer.latent(x_local)
        kv_all = torch.cat([gather_needed(kv_a, plan, pg), kv_a])
        k, v = layer.keys_values(kv_all, keys_pos)
        return layer.out_project(_core(layer, q, k, v, plan, rank, backend), x_local)
    if isinstance(layer, CompactGatedAttention):
        q, k, v, gate = layer.project_gated(x_local, pos)
    elif isinstance(layer, CompactAttentionBase):
        q, k, v = layer.project(x_local, pos)
        gate = None
    else:
        raise InvalidInputError("layer", f"{type(layer).__name__} is not a compact attention layer")
    hkv, dk = k.shape[1], k.shape[2]
    kv = torch.cat([k.flatten(1), v.flatten(1)], dim=1)
    kv_need = gather_needed(kv, plan, pg)
    m = kv_need.shape[0]
    k_all = torch.cat([kv_need[:, : hkv * dk].reshape(m, hkv, dk), k])
    v_all = torch.cat([kv_need[:, hkv * dk :].reshape(m, hkv, v.shape[2]), v])
    o = _core(layer, q, k_all, v_all, plan, rank, backend)
    if gate is not None:
        assert isinstance(layer, CompactGatedAttention)  # the only layer with a gate
        return layer._output(o, gate)
    return layer.out_project(o, x_local)
