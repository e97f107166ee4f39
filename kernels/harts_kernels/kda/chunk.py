"""KDA ChunkLA operator with selectable, differentiable chunk-boundary states (Equation 16).

``chunk_kda_with_states`` is the public entry point. On CUDA tensors it runs chunk KDA with
fla 0.6.0's stages (gate cumsum, intra-chunk WY factors, output, dAv, dqkg, intra backward)
around our own Triton state scan (:mod:`harts_kernels.kda.state_scan`), which writes the
requested boundary states in fp32 from the forward scan and injects their gradients into the
backward dh recurrence. On CPU (or with ``backend="naive"``) it runs the pure-PyTorch chunked
reference :func:`harts_kernels.kda.naive.naive_chunk_kda_with_states`. fla and triton are
imported only inside the GPU path, so this module imports with torch alone.

Gate convention (the same as fla's ``chunk_kda(use_gate_in_kernel=False,
use_beta_sigmoid_in_kernel=False, use_qk_l2norm_in_kernel=False)``):

* ``g`` is the per key-dim decay in natural-log space (``g <= 0``; the state row d is multiplied
  by ``exp(g[t, h, d])`` before token t's delta update). Compute it outside the op, e.g.
  ``g = -exp(A_log) * softplus(g_raw + dt_bias)`` as fla's ``naive_kda_gate``.
* ``beta`` is post-sigmoid (``0 < beta < 1``).
* q and k are used as given: apply the L2 normalisation of KDA outside the op.
* H == HV (no grouped value heads); K <= 256 on the GPU path; state layout ``[K, V]``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from harts_kernels.device import on_device
from harts_kernels.kda.naive import naive_chunk_kda_with_states
from harts_kernels.kda.utils import (
    PackedRequests,
    as_int_list,
    check_initial_state,
    pack_inputs,
    seq_lens_from_cu_seqlens,
    validate_requests,
)

RCP_LN2 = 1.4426950408889634  # 1 / ln(2): fla's gates are log2 inside the kernels


class _Plan:
    """Device-side index tensors of one packed call, built on the host and sent in one copy.

    ``requests = (req_off [N + 1], req_chunk [U], req_row [U])`` (int32) list the distinct
    requested boundaries per sequence in increasing c, with the output row of each. Without
    duplicates the rows are the caller's order, so the scan writes the states where they are
    asked for; with duplicates it writes the U distinct states and ``inverse [R]`` picks the rows.
    ``requests`` is None when nothing is requested.
    """

    def __init__(self, req: PackedRequests, cu: list[int], device: torch.device):
        n = len(req.seq_lens)
        nt = req.chunk_offsets[-1]
        self.num_seqs, self.num_chunks = n, nt
        pairs, inverse, req_off = req.distinct_requests()
        self.num_boundaries = len(pairs)
        # distinct requests: pair inverse[r] goes to output row r; duplicates: rows 0..U-1 + inverse
        unique_rows = None
        if len(pairs) == len(inverse):
            unique_rows = [0] * len(pairs)
            for r, j in enumerate(inverse):
                unique_rows[j] = r
        row = unique_rows if unique_rows is not None else list(range(len(pairs)))
        nc = torch.tensor(req.num_chunks, dtype=torch.long)
        seq_of_chunk = torch.repeat_interleave(torch.arange(n), nc)
        first_chunk = torch.repeat_interleave(torch.tensor(req.chunk_offsets[:-1], dtype=torch.long), nc)
        chunk_index = torch.stack([seq_of_chunk, torch.arange(nt) - first_chunk], 1).flatten()  # (seq, chunk)
        sections = (
            [torch.tensor(x, dtype=torch.long) for x in (cu, req.chunk_offsets)]
            + [chunk_index]
            + [torch.tensor(x, dtype=torch.long) for x in (req_off, [c for _, c in pairs], row, inverse)]
        )
        # One pageable host->device copy (each such copy synchronizes the stream), then views.
        # Sections start at multiples of 4 elements: aligned pointers keep Triton's
        # specialization (and so its compiled variants) independent of N.
        pad = [torch.zeros(-len(x) % 4, dtype=torch.long) for x in sections]
        dev = torch.cat([t for x, z in zip(sections, pad) for t in (x, z)]).to(device)
        view, o = [], 0
        for x, z in zip(sections, pad):
            view.append(dev[o : o + len(x)])
            o += len(x) + len(z)
        self.cu_seqlens, self.chunk_offsets = view[0], view[1]
        self.chunk_indices = view[2].view(nt, 2)  # [NT, 2] (seq, chunk)
        self.requests = self.inverse = None
        if pairs:
            self.requests = tuple(v.to(torch.int32) for v in view[3:6])
            if unique_rows is None:
                self.inverse = view[6]


_PLANS: OrderedDict = OrderedDict()
_PLANS_MAX = 64


def _plan_for(cu: list[int], T: int, chunk_size: int, request_seq, request_chunk, device) -> _Plan:
    """The validated device plan of a call, cached by its host description: every KDA layer of a
    microbatch (and its recomputation) calls with the same ``cu_seqlens`` and requests, so the
    host work and the host->device copy are paid once. LRU, at most ``_PLANS_MAX`` plans."""
    rs = as_int_list(request_seq, "request_seq")
    rc = as_int_list(request_chunk, "request_chunk")
    key = (tuple(cu), T, chunk_size, tuple(rs), tuple(rc), device)
    plan = _PLANS.get(key)
    if plan is None:
        req = validate_requests(seq_lens_from_cu_seqlens(cu, T), chunk_size, rs, rc)
        plan = _PLANS[key] = _Plan(req, cu, device)
        while len(_PLANS) > _PLANS_MAX:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def _fla_fwd(q, k, v, g, beta, scale, initial_state, plan: _Plan, chunk_size, output_final_state, keep=False):
    """fla's forward stages around our state scan. ``keep``: also return the backward's inputs
    ``(w, u, qg, kg, h, v_new)`` (fla's ``disable_recompute``), else None."""
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.utils import chunk_local_cumsum

    from harts_kernels.kda.state_scan import state_scan_fwd

    g_cum = chunk_local_cumsum(
        g, chunk_size=chunk_size, scale=RCP_LN2, cu_seqlens=plan.cu_seqlens, chunk_indices=plan.chunk_indices
    )  # [1, T, H, K] fp32 log2
    w, u, qg, kg, Aqk, Akk = chunk_kda_fwd_intra(
        q=q,
        k=k,
        v=v,
        gk=g_cum,
        beta=beta,
        scale=scale,
        cu_seqlens=plan.cu_seqlens,
        chunk_size=chunk_size,
        chunk_indices=plan.chunk_indices,
        safe_gate=False,
        disable_recompute=keep,  # qg is computed only then
    )
    h, v_new, final_state, bstates = state_scan_fwd(
        kg=kg,
        w=w,
        u=u,
        gk=g_cum,
        initial_state=initial_state,
        cu_seqlens=plan.cu_seqlens,
        chunk_offsets=plan.chunk_offsets,
        num_chunks=plan.num_chunks,
        chunk_size=chunk_size,
        output_final_state=output_final_state,
        requests=plan.requests,
    )
    o = chunk_gla_fwd_o_gk(
        q=q,
        v=v_new,
        g=g_cum,
        A=Aqk,
        h=h,
        scale=scale,
        cu_seqlens=plan.cu_seqlens,
        chunk_size=chunk_size,
        chunk_indices=plan.chunk_indices,
    )
    return o, final_state, bstates, g_cum, Aqk, Akk, ((w, u, qg, kg, h, v_new) if keep else None)


def _fla_bwd(
    q,
    k,
    v,
    beta,
    g_cum,
    Aqk,
    Akk,
    scale,
    initial_state,
    do,
    dht,
    d_bstates,
    plan: _Plan,
    chunk_size,
    kept=None,
):
    """fla's backward stages around our state-scan backward. ``kept``: the forward's
    ``(w, u, qg, kg, h, v_new)``; None recomputes them (the WY factors, then the state scan)."""
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra
    from fla.ops.kda.wy_fast import recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum

    from harts_kernels.kda.state_scan import state_scan_bwd, state_scan_fwd

    ci, cu = plan.chunk_indices, plan.cu_seqlens
    if kept is not None:
        w, u, qg, kg, h, v_new = kept
    else:
        w, u, qg, kg = recompute_w_u_fwd(
            k=k, v=v, beta=beta, A=Akk, gk=g_cum, q=q, cu_seqlens=cu, chunk_indices=ci
        )
        # Recompute h and v_new (as fla does by default); no final or boundary states are needed.
        h, v_new, _, _ = state_scan_fwd(
            kg=kg,
            w=w,
            u=u,
            gk=g_cum,
            initial_state=initial_state,
            cu_seqlens=cu,
            chunk_offsets=plan.chunk_offsets,
            num_chunks=plan.num_chunks,
            chunk_size=chunk_size,
            output_final_state=False,
        )
    dAqk, dv = chunk_kda_bwd_dAv(
        q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, cu_seqlens=cu, chunk_size=chunk_size, chunk_indices=ci
    )
    dh, dh0, dv = state_scan_bwd(
        qg=qg,
        kg=kg,
        w=w,
        gk=g_cum,
        do=do,
        dv=dv,
        scale=scale,
        initial_state=initial_state,
        dht=dht,
        cu_seqlens=cu,
        chunk_offsets=plan.chunk_offsets,
        num_chunks=plan.num_chunks,
        chunk_size=chunk_size,
        requests=plan.requests,
        d_boundary=d_bstates,
    )
    dq, dk, dv, db, dg, dAkk = chunk_kda_bwd_wy_dqkg_fused(
        q=q,
        k=k,
        v=v,
        v_new=v_new,
        g=g_cum,
        beta=beta,
        A=Akk,
        h=h,
        do=do,
        dh=dh,
        dv=dv,
        scale=scale,
        cu_seqlens=cu,
        chunk_size=chunk_size,
        chunk_indices=ci,
        chunk_offsets=plan.chunk_offsets,
    )
    dq, dk, db, dg = chunk_kda_bwd_intra(
        q=q,
        k=k,
        g=g_cum,
        beta=beta,
        dAqk=dAqk,
        dAkk=dAkk,
        dq=dq,
        dk=dk,
        db=db,
        dg=dg,
        cu_seqlens=cu,
        chunk_indices=ci,
        chunk_size=chunk_size,
        safe_gate=False,
    )
    dg = chunk_local_cumsum(dg, chunk_size=chunk_size, reverse=True, cu_seqlens=cu, chunk_indices=ci)
    return dq, dk, dv, db, dg, dh0


class ChunkKDAWithStatesFunction(torch.autograd.Function):
    """Packed-varlen chunk KDA returning ``(o, final_state, boundary_states)``.

    ``boundary_states`` has one fp32 row per distinct requested boundary, in request order when
    there are no duplicates (else ``plan.inverse`` maps requests to rows outside). Its gradient is injected into the backward state recurrence;
    the final-state gradient enters as fla's ``dht``; ``dh0`` is the initial-state gradient.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, plan, chunk_size, output_final_state, keep):
        o, final_state, bstates, g_cum, Aqk, Akk, kept = _fla_fwd(
            q, k, v, g, beta, scale, initial_state, plan, chunk_size, output_final_state, keep
        )
        ctx.save_for_backward(q, k, v, beta, g_cum, Aqk, Akk, initial_state, *(kept or ()))
        ctx.scale, ctx.plan, ctx.chunk_size, ctx.g_dtype = scale, plan, chunk_size, g.dtype
        ctx.set_materialize_grads(False)
        if bstates is None:
            bstates = q.new_zeros(0, *q.shape[2:3], q.shape[3], v.shape[3], dtype=torch.float32)
        return o.to(q.dtype), final_state, bstates

    @staticmethod
    def backward(ctx, do, dht, d_bstates):
        q, k, v, beta, g_cum, Aqk, Akk, initial_state, *kept = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        dq, dk, dv, db, dg, dh0 = _fla_bwd(
            q,
            k,
            v,
            beta,
            g_cum,
            Aqk,
            Akk,
            ctx.scale,
            initial_state,
            do.contiguous(),
            dht,
            d_bstates,
            ctx.plan,
            ctx.chunk_size,
            kept or None,
        )
        return (
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            dg.to(ctx.g_dtype),
            db.to(beta.dtype),
            dh0,
            None,
            None,
            None,
            None,
            None,
        )


def chunk_kda_with_states(
    q: torch.Tensor,  # [B, T, H, K]   (B = 1 with cu_seqlens)
    k: torch.Tensor,  # [B, T, H, K]
    v: torch.Tensor,  # [B, T, H, V]
    g: torch.Tensor,  # [B, T, H, K]   log-space per key-dim decay, <= 0
    beta: torch.Tensor,  # [B, T, H]      post-sigmoid
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,  # [N, H, K, V] fp32
    cu_seqlens=None,  # [N + 1] list or int tensor (host copy preferred)
    chunk_size: int = 64,
    request_seq=None,  # [R] sequence of each requested boundary
    request_chunk=None,  # [R] boundary index c on that sequence's grid
    output_final_state: bool = True,
    backend: str = "auto",
    save_intermediates: bool = False,
):
    """ChunkLA for KDA over a packed varlen call (Equation 16).

    Parameters
    ----------
    q, k, v, g, beta
        Packed ``[1, T, ...]`` tensors with ``cu_seqlens``, or a ``[B, T, ...]`` batch without
        (then ``N = B`` sequences of length ``T``). Gate convention in the module docstring.
    scale
        Query scale, default ``K ** -0.5``.
    initial_state
        ``[N, H, K, V]`` fp32 per-sequence initial states (zeros when None); differentiable.
    cu_seqlens
        ``[N + 1]`` cumulative lengths; each sequence's chunk grid starts at its first row.
    chunk_size
        ``B``. Any ``B >= 1`` on the reference path; 32 or 64 on the GPU path.
    request_seq, request_chunk
        ``R`` requested boundaries: row r asks for ``S_[c]`` of sequence ``i``, the state after
        its first ``c * B`` tokens, ``1 <= c``, ``c * B <= L_i``. Duplicates are allowed.
    output_final_state
        Return the ``[N, H, K, V]`` fp32 final states (differentiable).
    backend
        ``"auto"`` (Triton on CUDA, reference otherwise), ``"triton"`` or ``"naive"``.
    save_intermediates
        Triton path: save the WY factors ``w, u``, the gated ``q, k``, the chunk states ``h`` and
        ``v_new`` for backward (fla's ``disable_recompute``) instead of recomputing them there
        (the WY kernel and one state scan). The same values as the recomputation (bit for bit
        when both compile the same kernel configurations; Triton autotunes each argument
        signature on its own) for ``(3 K + 2 V) T H`` elements of q's dtype plus ``NT H K V``
        (1.9 GB at T = 65,536, H = 16, K = V = 128 in bf16). The reference path saves what
        autograd saves either way.

    Returns
    -------
    o : ``[B, T, H, V]`` in v's dtype.
    final_state : ``[N, H, K, V]`` fp32, or None.
    boundary_states : ``[R, H, K, V]`` fp32, requests in order. Gradients arriving here flow into
        the chunks before each boundary and into ``initial_state``.

    Raises
    ------
    ValueError
        Bad shapes, ``cu_seqlens`` or requests; the message names the field.
    """
    if backend not in ("auto", "triton", "naive"):
        raise ValueError(f"backend: expected 'auto', 'triton' or 'naive', got {backend!r}")
    use_triton = backend == "triton" or (backend == "auto" and q.is_cuda)
    if not use_triton:
        return naive_chunk_kda_with_states(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            chunk_size=chunk_size,
            request_seq=request_seq,
            request_chunk=request_chunk,
            output_final_state=output_final_state,
        )

    q, k, v, g, beta, cu, batch_shape = pack_inputs(q, k, v, g, beta, cu_seqlens)
    _, T, H, K = q.shape
    V = v.shape[-1]
    if chunk_size not in (32, 64):
        raise ValueError(f"chunk_size: the Triton path supports 32 or 64, got {chunk_size}")
    if K > 256:
        raise ValueError(f"q: head dim K must be <= 256 on the Triton path, got {K}")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise ValueError(f"initial_state: must be float32, got {initial_state.dtype}")
    scale = K**-0.5 if scale is None else float(scale)
    plan = _plan_for(cu, T, chunk_size, request_seq, request_chunk, q.device)
    check_initial_state(initial_state, plan.num_seqs, H, K, V)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    with on_device(q):
        o, final_state, bstates = ChunkKDAWithStatesFunction.apply(
            q,
            k,
            v,
            g,
            beta,
            initial_state,
            scale,
            plan,
            chunk_size,
            output_final_state,
            bool(save_intermediates),
        )
    if plan.inverse is not None:
        bstates = bstates.index_select(0, plan.inverse)  # [R, H, K, V]
    if batch_shape is not None:
        o = o.reshape(*batch_shape, H, V)
    return o, (final_state if output_final_state else None), bstates
