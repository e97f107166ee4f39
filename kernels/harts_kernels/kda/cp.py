"""Context parallelism for chunkwise KDA / GDN by state passing with per-rank affine summaries:
the state-passing building block of one sequence and its reference. The runtime's states mode
(:mod:`harts_runtime.parallel.context_states`) applies the same identity to a rank's whole local
call plan with the production kernel; it does not call this module.

Glossary
--------
* B: ``chunk_size``, the chunk grid of :func:`harts_kernels.kda.chunk_kda_with_states`.
* piece ``r``: the contiguous token range ``[t_r, t_{r+1})`` of one sequence held by rank ``r`` of
  ``C``; ``t_0 = 0``, ``t_C = T``. The interior ``cuts = [t_1, ..., t_{C-1}]`` lie on the chunk grid
  (multiples of B, non-decreasing, in ``[0, T]``), so every piece but the last is whole chunks and
  each piece's own grid is the sequence's grid: the chunk partition is the one process's.
* state ``S [K, V]`` per head (``[H, K, V]`` fp32, float64 for float64 inputs); ``S_in(r)`` is the
  state entering piece ``r`` (the state after token ``t_r - 1``), ``S_in(0)`` the initial state.
* summary ``(A_r [H, K, K], b_r [H, K, V])`` of piece ``r``: the affine map its tokens apply to the
  state, ``S_out = A_r S_in + b_r``.
* fold: ``S_in(0) = initial`` (or 0), ``S_in(r + 1) = A_r S_in(r) + b_r``.

The math (per head; the convention of :mod:`harts_kernels.kda.naive`)
-------------------------------------------------------------------
Token t (gate ``g_t <= 0`` per key dim, ``beta_t``, ``k_t [K]``, ``v_t [V]``) maps the state as

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T  =  M_t S_{t-1} + beta_t k_t v_t^T

(decay first, then the delta update: ``S' = D S``; ``S' + beta k (v - S'^T k)^T``). It is affine in
the state and acts on its K rows only; the V columns never mix. Over a piece of tokens ``1..n``:

    A = M_n ... M_1   (K x K),   b = the piece's final state from S_0 = 0   (K x V).

GDN is KDA with one decay per head broadcast over K (``Diag(exp g_t) = exp(g_t) I``); A is still a
full K x K matrix because of the delta rule, so GDN's summary costs the same.

How :func:`piece_summary` gets ``(A, b)`` with the production kernel, exactly: because the columns of
the state evolve independently, one call of :func:`chunk_kda_with_states` on the piece with the
values widened to ``[v | 0_K]`` (``V + K`` columns) from the initial state ``[0 | I_K]`` returns the
final state ``[b | A]``: columns ``0..V-1`` start at 0 and receive ``v`` (that is ``b``), columns
``V..V+K-1`` start at ``I`` and receive nothing (``M_n ... M_1 I = A``). It is the kernel's own
chunked recurrence, so ``A`` and ``b`` carry the kernel's rounding and nothing else, and both are
differentiable through the kernel's backward. The call's output ``o`` is discarded (``q`` and
``scale`` do not enter a summary; they are taken for the signature of the call).

State passing on C ranks: each rank summarizes its piece from the zero state (in parallel), the
summaries are all-gathered and folded in rank order (every rank can fold: it needs only the
summaries of the ranks before it), and each rank reruns its piece from its ``S_in(r)`` with
``chunk_kda_with_states(initial_state=S_in(r))``, which gives the one-process output rows and, on
the last rank, the final state. :func:`chunk_kda_cp_reference` runs all of it in one process and is
differentiable end to end. Backward, the rerun returns ``dS_in(r)`` (the kernel's initial-state
gradient); the fold's backward is its transpose, a reverse fold (:func:`fold_states_backward`):

    lambda_{C-1} = dS_in(C-1),   lambda_r = dS_in(r) + A_r^T lambda_{r+1},
    dA_r = lambda_{r+1} S_in(r)^T,   db_r = lambda_{r+1}   (dA_{C-1} = db_{C-1} = 0),
    d initial = lambda_0,

and ``(dA_r, db_r)`` enter the summary call's backward as the gradient of its final state.

Cost
----
* communication: one summary per rank, ``H * (K * K + K * V) * 4`` bytes (fp32), all-gathered
  (backward: the same bytes of ``dS_in`` for the reverse fold). K = V = 128, H = 16: 2 MiB per rank
  and layer.
* the fold: ``C - 1`` steps of ``[K, K] @ [K, V]`` per head, ``O(C H K^2 V)`` flops, sequential in C
  (cheap next to the pieces for C << T / B; a log-depth scan of the composition
  ``(A2, b2) o (A1, b1) = (A2 A1, A2 b1 + b2)`` would cost ``O(C log C H K^2 (K + V))``).
* the pieces: the summary call on ``V + K`` value columns plus the rerun on ``V``: about
  ``2 + K / V`` times the one-process linear-attention work of the piece, in parallel over ranks.
  The last rank's summary is not needed by the fold, and without an initial state rank 0's summary
  run is already its true run; a distributed version may skip both.

Tested on the CPU reference (``tests/kernels/test_kda_cp.py``) and on the Triton kernel at real head
dims (``tests/kernels/test_kda_cp_gpu.py``: the summary call on ``V + K`` value columns from an fp32
``[0 | I]`` initial state, and the C-piece algorithm against one call, forward and backward).

Errors: :class:`StatePassingError`, a ``ValueError`` whose ``.field`` names the bad argument
(``"cuts[1]"``, ``"A"``, ``"initial_state"``) and whose message is one line ``"<field>: <what>"``.
The kernel's own checks (shapes of k, v, g, beta) raise its ``ValueError`` naming the field.
"""

