"""Pure-PyTorch references of the KDA ChunkLA contract (Equation 16): chunked and recurrent.

Both take the same arguments as :func:`harts_kernels.kda.chunk_kda_with_states` and return
``(o, final_state, boundary_states)``. They compute in float32 (float64 when the inputs are
float64, for ``gradcheck``), support packed varlen calls, per-sequence initial states and
requested boundary states, and are differentiable by plain autograd. They import only torch.

Recurrence (per sequence and head; state ``S [K, V]``, log-space per key-dim decay ``g``):

    S_t = Diag(exp(g_t)) S_{t-1}
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T
    o_t = scale * S_t^T q_t

Chunk form on the sequence's own grid of ``B = chunk_size`` tokens (``G`` = in-chunk cumulative
``g``, ``S`` = state at the chunk start; Equation 1 of the paper in this notation):

    L     = I + Diag(beta) tril_strict(A_kk),  A_kk[i, j] = sum_d k_id k_jd exp(G_id - G_jd)
    u     = L^-1 Diag(beta) V,   w = L^-1 Diag(beta) (exp(G) * K)
    v_new = u - w S
    O     = scale (exp(G) * Q) S + scale tril(A_qk) v_new,   A_qk like A_kk with q_i
    S'    = Diag(exp(G_last)) S + (exp(G_last - G) * K)^T v_new

Every exponent is <= 0 after masking, so the reference is stable for any decay. The chunked
reference supports any ``chunk_size >= 1`` (the GPU path only 32 or 64).

State passing (context parallelism, :mod:`harts_kernels.kda.cp`): :func:`naive_piece_summary` (the
affine summary ``S_out = A S_in + b`` of a piece, token by token) and :func:`naive_fold_states` (the
fold of the summaries in piece order), plain-loop references.
"""

from __future__ import annotations

import torch

from harts_kernels.kda.utils import (
    check_initial_state,
    pack_inputs,
    seq_lens_from_cu_seqlens,
    validate_requests,
)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _finish(o, final, boundary, req, H, K, V, cdt, device, v_dtype, batch_shape, output_final_state):
    if boundary:
        bstates = torch.stack(boundary, 0)  # [R, H, K, V]
    else:
        bstates = torch.zeros(0, H, K, V, dtype=cdt, device=device)
    o = o.to(v_dtype).unsqueeze(0)  # [1, T, H, V]
    if batch_shape is not None:
        o = o.reshape(*batch_shape, H, V)  # [B, T, H, V]
    return o, (final if output_final_state else None), bstates


def naive_recurrent_kda_with_states(
    q: torch.Tensor,  # [B, T, H, K]   (B = 1 with cu_seqlens)
    k: torch.Tensor,  # [B, T, H, K]
    v: torch.Tensor,  # [B, T, H, V]
    g: torch.Tensor,  # [B, T, H, K]   log-space decay, <= 0
    beta: torch.Tensor,  # [B, T, H]      post-sigmoid
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,  # [N, H, K, V] fp32
    cu_seqlens=None,  # [N + 1]
    chunk_size: int = 64,
    request_seq=None,  # [R]
    request_chunk=None,  # [R]
    output_final_state: bool = True,
):
    """Token-by-token reference. Returns ``(o [B, T, H, V], final_state [N, H, K, V] | None,
    boundary_states [R, H, K, V])``; states in float32 (float64 for float64 inputs)."""
    in_dtype = v.dtype
    q, k, v, g, beta, cu, batch_shape = pack_inputs(q, k, v, g, beta, cu_seqlens)
    _, T, H, K = q.shape
    V = v.shape[-1]
    lens = seq_lens_from_cu_seqlens(cu, T)
    req = validate_requests(lens, chunk_size, request_seq, request_chunk)
    N = len(lens)
    check_initial_state(initial_state, N, H, K, V)
    cdt = _compute_dtype(q)
    dev = q.device
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x[0].to(cdt) for x in (q, k, v, g, beta))  # [T, H, *]

    wanted = {}
    for r, (i, c) in enumerate(zip(req.request_seq, req.request_chunk)):
        wanted.setdefault((i, c), []).append(r)
    boundary = [None] * req.num_requests

    S = (
        initial_state.to(cdt) if initial_state is not None else torch.zeros(N, H, K, V, dtype=cdt, device=dev)
    )  # [N, H, K, V]
    rows_out, o_out = [], []
    for t in range(max(lens)):
        act = [i for i in range(N) if lens[i] > t]
        ai = torch.tensor(act, device=dev)
        rows = torch.tensor([cu[i] + t for i in act], device=dev)
        full = len(act) == N
        S_a = S if full else S[ai]  # [A, H, K, V]
        q_t, k_t, v_t, g_t, b_t = q[rows], k[rows], v[rows], g[rows], beta[rows]
        S_a = S_a * g_t.exp()[..., None]
        delta = b_t[..., None] * (v_t - torch.einsum("ahk,ahkv->ahv", k_t, S_a))
        S_a = S_a + k_t[..., None] * delta[..., None, :]
        o_out.append(scale * torch.einsum("ahk,ahkv->ahv", q_t, S_a))  # [A, H, V]
        rows_out.append(rows)
        S = S_a if full else S.index_copy(0, ai, S_a)
        if (t + 1) % chunk_size == 0:
            c = (t + 1) // chunk_size
            for j, i in enumerate(act):
                for r in wanted.get((i, c), ()):
                    boundary[r] = S_a[j]
    order = torch.cat(rows_out)
    o = torch.cat(o_out)[torch.argsort(order)]  # [T, H, V]
    return _finish(o, S, boundary, req, H, K, V, cdt, dev, in_dtype, batch_shape, output_final_state)


