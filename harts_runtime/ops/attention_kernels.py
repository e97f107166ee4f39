"""The kernels behind :func:`harts_runtime.ops.attention.compact_attention`'s backends, one
interface: the view-based ones take packed ``q [Lq, Hq, Dqk]``, ``k [Lk, Hkv, Dqk]``,
``v [Lk, Hkv, Dv]`` with the branches' ``cu_seqlens`` (bottom-right causal alignment) and return
``[Lq, Hq, Dv]``; the tree-mask ones take the compact rows themselves with the mask "kv is an
ancestor of, or equal to, q" and return ``[C, Hq, Dv]``. The backend table, the choice of
``auto`` and the gather / scatter around the kernels are :mod:`harts_runtime.ops.attention`'s;
this module is only the kernels and their helpers (grouped-query head repeat, the reference math
dtype, zero-padded head dims).
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
import torch.nn.functional as F

from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.views import AttentionViews

__all__ = ["FA4_HEAD_DIMS", "tree_block_mask"]


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
(flash-attn-4 4.0.0b36, bf16, tree and forest views; ``tests/runtime/ops/test_attention_gpu.py``).
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
