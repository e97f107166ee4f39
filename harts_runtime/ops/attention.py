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

``auto`` (:func:`resolve_backend`, per call) is the fastest backend measured on the H200 that runs
here for the call's head dims and dtype: on CUDA the first available of :data:`CUDA_PREFERENCE` that
accepts them (``fa4`` only for :data:`FA4_HEAD_DIMS` on SM90), on the CPU ``reference``.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.views import AttentionViews
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


# ---------------------------------------------------------------------------------------- helpers
def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[N, Hkv, D] -> [N, Hkv * groups, D]; query head ``h`` uses KV head ``h // groups``."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _acc(x: torch.Tensor) -> torch.Tensor:
    """x in the reference math dtype: float64 stays float64, everything else becomes float32."""
    return x if x.dtype == torch.float64 else x.float()


def _groups(q: torch.Tensor, k: torch.Tensor) -> int:
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise InvalidInputError("heads", f"{hq} query heads are not a multiple of {hkv} KV heads")
    return hq // hkv


def _pad_head_dims(q, k, v, multiple: int = 8):
    """Zero-pad Q/K and V head dims to one common size (a multiple of ``multiple``).

    Returns ``(q, k, v, dv)``; slice the kernel output to ``[..., :dv]``.
    """
    dqk, dv = q.shape[-1], v.shape[-1]
    d = -(-max(dqk, dv) // multiple) * multiple
    pad = lambda x: x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1]))
    return pad(q), pad(k), pad(v), dv


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


# ------------------------------------------------------------------------- view-based kernels
# Each takes packed q [Lq, Hq, Dqk], k [Lk, Hkv, Dqk], v [Lk, Hkv, Dv] and returns [Lq, Hq, Dv].
def _varlen_reference(q, k, v, views: AttentionViews, scale: float) -> torch.Tensor:
    groups = _groups(q, k)
    cq, ck = views.cu_seqlens_q.tolist(), views.cu_seqlens_k.tolist()
    outs = []
    for b in range(views.num_branches):
        qb = _acc(q[cq[b] : cq[b + 1]])  # [l, Hq, Dqk]
        kb = _acc(_repeat_kv(k[ck[b] : ck[b + 1]], groups))  # [h + l, Hq, Dqk]
        vb = _acc(_repeat_kv(v[ck[b] : ck[b + 1]], groups))  # [h + l, Hq, Dv]
        lq, lk = qb.shape[0], kb.shape[0]
        h = lk - lq
        allowed = torch.arange(lk, device=q.device)[None, :] <= h + torch.arange(lq, device=q.device)[:, None]
        s = torch.einsum("ihd,jhd->hij", qb, kb) * scale  # [Hq, l, h + l]
        s = s.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hij,jhd->ihd", s.softmax(-1), vb))
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    return torch.cat(outs).to(q.dtype)


def _padded_layout(views: AttentionViews):
    """Cached padded-batch indices: q_pos [B, mq], q_valid [B, mq], k_pos [B, mk], allowed [B, mq, mk]."""
    key = ("padded", str(views.device))
    if key not in views.cache:
        dev = views.device
        cu_q, cu_k = views.cu_seqlens_q.long(), views.cu_seqlens_k.long()
        lq, lk = cu_q.diff(), cu_k.diff()
        iq = torch.arange(views.max_seqlen_q, device=dev)
        jk = torch.arange(views.max_seqlen_k, device=dev)
        q_valid = iq[None, :] < lq[:, None]
        k_valid = jk[None, :] < lk[:, None]
        q_pos = torch.where(q_valid, cu_q[:-1, None] + iq[None, :], 0)
        k_pos = torch.where(k_valid, cu_k[:-1, None] + jk[None, :], 0)
        h = lk - lq
        allowed = k_valid[:, None, :] & (jk[None, None, :] <= h[:, None, None] + iq[None, :, None])
        # Padded query rows read entry 0 only (their output is dropped) so no softmax row is empty.
        allowed |= (~q_valid)[:, :, None] & (jk == 0)[None, None, :]
        views.cache[key] = (q_pos, q_valid, k_pos, allowed)
    return views.cache[key]


def _varlen_sdpa(q, k, v, views: AttentionViews, scale: float) -> torch.Tensor:
    groups = _groups(q, k)
    q_pos, q_valid, k_pos, allowed = _padded_layout(views)
    qp = q[q_pos].transpose(1, 2)  # [B, Hq, mq, Dqk]
    kp = _repeat_kv(k, groups)[k_pos].transpose(1, 2)  # [B, Hq, mk, Dqk]
    vp = _repeat_kv(v, groups)[k_pos].transpose(1, 2)  # [B, Hq, mk, Dv]
    o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=allowed[:, None], scale=scale)
    return o.transpose(1, 2)[q_valid]  # [Lq, Hq, Dv]


@functools.cache
def _varlen_attn_params() -> frozenset:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_torch(q, k, v, views: AttentionViews, scale: float) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    groups = _groups(q, k)
    kw = {}
    if groups > 1 and "enable_gqa" in _varlen_attn_params():
        kw["enable_gqa"] = True
    else:
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    q, k, v, dv = _pad_head_dims(q, k, v)
    out = varlen_attn(
        q,
        k,
        v,
        views.cu_seqlens_q,
        views.cu_seqlens_k,
        views.max_seqlen_q,
        views.max_seqlen_k,
        scale=scale,
        window_size=(-1, 0),
        **kw,
    )
    return out[..., :dv]


