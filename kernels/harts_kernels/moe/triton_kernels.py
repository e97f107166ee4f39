"""The Triton kernels of :mod:`harts_kernels.moe` (imported on first use: this module needs triton).

``W`` in the SwiGLU kernels is the intermediate width I.

Every row count is a runtime argument excluded from specialization (``do_not_specialize``): the
constexprs are the block sizes, chosen from the widths alone, and flags, so a microbatch of a
never-seen size reuses the compiled kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N"])
def gather_sum_kernel(y, index, base, out, N, D, K: tl.constexpr, HAS_BASE: tl.constexpr, BD: tl.constexpr):
    """Program (n, c): ``out[n, cols] = base[n, cols] + sum_{j < K} y[index[n K + j], cols]``,
    float32, the base first, then j ascending."""
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = cols < D
    if HAS_BASE:
        acc = tl.load(base + n * D + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(K):
        src = tl.load(index + n * K + j).to(tl.int64)  # row offsets past 2^31 elements
        acc += tl.load(y + src * D + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + n * D + cols, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "LIMIT"])
def swiglu_fwd_kernel(
    gu, w, h, M, W, LIMIT, HAS_W: tl.constexpr, HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BI: tl.constexpr
):
    """Program (r, c): rows ``r BM ..``, columns ``c BI ..`` of ``h = silu(a) * b (* w)``; with
    ``HAS_LIMIT`` ``min(silu(a), LIMIT) * clamp(b, -LIMIT, LIMIT) (* w)``."""
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = (rows < M)[:, None] & (cols < W)[None, :]
    p = gu + rows[:, None] * (2 * W) + cols[None, :]
    a = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(p + W, mask=mask, other=0.0).to(tl.float32)
    silu = a * tl.sigmoid(a)
    if HAS_LIMIT:
        silu = tl.minimum(silu, LIMIT)
        b = tl.minimum(tl.maximum(b, -LIMIT), LIMIT)
    out = silu * b
    if HAS_W:
        out *= tl.load(w + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]
    tl.store(h + rows[:, None] * W + cols[None, :], out.to(h.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "LIMIT"])
def swiglu_bwd_kernel(
    gu,
    w,
    g,
    dgu,
    dw,
    M,
    W,
    LIMIT,
    HAS_W: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BM: tl.constexpr,
    BI: tl.constexpr,
):
    """Program r: rows ``r BM ..``, all W columns in blocks of BI: ``d a``, ``d b`` into ``dgu``
    and, with weights, ``dw = sum_I g * silu(a) * b`` (float32, one rounding). With
    ``HAS_LIMIT`` the clipped SwiGLU's gradients: a clamp passes the gradient where its input lies
    inside the closed interval (torch's ``clamp`` convention) and blocks it outside."""
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rmask = rows < M
    if HAS_W:
        wr = tl.load(w + rows, mask=rmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BM], dtype=tl.float32)
    for c0 in range(0, W, BI):
        cols = c0 + tl.arange(0, BI)
        mask = rmask[:, None] & (cols < W)[None, :]
        p = gu + rows[:, None] * (2 * W) + cols[None, :]
        a = tl.load(p, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(p + W, mask=mask, other=0.0).to(tl.float32)
        go = tl.load(g + rows[:, None] * W + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(a)
        silu = a * s
        dsilu = s * (1.0 + a * (1.0 - s))
        if HAS_LIMIT:
            dsilu = tl.where(silu <= LIMIT, dsilu, 0.0)
            silu = tl.minimum(silu, LIMIT)
            bpass = (b >= -LIMIT) & (b <= LIMIT)
            b = tl.minimum(tl.maximum(b, -LIMIT), LIMIT)
        if HAS_W:
            acc += tl.sum(go * silu * b, 1)
            dh = go * wr[:, None]
        else:
            dh = go
        da = dh * b * dsilu
        db = dh * silu
        if HAS_LIMIT:
            db = tl.where(bpass, db, 0.0)
        q = dgu + rows[:, None] * (2 * W) + cols[None, :]
        tl.store(q, da.to(dgu.dtype.element_ty), mask=mask)
        tl.store(q + W, db.to(dgu.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(dw + rows, acc.to(dw.dtype.element_ty), mask=rmask)
