"""Pure-PyTorch references of the SSD (Mamba2) ChunkLA contract: chunked and recurrent.

Both take the same arguments as :func:`harts_kernels.ssd.chunk_ssd_with_states` and return
``(o, final_state, boundary_states)``. They compute in float32 (float64 for float64 inputs, for
``gradcheck``), support packed varlen calls, per-sequence initial states and requested boundary
states, and are differentiable by plain autograd. They import only torch.

Recurrence (per sequence and head; state ``S [K, V]``; one log-space decay ``g_t <= 0`` per
token and head). In Mamba2's names ``q = C``, ``k = B``, ``v = dt * x``, ``g = dt * A``,
``K = ssm_state_size``, ``V = head_dim``, ``scale = 1``:

    S_t = exp(g_t) S_{t-1} + k_t v_t^T
    o_t = scale * S_t^T q_t

Chunk form on the sequence's own grid of ``B = chunk_size`` tokens (``G`` = in-chunk cumulative
``g``, ``S`` = state at the chunk start):

    O  = scale exp(G) Q S + scale (tril(Q K^T) * exp(G_i - G_j)) V
    S' = exp(G_last) S + (exp(G_last - G) * K)^T V

Every exponent is <= 0 after masking, so the reference is stable for any decay.

State passing (context parallelism, :mod:`harts_kernels.ssd.cp`): :func:`naive_piece_summary` (the
affine summary ``S_out = a S_in + b`` of a piece, token by token) and :func:`naive_fold_states`
(the fold of the summaries in state order), plain-loop references.
"""

from __future__ import annotations

import torch

from harts_kernels.kda.utils import (
    as_int_list,
    check_initial_state,
    seq_lens_from_cu_seqlens,
    validate_requests,
)

__all__ = [
    "check_ssd_inputs",
    "naive_chunk_ssd_with_states",
    "naive_fold_states",
    "naive_piece_summary",
    "naive_recurrent_ssd_with_states",
]


def check_ssd_inputs(q, k, v, g, cu_seqlens):
    """Return ``(cu_seqlens list, batch_shape)`` after checking shapes: q, k [B, T, H, K]; v
    [B, T, H, V]; g [B, T, H]. Without ``cu_seqlens`` a [B, T] batch is B sequences of length T
    (``batch_shape = (B, T)``); with it B must be 1 (``batch_shape = None``). Raises ValueError."""
    if q.dim() != 4:
        raise ValueError(f"q: expected [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, _ = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v: expected [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if g.shape != (B, T, H):
        raise ValueError(f"g: expected shape {(B, T, H)}, got {tuple(g.shape)}")
    if cu_seqlens is None:
        return [b * T for b in range(B + 1)], (B, T)
    if B != 1:
        raise ValueError(f"q: batch must be 1 with cu_seqlens (packed varlen), got {B}")
    return as_int_list(cu_seqlens, "cu_seqlens"), None


def _prepare(q, k, v, g, initial_state, cu_seqlens, chunk_size, request_seq, request_chunk):
    cu, batch_shape = check_ssd_inputs(q, k, v, g, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g))
    lens = seq_lens_from_cu_seqlens(cu, B * T)
    req = validate_requests(lens, chunk_size, request_seq, request_chunk)
    check_initial_state(initial_state, len(lens), H, K, V)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g = (x[0].to(cdt) for x in (q, k, v, g))  # [T, H, *]
    wanted: dict = {}
    for r, (i, c) in enumerate(zip(req.request_seq, req.request_chunk)):
        wanted.setdefault((i, c), []).append(r)
    return q, k, v, g, cu, lens, req, wanted, batch_shape, cdt


def _finish(o, S, boundary, H, K, V, cdt, device, v_dtype, batch_shape, output_final_state):
    bstates = torch.stack(boundary, 0) if boundary else torch.zeros(0, H, K, V, dtype=cdt, device=device)
    o = o.to(v_dtype).unsqueeze(0)  # [1, T, H, V]
    if batch_shape is not None:
        o = o.reshape(*batch_shape, H, V)
    return o, (S if output_final_state else None), bstates


