"""Context parallelism over rollout trees: one microbatch of up to ``C x T`` compact rows on the C
ranks of a CP group (``docs/parallel.md``, "Context parallelism").

This module is the head-parallel mode (``cp_mode="heads"``) and the row map both modes share; the
state-passing mode (``cp_mode="states"``, and ``"auto"`` per layer) is
:mod:`harts_runtime.parallel.context_states`, whose microbatches give each rank the planner's
split of the rows instead of :func:`row_block`'s (:class:`RowMap`, :func:`gather_cp`,
:func:`scatter_cp`).

Design: rows split for the row-local work, heads split for the mixers (head-parallel CP, the
Ulysses family; ``docs/parallel.md`` compares it with state passing):

=====================  ========================================================================
part                   under ``cp = C`` (rank ``c`` of the CP group)
=====================  ========================================================================
embedding              the input ids of this rank's *row block* only (:func:`cp_rows`:
                       ``row_block(N, C, c)``, contiguous physical rows, ``ceil(N / C)`` each)
norms, dense FFN, MoE  this rank's row block (MoE: its rows' multiplicities; the router
                       statistics summed over CP, :class:`ContextParallelRows`)
mixers                 a :class:`ContextParallelMixer`: the normed input rows all-gathered over
                       CP to all N rows, the *unchanged* one-process mixer on ``1 / C`` of its
                       heads (its weights sliced by head, :func:`cp_plan`) with the microbatch's
                       full call plan (KDA / GDN rounds, replay, fork states, short convolutions,
                       attention's ancestor views: every head sees every row of its trees), the
                       output's partial sums reduce-scattered back to the row blocks
MLA                    the latent, not K/V, nor the input: each rank projects its rows' KV latent
                       (``r_kv + rope`` = 576 values per row in DeepSeek / Ling) and queries; the
                       latent is all-gathered, the queries go rows -> heads (all-to-all), the
                       core runs on its heads over all rows, its output goes heads -> rows
                       (all-to-all) into ``o_proj`` on the rank's rows
LM head                the log-probs of the targets whose rows this rank holds, summed over CP
                       into the microbatch's ``[P]`` (every CP rank then evaluates the same loss)
=====================  ========================================================================

Exactness: every head of every mixer computes exactly what one process computes (same rows, same
call plan, same chunk partition); every row-local op runs once, on the rank holding the row. The
gradients of a rank's parameters are partial (its rows, its heads), and FSDP2 sums them over
``dp_shard x cp`` (:meth:`~harts_runtime.parallel.dims.ParallelMesh.fsdp`). The per-microbatch loss
is replicated over CP (log-probs and router statistics are summed forward, their backward is the
identity), so the step loss is summed over DP only.

Collectives per mixer layer and microbatch (forward; the backward mirrors them, block recomputation
repeats the forward's): an all-gather of ``[N, D]`` rows and a reduce-scatter of ``[N, D]``
partial rows over CP (DTensor ``Shard(0) -> Replicate`` and ``Partial -> Shard(0)`` on the CP
submesh); for MLA an all-gather of the ``[N, r_kv + rope]`` latent and two all-to-alls of
``[N / C, H, Dqk]`` queries and ``[N / C, H, Dv]`` outputs. Per microbatch: an all-reduce of the ``P`` log-probs; per MoE layer: one of ``2E + 2``
router statistics. The degree is capped by the head count: C (times ``tp``) must divide every
mixer's heads (key heads for the gated delta net); a GQA layer with fewer KV heads than ranks gives
each rank the KV head of its query heads.

Composition: under TP the CP mixer runs inside the TP region on the TP rank's local heads (the CP
slices are slices of those); under sequence parallelism each TP rank holds a :func:`row_block` of
its CP block. EP exchanges rows between the EP ranks of one CP coordinate.
"""

from __future__ import annotations

import functools
from typing import cast

import numpy as np
import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Partial, Shard

from harts_runtime.errors import ParallelConfigError
from harts_runtime.layers.mla import CompactMLA
from harts_runtime.layers.moe import CompactMoE
from harts_runtime.ops.attention import compact_attention
from harts_runtime.parallel.cp_heads import GROUP, cp_plan
from harts_runtime.parallel.plans import COL, REP, ROW, model_blocks
from harts_runtime.parallel.tensor import _params, gather_rows, local_parameters, row_block, sum_partials

