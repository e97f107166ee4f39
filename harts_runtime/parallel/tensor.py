"""Tensor and sequence parallelism on DTensor: the ``ParallelStyle``s that :func:`apply_tp` applies
(paper Section 4.3).

Every parameter of a tensor-parallel model is a DTensor over the TP mesh: ``Shard`` where a layer's
plan (:mod:`harts_runtime.parallel.plans`) splits it by heads, ``Replicate`` elsewhere. A layer
never sees a DTensor: its ordinary ``forward(x, layout)`` runs on local tensors, with its
parameters temporarily replaced by their local shards (:func:`local_parameters`), and infers its
head counts from them. The styles differ in how rows enter and leave:

* :class:`TensorParallelRegion` (mixers and dense FFNs): the layer body is a ``local_map`` whose
  input is the replica's rows, ``Replicate``, and whose output is ``Partial`` (each rank's heads
  add a share of the output projection). Entry and exit are DTensor redistributions, one
  collective each per layer and direction:

  =========  =====================================  ========================================
  mode       entry (rows in)                          exit (rows out)
  =========  =====================================  ========================================
  TP         ``Replicate``; backward all-reduce       ``Partial -> Replicate``: all-reduce
  TP + SP    ``Shard(0) -> Replicate``: all-gather    ``Partial -> Shard(0)``: reduce-scatter
  =========  =====================================  ========================================

  Inside a region every rank sees all rows of the replica, so the row-indexed metadata (attention
  views, KDA call plans, positions) is the replica's full one: the cores run on local heads with
  the call plan unchanged. Replicated parameters of a region (latent projections, per-head-dim
  norms) get ``Partial`` gradients: each rank saw only its own heads downstream.
* :class:`ReplicatedParameters` (norms, MoE router, experts and shared experts outside EP, the
  final norm): parameters ``Replicate``, the rows as they come (all of them, or this rank's block
  under SP). Under SP the gradients are ``Partial`` (each rank saw only its rows), otherwise
  ``Replicate`` (every rank computed the same gradient).
* the embedding: torch's ``RowwiseParallel`` (vocabulary rows sharded, masked lookup, then an
  all-reduce, or a reduce-scatter of the rows under SP);
* :class:`VocabParallelHead` (the LM head): vocabulary rows sharded; the fused chunked log-probs of
  :func:`harts_runtime.loss.logprobs.lm_head_logprobs` over the local vocabulary with the TP group,
  two collectives of per-row scalars per microbatch and never a ``[rows, V]`` block (Section 3.5).

FSDP2 reduces ``Partial`` TP gradients together with its DP reduce-scatter, so nothing here sums
gradients by hand.

Sequence parallelism splits the N compact rows of a replica in DTensor's ``Shard(0)`` convention
(:func:`row_block`: ``ceil(N / tp)`` rows per rank, the last ranks fewer or none), so any row count
works without padding rows the model sees.
"""

from __future__ import annotations

import contextlib
import functools
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import local_map
from torch.distributed.tensor.parallel import ParallelStyle

from harts_runtime.parallel.plans import LayerPlan

__all__ = [
    "ReplicatedParameters",
    "SequenceParallelRows",
    "TensorParallelRegion",
    "VocabParallelHead",
    "distribute_parameters",
    "gather_rows",
    "local_parameters",
    "row_block",
    "sum_partials",
]


