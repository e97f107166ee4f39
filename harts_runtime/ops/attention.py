"""The full-attention op on compact rows and its backend registry (paper Sections 3.4, 4.2, Eq. 21-22).

The layers (:mod:`harts_runtime.layers.attention` for MHA/GQA, :mod:`harts_runtime.layers.mla`)
run on C compact rows (any row order; see :mod:`harts_runtime.layout.views`):

1. projections and RoPE run once per compact row, RoPE at the row's original trajectory position;
2. each branch gathers a packed Q of its ``l`` current rows and a packed KV of its ``h`` ancestors
   plus the same ``l`` rows (``index_select``), with separate ``cu_seqlens`` for Q and KV;
3. a packed attention kernel runs with bottom-right causal alignment: query ``i`` of a branch reads
   KV entry ``j`` iff ``j <= h + i``;
4. the packed outputs are scattered back to their compact rows, and the output projection runs once
   per compact row.

The KV gather's backward is ``index_add``: every branch that reads a shared ancestor row adds its
gradient into that row's unique projection, which is the accumulation the paper requires.

Backends (``compact_attention(..., backend=NAME)``), one interface; ``q [C, Hq, Dqk]``,
``k [C, Hkv, Dqk]``, ``v [C, Hkv, Dv]`` in, ``[C, Hq, Dv]`` out:

============== ======= ======== ===========================================================
name           input   device   kernel
============== ======= ======== ===========================================================
``reference``  views   any      per-branch loop, float32 math (float64 kept) (the oracle; slow)
``sdpa``       views   any      branches padded into a batch, boolean bottom-right mask,
                                ``F.scaled_dot_product_attention`` (CPU fast path)
``varlen``     views   CUDA     ``torch.nn.attention.varlen.varlen_attn``, window (-1, 0)
``flash_attn`` views   CUDA     ``flash_attn_varlen_func(causal=True)`` (bottom-right, >= 2.1)
``fa4``        views   CUDA     FlashAttention-4 (``flash_attn.cute``, the ``flash-attn-4`` wheel:
                                CuTe-DSL kernels for SM90 and SM100), ``causal=True``; separate
                                Q/K and V head dims (MLA's 192/128) without padding
``te``         views   CUDA     Transformer Engine ``DotProductAttention``, ``thd``,
                                ``padding_causal_bottom_right``
``flex_tree``  tree    CUDA     FlexAttention over the compact rows themselves with the mask
                                "kv is an ancestor of, or equal to, q"; no K/V copies
``dense_tree`` tree    any      the same mask as a dense [C, C] boolean for SDPA (tests, small C)
============== ======= ======== ===========================================================

The kernel call is a kept region named ``"attention"`` (:mod:`harts_runtime.ops.keep`):
``apply_recompute(model, keep=("attention",))`` keeps its activations instead of recomputing it.

Kernels that need equal Q/K and V head dims (flash-attn 2, torch varlen) get zero-padded head
dims; zero columns change neither scores nor outputs (the scale is passed explicitly).

``auto`` (:func:`resolve_backend`, per call) is the fastest backend (``benchmarks/layer_speed.py``) that runs
here for the call's head dims and dtype: on CUDA the first available of :data:`CUDA_PREFERENCE` that
accepts them (``fa4`` only for :data:`FA4_HEAD_DIMS` on SM90), on the CPU ``reference``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.views import AttentionViews
from harts_runtime.ops.attention_kernels import (  # the kernels; their names stay importable here
    FA4_HEAD_DIMS,
    _acc,
    _groups,
    _repeat_kv,
    _tree_dense,
    _tree_flex,
    _varlen_fa4,
    _varlen_flash_attn,
    _varlen_reference,
    _varlen_sdpa,
    _varlen_te,
    _varlen_torch,
    tree_block_mask,
)
from harts_runtime.ops.keep import kept

__all__ = [
    "BACKENDS",
    "Backend",
    "CUDA_PREFERENCE",
    "FA4_HEAD_DIMS",
    "available_backends",
    "compact_attention",
    "resolve_backend",
    "scatter_rows",
    "trajectory_attention",
    "tree_block_mask",
]


def scatter_rows(packed: torch.Tensor, views: AttentionViews) -> torch.Tensor:
    """Packed query outputs [Lq, ...] -> compact rows [C, ...] (rows without a query get zeros)."""
    if views.q_inverse is not None:
        return packed.index_select(0, views.q_inverse)
    out = packed.new_zeros((views.num_rows,) + tuple(packed.shape[1:]))
    return out.index_copy(0, views.q_index, packed)


def trajectory_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Ordinary causal attention over one trajectory, float32 math (the trajectory-wise baseline).

    q [L, Hq, Dqk], k [L, Hkv, Dqk], v [L, Hkv, Dv] -> [L, Hq, Dv] of ``q.dtype``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    groups = _groups(q, k)
    kk, vv = _acc(_repeat_kv(k, groups)), _acc(_repeat_kv(v, groups))
    s = torch.einsum("ihd,jhd->hij", _acc(q), kk) * scale  # [H, L, L]
    n = q.shape[0]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.einsum("hij,jhd->ihd", s.softmax(-1), vv).to(q.dtype)


# ------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class Backend:
    """One attention backend: ``kind`` "views" (packed Q/KV kernel) or "tree" (compact rows + mask)."""

    name: str
    kind: str
    fn: Callable
    needs: str | None = None
    """Importable module the backend needs (None: torch only)."""
    cuda_only: bool = False
    head_dims: frozenset | None = None
    """(Dqk, Dv) pairs the backend accepts (None: any)."""
    archs: tuple[int, ...] | None = None
    """CUDA compute-capability majors ``auto`` takes it on (None: any)."""
    dtypes: tuple[torch.dtype, ...] | None = None
    """Input dtypes it runs (None: any)."""

    def accepts(self, dqk: int | None, dv: int | None, arch: int | None = None, dtype=None) -> bool:
        return (
            (self.head_dims is None or (dqk, dv) in self.head_dims)
            and (self.archs is None or arch in self.archs)
            and (self.dtypes is None or dtype is None or dtype in self.dtypes)
        )


_HALF = (torch.bfloat16, torch.float16)


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in [
        Backend("reference", "views", _varlen_reference),
        Backend("sdpa", "views", _varlen_sdpa),
        Backend("varlen", "views", _varlen_torch, "torch.nn.attention.varlen", cuda_only=True, dtypes=_HALF),
        # FA2's module: the flash-attn-4 wheel makes ``flash_attn`` a namespace of ``cute`` only
        Backend("flash_attn", "views", _varlen_flash_attn, "flash_attn.flash_attn_interface", cuda_only=True),
        Backend(
            "fa4",
            "views",
            _varlen_fa4,
            "flash_attn.cute",
            cuda_only=True,
            head_dims=FA4_HEAD_DIMS,
            archs=(9,),
            dtypes=_HALF,
        ),
        Backend("te", "views", _varlen_te, "transformer_engine", cuda_only=True),
        Backend("flex_tree", "tree", _tree_flex, "torch.nn.attention.flex_attention", cuda_only=True),
        Backend("dense_tree", "tree", _tree_dense),
    ]
}


def _importable(name: str | None) -> bool:
    if name is None:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def available_backends(device: str | torch.device = "cpu") -> list[str]:
    """Backends that can run forward and backward on ``device`` here."""
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    return [b.name for b in BACKENDS.values() if (cuda or not b.cuda_only) and _importable(b.needs)]


CUDA_PREFERENCE: tuple[str, ...] = ("fa4", "varlen", "sdpa")
"""What ``auto`` picks on CUDA, fastest first (``benchmarks/layer_speed.py``'s attention case: fa4
about twice as fast as varlen forward and backward at MLA's and GQA's head dims): the first of these that is
importable here and accepts the head dims, the GPU generation (fa4: SM90, where it was verified)
and the dtype (the flash kernels: bf16 / fp16; float32 takes the padded SDPA path)."""


def resolve_backend(
    name: str,
    device: str | torch.device,
    dqk: int | None = None,
    dv: int | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    """``name`` itself (checked), or for ``"auto"`` the backend used on ``device`` for (``dqk``,
    ``dv``) head dims and ``dtype`` inputs: on CUDA the first importable entry of
    :data:`CUDA_PREFERENCE` that accepts them (unknown dims: only backends that accept any),
    elsewhere ``reference``."""
    if name != "auto":
        if name not in BACKENDS:
            raise InvalidInputError("backend", f"unknown {name!r}; choose auto or one of {sorted(BACKENDS)}")
        return name
    device = torch.device(device)
    arch = None
    if device.type == "cuda" and torch.cuda.is_available():
        arch = torch.cuda.get_device_capability(device)[0]
    return _auto(device.type, arch, dqk, dv, dtype)


@functools.cache
def _auto(device_type: str, arch: int | None, dqk: int | None, dv: int | None, dtype) -> str:
    if device_type != "cuda":
        return "reference"
    for b in CUDA_PREFERENCE:
        spec = BACKENDS[b]
        if _importable(spec.needs) and spec.accepts(dqk, dv, arch, dtype):
            return b
    return "reference"


def compact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    views: AttentionViews,
    *,
    backend: str = "reference",
    scale: float | None = None,
) -> torch.Tensor:
    """Full attention on compact rows with tree (ancestor) visibility.

    Parameters
    ----------
    q : Tensor, shape [C, Hq, Dqk]
        Queries of every compact row (after RoPE).
    k : Tensor, shape [C, Hkv, Dqk]
        Keys (after RoPE); ``Hq`` is a multiple of ``Hkv`` (MHA: equal; GQA/MQA: fewer).
    v : Tensor, shape [C, Hkv, Dv]
        Values; ``Dv`` may differ from ``Dqk`` (MLA).
    views : AttentionViews
        Index views of the rows, on ``q.device``.
    backend : str
        A key of :data:`BACKENDS`, or ``"auto"`` (:func:`resolve_backend` for this device and
        these head dims).
    scale : float, optional
        Softmax scale, default ``Dqk ** -0.5``.

    Returns
    -------
    Tensor, shape [C, Hq, Dv]
        Row ``c`` attends to exactly its ancestors and itself. Rows without a query (padding) are
        zero for view backends.
    """
    if q.shape[0] == 0:  # no rows (an empty microbatch): nothing to attend, any backend's zero rows
        backend = "reference"
    elif backend == "auto":
        backend = resolve_backend("auto", q.device, q.shape[-1], v.shape[-1], q.dtype)
    try:
        spec = BACKENDS[backend]
    except KeyError:
        raise InvalidInputError("backend", f"unknown {backend!r}; choose one of {sorted(BACKENDS)}") from None
    if q.shape[0] != views.num_rows or k.shape[0] != views.num_rows or v.shape[0] != views.num_rows:
        raise InvalidInputError(
            "q/k/v", f"need {views.num_rows} rows (the views' C), got {q.shape[0]}/{k.shape[0]}/{v.shape[0]}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if spec.kind == "tree":
        return kept("attention", spec.fn, q, k, v, views, scale)
    with record_function("harts.attn.views"):
        qp = q.index_select(0, views.q_index)  # [Lq, Hq, Dqk]
        kp = k.index_select(0, views.kv_index)  # [Lk, Hkv, Dqk]
        vp = v.index_select(0, views.kv_index)  # [Lk, Hkv, Dv]
    with record_function("harts.attn.core"):
        out = kept("attention", spec.fn, qp, kp, vp, views, scale)
    with record_function("harts.attn.views"):
        return scatter_rows(out, views)