__all__ = [
    "ContextParallelRows",
    "RowMap",
    "apply_cp_head",
    "apply_cp_rows",
    "cp_plan",
    "cp_rows",
    "gather_cp",
    "scatter_cp",
    "scatter_rows",
]


def cp_rows(n: int, cp_mesh) -> tuple[int, int]:
    """``[start, end)``: this rank's block of a microbatch's ``n`` physical rows."""
    return row_block(n, cp_mesh.size(), cp_mesh.get_local_rank())


def scatter_rows(y: torch.Tensor, cp_mesh) -> torch.Tensor:
    """This rank's row block of the sum over CP of the partial rows ``y`` (reduce-scatter; backward:
    all-gather)."""
    return (
        DTensor.from_local(y, cp_mesh, [Partial()], run_check=False)
        .redistribute(cp_mesh, [Shard(0)])
        .to_local()
    )


def _blocks(n: int, cp_mesh) -> list[int]:
    size = cp_mesh.size()
    return [end - start for start, end in (row_block(n, size, r) for r in range(size))]


def rows_to_heads(x: torch.Tensor, cp_mesh, n: int, rows=None) -> torch.Tensor:
    """This rank's rows ``x`` ``[n_c, H, d]`` of all heads -> all ``n`` rows (physical order) of its
    head block ``[n, H / C, d]`` (an all-to-all; backward: the reverse all-to-all). ``rows``: the
    microbatch's :class:`~harts_runtime.parallel.context_states.CpRows` (None: row blocks)."""
    size, (mine, h, d) = cp_mesh.size(), x.shape
    hc = h // size
    sizes = _blocks(n, cp_mesh) if rows is None else rows.sizes
    send = x.reshape(mine, size, hc * d).transpose(0, 1).reshape(size * mine, hc * d)
    out = all_to_all_single_autograd(send, sizes, [mine] * size, cp_mesh.get_group()).view(n, hc, d)
    if rows is not None and not rows.identity:
        out = out.index_select(0, rows.tensor("p2r", x.device))
    return out


def heads_to_rows(x: torch.Tensor, cp_mesh, rows=None) -> torch.Tensor:
    """All rows (physical order) of this rank's head block ``[n, H / C, d]`` -> its rows of all heads
    ``[n_c, H, d]`` (the inverse of :func:`rows_to_heads`)."""
    size, (n, hc, d) = cp_mesh.size(), x.shape
    if rows is None:
        start, end = cp_rows(n, cp_mesh)
        sizes = _blocks(n, cp_mesh)
    else:
        (start, end), sizes = rows.block, rows.sizes
        if not rows.identity:
            x = x.index_select(0, rows.tensor("r2p", x.device))
    mine = end - start
    out = all_to_all_single_autograd(x.reshape(n, hc * d), [mine] * size, sizes, cp_mesh.get_group())
    return out.view(size, mine, hc, d).transpose(0, 1).reshape(mine, size * hc, d)


class RowMap:
    """The rows each CP rank holds in the microbatch now running: the layout's
    ``info["cp_rows"]`` (:class:`~harts_runtime.parallel.context_states.CpRows`, the split's row
    ranges under ``cp_mode="states"``), set by a forward pre-hook on the model; without it,
    :func:`row_block` ranges (heads mode)."""

    def __init__(self, cp_mesh):
        self.mesh, self.current, self._blocks = cp_mesh, None, {}

    def set(self, layout) -> None:
        self.current = getattr(layout, "info", {}).get("cp_rows")

    def get(self, n: int):
        from harts_runtime.parallel.context_states import CpRows

        cur = self.current
        if cur is not None:
            if cur.num_rows != n:
                raise ParallelConfigError(
                    "cp_rows", f"the microbatch's split holds {cur.num_rows} rows, the layer sees {n}"
                )
            return cur
        rows = self._blocks.get(n)
        if rows is None:
            rows = self._blocks[n] = CpRows.blocks(n, self.mesh.size(), self.mesh.get_local_rank())
        return rows


def _is_blocks(rows) -> bool:
    return rows.identity and rows.offsets == [
        row_block(rows.num_rows, len(rows.sizes), r)[0] for r in range(len(rows.sizes))
    ] + [rows.num_rows]