def row_block(n: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s rows of ``n`` under DTensor's ``Shard(0)`` split
    (``torch.chunk``: ``ceil(n / world)`` rows per rank, the last ranks fewer or none)."""
    per = -(-n // world) if n else 0
    start = min(n, rank * per)
    return start, min(n, start + per)


def gather_rows(x: torch.Tensor, mesh, n: int) -> torch.Tensor:
    """All ``n`` rows from each rank's ``Shard(0)`` block ``x`` over the 1-D ``mesh`` (all-gather;
    backward: reduce-scatter of the partial row gradients). Blocks as :func:`row_block`."""
    shape = (n, *x.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    d = DTensor.from_local(x, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
    return d.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def sum_partials(t: torch.Tensor, mesh) -> torch.Tensor:
    """The sum over the 1-D ``mesh`` of each rank's partial ``t`` (all-reduce), replicated; backward:
    the identity (every rank evaluates the same function of the sum)."""
    d = DTensor.from_local(t, mesh, [Partial()], run_check=False)
    return d.redistribute(mesh, [Replicate()]).to_local()


def _resolve(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    sub, _, leaf = name.rpartition(".")
    return (module.get_submodule(sub) if sub else module), leaf


def distribute_parameters(module: nn.Module, mesh, placements: dict[str, tuple]) -> None:
    """Replace each named parameter of ``module`` by a DTensor over ``mesh`` with the given
    placements (every rank must hold the same full values; rank 0's are distributed)."""
    for name, pl in placements.items():
        sub, leaf = _resolve(module, name)
        p = sub._parameters[leaf]
        assert p is not None, name  # a registered parameter (not a None placeholder)
        if isinstance(p, DTensor):
            continue
        d = distribute_tensor(p.data, mesh, list(pl))
        sub.register_parameter(leaf, nn.Parameter(d, requires_grad=p.requires_grad))


@contextlib.contextmanager
def local_parameters(module: nn.Module, names: list[str], tensors: list[torch.Tensor]):
    """Within the block, ``module``'s parameters ``names`` read as ``tensors`` (plain local tensors,
    still connected to the DTensor parameters by autograd); restored on exit. Parameter names and
    ``named_parameters()`` outside the block are unchanged (this is what FSDP2 does to present its
    unsharded parameters)."""
    slots = [_resolve(module, n) for n in names]
    saved = [sub._parameters[leaf] for sub, leaf in slots]
    try:
        for (sub, leaf), t in zip(slots, tensors):
            # Plain tensors in _parameters on purpose (what FSDP2 does); torch types it Parameter.
            sub._parameters[leaf] = t  # pyright: ignore[reportArgumentType]
        yield
    finally:
        for (sub, leaf), p in zip(slots, saved):
            sub._parameters[leaf] = p


def _params(module: nn.Module, names: list[str]) -> list[torch.Tensor]:
    out = [_resolve(module, n)[0]._parameters[_resolve(module, n)[1]] for n in names]
    assert all(p is not None for p in out), names  # registered parameters (not None placeholders)
    return cast(list[torch.Tensor], out)


def _install_forward(module: nn.Module, forward) -> None:
    """Route ``module(...)`` through ``forward(orig_forward, *args)``; hooks (FSDP2's) still run
    around it, and parameter names do not change."""
    orig = module.forward
    module.forward = functools.partial(forward, orig)


def _partial_grads(placements: tuple) -> tuple:
    return tuple(Partial() if isinstance(p, Replicate) else p for p in placements)


def _cp_block_rows(layout, n: int, cp_mesh) -> int:
    """The rows of this rank's CP block of a microbatch of ``n`` rows: the split's range under
    ``cp_mode`` ``"states"`` / ``"auto"`` (``layout.info["cp_rows"]``), else :func:`row_block`'s."""
    held = getattr(layout, "info", {}).get("cp_rows")
    if held is not None:
        start, end = held.block
    else:
        start, end = row_block(n, cp_mesh.size(), cp_mesh.get_local_rank())
    return end - start


class TensorParallelRegion(ParallelStyle):
    """A layer split by heads (or FFN width) per its :class:`LayerPlan`; see the module docstring.

    ``forward(x, layout, ...)``: ``x`` [N, D] are all rows of the replica, or under sequence
    parallelism this rank's :func:`row_block` of ``layout.num_rows`` rows; the output has the
    same rows as ``x``.
    """

    def __init__(self, plan: LayerPlan, sequence_parallel: bool = False, cp_mesh=None):
        super().__init__()
        self.plan, self.sequence_parallel = plan, bool(sequence_parallel)
        self.cp_mesh = cp_mesh  # under context parallelism the replica's rows are this CP block

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        names = list(self.plan.placements)
        placements = [(self.plan.placements[n],) for n in names]
        distribute_parameters(module, device_mesh, dict(zip(names, placements)))
        sp, cp_mesh = self.sequence_parallel, self.cp_mesh

        def body(orig, layout, x, *local):
            with local_parameters(module, names, list(local)):
                return orig(x, layout)

        def forward(orig, x, layout=None):
            mesh = device_mesh
            d = x.shape[-1]
            if sp:
                assert layout is not None  # sequence parallelism runs with the microbatch's layout
                n = layout.num_rows
                if cp_mesh is not None:  # the rows of this rank's CP block (parallel.context)
                    n = _cp_block_rows(layout, n, cp_mesh)
                xd = DTensor.from_local(
                    x, mesh, [Shard(0)], run_check=False, shape=torch.Size((n, d)), stride=(d, 1)
                )
                xd = xd.redistribute(mesh, [Replicate()])
            else:
                xd = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            fn = local_map(
                functools.partial(body, orig, layout),  # the layout is the replica's, on every rank
                out_placements=[Partial()],
                in_placements=((Replicate(),), *placements),
                in_grad_placements=((Partial(),), *map(_partial_grads, placements)),
                device_mesh=mesh,
            )
            # local_map's stub returns an untyped callable; with out_placements its output is a DTensor.
            out = cast(DTensor, fn(xd, *_params(module, names)))
            return out.redistribute(mesh, [Shard(0)] if sp else [Replicate()]).to_local()

        _install_forward(module, forward)
        # torch's stub types Module.__setattr__'s value as Tensor | Module; any attribute is allowed.
        module._harts_tp = {"plan": self.plan, "sequence_parallel": sp}  # pyright: ignore[reportArgumentType]
        return module


class ReplicatedParameters(ParallelStyle):
    """Parameters ``Replicate`` over ``device_mesh``; the module runs on local rows with local
    parameters. ``partial_grad``: each rank's gradient is a partial sum (its rows are a share of the
    replica's, under sequence parallelism). ``placements`` overrides single parameters (used for
    the routed experts under EP: ``Shard(0)`` over the EP dimension of a 2-D mesh)."""

    def __init__(self, partial_grad: bool, placements: dict[str, tuple] | None = None, grads=None):
        super().__init__()
        self.partial_grad = bool(partial_grad)
        self.placements = dict(placements or {})
        self.grads = dict(grads or {})

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        nd = device_mesh.ndim
        rep = tuple(Replicate() for _ in range(nd))
        names = [n for n, _ in module.named_parameters()]
        pl = {n: self.placements.get(n, rep) for n in names}
        distribute_parameters(module, device_mesh, pl)
        default_grad = tuple(Partial() for _ in range(nd)) if self.partial_grad else rep
        grads = [self.grads.get(n, default_grad if n not in self.placements else pl[n]) for n in names]

        def forward(orig, *args, **kwargs):
            params = _params(module, names)
            local = [
                p.to_local(grad_placements=g) if isinstance(p, DTensor) else p for p, g in zip(params, grads)
            ]
            with local_parameters(module, names, local):
                return orig(*args, **kwargs)

        _install_forward(module, forward)
        return module


class VocabParallelHead(ParallelStyle):
    """The untied, bias-free LM head ``[V, D]`` split by vocabulary rows (``Shard(0)``; any V).

    Installs ``mapped_logprobs(hidden, row_index, labels, chunks, rows)`` on the head, which
    :meth:`harts_runtime.models.HybridModel.logprobs` calls: the hidden rows enter as a
    ``Replicate`` region input (all-gathered under SP; backward all-reduce / reduce-scatter of
    ``dhidden``), then :func:`~harts_runtime.loss.logprobs.lm_head_logprobs` over the local
    ``[V_r, D]`` shard with the TP group: ``all_reduce(MAX)`` of N row maxima and
    ``all_reduce(SUM)`` of N + P scalars forward, nothing else; its backward recomputes each row
    chunk's local logits. ``forward(hidden)`` (evaluation only) gathers full ``[n, V]`` logits.
    """

    def __init__(self, sequence_parallel: bool = False, backend: str = "auto"):
        super().__init__()
        self.sequence_parallel, self.backend = bool(sequence_parallel), backend

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from harts_runtime.errors import ParallelConfigError
        from harts_runtime.layout.rows import lm_chunks
        from harts_runtime.loss.logprobs import lm_head_logprobs
        from harts_runtime.modules.fused import use_fla

        if not isinstance(module, nn.Linear) or module.bias is not None:
            raise ParallelConfigError(
                "lm_head", "a vocabulary-parallel LM head must be a bias-free nn.Linear"
            )
        if module.weight.shape[0] < device_mesh.size():
            raise ParallelConfigError(
                "vocab_size",
                f"{module.weight.shape[0]} < tp={device_mesh.size()}: a rank would hold no vocabulary",
            )
        distribute_parameters(module, device_mesh, {"weight": (Shard(0),)})
        sp, mesh, backend = self.sequence_parallel, device_mesh, self.backend
        group = mesh.get_group()

        def vocab_start() -> int:
            v, w, r = module.weight.shape[0], mesh.size(), mesh.get_local_rank()
            return row_block(v, w, r)[0]

        def mapped_logprobs(hidden, row_index, labels, chunks, rows, num_rows=None):
            if sp:
                total = _sp_rows(hidden.shape[0], group) if num_rows is None else int(num_rows)
                h = gather_rows(hidden, mesh, total)
            else:
                h = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
                h = h.to_local(grad_placements=[Partial()])
            w = module.weight
            w = w.to_local() if isinstance(w, DTensor) else w
            if chunks is None:
                chunks = lm_chunks(row_index.cpu().numpy(), h.shape[0], rows)
            return lm_head_logprobs(
                h,
                w,
                row_index,
                labels,
                chunks,
                rows,
                vocab_start=vocab_start(),
                group=group,
                fla_kernels=use_fla(h, backend),
            )

        def forward(orig, hidden):
            with torch.no_grad():
                w = module.weight
                local = hidden @ (w.to_local() if isinstance(w, DTensor) else w).t()
                v = w.shape[0]
                return DTensor.from_local(
                    local,
                    mesh,
                    [Shard(local.dim() - 1)],
                    run_check=False,
                    shape=torch.Size((*local.shape[:-1], v)),
                ).full_tensor()

        # torch's stub types Module.__setattr__'s value as Tensor | Module; any attribute is allowed.
        module.mapped_logprobs = mapped_logprobs  # pyright: ignore[reportArgumentType]
        _install_forward(module, forward)
        return module


def _sp_rows(local_rows: int, group) -> int:
    """Total rows of a sequence-parallel tensor whose local block has ``local_rows`` rows, by a tiny
    all-reduce (for callers that do not pass the layout's row count)."""
    t = torch.tensor([local_rows], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, group=group)
    return int(t.item())


class SequenceParallelRows:
    """The ``row_shard`` of a :class:`harts_runtime.layers.moe.CompactMoE` under sequence
    parallelism (a plain attribute: the single-process MoE imports nothing from here).

    Each TP rank routes only its :func:`row_block` of the replica's N rows, but the layout's
    multiplicities ``q_c`` cover all N rows and the router losses are nonlinear in row sums
    (``E / (k S^2) sum_e P_e f_e``, ``z / S``). :meth:`select` slices ``q`` to this rank's block;
    :meth:`reduce` sums the per-block partial statistics over TP as a DTensor ``Partial ->
    Replicate`` redistribution (forward all-reduce of ``2E + 2`` scalars; backward identity, because
    every TP rank evaluates the same replicated loss from the summed statistics).
    """

    def __init__(self, mesh):
        self.mesh = mesh
        self.rank, self.size = mesh.get_local_rank(), mesh.size()

    def select(self, multiplicity: torch.Tensor, n: int) -> torch.Tensor:
        from harts_runtime.errors import ParallelConfigError

        start, end = row_block(multiplicity.shape[0], self.size, self.rank)
        if end - start != n:
            raise ParallelConfigError(
                "multiplicity",
                f"{multiplicity.shape[0]} rows split over tp={self.size} give rank {self.rank} "
                f"{end - start} rows, but the MoE input has {n}",
            )
        return multiplicity[start:end]

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return sum_partials(partial, self.mesh)
