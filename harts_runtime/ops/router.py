"""Router logits: float32 logits of the rows against the router's expert vectors.

``router_logits(hidden [N, D], weight [E, D]) -> float32 [N, E]`` = ``hidden @ weight^T`` in
float32 (float64 for float64 inputs), as transformers' routers compute them (Kimi-Linear, Ling and
DeepSeek-V3 cast both operands to float32 first).

On CUDA with both operands in bf16 all three products run on bf16 tensor cores with float32
outputs (``torch.mm(..., out_dtype=torch.float32)``, :class:`_Bf16RouterLogits`):

* forward, ``logits = hidden @ W^T``: every product of two bf16 values is exact in float32 and the
  sum is accumulated in float32, so the logits are the float32 product's up to the accumulation
  order, with no float32 copy of ``hidden``;
* backward, ``d hidden = d logits @ W`` and ``d W = d logits^T @ hidden``: ``d logits`` is a
  float32 value, so it is split into two bf16 terms, ``hi = bf16(g)`` and ``lo = bf16(g - hi)``
  (:func:`split_bf16`; ``hi + lo`` is ``g`` to 2^-16 relative), and each product is the sum of the
  two exact bf16 products. That is float32's product up to about 2^-16 relative, far below the
  bf16 rounding (2^-8) of the gradients that come out.

What it replaces (24-layer ling-tiny MoE at N = 65,536, D = 1,536, E = 128 on the H200): three
float32 SIMT GEMMs, 0.55-0.70 ms each of the layer's 27.6 ms (the forward runs twice under
recomputation), and the float32 copy of ``hidden`` autograd kept for the backward. Everything else
(float32 or float64 rows, the CPU, a torch without ``out_dtype``) is the plain float32 product.
"""

from __future__ import annotations

import torch

__all__ = ["router_logits"]


def split_bf16(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` in bf16 with ``hi = bf16(g)``, ``lo = bf16(g - hi)``: ``hi + lo`` equals the
    float32 ``g`` to 2^-16 relative (a bf16 rounding errs by at most 2^-8 of its value, and ``lo``
    rounds a value at most 2^-8 of ``|g|``)."""
    hi = g.to(torch.bfloat16)
    return hi, (g - hi.float()).to(torch.bfloat16)


def mm_split(hi: torch.Tensor, lo: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(hi + lo) @ b`` in float32 for bf16 ``hi``, ``lo``, ``b``: two bf16 tensor-core products
    with float32 outputs, summed (exact products, float32 accumulation)."""
    return torch.mm(hi, b, out_dtype=torch.float32).add_(torch.mm(lo, b, out_dtype=torch.float32))


class _Bf16RouterLogits(torch.autograd.Function):
    """``hidden.float() @ weight.float().t()`` for bf16 operands, forward and backward on bf16
    tensor cores with float32 outputs (module docstring); saves the bf16 operands."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        hidden, weight = ctx.saved_tensors
        hi, lo = split_bf16(g.contiguous())
        dh = mm_split(hi, lo, weight).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        dw = mm_split(hi.t(), lo.t(), hidden).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dh, dw


_OUT_DTYPE = torch.torch_version.TorchVersion(torch.__version__) >= "2.8"
"""``torch.mm(..., out_dtype=)`` (bf16 operands, float32 output on CUDA) exists from torch 2.8."""
_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types the tensor-core path takes: not DTensor, whose sharding rules may lack ``out_dtype``."""


def router_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 (float64 for float64 rows) logits ``hidden @ weight^T`` [N, E] (module docstring)."""
    if (
        _OUT_DTYPE
        and hidden.is_cuda
        and hidden.dim() == 2
        and hidden.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and type(hidden) in _PLAIN  # a DTensor (tensor parallelism outside a local region) keeps torch's path
        and type(weight) in _PLAIN
    ):
        return _Bf16RouterLogits.apply(hidden, weight)
    dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    return hidden.to(dt) @ weight.to(dt).t()