def naive_chunk_kda_with_states(
    q: torch.Tensor,  # [B, T, H, K]   (B = 1 with cu_seqlens)
    k: torch.Tensor,  # [B, T, H, K]
    v: torch.Tensor,  # [B, T, H, V]
    g: torch.Tensor,  # [B, T, H, K]   log-space decay, <= 0
    beta: torch.Tensor,  # [B, T, H]      post-sigmoid
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,  # [N, H, K, V] fp32
    cu_seqlens=None,  # [N + 1]
    chunk_size: int = 64,
    request_seq=None,  # [R]
    request_chunk=None,  # [R]
    output_final_state: bool = True,
):
    """Chunked reference on each sequence's own grid of ``chunk_size`` tokens (the GPU path's
    grid). Same arguments and returns as :func:`naive_recurrent_kda_with_states`."""
    in_dtype = v.dtype
    q, k, v, g, beta, cu, batch_shape = pack_inputs(q, k, v, g, beta, cu_seqlens)
    _, T, H, K = q.shape
    V = v.shape[-1]
    lens = seq_lens_from_cu_seqlens(cu, T)
    req = validate_requests(lens, chunk_size, request_seq, request_chunk)
    N = len(lens)
    check_initial_state(initial_state, N, H, K, V)
    cdt = _compute_dtype(q)
    dev = q.device
    BT = chunk_size
    scale = K**-0.5 if scale is None else scale

    # Chunk table: chunk c of sequence i is global chunk chunk_of[i][c]; rows past a partial
    # chunk's end point at a zero pad row T (k = v = beta = g = 0 leaves the recurrence exact).
    starts, ends, chunk_of = [], [], []
    for i in range(len(lens)):
        chunk_of.append([])
        for c in range(req.num_chunks[i]):
            chunk_of[i].append(len(starts))
            starts.append(cu[i] + c * BT)
            ends.append(cu[i + 1])
    NC = len(starts)
    idx = torch.tensor(starts, device=dev)[:, None] + torch.arange(BT, device=dev)  # [NC, BT]
    valid = idx < torch.tensor(ends, device=dev)[:, None]
    idx = torch.where(valid, idx, torch.full_like(idx, T))

    def chunked(x):  # [T, H, *] -> [NC, H, BT, *]
        x = x[0].to(cdt)
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])], 0)[idx]  # [NC, BT, H, *]
        return x.transpose(1, 2)

    qc, kc, vc, gc = chunked(q), chunked(k), chunked(v), chunked(g)  # [NC, H, BT, K|V]
    bc = chunked(beta)  # [NC, H, BT]
    G = gc.cumsum(2)  # [NC, H, BT, K]

    incl = torch.ones(BT, BT, dtype=torch.bool, device=dev).tril()
    strict = incl.tril(-1)
    D = G[:, :, :, None, :] - G[:, :, None, :, :]  # [NC, H, BT(i), BT(j), K]
    E = D.masked_fill(~incl[:, :, None], float("-inf")).exp()  # exp(G_i - G_j), j <= i
    Aqk = torch.einsum("nhid,nhjd,nhijd->nhij", qc, kc, E) * scale  # [NC, H, BT, BT]
    Akk = torch.einsum(
        "nhid,nhjd,nhijd->nhij", kc, kc, E.masked_fill(~strict[:, :, None], 0.0)
    )  # strictly lower
    eye = torch.eye(BT, dtype=cdt, device=dev)
    Lmat = eye + bc[..., None] * Akk  # unit lower triangular
    u = torch.linalg.solve_triangular(Lmat, bc[..., None] * vc, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        Lmat, bc[..., None] * (G.exp() * kc), upper=False, unitriangular=True
    )  # [NC, H, BT, K]
    qg = qc * G.exp() * scale  # [NC, H, BT, K]
    G_last = G[:, :, -1, :]  # [NC, H, K] (pads add 0)
    kg = kc * (G_last[:, :, None, :] - G).exp()  # [NC, H, BT, K]
    decay = G_last.exp()[..., None]  # [NC, H, K, 1]

    wanted = {}
    for r, (i, c) in enumerate(zip(req.request_seq, req.request_chunk)):
        wanted.setdefault((i, c), []).append(r)
    boundary = [None] * req.num_requests

    S = (
        initial_state.to(cdt) if initial_state is not None else torch.zeros(N, H, K, V, dtype=cdt, device=dev)
    )  # [N, H, K, V]
    cids, outs = [], []
    for j in range(max(req.num_chunks)):
        act = [i for i in range(N) if req.num_chunks[i] > j]
        full = len(act) == N
        ai = torch.tensor(act, device=dev)
        cid = torch.tensor([chunk_of[i][j] for i in act], device=dev)
        S_a = S if full else S[ai]  # [A, H, K, V]
        v_new = u[cid] - w[cid] @ S_a  # [A, H, BT, V]
        outs.append(qg[cid] @ S_a + Aqk[cid] @ v_new)  # [A, H, BT, V]
        cids.append(cid)
        S_a = decay[cid] * S_a + kg[cid].transpose(-1, -2) @ v_new
        S = S_a if full else S.index_copy(0, ai, S_a)
        for a, i in enumerate(act):
            for r in wanted.get((i, j + 1), ()):
                boundary[r] = S_a[a]
    o = torch.cat(outs)[torch.argsort(torch.cat(cids))]  # [NC, H, BT, V]
    o = o.transpose(1, 2).reshape(NC * BT, H, V)[valid.reshape(-1)]  # [T, H, V]
    return _finish(o, S, boundary, req, H, K, V, cdt, dev, in_dtype, batch_shape, output_final_state)


