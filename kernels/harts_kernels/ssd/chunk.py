"""SSD (Mamba2) ChunkLA operator with requested, differentiable chunk-boundary states.

``chunk_ssd_with_states`` is the public entry point; its contract is
:func:`harts_kernels.ssd.naive.naive_chunk_ssd_with_states`'s (scalar log decay per token and
head, state ``[K, V]``, each sequence chunked on its own grid, initial states in, the final and
requested boundary states out, all differentiable).

* ``backend="naive"``, or any CPU tensor with ``"auto"``: the chunked PyTorch reference.
* ``"triton"``, or CUDA with ``"auto"``: fla 0.6.0's ``chunk_simple_gla`` (Triton, varlen,
  ``initial_state`` in with its gradient, the final state out). fla returns no intermediate
  states, so a requested boundary ``(i, c)`` is served by one extra packed sequence: the first
  ``c * chunk_size`` rows of sequence ``i`` from the same initial state, whose final state is the
  boundary state (same grid, so the same floating-point state as the full sequence computes;
  extra work = the requested prefixes' rows; its outputs are discarded). A dedicated state scan
  that writes boundary states from the one pass (as :mod:`harts_kernels.kda.state_scan` does
  for KDA) would remove that overhead. fla takes power-of-2 chunk sizes only (the plans' 32 or 64);
  another raises its ValueError.

fla 0.6.0 refuses the *backward* of its gated chunk kernels on Hopper GPUs with Triton in [3.4.0,
3.7.1) (fla-org/flash-linear-attention#640: wrong gradients; its ``chunk_bwd_dqkwg`` raises
unless tilelang is installed), Triton 3.6 included. There (:func:`fla_gated_backward_refused`) a call
that will be differentiated runs the chunked PyTorch reference on the GPU with ``"auto"`` (the same
math, slower; a warning says so once), and is refused naming ``backend`` with ``"triton"``;
forward-only calls keep fla's kernel.

fla and triton are imported only inside the GPU path, so this module imports with torch alone.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import warnings

import torch

from harts_kernels.device import on_device
from harts_kernels.kda.utils import (
    as_int_list,
    check_initial_state,
    seq_lens_from_cu_seqlens,
    validate_requests,
)
from harts_kernels.ssd.naive import check_ssd_inputs, naive_chunk_ssd_with_states

__all__ = ["chunk_ssd_with_states", "fla_gated_backward_refused"]

_BACKENDS = ("auto", "triton", "naive")


def chunk_ssd_with_states(
    q: torch.Tensor,  # [1, T, H, K]   Mamba2's C
    k: torch.Tensor,  # [1, T, H, K]   Mamba2's B
    v: torch.Tensor,  # [1, T, H, V]   Mamba2's dt * x
    g: torch.Tensor,  # [1, T, H]      fp32 log decay <= 0, Mamba2's dt * A
    *,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,  # [N, H, K, V] fp32
    cu_seqlens=None,
    chunk_size: int = 64,
    request_seq=None,
    request_chunk=None,
    output_final_state: bool = True,
    backend: str = "auto",
    save_intermediates: bool = False,
):
    """``(o [1, T, H, V], final_state [N, H, K, V] | None, boundary_states [R, H, K, V])``.

    ``save_intermediates`` is accepted for the KDA operator's signature (fla's simple-GLA saves
    its own). Raises ValueError on bad shapes, requests or ``backend``."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend: choose one of {_BACKENDS}, got {backend!r}")
    use_triton = backend == "triton" or (backend == "auto" and q.is_cuda)
    if use_triton and _differentiated(q, k, v, g, initial_state):
        reason = fla_gated_backward_refused()
        if reason is not None:
            if backend == "triton":
                raise ValueError(f"backend: 'triton' cannot be differentiated here: {reason}; use 'auto'")
            _warn_fallback(reason)
            use_triton = False
    args = dict(
        scale=scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
        request_seq=request_seq,
        request_chunk=request_chunk,
        output_final_state=output_final_state,
    )
    if not use_triton:
        return naive_chunk_ssd_with_states(q, k, v, g, **args)
    return _fla_chunk(q, k, v, g, **args)


def _differentiated(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@functools.cache
def fla_gated_backward_refused() -> str | None:
    """Why fla 0.6.0's gated chunk backward cannot run on this GPU, or None: a Hopper GPU with Triton
    in [3.4.0, 3.7.1) and no tilelang (fla #640)."""
    if not torch.cuda.is_available():
        return None
    import triton

    v = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:3])
    hopper = torch.cuda.get_device_capability()[0] == 9
    if not hopper or not (3, 4, 0) <= v < (3, 7, 1):
        return None
    if importlib.util.find_spec("tilelang") is not None:
        return None
    return (
        f"fla refuses its gated chunk backward on Hopper GPUs with Triton {triton.__version__} "
        "(>= 3.4.0 and < 3.7.1, fla #640: wrong gradients) without tilelang"
    )


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(
        f"harts_kernels.ssd: {reason}; differentiated SSD calls run the chunked PyTorch reference "
        "on the GPU (same math, slower). Upgrade Triton to >= 3.7.1 or install tilelang for fla's kernel.",
        stacklevel=3,
    )


def _fla_chunk(
    q,
    k,
    v,
    g,
    *,
    scale,
    initial_state,
    cu_seqlens,
    chunk_size,
    request_seq,
    request_chunk,
    output_final_state,
):
    """fla's ``chunk_simple_gla`` over the sequences plus one prefix sequence per requested
    boundary (see the module docstring)."""
    from fla.ops.simple_gla import chunk_simple_gla

    cu, _ = check_ssd_inputs(q, k, v, g, cu_seqlens)
    if q.shape[0] != 1:
        raise ValueError(f"q: the Triton path takes one packed batch (pass cu_seqlens), got {q.shape[0]}")
    T, H, K, V = q.shape[1], q.shape[2], q.shape[3], v.shape[3]
    lens = seq_lens_from_cu_seqlens(cu, T)
    N = len(lens)
    rs, rc = as_int_list(request_seq, "request_seq"), as_int_list(request_chunk, "request_chunk")
    validate_requests(lens, chunk_size, rs, rc)
    check_initial_state(initial_state, N, H, K, V)
    dev = q.device
    h0 = initial_state
    if h0 is None and (rs or output_final_state):
        h0 = q.new_zeros(N, H, K, V, dtype=torch.float32)
    rows = [torch.arange(T, device=dev)]
    cu_all, seq_of = list(cu), list(range(N))
    for i, c in zip(rs, rc):  # the prefix sequences
        rows.append(torch.arange(cu[i], cu[i] + c * chunk_size, device=dev))
        cu_all.append(cu_all[-1] + c * chunk_size)
        seq_of.append(i)
    if rs:
        idx = torch.cat(rows)
        q, k, v, g = (x.index_select(1, idx) for x in (q, k, v, g))
        h0 = h0.index_select(0, torch.tensor(seq_of, device=dev))
    cu_t = torch.tensor(cu_all, dtype=torch.long)
    with on_device(q):
        o, ht = chunk_simple_gla(
            q,
            k,
            v,
            g=g.float(),
            scale=scale,
            initial_state=h0,
            output_final_state=bool(rs) or output_final_state,
            cu_seqlens=cu_t.to(dev),
            cu_seqlens_cpu=cu_t,
            chunk_size=chunk_size,
        )
    o = o[:, :T]
    bstates = ht[N:] if rs else q.new_zeros(0, H, K, V, dtype=torch.float32)
    final = ht[:N] if output_final_state else None
    return o, final, bstates
