"""Triton kernels: the KDA chunk state scan with selectable fp32 boundary states.

These replace the two sequential stages of fla's chunk KDA (``chunk_gated_delta_rule_fwd_h`` and
``chunk_gated_delta_rule_bwd_dhu`` in fla 0.6.0) with our own kernels that also serve the
ChunkLA contract of Equation (16). Every other stage of chunk KDA is fla's, called by
:mod:`harts_kernels.kda.chunk`; the tensors exchanged with those stages keep fla's layouts:

    kg, w      [1, T, H, K]   k * 2^(G_last - G) and the WY factor w (input dtype)
    u, v_new   [1, T, H, V]   u = A (beta v) and v_new = u - w S (input dtype)
    gk         [1, T, H, K]   in-chunk cumulative log2 decay (fp32)
    h, dh      [1, NT, H, K, V]  state at the start / state gradient at the end of each chunk
                               (input dtype; NT = total chunks of the packed call)
    h0, ht     [N, H, K, V]   fp32 initial and final states
    bs, dbs    [U, H, K, V]   fp32 requested boundary states and their gradients
    bmap       [NT + N] int32 boundary id -> row of bs, or -1 (ids: chunk_offsets[n] + n + c)

Forward, per (value block, sequence, head) program, chunk by chunk on the sequence's own grid:
    S_c is stored to h[c] (input dtype) and, when bmap[id(c)] >= 0, to bs in fp32;
    v_new = u - w S_c;  S_{c+1} = Diag(2^gk_last) S_c + kg^T v_new;  S_n -> ht / bs.
The fp32 state in registers is exactly the state the scan itself carries: requested states come
from the same scan at the cost of one extra masked store each; nothing is rescanned.

Backward runs the reverse recurrence on dS (fp32 registers). At the top of the step for chunk c
(before dh[c] is stored) it adds dbs[bmap[id(c + 1)]], the gradient arriving at the boundary at
the end of chunk c, so it reaches dh (hence dk, dv, dg, dbeta of every earlier chunk through
fla's dqkg stage), the propagated dS of earlier chunks and dh0:
    dS += dbs[id(c+1)];  dh[c] = dS;  dv2 = kg dS + dv;
    dS = Diag(2^gk_last) dS + scale qg^T do - w^T dv2;   after chunk 0: dh0 = dS.

Interpreter-friendly (TRITON_INTERPRET=1): no ``.to()`` on loop variables, no autotuning there.
"""

from __future__ import annotations

import inspect
import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _autotune(key):
    """Autotune over value-block width, warps and stages on a GPU; a fixed config when
    interpreting (the interpreter cannot benchmark)."""
    configs = [
        triton.Config({"BV": BV}, num_warps=num_warps, num_stages=num_stages)
        for BV in (32, 64)
        for num_warps in (2, 4)
        for num_stages in (2, 3, 4)
    ]

    # Keep tuned choices in Triton's cache dir (as fla does), so a warm cache skips benchmarking.
    cache = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}

    def deco(fn):
        return fn if _INTERPRET else triton.autotune(configs=configs, key=key, **cache)(fn)

    return deco