def naive_piece_summary(q, k, v, g, beta, *, chunk_size: int = 64, backend: str = "auto", scale=None):
    """fp32 reference of :func:`harts_kernels.kda.cp.piece_summary`: ``(A [H, K, K], b [H, K, V])``
    with ``S_out = A S_in + b`` over the piece ``[1, T, H, ...]``.

    Token by token: ``M_t = (I - beta_t k_t k_t^T) Diag(exp g_t)``, ``A = M_T ... M_1`` by explicit
    matrix products and ``b_t = M_t b_{t-1} + beta_t k_t v_t^T`` from ``b_0 = 0``. float32 (float64
    for float64 inputs). ``chunk_size``, ``backend`` and ``scale`` are taken for the signature and
    unused (the recurrence has no grid; q and the scale do not enter a summary).
    """
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q: expected one piece [1, T, H, K], got shape {tuple(q.shape)}")
    _, T, H, K = q.shape
    cdt = _compute_dtype(q)
    k, v, g, beta = (x[0].to(cdt) for x in (k, v, g, beta))  # [T, H, *]
    V = v.shape[-1]
    eye = torch.eye(K, dtype=cdt, device=q.device)
    A = eye.expand(H, K, K).clone()
    b = torch.zeros(H, K, V, dtype=cdt, device=q.device)
    for t in range(T):
        kt = k[t]  # [H, K]
        M = (eye - beta[t][:, None, None] * kt[:, :, None] * kt[:, None, :]) * g[t].exp()[:, None, :]
        A = M @ A
        b = M @ b + beta[t][:, None, None] * kt[:, :, None] * v[t][:, None, :]
    return A, b


def naive_fold_states(A: torch.Tensor, b: torch.Tensor, initial: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-loop reference of :func:`harts_kernels.kda.cp.fold_states`: ``S_in [C, H, K, V]`` with
    ``S_in[0] = initial`` (zeros when None) and ``S_in[r + 1] = A[r] S_in[r] + b[r]``, one piece
    and head at a time."""
    C, H, K, V = b.shape
    S = [initial[h].clone() if initial is not None else b.new_zeros(K, V) for h in range(H)]
    out = []
    for r in range(C):
        out.append(torch.stack(S, 0))
        S = [A[r, h] @ S[h] + b[r, h] for h in range(H)]
    return torch.stack(out, 0)