from __future__ import annotations

import torch

from harts_kernels.kda.chunk import chunk_kda_with_states

__all__ = [
    "StatePassingError",
    "chunk_kda_cp_reference",
    "fold_states",
    "fold_states_backward",
    "piece_summary",
]


class StatePassingError(ValueError):
    """A bad argument of the state-passing helpers; ``.field`` names it, the message is one line
    ``"<field>: <what is wrong>"`` (the style of ``harts_runtime.errors.InvalidInputError``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _state_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise StatePassingError("chunk_size", f"must be an integer >= 1, got {chunk_size!r}")
    return chunk_size


def _check_piece(q: torch.Tensor) -> tuple[int, int, int]:
    if q.dim() != 4 or q.shape[0] != 1:
        raise StatePassingError("q", f"expected one piece [1, T, H, K], got shape {tuple(q.shape)}")
    return q.shape[1], q.shape[2], q.shape[3]


def piece_summary(q, k, v, g, beta, *, chunk_size: int, backend: str = "auto", scale=None):
    """The affine summary ``(A [H, K, K], b [H, K, V])`` of one piece, ``S_out = A S_in + b``.

    Inputs are one piece ``[1, T, H, ...]`` as :func:`chunk_kda_with_states` takes them (``g`` log
    decay per key dim, ``beta`` post-sigmoid); T is any length (on the CP grid: a multiple of B but
    for the last piece). One kernel call on values ``[v | 0_K]`` from the initial state ``[0 | I]``
    (module docstring). fp32 (float64 for float64 inputs); differentiable in k, v, g, beta. An
    empty piece (T = 0) has the summary ``(I, 0)``.
    """
    _check_chunk_size(chunk_size)
    T, H, K = _check_piece(q)
    if v.dim() != 4 or tuple(v.shape[:3]) != (1, T, H):
        raise StatePassingError("v", f"expected [1, T, H, V] = [1, {T}, {H}, V], got {tuple(v.shape)}")
    V = v.shape[3]
    sdt = _state_dtype(q)
    if T == 0:
        eye = torch.eye(K, dtype=sdt, device=q.device).expand(H, K, K).clone()
        return eye, torch.zeros(H, K, V, dtype=sdt, device=q.device)
    v_wide = torch.cat([v, v.new_zeros(1, T, H, K)], dim=-1)  # [1, T, H, V + K]
    h0 = torch.zeros(1, H, K, V + K, dtype=sdt, device=q.device)
    h0[..., V:] = torch.eye(K, dtype=sdt, device=q.device)
    _, final, _ = chunk_kda_with_states(
        q,
        k,
        v_wide,
        g,
        beta,
        scale=scale,
        initial_state=h0,
        chunk_size=chunk_size,
        backend=backend,
    )  # final [1, H, K, V + K] = [b | A]
    return final[0, :, :, V:], final[0, :, :, :V]


def _check_summaries(A, b) -> tuple[int, int, int, int]:
    if A.dim() != 4 or A.shape[-1] != A.shape[-2]:
        raise StatePassingError("A", f"expected [C, H, K, K], got shape {tuple(A.shape)}")
    C, H, K, _ = A.shape
    if C < 1:
        raise StatePassingError("A", "needs at least one piece (C >= 1)")
    if b.dim() != 4 or tuple(b.shape[:3]) != (C, H, K):
        raise StatePassingError("b", f"expected [C, H, K, V] = [{C}, {H}, {K}, V], got {tuple(b.shape)}")
    return C, H, K, b.shape[3]


def fold_states(A: torch.Tensor, b: torch.Tensor, initial: torch.Tensor | None = None) -> torch.Tensor:
    """The state entering each piece: ``S_in [C, H, K, V]``, ``S_in[0] = initial`` (zeros when
    None), ``S_in[r + 1] = A[r] @ S_in[r] + b[r]``. ``A [C, H, K, K]``, ``b [C, H, K, V]``,
    ``initial [H, K, V]``. In the summaries' dtype (fp32; float64 in checks); differentiable, its
    backward is :func:`fold_states_backward`. ``O(C H K^2 V)``; ``A[C - 1]``, ``b[C - 1]`` are unused.
    """
    C, H, K, V = _check_summaries(A, b)
    if initial is None:
        S = b.new_zeros(H, K, V)
    else:
        if tuple(initial.shape) != (H, K, V):
            raise StatePassingError(
                "initial", f"expected [H, K, V] = {(H, K, V)}, got {tuple(initial.shape)}"
            )
        S = initial.to(b.dtype)
    out = [S]
    for r in range(C - 1):
        S = torch.matmul(A[r], S) + b[r]  # [H, K, V]
        out.append(S)
    return torch.stack(out, 0)


def fold_states_backward(A: torch.Tensor, S_in: torch.Tensor, dS_in: torch.Tensor):
    """The fold's backward, written out: the transposed (reverse) fold. Given the summaries ``A``,
    the folded ``S_in`` and the gradient ``dS_in [C, H, K, V]`` arriving at every ``S_in(r)``,
    returns ``(dA [C, H, K, K], db [C, H, K, V], d_initial [H, K, V])`` (module docstring). The
    distributed backward all-gathers ``dS_in`` and runs this on every rank."""
    C = A.shape[0]
    dA = torch.zeros_like(A)
    db = torch.zeros_like(S_in)
    lam = dS_in[C - 1]
    for r in range(C - 2, -1, -1):
        dA[r] = torch.matmul(lam, S_in[r].transpose(-1, -2))
        db[r] = lam
        lam = dS_in[r] + torch.matmul(A[r].transpose(-1, -2), lam)
    return dA, db, lam


def _check_cuts(cuts, T: int, chunk_size: int) -> list[int]:
    if isinstance(cuts, torch.Tensor):
        if cuts.dim() != 1 or cuts.dtype.is_floating_point or cuts.dtype.is_complex:
            raise StatePassingError(
                "cuts", f"expected a 1-D integer list, got {cuts.dtype} {tuple(cuts.shape)}"
            )
        cuts = cuts.tolist()
    try:
        items = list(cuts)
    except TypeError:
        raise StatePassingError("cuts", f"expected a list of integers, got {type(cuts).__name__}") from None
    out, prev = [], 0
    for i, c in enumerate(items):
        if isinstance(c, bool) or not isinstance(c, int):
            raise StatePassingError(f"cuts[{i}]", f"must be an integer, got {c!r}")
        if not 0 <= c <= T:
            raise StatePassingError(f"cuts[{i}]", f"cut {c} out of range [0, T={T}]")
        if c % chunk_size:
            raise StatePassingError(
                f"cuts[{i}]", f"cut {c} is not on the chunk grid (a multiple of {chunk_size})"
            )
        if c < prev:
            raise StatePassingError(f"cuts[{i}]", f"cuts must be non-decreasing, got {c} after {prev}")
        out.append(c)
        prev = c
    return out


def chunk_kda_cp_reference(
    q,
    k,
    v,
    g,
    beta,
    cuts,
    *,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
    backend: str = "auto",
    scale=None,
):
    """State passing over ``C = len(cuts) + 1`` pieces in one process; equals one call of
    :func:`chunk_kda_with_states` on the whole sequence.

    ``q, k, v, g, beta``: one sequence ``[1, T, H, ...]``. ``cuts``: the ``C - 1`` interior cuts
    (multiples of ``chunk_size``, non-decreasing, in ``[0, T]``; equal cuts give empty pieces).
    ``initial_state``: ``[1, H, K, V]`` (as the one call takes it) or ``[H, K, V]``, fp32 (float64
    in checks), or None. Summaries of every piece (:func:`piece_summary`), :func:`fold_states`, then
    each piece rerun from its ``S_in(r)``. Returns ``(o [1, T, H, V], final_state [1, H, K, V])``,
    differentiable end to end (gradients reach q, k, v, g, beta and ``initial_state``).
    """
    _check_chunk_size(chunk_size)
    T, H, K = _check_piece(q)
    if v.dim() != 4 or tuple(v.shape[:3]) != (1, T, H):
        raise StatePassingError("v", f"expected [1, T, H, V] = [1, {T}, {H}, V], got {tuple(v.shape)}")
    V = v.shape[3]
    if T == 0:
        raise StatePassingError("q", "the sequence is empty (T = 0)")
    bounds = [0, *_check_cuts(cuts, T, chunk_size), T]
    h0 = None
    if initial_state is not None:
        if initial_state.dim() == 4 and initial_state.shape[0] == 1:
            h0 = initial_state[0]
        elif initial_state.dim() == 3:
            h0 = initial_state
        if h0 is None or tuple(h0.shape) != (H, K, V):
            raise StatePassingError(
                "initial_state", f"expected [1, H, K, V] = {(1, H, K, V)}, got {tuple(initial_state.shape)}"
            )
        if initial_state.dtype not in (torch.float32, torch.float64):
            raise StatePassingError(
                "initial_state", f"must be float32 (float64 in checks), got {initial_state.dtype}"
            )
    C = len(bounds) - 1
    pieces = [tuple(x[:, bounds[r] : bounds[r + 1]] for x in (q, k, v, g, beta)) for r in range(C)]
    # 1. summaries, every rank in parallel from the zero state (all-gathered in the distributed form)
    summ = [piece_summary(*p, chunk_size=chunk_size, backend=backend, scale=scale) for p in pieces]
    A = torch.stack([a for a, _ in summ], 0)  # [C, H, K, K]
    b = torch.stack([s for _, s in summ], 0)  # [C, H, K, V]
    # 2. fold in rank order
    S_in = fold_states(A, b, h0)  # [C, H, K, V]
    # 3. rerun each piece from its true entering state
    outs, final = [], None
    for r, p in enumerate(pieces):
        if bounds[r + 1] == bounds[r]:
            final = S_in[r]  # an empty piece passes its state through
            continue
        o_r, f_r, _ = chunk_kda_with_states(
            *p, scale=scale, initial_state=S_in[r][None], chunk_size=chunk_size, backend=backend
        )
        outs.append(o_r)
        final = f_r[0]
    return torch.cat(outs, 1), final[None]
