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
    bs, dbs    [U, H, K, V]   fp32 requested boundary states and their gradients, one row per
                               distinct boundary
    req_off    [N + 1] int32  requests [req_off[n], req_off[n + 1]) belong to sequence n
    req_chunk  [U] int32      boundary c of each request (strictly increasing within a sequence)
    req_row    [U] int32      row of bs / dbs of each request (so states land in the caller's order)

Glossary: a program owns one (value block of BV columns, sequence n, head h); the key dim is
held in up to four 64-row register blocks (K <= 256), so each [K, BV] state is 1-4 tiles of
[64, BV] fp32 and every product is a 64-deep (or BT-deep) tensor-core dot.

Forward, chunk by chunk on the sequence's own grid:
    S_c -> h[c] (input dtype);  if c is the next requested boundary of n: S_c -> bs (fp32);
    v_new = u - w S_c;  S_{c+1} = Diag(2^gk_last) S_c + kg^T v_new;  S_n -> ht / bs.
The requested boundaries of a sequence are visited in order with a scalar cursor in registers
(the next boundary to store), so a chunk pays one integer compare and only a requested boundary
pays its fp32 store and one scalar load: no per-chunk table lookup, no second scan.

Backward runs the reverse recurrence on dS (fp32 registers) with a cursor walking the same
requests from the last: at the top of the step for chunk c (before dh[c] is stored) it adds
dbs of the boundary that ends chunk c, if requested, so that gradient reaches dh (hence dk,
dv, dg, dbeta of every earlier chunk through fla's dqkg stage), dS of earlier chunks and dh0:
    dS += dbs[c + 1];  dh[c] = dS;  dv2 = kg dS + dv;
    dS = Diag(2^gk_last) dS + scale qg^T do - w^T dv2;   after chunk 0: dh0 = dS.

Cost: work and traffic of fla's scans, plus per requested boundary one [K, V] fp32 store
(forward) or load (backward) per head. Complexity O(T H K V) per scan; preconditions are
checked by :func:`harts_kernels.kda.chunk.chunk_kda_with_states` (K <= 256, BT in {32, 64}).

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
    cache = (
        {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    )

    def deco(fn):
        return fn if _INTERPRET else triton.autotune(configs=configs, key=key, **cache)(fn)

    return deco


# ----------------------------------------------------------------------------- tile helpers
# A state is up to four [64, BV] fp32 blocks b1..b4 (key rows [0,64), [64,128), ...); blocks past
# K are never touched (the `K > 64` etc. branches are resolved at compile time).


@triton.jit
def _state_load(p, o_v, m_v, K: tl.constexpr, V: tl.constexpr, b1, b2, b3, b4):
    """b_i += the [K, V] fp32 state at p (key blocks of 64 rows)."""
    o_k = tl.arange(0, 64)
    b1 += tl.load(p + o_k[:, None] * V + o_v[None, :], mask=(o_k < K)[:, None] & m_v[None, :], other=0.0)
    if K > 64:
        b2 += tl.load(
            p + (64 + o_k)[:, None] * V + o_v[None, :], mask=(64 + o_k < K)[:, None] & m_v[None, :], other=0.0
        )
    if K > 128:
        b3 += tl.load(
            p + (128 + o_k)[:, None] * V + o_v[None, :],
            mask=(128 + o_k < K)[:, None] & m_v[None, :],
            other=0.0,
        )
    if K > 192:
        b4 += tl.load(
            p + (192 + o_k)[:, None] * V + o_v[None, :],
            mask=(192 + o_k < K)[:, None] & m_v[None, :],
            other=0.0,
        )
    return b1, b2, b3, b4


@triton.jit
def _state_store(p, o_v, m_v, K: tl.constexpr, V: tl.constexpr, b1, b2, b3, b4):
    """The [K, V] state at p (its dtype) = blocks b1..b4."""
    o_k = tl.arange(0, 64)
    tl.store(
        p + o_k[:, None] * V + o_v[None, :], b1.to(p.dtype.element_ty), mask=(o_k < K)[:, None] & m_v[None, :]
    )
    if K > 64:
        tl.store(
            p + (64 + o_k)[:, None] * V + o_v[None, :],
            b2.to(p.dtype.element_ty),
            mask=(64 + o_k < K)[:, None] & m_v[None, :],
        )
    if K > 128:
        tl.store(
            p + (128 + o_k)[:, None] * V + o_v[None, :],
            b3.to(p.dtype.element_ty),
            mask=(128 + o_k < K)[:, None] & m_v[None, :],
        )
    if K > 192:
        tl.store(
            p + (192 + o_k)[:, None] * V + o_v[None, :],
            b4.to(p.dtype.element_ty),
            mask=(192 + o_k < K)[:, None] & m_v[None, :],
        )


@triton.jit
def _rows(p, o_t, m_t, k0: tl.constexpr, K: tl.constexpr, HK: tl.constexpr):
    """[BT, 64] tile of key columns [k0, k0 + 64) of rows o_t (mask m_t) of a [.., H, K]
    row-major tensor at p (row stride HK = H * K)."""
    o_k = k0 + tl.arange(0, 64)
    return tl.load(p + o_t[:, None] * HK + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)


@triton.jit
def _rows_times_state(p, o_t, m_t, K: tl.constexpr, HK: tl.constexpr, b1, b2, b3, b4):
    """[BT, BV] fp32 = X S: the [BT, K] rows X of p (see :func:`_rows`) times the state in
    blocks b1..b4 (cast to p's dtype for the tensor-core dots)."""
    acc = tl.dot(_rows(p, o_t, m_t, 0, K, HK), b1.to(p.dtype.element_ty))
    if K > 64:
        acc = tl.dot(_rows(p, o_t, m_t, 64, K, HK), b2.to(p.dtype.element_ty), acc)
    if K > 128:
        acc = tl.dot(_rows(p, o_t, m_t, 128, K, HK), b3.to(p.dtype.element_ty), acc)
    if K > 192:
        acc = tl.dot(_rows(p, o_t, m_t, 192, K, HK), b4.to(p.dtype.element_ty), acc)
    return acc


@triton.jit
def _cols(p, o_t, m_t, k0: tl.constexpr, K: tl.constexpr, HK: tl.constexpr):
    """[64, BT] transposed tile of key columns [k0, k0 + 64) (see :func:`_rows`)."""
    o_k = k0 + tl.arange(0, 64)
    return tl.load(p + o_k[:, None] + o_t[None, :] * HK, mask=(o_k < K)[:, None] & m_t[None, :], other=0.0)


@triton.jit
def _decay(p, k0: tl.constexpr, K: tl.constexpr):
    """[64, 1] factors 2^gk_last of key rows [k0, k0 + 64) (gk fp32 log2 at p)."""
    o_k = k0 + tl.arange(0, 64)
    return tl.exp2(tl.load(p + o_k, mask=o_k < K, other=0.0))[:, None]


@triton.jit
def _program(cu_seqlens, chunk_offsets, H: tl.constexpr, BT: tl.constexpr):
    """This program's value block i_v, sequence i_n and head i_h (grid (NV, N * H)), the
    sequence's first packed row bos (int64), length T, chunk count NT and first chunk boh (int64)
    in the [1, NT_total, ...] state tensors."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    return i_v, i_n, i_h, bos, T, tl.cdiv(T, BT), boh


# ----------------------------------------------------------------------------- kernels


@triton.heuristics(
    {
        "USE_INITIAL_STATE": lambda args: args["h0"] is not None,
        "STORE_FINAL_STATE": lambda args: args["ht"] is not None,
        "STORE_BOUNDARY": lambda args: args["bs"] is not None,
        "SAVE_NEW_VALUE": lambda args: args["v_new"] is not None,
    }
)
@_autotune(key=["H", "K", "V", "BT"])
@triton.jit(do_not_specialize=["T"])
def harts_kda_fwd_h_kernel(
    k,  # kg [1, T, H, K]
    u,  # [1, T, H, V]
    w,  # [1, T, H, K]
    gk,  # [1, T, H, K] fp32, in-chunk cumulative log2 decay
    v_new,  # [1, T, H, V] out (or None)
    h,  # [1, NT, H, K, V] out
    h0,  # [N, H, K, V] fp32 (or None)
    ht,  # [N, H, K, V] fp32 out (or None)
    bs,  # [U, H, K, V] fp32 out (or None)
    req_off,  # [N + 1] int32 (or None when bs is None)
    req_chunk,  # [U] int32 (or None when bs is None)
    req_row,  # [U] int32 (or None when bs is None)
    cu_seqlens,  # [N + 1]
    chunk_offsets,  # [N + 1]
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    STORE_BOUNDARY: tl.constexpr,
    SAVE_NEW_VALUE: tl.constexpr,
):
    i_v, i_n, i_h, bos, T, NT, boh = _program(cu_seqlens, chunk_offsets, H, BT)

    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_b = tl.arange(0, BT)  # row inside a chunk
    # Per-(sequence, head) base pointers; per-chunk offsets are scalar, per-element ones int32.
    k += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    u += (bos * H + i_h) * V
    gk += (bos * H + i_h) * K
    if SAVE_NEW_VALUE:
        v_new += (bos * H + i_h) * V
    h += (boh * H + i_h) * (K * V)
    s_nh = (i_n.to(tl.int64) * H + i_h) * (K * V)  # [N, H, K, V] offset of (n, h)

    b_h1 = tl.zeros([64, BV], dtype=tl.float32)
    b_h2 = tl.zeros([64, BV], dtype=tl.float32)
    b_h3 = tl.zeros([64, BV], dtype=tl.float32)
    b_h4 = tl.zeros([64, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h1, b_h2, b_h3, b_h4 = _state_load(h0 + s_nh, o_v, m_v, K, V, b_h1, b_h2, b_h3, b_h4)
    if STORE_BOUNDARY:
        # cursor: row j of bs is the next requested boundary c_next of this sequence (-1: none)
        j = tl.load(req_off + i_n).to(tl.int64)
        j_end = tl.load(req_off + i_n + 1).to(tl.int64)
        c_next = tl.load(req_chunk + j, mask=j < j_end, other=-1)

    for i_t in range(NT):
        t64 = boh * 0 + i_t  # chunk index as int64 (no .to on i_t)
        _state_store(h + t64 * H * (K * V), o_v, m_v, K, V, b_h1, b_h2, b_h3, b_h4)
        if STORE_BOUNDARY:
            if i_t == c_next:
                row = tl.load(req_row + j).to(tl.int64)
                _state_store(bs + (row * H + i_h) * (K * V), o_v, m_v, K, V, b_h1, b_h2, b_h3, b_h4)
                j += 1
                c_next = tl.load(req_chunk + j, mask=j < j_end, other=-1)

        r0 = i_t * BT  # first row of the chunk in the sequence
        m_t = r0 + o_b < T
        c_k = t64 * BT * (H * K)  # chunk offsets (int64) in [.., H, K] and
        c_v = t64 * BT * (H * V)  # [.., H, V] tensors; rows are then o_b
        # v_new = u - w S
        b_v = _rows_times_state(w + c_k, o_b, m_t, K, H * K, b_h1, b_h2, b_h3, b_h4)
        m_tv = m_t[:, None] & m_v[None, :]
        b_v = (
            tl.load(u + c_v + o_b[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            - b_v
        )
        if SAVE_NEW_VALUE:
            tl.store(
                v_new + c_v + o_b[:, None] * (H * V) + o_v[None, :], b_v.to(v_new.dtype.element_ty), mask=m_tv
            )
        b_v = b_v.to(k.dtype.element_ty)

        # S = Diag(2^gk_last) S + kg^T v_new
        p_gl = gk + c_k + (tl.minimum(BT, T - r0) - 1) * (H * K)
        b_h1 = tl.dot(_cols(k + c_k, o_b, m_t, 0, K, H * K), b_v, b_h1 * _decay(p_gl, 0, K))
        if K > 64:
            b_h2 = tl.dot(_cols(k + c_k, o_b, m_t, 64, K, H * K), b_v, b_h2 * _decay(p_gl, 64, K))
        if K > 128:
            b_h3 = tl.dot(_cols(k + c_k, o_b, m_t, 128, K, H * K), b_v, b_h3 * _decay(p_gl, 128, K))
        if K > 192:
            b_h4 = tl.dot(_cols(k + c_k, o_b, m_t, 192, K, H * K), b_v, b_h4 * _decay(p_gl, 192, K))

    if STORE_FINAL_STATE:
        _state_store(ht + s_nh, o_v, m_v, K, V, b_h1, b_h2, b_h3, b_h4)
    if STORE_BOUNDARY:
        if NT == c_next:
            row = tl.load(req_row + j).to(tl.int64)
            _state_store(bs + (row * H + i_h) * (K * V), o_v, m_v, K, V, b_h1, b_h2, b_h3, b_h4)


@triton.heuristics(
    {
        "USE_INITIAL_STATE": lambda args: args["dh0"] is not None,
        "USE_FINAL_STATE_GRADIENT": lambda args: args["dht"] is not None,
        "USE_BOUNDARY_GRADIENT": lambda args: args["dbs"] is not None,
    }
)
@_autotune(key=["H", "K", "V", "BT"])
@triton.jit(do_not_specialize=["T"])
def harts_kda_bwd_dh_kernel(
    q,  # qg [1, T, H, K] = q * 2^G
    k,  # kg [1, T, H, K]
    w,  # [1, T, H, K]
    gk,  # [1, T, H, K] fp32
    do,  # [1, T, H, V]
    dv,  # [1, T, H, V] intra-chunk part of dv_new (from fla's dAv stage)
    dv2,  # [1, T, H, V] out: dv + kg dS
    dh,  # [1, NT, H, K, V] out
    dh0,  # [N, H, K, V] fp32 out (or None)
    dht,  # [N, H, K, V] fp32 (or None)
    dbs,  # [U, H, K, V] fp32 (or None)
    req_off,  # [N + 1] int32 (or None when dbs is None)
    req_chunk,  # [U] int32 (or None when dbs is None)
    req_row,  # [U] int32 (or None when dbs is None)
    cu_seqlens,
    chunk_offsets,
    scale,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    USE_FINAL_STATE_GRADIENT: tl.constexpr,
    USE_BOUNDARY_GRADIENT: tl.constexpr,
):
    i_v, i_n, i_h, bos, T, NT, boh = _program(cu_seqlens, chunk_offsets, H, BT)

    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_b = tl.arange(0, BT)
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    gk += (bos * H + i_h) * K
    do += (bos * H + i_h) * V
    dv += (bos * H + i_h) * V
    dv2 += (bos * H + i_h) * V
    dh += (boh * H + i_h) * (K * V)
    s_nh = (i_n.to(tl.int64) * H + i_h) * (K * V)

    b_dh1 = tl.zeros([64, BV], dtype=tl.float32)
    b_dh2 = tl.zeros([64, BV], dtype=tl.float32)
    b_dh3 = tl.zeros([64, BV], dtype=tl.float32)
    b_dh4 = tl.zeros([64, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_dh1, b_dh2, b_dh3, b_dh4 = _state_load(dht + s_nh, o_v, m_v, K, V, b_dh1, b_dh2, b_dh3, b_dh4)
    if USE_BOUNDARY_GRADIENT:
        # cursor from the last request: row j of dbs is boundary c_prev of this sequence (-1: none)
        j_beg = tl.load(req_off + i_n).to(tl.int64)
        j = tl.load(req_off + i_n + 1).to(tl.int64) - 1
        c_prev = tl.load(req_chunk + j, mask=j >= j_beg, other=-1)

    for i_t in range(NT - 1, -1, -1):
        if USE_BOUNDARY_GRADIENT:
            if i_t + 1 == c_prev:  # the boundary that ends chunk i_t
                row = tl.load(req_row + j).to(tl.int64)
                b_dh1, b_dh2, b_dh3, b_dh4 = _state_load(
                    dbs + (row * H + i_h) * (K * V), o_v, m_v, K, V, b_dh1, b_dh2, b_dh3, b_dh4
                )
                j -= 1
                c_prev = tl.load(req_chunk + j, mask=j >= j_beg, other=-1)
        t64 = boh * 0 + i_t
        _state_store(dh + t64 * H * (K * V), o_v, m_v, K, V, b_dh1, b_dh2, b_dh3, b_dh4)

        r0 = i_t * BT
        m_t = r0 + o_b < T
        c_k = t64 * BT * (H * K)
        c_v = t64 * BT * (H * V)
        m_tv = m_t[:, None] & m_v[None, :]
        # dv2 = kg dS + dv
        b_dv = _rows_times_state(k + c_k, o_b, m_t, K, H * K, b_dh1, b_dh2, b_dh3, b_dh4)
        b_dv += tl.load(dv + c_v + o_b[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        tl.store(dv2 + c_v + o_b[:, None] * (H * V) + o_v[None, :], b_dv.to(dv2.dtype.element_ty), mask=m_tv)
        b_dv = b_dv.to(w.dtype.element_ty)

        # dS = Diag(2^gk_last) dS + scale qg^T do - w^T dv2
        b_do = tl.load(do + c_v + o_b[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0).to(
            q.dtype.element_ty
        )
        p_gl = gk + c_k + (tl.minimum(BT, T - r0) - 1) * (H * K)
        b_dh1 = (
            b_dh1 * _decay(p_gl, 0, K)
            + tl.dot(_cols(q + c_k, o_b, m_t, 0, K, H * K), b_do) * scale
            - tl.dot(_cols(w + c_k, o_b, m_t, 0, K, H * K), b_dv)
        )
        if K > 64:
            b_dh2 = (
                b_dh2 * _decay(p_gl, 64, K)
                + tl.dot(_cols(q + c_k, o_b, m_t, 64, K, H * K), b_do) * scale
                - tl.dot(_cols(w + c_k, o_b, m_t, 64, K, H * K), b_dv)
            )
        if K > 128:
            b_dh3 = (
                b_dh3 * _decay(p_gl, 128, K)
                + tl.dot(_cols(q + c_k, o_b, m_t, 128, K, H * K), b_do) * scale
                - tl.dot(_cols(w + c_k, o_b, m_t, 128, K, H * K), b_dv)
            )
        if K > 192:
            b_dh4 = (
                b_dh4 * _decay(p_gl, 192, K)
                + tl.dot(_cols(q + c_k, o_b, m_t, 192, K, H * K), b_do) * scale
                - tl.dot(_cols(w + c_k, o_b, m_t, 192, K, H * K), b_dv)
            )

    if USE_INITIAL_STATE:
        _state_store(dh0 + s_nh, o_v, m_v, K, V, b_dh1, b_dh2, b_dh3, b_dh4)


# ----------------------------------------------------------------------------- launchers


def _check_k(K: int) -> None:
    if K > 256:
        raise ValueError(f"K: the state scan supports head dim K <= 256, got {K}")


def _launch_kwargs():
    return {"BV": 32} if _INTERPRET else {}


def _requests(req, n: int):
    """``req = (req_off [N + 1], req_chunk [U], req_row [U])`` int32 device tensors, or None."""
    if req is None or req[1].numel() == 0:
        return None, None, None
    req_off, req_chunk, req_row = req
    if (
        req_off.numel() != n + 1
        or req_row.numel() != req_chunk.numel()
        or any(t.dtype != torch.int32 for t in req)
    ):
        raise ValueError(
            f"requests: expected int32 req_off [N + 1 = {n + 1}], req_chunk [U], req_row [U]; "
            f"got {[(t.dtype, tuple(t.shape)) for t in req]}"
        )
    return req_off, req_chunk, req_row


def state_scan_fwd(
    kg: torch.Tensor,  # [1, T, H, K]
    w: torch.Tensor,  # [1, T, H, K]
    u: torch.Tensor,  # [1, T, H, V]
    gk: torch.Tensor,  # [1, T, H, K] fp32 log2 in-chunk cumsum
    initial_state: torch.Tensor | None,  # [N, H, K, V] fp32
    cu_seqlens: torch.Tensor,  # [N + 1] int64, device
    chunk_offsets: torch.Tensor,  # [N + 1] int64, device
    num_chunks: int,  # NT, total chunks
    chunk_size: int,
    output_final_state: bool,
    requests=None,  # (req_off [N + 1], req_chunk [U], req_row [U]) int32, device
    save_new_value: bool = True,
):
    """Forward state scan. Returns ``(h [1, NT, H, K, V], v_new [1, T, H, V] | None,
    final_state [N, H, K, V] fp32 | None, boundary_states [U, H, K, V] fp32 | None)``."""
    B, T, H, K = kg.shape
    V = u.shape[-1]
    N = cu_seqlens.numel() - 1
    _check_k(K)
    req_off, req_chunk, req_row = _requests(requests, N)
    h = kg.new_empty(B, num_chunks, H, K, V)
    v_new = torch.empty_like(u) if save_new_value else None
    ht = kg.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    bs = kg.new_empty(req_chunk.numel(), H, K, V, dtype=torch.float32) if req_chunk is not None else None

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), N * H)

    harts_kda_fwd_h_kernel[grid](
        k=kg,
        u=u,
        w=w,
        gk=gk,
        v_new=v_new,
        h=h,
        h0=initial_state,
        ht=ht,
        bs=bs,
        req_off=req_off,
        req_chunk=req_chunk,
        req_row=req_row,
        cu_seqlens=cu_seqlens,
        chunk_offsets=chunk_offsets,
        T=T,
        H=H,
        K=K,
        V=V,
        BT=chunk_size,
        **_launch_kwargs(),
    )
    return h, v_new, ht, bs


def state_scan_bwd(
    qg: torch.Tensor,  # [1, T, H, K]
    kg: torch.Tensor,  # [1, T, H, K]
    w: torch.Tensor,  # [1, T, H, K]
    gk: torch.Tensor,  # [1, T, H, K] fp32
    do: torch.Tensor,  # [1, T, H, V]
    dv: torch.Tensor,  # [1, T, H, V]
    scale: float,
    initial_state: torch.Tensor | None,  # only its presence matters: dh0 is returned iff given
    dht: torch.Tensor | None,  # [N, H, K, V] fp32
    cu_seqlens: torch.Tensor,
    chunk_offsets: torch.Tensor,
    num_chunks: int,
    chunk_size: int,
    requests=None,  # (req_off, req_chunk, req_row) as in state_scan_fwd
    d_boundary: torch.Tensor | None = None,  # [U, H, K, V] fp32
):
    """Reverse state recurrence with boundary-gradient injection. Returns
    ``(dh [1, NT, H, K, V], dh0 [N, H, K, V] fp32 | None, dv2 [1, T, H, V])``."""
    B, T, H, K = qg.shape
    V = do.shape[-1]
    N = cu_seqlens.numel() - 1
    _check_k(K)
    dh = qg.new_empty(B, num_chunks, H, K, V)
    dh0 = qg.new_empty(N, H, K, V, dtype=torch.float32) if initial_state is not None else None
    dv2 = torch.empty_like(dv)
    req_off, req_chunk, req_row = _requests(requests, N)
    if d_boundary is None or req_chunk is None:
        d_boundary, req_off, req_chunk, req_row = None, None, None, None
    else:
        if d_boundary.shape[0] != req_chunk.numel():
            raise ValueError(f"d_boundary: expected {req_chunk.numel()} rows, got {d_boundary.shape[0]}")
        d_boundary = d_boundary.to(torch.float32).contiguous()
    if dht is not None:
        dht = dht.to(torch.float32).contiguous()

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), N * H)

    harts_kda_bwd_dh_kernel[grid](
        q=qg,
        k=kg,
        w=w,
        gk=gk,
        do=do,
        dv=dv,
        dv2=dv2,
        dh=dh,
        dh0=dh0,
        dht=dht,
        dbs=d_boundary,
        req_off=req_off,
        req_chunk=req_chunk,
        req_row=req_row,
        cu_seqlens=cu_seqlens,
        chunk_offsets=chunk_offsets,
        scale=scale,
        T=T,
        H=H,
        K=K,
        V=V,
        BT=chunk_size,
        **_launch_kwargs(),
    )
    return dh, dh0, dv2