@triton.heuristics({
    "USE_INITIAL_STATE": lambda args: args["h0"] is not None,
    "STORE_FINAL_STATE": lambda args: args["ht"] is not None,
    "STORE_BOUNDARY": lambda args: args["bs"] is not None,
    "SAVE_NEW_VALUE": lambda args: args["v_new"] is not None,
})
@_autotune(key=["H", "K", "V", "BT", "BK"])
@triton.jit(do_not_specialize=["T"])
def harts_kda_fwd_h_kernel(
    k,              # kg [1, T, H, K]
    u,              # [1, T, H, V]
    w,              # [1, T, H, K]
    gk,             # [1, T, H, K] fp32, in-chunk cumulative log2 decay
    v_new,          # [1, T, H, V] out (or None)
    h,              # [1, NT, H, K, V] out
    h0,             # [N, H, K, V] fp32 (or None)
    ht,             # [N, H, K, V] fp32 out (or None)
    bs,             # [U, H, K, V] fp32 out (or None)
    bmap,           # [NT + N] int32 (or None when bs is None)
    cu_seqlens,     # [N + 1]
    chunk_offsets,  # [N + 1]
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    STORE_BOUNDARY: tl.constexpr,
    SAVE_NEW_VALUE: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = (eos - bos).to(tl.int32)
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)   # first chunk of this sequence in h
    bnd = boh + i_n                                   # its first boundary id in bmap

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]            # offsets inside one [K, V] state
    s_nh = (i_n.to(tl.int64) * H + i_h) * (K * V)      # [N, H, K, V] offset of (n, h)

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + s_nh + o_kv, mask=m_kv, other=0.0).to(tl.float32)

    for i_t in range(NT):
        # S at the start of chunk i_t: to h (for fla's output and dqkg stages) and, if requested,
        # in fp32 to its boundary-state row.
        tl.store(h + ((boh + i_t) * H + i_h) * (K * V) + o_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        if STORE_BOUNDARY:
            # (o_kv * 0 + i_s) broadcasts the slot before the compare: the interpreter rejects
            # a block mask combined with a scalar predicate.
            i_s = tl.load(bmap + bnd + i_t)
            p_s = bs + (tl.maximum(i_s, 0).to(tl.int64) * H + i_h) * (K * V) + o_kv
            tl.store(p_s, b_h, mask=m_kv & ((o_kv * 0 + i_s) >= 0))

        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        r_t = bos + o_t                                # packed rows of this chunk
        b_w = tl.load(w + (r_t[:, None] * H + i_h) * K + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.0)                   # [BT, BK]
        b_v = tl.load(u + (r_t[:, None] * H + i_h) * V + o_v[None, :],
                      mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)    # [BT, BV]
        b_v -= tl.dot(b_w, b_h.to(b_w.dtype))
        if SAVE_NEW_VALUE:
            tl.store(v_new + (r_t[:, None] * H + i_h) * V + o_v[None, :],
                     b_v.to(v_new.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

        r_last = bos + tl.minimum((i_t + 1) * BT, T) - 1
        b_gl = tl.load(gk + (r_last * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_h *= tl.exp2(b_gl)[:, None]
        b_k = tl.load(k + (r_t[None, :] * H + i_h) * K + o_k[:, None],
                      mask=m_k[:, None] & m_t[None, :], other=0.0)                   # [BK, BT]
        b_h = tl.dot(b_k, b_v.to(b_k.dtype), b_h)

    if STORE_FINAL_STATE:
        tl.store(ht + s_nh + o_kv, b_h, mask=m_kv)
    if STORE_BOUNDARY:
        i_s = tl.load(bmap + bnd + NT)
        p_s = bs + (tl.maximum(i_s, 0).to(tl.int64) * H + i_h) * (K * V) + o_kv
        tl.store(p_s, b_h, mask=m_kv & ((o_kv * 0 + i_s) >= 0))


@triton.heuristics({
    "USE_INITIAL_STATE": lambda args: args["dh0"] is not None,
    "USE_FINAL_STATE_GRADIENT": lambda args: args["dht"] is not None,
    "USE_BOUNDARY_GRADIENT": lambda args: args["dbs"] is not None,
})
@_autotune(key=["H", "K", "V", "BT", "BK"])
@triton.jit(do_not_specialize=["T"])
def harts_kda_bwd_dh_kernel(
    q,              # qg [1, T, H, K] = q * 2^G
    k,              # kg [1, T, H, K]
    w,              # [1, T, H, K]
    gk,             # [1, T, H, K] fp32
    do,             # [1, T, H, V]
    dv,             # [1, T, H, V] intra-chunk part of dv_new (from fla's dAv stage)
    dv2,            # [1, T, H, V] out: dv + kg dS
    dh,             # [1, NT, H, K, V] out
    dh0,            # [N, H, K, V] fp32 out (or None)
    dht,            # [N, H, K, V] fp32 (or None)
    dbs,            # [U, H, K, V] fp32 (or None)
    bmap,           # [NT + N] int32 (or None when dbs is None)
    cu_seqlens,
    chunk_offsets,
    scale,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    USE_FINAL_STATE_GRADIENT: tl.constexpr,
    USE_BOUNDARY_GRADIENT: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = (eos - bos).to(tl.int32)
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    bnd = boh + i_n

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    s_nh = (i_n.to(tl.int64) * H + i_h) * (K * V)

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_dh += tl.load(dht + s_nh + o_kv, mask=m_kv, other=0.0).to(tl.float32)

    for i_t in range(NT - 1, -1, -1):
        if USE_BOUNDARY_GRADIENT:
            # gradient arriving at the boundary that ends chunk i_t (id i_t + 1)
            i_s = tl.load(bmap + bnd + i_t + 1)
            p_s = dbs + (tl.maximum(i_s, 0).to(tl.int64) * H + i_h) * (K * V) + o_kv
            b_dh += tl.load(p_s, mask=m_kv & ((o_kv * 0 + i_s) >= 0), other=0.0).to(tl.float32)
        tl.store(dh + ((boh + i_t) * H + i_h) * (K * V) + o_kv, b_dh.to(dh.dtype.element_ty), mask=m_kv)

        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        r_t = bos + o_t
        m_tv = m_t[:, None] & m_v[None, :]
        b_k = tl.load(k + (r_t[:, None] * H + i_h) * K + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.0)                   # [BT, BK]
        b_dv = tl.dot(b_k, b_dh.to(b_k.dtype))                                         # [BT, BV]
        b_dv += tl.load(dv + (r_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        tl.store(dv2 + (r_t[:, None] * H + i_h) * V + o_v[None, :], b_dv.to(dv2.dtype.element_ty), mask=m_tv)

        r_last = bos + tl.minimum((i_t + 1) * BT, T) - 1
        b_gl = tl.load(gk + (r_last * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_q = tl.load(q + (r_t[None, :] * H + i_h) * K + o_k[:, None],
                      mask=m_k[:, None] & m_t[None, :], other=0.0)                   # [BK, BT]
        b_w = tl.load(w + (r_t[None, :] * H + i_h) * K + o_k[:, None],
                      mask=m_k[:, None] & m_t[None, :], other=0.0)                   # [BK, BT]
        b_do = tl.load(do + (r_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
        b_dh *= tl.exp2(b_gl)[:, None]
        b_dh += tl.dot(b_q, b_do.to(b_q.dtype)) * scale - tl.dot(b_w, b_dv.to(b_w.dtype))

    if USE_INITIAL_STATE:
        tl.store(dh0 + s_nh + o_kv, b_dh, mask=m_kv)


def _block_k(K: int) -> int:
    if K > 256:
        raise ValueError(f"K: the state scan supports head dim K <= 256, got {K}")
    return max(16, triton.next_power_of_2(K))


def _launch_kwargs():
    return {"BV": 32} if _INTERPRET else {}


def state_scan_fwd(
    kg: torch.Tensor,              # [1, T, H, K]
    w: torch.Tensor,               # [1, T, H, K]
    u: torch.Tensor,               # [1, T, H, V]
    gk: torch.Tensor,              # [1, T, H, K] fp32 log2 in-chunk cumsum
    initial_state: torch.Tensor | None,   # [N, H, K, V] fp32
    cu_seqlens: torch.Tensor,      # [N + 1] int64, device
    chunk_offsets: torch.Tensor,   # [N + 1] int64, device
    num_chunks: int,               # NT, total chunks
    chunk_size: int,
    output_final_state: bool,
    boundary_map: torch.Tensor | None = None,   # [NT + N] int32, device
    num_boundaries: int = 0,       # U, rows of the fp32 boundary-state output
    save_new_value: bool = True,
):
    """Forward state scan. Returns ``(h [1, NT, H, K, V], v_new [1, T, H, V] | None,
    final_state [N, H, K, V] fp32 | None, boundary_states [U, H, K, V] fp32 | None)``."""
    B, T, H, K = kg.shape
    V = u.shape[-1]
    N = cu_seqlens.numel() - 1
    h = kg.new_empty(B, num_chunks, H, K, V)
    v_new = torch.empty_like(u) if save_new_value else None
    ht = kg.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    bs = None
    if boundary_map is not None and num_boundaries > 0:
        bs = kg.new_empty(num_boundaries, H, K, V, dtype=torch.float32)
    else:
        boundary_map = None

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), N * H)

    harts_kda_fwd_h_kernel[grid](
        k=kg, u=u, w=w, gk=gk, v_new=v_new, h=h, h0=initial_state, ht=ht, bs=bs, bmap=boundary_map,
        cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets, T=T,
        H=H, K=K, V=V, BT=chunk_size, BK=_block_k(K), **_launch_kwargs(),
    )
    return h, v_new, ht, bs


def state_scan_bwd(
    qg: torch.Tensor,              # [1, T, H, K]
    kg: torch.Tensor,              # [1, T, H, K]
    w: torch.Tensor,               # [1, T, H, K]
    gk: torch.Tensor,              # [1, T, H, K] fp32
    do: torch.Tensor,              # [1, T, H, V]
    dv: torch.Tensor,              # [1, T, H, V]
    scale: float,
    initial_state: torch.Tensor | None,   # only its presence matters: dh0 is returned iff given
    dht: torch.Tensor | None,      # [N, H, K, V] fp32
    cu_seqlens: torch.Tensor,
    chunk_offsets: torch.Tensor,
    num_chunks: int,
    chunk_size: int,
    boundary_map: torch.Tensor | None = None,
    d_boundary: torch.Tensor | None = None,     # [U, H, K, V] fp32
):
    """Reverse state recurrence with boundary-gradient injection. Returns
    ``(dh [1, NT, H, K, V], dh0 [N, H, K, V] fp32 | None, dv2 [1, T, H, V])``."""
    B, T, H, K = qg.shape
    V = do.shape[-1]
    N = cu_seqlens.numel() - 1
    dh = qg.new_empty(B, num_chunks, H, K, V)
    dh0 = qg.new_empty(N, H, K, V, dtype=torch.float32) if initial_state is not None else None
    dv2 = torch.empty_like(dv)
    if d_boundary is None or boundary_map is None or d_boundary.shape[0] == 0:
        d_boundary, boundary_map = None, None
    else:
        d_boundary = d_boundary.to(torch.float32).contiguous()
    if dht is not None:
        dht = dht.to(torch.float32).contiguous()

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), N * H)

    harts_kda_bwd_dh_kernel[grid](
        q=qg, k=kg, w=w, gk=gk, do=do, dv=dv, dv2=dv2, dh=dh, dh0=dh0, dht=dht, dbs=d_boundary,
        bmap=boundary_map, cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets, scale=scale, T=T,
        H=H, K=K, V=V, BT=chunk_size, BK=_block_k(K), **_launch_kwargs(),
    )
    return dh, dh0, dv2