def naive_recurrent_ssd_with_states(
    q: torch.Tensor,  # [B, T, H, K]  (B = 1 with cu_seqlens); Mamba2's C
    k: torch.Tensor,  # [B, T, H, K]  Mamba2's B
    v: torch.Tensor,  # [B, T, H, V]  Mamba2's dt * x
    g: torch.Tensor,  # [B, T, H]     log decay <= 0, Mamba2's dt * A
    *,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,  # [N, H, K, V]
    cu_seqlens=None,  # [N + 1]
    chunk_size: int = 64,
    request_seq=None,  # [R]
    request_chunk=None,  # [R]
    output_final_state: bool = True,
):
    """Token-by-token reference. Returns ``(o [B, T, H, V], final_state [N, H, K, V] | None,
    boundary_states [R, H, K, V])``; boundary ``(i, c)`` is sequence i's state after its first
    ``c * chunk_size`` tokens."""
    in_dtype, dev = v.dtype, q.device
    q, k, v, g, cu, lens, req, wanted, batch_shape, cdt = _prepare(
        q, k, v, g, initial_state, cu_seqlens, chunk_size, request_seq, request_chunk
    )
    H, K, V, N = q.shape[1], q.shape[2], v.shape[2], len(lens)
    S = initial_state.to(cdt) if initial_state is not None else q.new_zeros(N, H, K, V)
    boundary = [None] * req.num_requests
    outs, finals = [], []
    for i in range(N):
        s = S[i]
        for t in range(cu[i], cu[i + 1]):
            s = g[t].exp()[:, None, None] * s + k[t][:, :, None] * v[t][:, None, :]
            outs.append(scale * torch.einsum("hk,hkv->hv", q[t], s))
            n = t + 1 - cu[i]
            if n % chunk_size == 0:
                for r in wanted.get((i, n // chunk_size), ()):
                    boundary[r] = s
        finals.append(s)
    o = torch.stack(outs) if outs else v.new_zeros(0, H, V)
    return _finish(
        o, torch.stack(finals), boundary, H, K, V, cdt, dev, in_dtype, batch_shape, output_final_state
    )


def naive_chunk_ssd_with_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    cu_seqlens=None,
    chunk_size: int = 64,
    request_seq=None,
    request_chunk=None,
    output_final_state: bool = True,
):
    """Chunked reference on each sequence's own grid of ``chunk_size`` tokens (fla's grid). Same
    arguments and returns as :func:`naive_recurrent_ssd_with_states`; all chunks of all sequences
    in one batched product, then the inter-chunk state scan."""
    in_dtype, dev = v.dtype, q.device
    q, k, v, g, cu, lens, req, wanted, batch_shape, cdt = _prepare(
        q, k, v, g, initial_state, cu_seqlens, chunk_size, request_seq, request_chunk
    )
    T, H, K = q.shape
    V, N, BT = v.shape[2], len(lens), chunk_size
    starts, ends, chunk_of = [], [], []
    for i in range(N):
        chunk_of.append(list(range(len(starts), len(starts) + req.num_chunks[i])))
        for c in range(req.num_chunks[i]):
            starts.append(cu[i] + c * BT)
            ends.append(cu[i + 1])
    NC = len(starts)
    idx = torch.tensor(starts, device=dev)[:, None] + torch.arange(BT, device=dev)  # [NC, BT]
    valid = idx < torch.tensor(ends, device=dev)[:, None]
    idx = torch.where(valid, idx, torch.full_like(idx, T))  # pad row T: k = v = g = 0

    def chunked(x):  # [T, H, *] -> [NC, H, BT, *]
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])], 0)[idx]
        return x.transpose(1, 2)

    qc, kc, vc, gc = chunked(q), chunked(k), chunked(v), chunked(g)  # gc [NC, H, BT]
    G = gc.cumsum(-1)
    incl = torch.ones(BT, BT, dtype=torch.bool, device=dev).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~incl, float("-inf")).exp()  # [NC, H, i, j]
    o_intra = (scale * (qc @ kc.transpose(-1, -2)) * decay) @ vc  # [NC, H, BT, V]
    qg = scale * qc * G.exp()[..., None]
    G_last = G[..., -1]  # [NC, H] (pads add 0)
    kg = kc * (G_last[..., None] - G).exp()[..., None]
    dS = kg.transpose(-1, -2) @ vc  # [NC, H, K, V]: the chunk's own contribution
    a = G_last.exp()[..., None, None]  # [NC, H, 1, 1]

    S = initial_state.to(cdt) if initial_state is not None else q.new_zeros(N, H, K, V)
    boundary = [None] * req.num_requests
    cids, starts_S = [], []
    for j in range(max(req.num_chunks)):  # the inter-chunk scan: chunk j of every sequence at once
        act = [i for i in range(N) if req.num_chunks[i] > j]
        full = len(act) == N
        ai = torch.tensor(act, device=dev)
        cid = torch.tensor([chunk_of[i][j] for i in act], device=dev)
        S_a = S if full else S[ai]
        starts_S.append(S_a)
        cids.append(cid)
        S_a = a[cid] * S_a + dS[cid]
        S = S_a if full else S.index_copy(0, ai, S_a)
        for r_i, i in enumerate(act):
            for r in wanted.get((i, j + 1), ()):
                boundary[r] = S_a[r_i]
    o = o_intra + qg @ torch.cat(starts_S)[torch.argsort(torch.cat(cids))]  # [NC, H, BT, V]
    o = o.transpose(1, 2).reshape(NC * BT, H, V)[valid.reshape(-1)]
    return _finish(o, S, boundary, H, K, V, cdt, dev, in_dtype, batch_shape, output_final_state)


