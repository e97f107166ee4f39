"""The causal depthwise short convolution on compact rows (Section 4.2).

:class:`ShortConvolution` has ``fla.modules.ShortConvolution``'s parameters (an ``nn.Conv1d`` with
``weight [C, 1, w]``, no bias; ``weight[:, 0, -1]`` multiplies the row itself), so an fla state dict
loads unchanged. A row's window is the ``w`` rows at positions ``p - w + 1 .. p`` on its own ancestry
path (zeros before position 0), described per microbatch by
:class:`~harts_runtime.layout.conv.ConvWindows` in two forms, one per path:

* reference (:func:`causal_conv`): each output row reads its window through the table
  ``index [C_out, w]`` (-1 read as zeros); the gather's backward accumulates every consumer's
  gradient at the unique producer row. O(C w D) memory for the gathered windows.
* fused (:func:`varlen_causal_conv`): fla's varlen convolution kernel over sequences contiguous
  in physical order, each sequence's ``w - 1`` context rows (its true ancestors) passed as the
  kernel's per-sequence initial state; the kernel's gradient of that state is added to the
  context rows in place (:class:`_ContextConv`). No window tensor.

:func:`naive_varlen_causal_conv` is :func:`varlen_causal_conv`'s reference with the same signature.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harts_runtime.errors import InvalidInputError
from harts_runtime.modules.fused import device_guard, use_fla

# ``windows`` below is a :class:`harts_runtime.layout.conv.ConvWindows` (read by attribute: modules
# import no other room of the runtime).

__all__ = ["ROW_BUCKET", "ShortConvolution", "causal_conv", "naive_varlen_causal_conv", "varlen_causal_conv"]

ROW_BUCKET = 16
"""fla's convolution kernels leave the row count to Triton's integer specialization (a multiple of
16 or not), so unpadded row counts would compile two variants of each: the fused path pads its rows
to a multiple of ``ROW_BUCKET`` (one extra zero sequence, cut off the output) and compiles one."""


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, conv_index: torch.Tensor, activation: str | None = "silu"
) -> torch.Tensor:
    """``y[c] = act(sum_i weight[:, i] * x[conv_index[c, i]])`` (zeros where the index is -1).

    x: [C, D]; weight: [D, w] (depthwise, no bias; ``weight[:, -1]`` multiplies the row itself);
    conv_index: [C_out, w] int64. Returns [C_out, D]; O(C_out * w * D).
    """
    xp = torch.cat([x, x.new_zeros(1, x.shape[1])], 0)  # row C = zero pad
    idx = torch.where(conv_index < 0, torch.full_like(conv_index, x.shape[0]), conv_index)
    windows = xp[idx]  # [C_out, w, D]
    y = torch.einsum("cwd,dw->cd", windows, weight.to(x.dtype))
    return F.silu(y) if activation == "silu" else y


def _context_state(x: torch.Tensor, context: torch.Tensor, width: int) -> torch.Tensor:
    """fla's initial state [N, D, w] from context rows [N, w - 1] (-1 = zeros): column ``j`` holds
    the input at position ``j - w`` before the sequence (column 0 is never read by a width-w kernel).
    Differentiable: the state's gradient flows back to the context rows."""
    n = context.shape[0]
    flat = context.reshape(-1)
    rows = x.index_select(0, flat.clamp(min=0)) * (flat >= 0).unsqueeze(1).to(x.dtype)
    state = rows.view(n, width - 1, x.shape[1]).transpose(1, 2)  # [N, D, w - 1]
    return F.pad(state, (1, 0)).contiguous()


def varlen_causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    windows,
    activation: str | None = "silu",
    backend: str = "auto",
) -> torch.Tensor:
    """The short convolution over ``windows``' sequences: x [C, D], weight [D, w] -> [C, D].

    Through fla's ``causal_conv1d`` (Triton) when ``backend`` selects it
    (:func:`~harts_runtime.modules.fused.use_fla`), else :func:`naive_varlen_causal_conv`."""
    if x.shape[0] != windows.num_rows or weight.shape[-1] != windows.width:
        raise InvalidInputError(
            "conv",
            f"x has {x.shape[0]} rows and width {weight.shape[-1]}, windows are "
            f"{windows.num_rows} rows of width {windows.width}",
        )
    if not use_fla(x, backend):
        return naive_varlen_causal_conv(x, weight, windows, activation)
    n = x.shape[0]
    pad = -n % ROW_BUCKET
    if pad:  # one compiled variant for every row count (see ROW_BUCKET)
        x, windows = F.pad(x, (0, 0, 0, pad)), windows.padded(ROW_BUCKET)
    if windows.context is not None:
        y = _ContextConv.apply(x, weight, windows, activation)
    else:
        from fla.modules.causal_conv1d import causal_conv1d

        y, _ = causal_conv1d(
            x.unsqueeze(0),
            weight,
            activation=activation,
            cu_seqlens=windows.cu_seqlens,
            cu_seqlens_cpu=windows.cu_seqlens_cpu,
        )
        y = y.squeeze(0)
    return y[:n] if pad else y