def _varlen_flash_attn(q, k, v, views: AttentionViews, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    _groups(q, k)
    q, k, v, dv = _pad_head_dims(q, k, v)
    out = flash_attn_varlen_func(
        q,
        k,
        v,
        views.cu_seqlens_q,
        views.cu_seqlens_k,
        views.max_seqlen_q,
        views.max_seqlen_k,
        softmax_scale=scale,
        causal=True,
    )
    return out[..., :dv]


FA4_HEAD_DIMS = frozenset({(32, 32), (64, 64), (96, 64), (128, 128), (192, 128)})
"""(Dqk, Dv) pairs whose ``fa4`` forward and backward matched the float32 reference on the H200
(flash-attn-4 4.0.0b36, bf16, tree and forest views; ``tests/runtime/test_attention_gpu.py``).
Outside them its SM90 kernels were seen to go wrong: Dqk = 48 (Kimi-Linear's tiny test shape,
32 + 16) gave dq with relative error ~1.0 while out, dk and dv were right, and (64, 32) did not
compile. ``fa4`` refuses other head dims; ``auto`` takes the next backend for them."""


def _varlen_fa4(q, k, v, views: AttentionViews, scale: float) -> torch.Tensor:
    _groups(q, k)
    if (q.shape[-1], v.shape[-1]) not in FA4_HEAD_DIMS:
        raise InvalidInputError(
            "head dims",
            f"fa4 is verified for (Dqk, Dv) in {sorted(FA4_HEAD_DIMS)}, not {(q.shape[-1], v.shape[-1])} "
            "(wrong dq was measured at Dqk = 48); use backend='auto' or 'varlen'",
        )
    from flash_attn.cute import flash_attn_varlen_func

    out, _ = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=views.cu_seqlens_q,
        cu_seqlens_k=views.cu_seqlens_k,
        max_seqlen_q=views.max_seqlen_q,
        max_seqlen_k=views.max_seqlen_k,
        softmax_scale=scale,
        causal=True,
    )
    return out


@functools.cache
def _te_module(hq: int, hkv: int, dqk: int, dv: int, scale: float):
    import transformer_engine.pytorch as te

    return te.DotProductAttention(
        num_attention_heads=hq,
        kv_channels=(dqk, dv),
        num_gqa_groups=hkv,
        attn_mask_type="padding_causal_bottom_right",
        qkv_format="thd",
        softmax_scale=scale,
        attention_dropout=0.0,
    )


def _varlen_te(q, k, v, views: AttentionViews, scale: float) -> torch.Tensor:
    _groups(q, k)
    mod = _te_module(q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], float(scale))
    out = mod(
        q,
        k,
        v,
        cu_seqlens_q=views.cu_seqlens_q,
        cu_seqlens_kv=views.cu_seqlens_k,
        max_seqlen_q=views.max_seqlen_q,
        max_seqlen_kv=views.max_seqlen_k,
    )
    return out.view(q.shape[0], q.shape[1], v.shape[-1])


# ---------------------------------------------------------------------- tree-mask kernels
# Each takes compact q [C, Hq, Dqk], k [C, Hkv, Dqk], v [C, Hkv, Dv] and returns [C, Hq, Dv].
def _tree_dense(q, k, v, views: AttentionViews, scale: float) -> torch.Tensor:
    groups = _groups(q, k)
    pre, end = views.tree_pre.long(), views.tree_end.long()
    mask = (pre[None, :] <= pre[:, None]) & (pre[:, None] < end[None, :])  # [C, C]: kv ancestor of q
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        _repeat_kv(k, groups).transpose(0, 1),
        _repeat_kv(v, groups).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return o.transpose(0, 1)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def tree_block_mask(views: AttentionViews, block_size: int = 128):
    """FlexAttention ``BlockMask`` of the tree-ancestor relation over the views' rows (cached)."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = ("flex", str(views.device), block_size)
    if key not in views.cache:
        pre, end = views.tree_pre, views.tree_end

        def ancestor_or_self(b, h, q_idx, kv_idx):
            return (pre[kv_idx] <= pre[q_idx]) & (pre[q_idx] < end[kv_idx])

        c = views.num_rows
        with warnings.catch_warnings():  # torch >= 2.10 deprecates _compile; it still avoids a [C, C] mask
            warnings.simplefilter("ignore", DeprecationWarning)
            views.cache[key] = create_block_mask(
                ancestor_or_self,
                None,
                None,
                c,
                c,
                device=views.device,
                BLOCK_SIZE=block_size,
                _compile=views.device.type == "cuda",
            )
    return views.cache[key]


def _tree_flex(q, k, v, views: AttentionViews, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    groups = _groups(q, k)
    fn = _compiled_flex() if q.is_cuda else flex_attention
    o = fn(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=tree_block_mask(views),
        scale=scale,
        enable_gqa=groups > 1,
    )
    return o[0].transpose(0, 1)


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
"""What ``auto`` picks on CUDA, fastest first (``benchmarks/layer_speed.py``'s attention case on the
H200: fa4 2.05x varlen's fwd+bwd at MLA's 192/128, 1.85x at GQA 128/128): the first of these that is
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
