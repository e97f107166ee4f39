"""Router logits: float32 logits of the rows against the router's expert vectors.

``router_logits(hidden [N, D], weight [E, D]) -> float32 [N, E]`` = ``hidden @ weight^T`` in
float32 (float64 for float64 inputs), as transformers' routers compute them (Kimi-Linear, Ling and
DeepSeek-V3 cast both operands to float32 first).

On CUDA with both operands in bf16 the forward product runs on bf16 tensor cores with a float32
output (``torch.mm(..., out_dtype=torch.float32)``, :class:`_Bf16RouterLogits`): every product of
two bf16 values is exact in float32 and the sum is accumulated in float32, so the logits are the
float32 product's up to the accumulation order, with no float32 copy of ``hidden``. The backward
(``d hidden = d logits @ W``, ``d W = d logits^T @ hidden``) stays in float32, as before, since
``d logits`` is a float32 value that bf16 would round. What it replaces: the float32 SIMT GEMM of
the forward (0.55-0.70 ms of the 24-layer ling-tiny MoE's 27.6 at N = 65,536, D = 1,536, E = 128
on the H200, run twice under recomputation) and the float32 copy of ``hidden`` autograd kept.
Everything else (float32 or float64 rows, the CPU, a torch without ``out_dtype``) is the plain
float32 product.
"""

from __future__ import annotations

import torch

__all__ = ["router_logits"]


class _Bf16RouterLogits(torch.autograd.Function):
    """``hidden.float() @ weight.float().t()`` for bf16 operands: forward on bf16 tensor cores
    with a float32 output, backward in float32 (module docstring); saves the bf16 operands."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        hidden, weight = ctx.saved_tensors
        dh = (g @ weight.float()).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        dw = (g.t() @ hidden.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dh, dw


_OUT_DTYPE = torch.torch_version.TorchVersion(torch.__version__) >= "2.8"
"""``torch.mm(..., out_dtype=)`` (bf16 operands, float32 output on CUDA) exists from torch 2.8."""


def router_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 (float64 for float64 rows) logits ``hidden @ weight^T`` [N, E] (module docstring)."""
    if (
        _OUT_DTYPE
        and hidden.is_cuda
        and hidden.dim() == 2
        and hidden.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
    ):
        return _Bf16RouterLogits.apply(hidden, weight)
    dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    return hidden.to(dt) @ weight.to(dt).t()