class _ContextConv(torch.autograd.Function):
    """fla's varlen convolution with each sequence's context rows as its initial state, whose
    gradient goes back to those rows in place: ``dx`` from fla's backward, then one ``index_add_``
    of the N (w - 1) context rows. Through autograd (a gather of the context rows into the state),
    the same gradient costs a zero-filled [C, D] tensor, its ``index_add`` and a full [C, D] add
    per convolution. forward(x [C, D], weight [D, w], windows, activation) -> [C, D]."""

    @staticmethod
    def forward(ctx, x, weight, windows, activation):
        from fla.modules.causal_conv1d.ops import causal_conv1d_fwd

        init = _context_state(x, windows.context, windows.width)
        with device_guard(x):
            y, _ = causal_conv1d_fwd(
                x.unsqueeze(0),
                weight,
                None,
                None,
                initial_state=init,
                activation=activation,
                cu_seqlens=windows.cu_seqlens,
                cu_seqlens_cpu=windows.cu_seqlens_cpu,
            )
        ctx.save_for_backward(x, weight, init, windows.context)
        ctx.windows, ctx.activation = windows, activation
        return y.squeeze(0)

    @staticmethod
    def backward(ctx, dy):
        from fla.modules.causal_conv1d.ops import causal_conv1d_bwd

        x, weight, init, context = ctx.saved_tensors
        w = ctx.windows
        with device_guard(x):
            dx, dw, _, _, dh0 = causal_conv1d_bwd(
                x.unsqueeze(0),
                dy.contiguous().unsqueeze(0),
                None,
                weight,
                initial_state=init,
                activation=ctx.activation,
                cu_seqlens=w.cu_seqlens,
                cu_seqlens_cpu=w.cu_seqlens_cpu,
            )
        dx = dx.squeeze(0)
        # state column j >= 1 is context row j - 1 (oldest first); rows -1 were zeros: add nothing
        flat = context.reshape(-1)
        d_rows = dh0[:, :, 1:].transpose(1, 2).reshape(-1, x.shape[1])
        d_rows = d_rows * (flat >= 0).unsqueeze(1).to(d_rows.dtype)
        dx.index_add_(0, flat.clamp(min=0), d_rows.to(dx.dtype))
        return dx, (dw if ctx.needs_input_grad[1] else None), None, None


def naive_varlen_causal_conv(
    x: torch.Tensor, weight: torch.Tensor, windows, activation: str | None = "silu"
) -> torch.Tensor:
    """Reference of :func:`varlen_causal_conv`: :func:`causal_conv` through the window table that
    ``windows`` builds from the same sequences and context rows."""
    return causal_conv(x, weight, windows.index, activation)


class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution of width ``kernel_size`` over ``hidden_size`` channels.

    forward(x [C, hidden_size], windows) -> [C_out, hidden_size]: ``windows`` a
    :class:`~harts_runtime.layout.conv.ConvWindows` (the fused kernel or the reference gather, by
    ``backend``) or a bare window table [C_out, kernel_size] int64 (the reference gather).
    Init: ``weight[:, 0, :] ~ N(0, 1 / kernel_size)``. ``activation``: ``"silu"`` or None.
    """

    def __init__(
        self, hidden_size: int, kernel_size: int, activation: str | None = "silu", *, backend: str = "auto"
    ):
        if activation not in ("silu", None):
            raise InvalidInputError("activation", f"choose 'silu' or None, got {activation!r}")
        super().__init__(
            hidden_size, hidden_size, kernel_size, padding=kernel_size - 1, groups=hidden_size, bias=False
        )
        self.hidden_size, self.activation, self.backend = hidden_size, activation, backend

    def reset_parameters(self) -> None:
        c, w = self.weight.shape[0], self.weight.shape[-1]
        with torch.no_grad():
            self.weight.copy_((torch.randn(c, w) / math.sqrt(w)).view(c, 1, w))

    def forward(self, x: torch.Tensor, windows) -> torch.Tensor:
        if isinstance(windows, torch.Tensor):  # a bare window table
            return causal_conv(x, self.weight[:, 0, :], windows, self.activation)
        if not use_fla(x, self.backend):
            return causal_conv(x, self.weight[:, 0, :], windows.index, self.activation)
        return varlen_causal_conv(x, self.weight[:, 0, :], windows, self.activation, self.backend)
