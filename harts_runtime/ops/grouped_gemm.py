"""Grouped matmul of expert-sorted rows: :func:`grouped_mm` and :func:`gate_up_mm`.

The expert products of the grouped MoE path (:class:`~harts_runtime.layers.moe.CompactMoE`, and
:class:`~harts_runtime.parallel.expert.ExpertDispatch` on each rank's local experts), on rows
already sorted by expert (:mod:`harts_runtime.ops.dispatch`):

* :func:`grouped_mm` ``(x [M, K], w [E, K, N], counts int [E]) -> [M, N]``: the ``counts[e]``
  consecutive rows of group ``e`` (``sum(counts) = M``; empty groups allowed) times ``w[e]``,
  differentiable in ``x`` and ``w``;
* :func:`gate_up_mm` ``(x [M, D], w_gate [E, D, I], w_up [E, D, I], counts) -> [M, 2I]``: the
  grouped matmul with ``[w_gate | w_up]`` [E, D, 2I], the gate product in the first I columns (one
  GEMM for both projections). On the ``torch._grouped_mm`` path the concatenation is made inside
  the forward and again inside the backward, never saved between them (:class:`_GateUpGroupedMM`);
  the parameters stay separate for the state-dict adapters and expert parallelism.

``impl`` selects the kernel: ``"grouped_mm"`` (``torch._grouped_mm`` with the int32 offsets
``cumsum(counts)``, computed on the device, or passed as ``offs`` when several matmuls share one
grouping), ``"bmm"`` (each group's rows padded into [E, max_count, K], one batched matmul) or
``"auto"``: the first where :func:`_grouped_mm_ok` allows it and ``M > 0``, else the second.

Host synchronisation: on CUDA ``torch._grouped_mm`` issues no device-to-host copy and
no data-dependent output shape, forward or backward, when it takes its fast path: bf16 inputs and
weights, compute capability 9.x or 10.x (PyTorch's ``_grouped_mm_cuda``; other devices and dtypes
run ``_grouped_mm_fallback``, which copies the offsets to the host), and 16-byte aligned rows (D
and I multiples of 8 in bf16: D=1536, I=512 qualifies). :func:`_grouped_mm_ok` checks exactly
that on CUDA (on the CPU, fp32 and bf16 with aligned rows qualify). Group sizes need no padding:
the forward and input-gradient products are 2-D x 3-D (the ragged dimension is M), and the weight
gradient is ``x^T`` (column-major) times the row-major output gradient, the one 2-D x 2-D layout
the kernel accepts with any group size, empty groups included. Anything else (fp32 or fp16 on
CUDA, unaligned widths, older GPUs) takes the padded-bmm fallback, which reads the largest count
on the host (one synchronisation per grouped matmul).
"""

from __future__ import annotations

import functools

import torch

from harts_runtime.errors import InvalidInputError

__all__ = ["gate_up_mm", "grouped_mm"]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (``_grouped_mm`` needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


@functools.cache
def _has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


@functools.cache
def _cuda_fast_grouped_mm(device_index: int) -> bool:
    """PyTorch's bf16 ``_grouped_mm`` fast path (CUTLASS, offsets read on the device) exists for
    compute capability 9.x and 10.x only (``_scaled_mm_allowed_device(sm90_only, sm100_only)``)."""
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10)


def _tma_layout(t: torch.Tensor) -> bool:
    """Row- or column-major in the last two dimensions with 16-byte aligned leading strides (the
    ``check_valid_strides_and_return_transposed`` rule of ``_grouped_mm``)."""
    align = 16 // t.element_size()
    s, z = t.stride(), t.shape
    if s[-1] == 1 and s[-2] >= max(1, z[-1]):
        return s[-2] % align == 0
    if s[-2] == 1 and s[-1] >= max(1, z[-2]):
        return s[-1] % align == 0
    return False


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`grouped_mm` may call ``torch._grouped_mm`` for ``x`` [M, K] and ``w`` [E, K, N].

    Both need 16-byte aligned rows (``K`` and ``N`` times the element size) and one dtype. On CUDA
    the dtype must be bf16 and the device SM90/SM100, the only case whose kernel reads the offsets
    on the device; fp32/fp16 there would run PyTorch's per-group host loop (a synchronisation),
    so they take the padded bmm instead. On the CPU fp32 and bf16 qualify.
    """
    if not _has_grouped_mm() or x.dtype != w.dtype:
        return False
    aligned = _tma_layout(x) and _tma_layout(w) and (w.shape[-1] * w.element_size()) % 16 == 0
    if x.is_cuda:
        return (
            aligned
            and x.dtype == torch.bfloat16
            and all((t.storage_offset() * t.element_size()) % 16 == 0 for t in (x, w))
            and _cuda_fast_grouped_mm(x.device.index)
        )
    return aligned and x.dtype in (torch.float32, torch.bfloat16)


def _padded_bmm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Segmented matmul by padding each expert's rows into [E, max_count, K] and one bmm.

    The fallback of :func:`grouped_mm`: the padded shape needs the largest count on the host (one
    device synchronisation per call)."""
    e = w.shape[0]
    m = int(counts.max()) if counts.numel() else 0
    starts = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(e, device=x.device), counts, output_size=x.shape[0])
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert]
    padded = x.new_zeros(e, m, x.shape[1]).index_put((expert, slot), x)
    return torch.bmm(padded, w)[expert, slot]


def grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    counts: torch.Tensor,
    impl: str = "auto",
    offs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of ``x`` [M, K] grouped by expert (``counts`` int [E], summing to M) times ``w`` [E, K, N].

    Returns [M, N]: group ``e``'s rows times ``w[e]``. ``impl``: ``"grouped_mm"``
    (``torch._grouped_mm``), ``"bmm"`` (padded batched matmul) or ``"auto"`` (the first when
    :func:`_grouped_mm_ok` allows it). Both are differentiable. ``offs``: the int32 cumulative
    counts, if the caller already has them (several matmuls over one grouping); computed on the
    device otherwise.
    """
    if _takes_grouped_mm(impl, x, w):
        offs = torch.cumsum(counts, 0, dtype=torch.int32) if offs is None else offs
        return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offs))
    return _padded_bmm(x, w, counts)


def _takes_grouped_mm(impl: str, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a grouped matmul of ``x`` by ``w`` under ``impl`` calls ``torch._grouped_mm``
    (:func:`grouped_mm`); :class:`InvalidInputError` for an unknown ``impl``."""
    if impl not in ("auto", "grouped_mm", "bmm"):
        raise InvalidInputError("impl", f"unknown {impl!r}; choose auto, grouped_mm or bmm")
    return impl == "grouped_mm" or (impl == "auto" and x.shape[0] > 0 and _grouped_mm_ok(x, w))


class _GateUpGroupedMM(torch.autograd.Function):
    """``torch._grouped_mm(x, [w_gate | w_up], offs)`` that does not keep the concatenation.

    The forward concatenates the two [E, D, I] weights into one [E, D, 2I] operand, multiplies and
    frees it; it saves ``x`` and the two parameters (which live anyway). The backward rebuilds the
    concatenation only for the input gradient, ``dY [w_gate | w_up]^T``, and computes the weight
    gradient as one ``x^T dY`` [E, D, 2I] split into the two parameters' gradients. These are the
    products of ``torch._grouped_mm``'s own derivative (2-D x 3-D, and column-major ``x^T`` times
    the row-major ``dY``: its device-offset fast path). With autograd's ``cat`` the [E, D, 2I]
    operand was saved from the forward to the backward: 2 E D I elements (0.4 GB per ling-tiny MoE
    layer in bf16, 1 GB per Qwen3.5-35B-A3B layer) per layer without recomputation."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, offs):
        ctx.save_for_backward(x, w_gate, w_up, offs)
        return torch._grouped_mm(x, torch.cat([w_gate, w_up], dim=-1), offs=offs)

    @staticmethod
    def backward(ctx, g):
        x, w_gate, w_up, offs = ctx.saved_tensors
        g = g.contiguous()
        dx = dg = du = None
        if ctx.needs_input_grad[0]:
            w = torch.cat([w_gate, w_up], dim=-1)
            dx = torch._grouped_mm(g, w.transpose(-2, -1), offs=offs)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dg, du = torch._grouped_mm(x.t(), g, offs=offs).split(w_gate.shape[-1], dim=-1)
        return dx, dg, du, None


def gate_up_mm(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    counts: torch.Tensor,
    impl: str = "auto",
    offs: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`grouped_mm` of ``x`` [M, D] with ``[w_gate | w_up]`` [E, D, 2I] (the two [E, D, I]
    weights side by side): [M, 2I], the gate product in the first I columns. On the
    ``torch._grouped_mm`` path the concatenation lives only inside the forward and the backward
    (:class:`_GateUpGroupedMM`); on the padded-bmm fallback it is an autograd ``cat``."""
    if w_gate.shape != w_up.shape or w_gate.dtype != w_up.dtype:
        raise InvalidInputError(
            "w_up", f"{tuple(w_up.shape)} {w_up.dtype} != w_gate {tuple(w_gate.shape)} {w_gate.dtype}"
        )
    # the concatenation is a fresh contiguous [E, D, 2I]: w_gate's checks cover its dtype, device
    # and alignment (I aligned implies 2I aligned)
    if _takes_grouped_mm(impl, x, w_gate):
        offs = torch.cumsum(counts, 0, dtype=torch.int32) if offs is None else offs
        return _GateUpGroupedMM.apply(x, w_gate, w_up, offs)
    return grouped_mm(x, torch.cat([w_gate, w_up], dim=-1), counts, impl, offs)
