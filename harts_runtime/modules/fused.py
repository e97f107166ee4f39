"""Where the token-wise building blocks run: fused Triton kernels or the PyTorch reference.

Every module of :mod:`harts_runtime.modules` with a fused path takes a ``backend``: ``"naive"``
(the PyTorch reference, float32 statistics, any device), ``"triton"`` (the fused kernels: fla's
short convolution, the norms of :mod:`harts_kernels.norm`; CUDA, or the CPU under
``TRITON_INTERPRET=1``) or ``"auto"`` (the fused kernels on CUDA when fla-core and triton are
importable, else the reference). The same names select the KDA core's backend
(:mod:`harts_kernels.kda`), so one ``backend`` switch moves a whole layer between its reference and
its production path.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from harts_kernels.device import on_device as device_guard  # the kernels' launch guard, one copy
from harts_runtime.errors import InvalidInputError

__all__ = ["BACKENDS", "device_guard", "fla_available", "use_fla"]

BACKENDS = ("auto", "triton", "naive")


@functools.cache
def fla_available() -> bool:
    """fla-core (``fla.modules``) and triton are importable."""
    try:
        return importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def use_fla(x: torch.Tensor, backend: str) -> bool:
    """Whether ``x`` goes through fla's kernels under ``backend``. Raises
    :class:`InvalidInputError` for an unknown backend, or ``"triton"`` without fla-core. A tensor
    without rows (an empty microbatch, data parallelism's padding) takes the reference: fla's
    kernels divide by the row count when they size their grids."""
    if backend == "naive":
        return False
    if backend == "auto":
        return x.is_cuda and fla_available() and x.shape[0] > 0
    if backend == "triton":
        if not fla_available():
            raise InvalidInputError("backend", "'triton' needs fla-core and triton (pip install fla-core)")
        return x.shape[0] > 0
    raise InvalidInputError("backend", f"unknown {backend!r}; choose one of {list(BACKENDS)}")
