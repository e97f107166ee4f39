"""The device guard of every kernel launch: Triton kernels (ours and fla's) launch on the current
CUDA device, so a call on a tensor of another device enters that device first.

``on_device(t)``: ``torch.cuda.device(t.device)`` for a CUDA tensor, a no-op context otherwise
(the CPU, the Triton interpreter). Importing this module needs only torch.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["on_device"]


def on_device(t: torch.Tensor):
    """The CUDA device context of ``t`` (a no-op off CUDA)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