def _pad_index(rows, device) -> torch.Tensor:
    """For every physical row, its place in the all-gather of per-rank blocks padded to the largest."""
    key = ("pad", str(device))
    t = (rows._dev or {}).get(key)
    if t is None:
        m = max(rows.sizes)
        rank = np.searchsorted(np.asarray(rows.offsets), np.arange(rows.num_rows), side="right") - 1
        padpos = rank * m + np.arange(rows.num_rows) - np.asarray(rows.offsets)[rank]
        t = torch.from_numpy(padpos[rows.p2r].astype(np.int64)).to(device)
        if rows._dev is None:
            rows._dev = {}
        rows._dev[key] = t
    return t


def gather_cp(x: torch.Tensor, cp_mesh, rows) -> torch.Tensor:
    """All rows, in physical order, from each rank's rows ``x`` (its rows of ``rows``, in row order):
    the all-gather of :func:`gather_rows` (blocks padded to the largest when the ranges are uneven,
    then put in physical order)."""
    n = rows.num_rows
    if _is_blocks(rows):
        return gather_rows(x, cp_mesh, n)
    m, size = max(rows.sizes), cp_mesh.size()
    pad = torch.cat([x, x.new_zeros(m - x.shape[0], *x.shape[1:])])
    return gather_rows(pad, cp_mesh, size * m).index_select(0, _pad_index(rows, x.device))


def scatter_cp(y: torch.Tensor, cp_mesh, rows) -> torch.Tensor:
    """This rank's rows (row order) of the sum over CP of the partial rows ``y`` (physical order):
    the reduce-scatter of :func:`scatter_rows`, padded as :func:`gather_cp`."""
    if _is_blocks(rows):
        return scatter_rows(y, cp_mesh)
    m, size = max(rows.sizes), cp_mesh.size()
    start, end = rows.block
    pad = y.new_zeros(size * m, *y.shape[1:]).index_copy(0, _pad_index(rows, y.device), y)
    return scatter_rows(pad, cp_mesh)[: end - start]


# ---------------------------------------------------------------------------------- head slices
def _slice(t: torch.Tensor, how, rank: int, cp: int, head_dim: int) -> torch.Tensor:
    if how == REP or cp == 1:
        return t
    if how == GROUP:  # the one KV head of this rank's query heads
        kv = t.shape[0] // head_dim
        h = rank * kv // cp
        return t[h * head_dim : (h + 1) * head_dim]
    dim = 0 if how == COL else 1
    if how not in (COL, ROW):
        raise ParallelConfigError("cp", f"no CP slice for placement {how!r}")
    return t.chunk(cp, dim)[rank].contiguous()


class ContextParallelMixer:
    """Installs the CP forward on a mixer (see the module docstring): ``forward(x, layout)`` takes
    this rank's row block ``x`` ``[n_c, D]`` (or under SP inside a TP region, the rows of this CP
    block) and returns the same rows of the mixer output."""

    def __init__(self, slices: dict[str, object], cp_mesh, row_map: RowMap | None = None):
        self.slices, self.mesh = slices, cp_mesh
        self.row_map = row_map or RowMap(cp_mesh)

    def apply(self, module: nn.Module) -> nn.Module:
        orig = module.forward
        module.forward = self.forward_of(module)
        # torch's stub types Module.__setattr__'s value as Tensor | Module; any attribute is allowed.
        module._harts_cp = {"slices": self.slices, "cp": self.mesh.size()}  # pyright: ignore[reportArgumentType]
        del orig
        return module

    def forward_of(self, module: nn.Module):
        """The CP forward of ``module`` (not installed)."""
        names = list(self.slices)
        mesh, slices, row_map = self.mesh, self.slices, self.row_map
        rank, size = mesh.get_local_rank(), mesh.size()
        head_dim = getattr(module.config, "head_dim", None) or 0
        orig = module.forward

        def forward(x, layout=None):
            assert layout is not None  # a CP mixer runs on the microbatch's layout
            rows = row_map.get(layout.num_rows)
            full = gather_cp(x, mesh, rows)
            params = _params(module, names)
            local = [_slice(p, slices[n], rank, size, head_dim) for n, p in zip(names, params)]
            with local_parameters(module, names, local):
                y = orig(full, layout)
            return scatter_cp(y, mesh, rows)

        if not isinstance(module, CompactMLA):
            return functools.update_wrapper(forward, orig)
        mla = module

        def forward_mla(x, layout=None):
            # the latent, not K/V: each rank projects its rows' latent and queries, gathers the
            # latent [N, r_kv + rope] and exchanges queries rows -> heads, runs the core on its
            # heads over all rows, and brings the outputs back heads -> rows for o_proj
            assert layout is not None  # a CP mixer runs on the microbatch's layout
            n = layout.num_rows
            rows = row_map.get(n)
            positions = layout.need("positions")
            kv_a = gather_cp(mla.latent(x), mesh, rows)
            q = rows_to_heads(
                mla.queries(x, positions.index_select(0, rows.tensor("mine", x.device))), mesh, n, rows
            )
            (w,) = _params(mla, ["kv_b_proj.weight"])
            with local_parameters(mla, ["kv_b_proj.weight"], [_slice(w, COL, rank, size, 0)]):
                k, v = mla.keys_values(kv_a, positions)
            o = compact_attention(q, k, v, layout.need("views"), backend=mla.backend, scale=mla.scale)
            return mla.out_project(heads_to_rows(o, mesh, rows), x)

        return functools.update_wrapper(forward_mla, orig)