# ---------------------------------------------------------------------------------- state passing
def naive_piece_summary(
    q, k, v, g, *, chunk_size: int = 64, backend: str = "auto", scale: float = 1.0, cu_seqlens=None
):
    """fp32 reference of :func:`harts_kernels.ssd.cp.piece_summary`: ``(a, b)`` with ``S_out = a S_in
    + b`` per head, token by token: ``a_t = exp(g_t) a_{t-1}`` from ``a_0 = 1`` and ``b_t = exp(g_t)
    b_{t-1} + k_t v_t^T`` from ``b_0 = 0``. One piece: ``a [H]``, ``b [H, K, V]``; with
    ``cu_seqlens`` (P packed pieces) ``a [P, H]``, ``b [P, H, K, V]``. float32 (float64 for float64
    inputs). ``chunk_size``, ``backend`` and ``scale`` are taken for the signature and unused."""
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q: expected pieces [1, T, H, K], got shape {tuple(q.shape)}")
    _, T, H, K = q.shape
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    k, v, g = (x[0].to(cdt) for x in (k, v, g))
    V = v.shape[-1]
    cu = [0, T] if cu_seqlens is None else as_int_list(cu_seqlens, "cu_seqlens")
    a_all, b_all = [], []
    for i in range(len(cu) - 1):
        a = torch.ones(H, dtype=cdt, device=q.device)
        b = torch.zeros(H, K, V, dtype=cdt, device=q.device)
        for t in range(cu[i], cu[i + 1]):
            a = g[t].exp() * a
            b = g[t].exp()[:, None, None] * b + k[t][:, :, None] * v[t][:, None, :]
        a_all.append(a)
        b_all.append(b)
    if cu_seqlens is None:
        return a_all[0], b_all[0]
    return torch.stack(a_all), torch.stack(b_all)


def naive_fold_states(a: torch.Tensor, b: torch.Tensor, initial: torch.Tensor | None = None, parent=None):
    """Plain-loop reference of :func:`harts_kernels.ssd.cp.fold_states`: ``S_in [C, H, K, V]``, one
    piece and head at a time; ``parent`` None is the chain ``r - 1``; ``initial`` ``[H, K, V]`` or
    ``[C, H, K, V]`` (row r entering root r) or None (zeros)."""
    C, H, K, V = b.shape
    par = list(range(-1, C - 1)) if parent is None else [int(p) for p in parent]
    out = []
    for r in range(C):
        p = par[r]
        heads = []
        for h in range(H):
            if p >= 0:
                heads.append(a[p, h] * out[p][h] + b[p, h])
            elif initial is None:
                heads.append(b.new_zeros(K, V))
            else:
                heads.append((initial[h] if initial.dim() == 3 else initial[r, h]).to(b.dtype))
        out.append(torch.stack(heads))
    return torch.stack(out)