# ---------------------------------------------------------------------------------- rows
class ContextParallelRows:
    """The ``row_shard`` of a :class:`~harts_runtime.layers.moe.CompactMoE` under CP: each CP rank
    routes its row block, so :meth:`select` slices the layout's multiplicities ``q`` to it (then to
    the TP rank's block under SP, ``inner``), and :meth:`reduce` sums the partial router statistics
    over TP (``inner``) and CP (forward all-reduce, backward identity)."""

    def __init__(self, cp_mesh, inner=None, row_map: RowMap | None = None):
        self.mesh, self.inner = cp_mesh, inner
        self.row_map = row_map or RowMap(cp_mesh)

    def select(self, multiplicity: torch.Tensor, n: int) -> torch.Tensor:
        rows = self.row_map.get(multiplicity.shape[0])
        if _is_blocks(rows):
            start, end = rows.block
            q = multiplicity[start:end]
        else:
            q = multiplicity.index_select(0, rows.tensor("mine", multiplicity.device))
        if self.inner is not None:
            return self.inner.select(q, n)
        if q.shape[0] != n:
            raise ParallelConfigError(
                "multiplicity",
                f"{multiplicity.shape[0]} rows split over cp={self.mesh.size()} give rank "
                f"{self.mesh.get_local_rank()} {q.shape[0]} rows, but the MoE input has {n}",
            )
        return q

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.inner is not None:
            partial = self.inner.reduce(partial)
        return sum_partials(partial, self.mesh)


def _select_ids(row_map: RowMap):
    def hook(module, args):
        ids = args[0]
        rows = row_map.get(ids.shape[0])
        if _is_blocks(rows):
            start, end = rows.block
            return (ids[start:end], *args[1:])
        return (ids.index_select(0, rows.tensor("mine", ids.device)), *args[1:])

    return hook


def apply_cp_rows(
    model: nn.Module, mesh, cp_mode: str = "heads", *, recompute: bool = False, capacity: int | None = None
) -> list[tuple[str, ...]]:
    """The first half of CP, applied before TP: every mixer gets its CP forward and the embedding
    reads its rank's rows' ids. ``cp_mode`` ``"heads"``: every mixer a :class:`ContextParallelMixer`
    (heads sliced per :func:`cp_plan`) on ``row_block`` rows; ``"states"`` or ``"auto"``: each
    microbatch is split by the planner (``make_microbatch`` calls
    :func:`~harts_runtime.parallel.context_states.attach_cp_rows`), and each mixer runs the mode the
    microbatch's plan gives it (:class:`~harts_runtime.parallel.context_states.CpChooser`: every
    mixer by state passing, or per layer from the counted-bytes model). Returns every block's
    possible modes (``model._harts_cp_modes``); ``capacity``: the per-rank rows T a split may give a
    rank (None: unchecked). Raises :class:`ParallelConfigError` naming the field
    for a mixer CP cannot split, ``cp_mode`` for an unknown mode or one that cannot run a layer."""
    from harts_runtime.parallel.context_states import CpChooser, attach_cp_rows, states_forward

    dims, cp_mesh = mesh.dims, mesh.cp
    chooser = CpChooser.of(model, cp_mode, dims.cp, dims.tp, recompute)
    row_map = RowMap(cp_mesh)
    # torch's stub types Module.__setattr__'s value as Tensor | Module; any attribute is allowed.
    model._harts_cp_rows = row_map  # pyright: ignore[reportArgumentType]
    model._harts_cp_modes = chooser.possible  # pyright: ignore[reportArgumentType] (as above)
    model.register_forward_pre_hook(lambda mod, args: row_map.set(args[0] if args else None))
    if cp_mode != "heads":
        model._harts_cp_layout = functools.partial(  # pyright: ignore[reportArgumentType] (as above)
            attach_cp_rows, cp_mesh=cp_mesh, chooser=chooser, capacity=capacity
        )
    model.get_submodule("embed").register_forward_pre_hook(_select_ids(row_map))
    for i, (block, possible) in enumerate(zip(model_blocks(model), chooser.possible)):
        if block.mixer is None:
            continue
        module, forwards = block.mixer, {}
        if "heads" in possible:
            slices = cp_plan(module, dims.tp, dims.cp, f" (blocks[{i}].mixer)")
            forwards["heads"] = ContextParallelMixer(slices, cp_mesh, row_map).forward_of(module)
        if "states" in possible:
            forwards["states"] = states_forward(module, cp_mesh)
        if cp_mode == "heads":
            module.forward = forwards["heads"]
            module._harts_cp = {"slices": slices, "cp": dims.cp}  # pyright: ignore[reportArgumentType] (as above)
            continue

        def forward(x, layout=None, i=i, forwards=forwards):
            assert layout is not None  # a CP mixer runs on the microbatch's layout
            modes = row_map.get(layout.num_rows).modes
            if modes is None:
                raise ParallelConfigError(
                    "cp_mode", "the microbatch has no CP plan: build it with make_microbatch on this model"
                )
            return forwards[modes[i]](x, layout)

        module.forward = functools.update_wrapper(forward, forwards[possible[0]])
        module._harts_cp = {"modes": possible, "cp": dims.cp}  # pyright: ignore[reportArgumentType] (as above)
    return chooser.possible


def apply_cp_head(model: nn.Module, mesh, backend: str = "auto") -> None:
    """The second half of CP, applied after TP: the LM head's log-probs of this rank's rows summed
    over CP (around the vocabulary-parallel head's under TP), and every MoE's rows and statistics
    (:class:`ContextParallelRows`, around sequence parallelism's)."""
    from harts_runtime.layout.rows import lm_chunks
    from harts_runtime.loss.logprobs import lm_head_logprobs
    from harts_runtime.modules.fused import use_fla

    cp_mesh = mesh.cp
    row_map = getattr(model, "_harts_cp_rows", None) or RowMap(cp_mesh)
    head = model.get_submodule("lm_head")
    inner = getattr(head, "mapped_logprobs", None)

    def mapped_logprobs(hidden, row_index, labels, chunks, rows, num_rows=None):
        if num_rows is None:
            raise ParallelConfigError("num_rows", "context parallelism needs the microbatch's row count")
        held = row_map.get(int(num_rows))
        start, end = held.block
        split_row = (
            row_index if held.identity else held.tensor("p2r", row_index.device).index_select(0, row_index)
        )
        mine = torch.nonzero((split_row >= start) & (split_row < end)).flatten()
        r_local, l_local = split_row.index_select(0, mine) - start, labels.index_select(0, mine)
        if inner is not None:
            lp = inner(hidden, r_local, l_local, None, rows, end - start)
        else:
            w = cast(torch.Tensor, head.weight)  # the Linear's weight (torch types Module attributes loosely)
            local_chunks = lm_chunks(r_local.cpu().numpy(), end - start, rows)
            lp = lm_head_logprobs(
                hidden, w, r_local, l_local, local_chunks, rows, fla_kernels=use_fla(hidden, backend)
            )
        out = lp.new_zeros(row_index.shape[0]).index_copy(0, mine, lp)
        return sum_partials(out, cp_mesh).clone()  # not a view: FSDP2 hooks the root's outputs

    # torch's stub types Module.__setattr__'s value as Tensor | Module; any attribute is allowed.
    head.mapped_logprobs = mapped_logprobs  # pyright: ignore[reportArgumentType]
    for block in model_blocks(model):
        if isinstance(block.ffn, CompactMoE):  # the FFN with a row_shard
            block.ffn.row_shard = ContextParallelRows(cp_mesh, block.ffn.row_shard, row_map)
