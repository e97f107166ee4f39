"""Context parallelism for chunkwise SSD (Mamba2) by state passing with per-piece affine summaries:
the state-passing building block of the states mode, the SSD counterpart of
:mod:`harts_kernels.kda.cp`.

Glossary
--------
* B: ``chunk_size``, the chunk grid of :func:`harts_kernels.ssd.chunk_ssd_with_states`.
* piece: a contiguous token range of one sequence held by one rank (several pieces of one rank may
  be packed into one call with ``cu_seqlens``). When pieces are cut on the chunk grid, each
  piece's grid is the sequence's and the chunk partition is the one process's.
* state ``S [K, V]`` per head (``[H, K, V]`` fp32, float64 for float64 inputs; Mamba2's ``K =
  ssm_state_size``, ``V = head_dim``); ``S_in(r)`` the state entering piece ``r``.
* summary ``(a_r [H], b_r [H, K, V])`` of piece ``r``: the affine map its tokens apply to the
  state, ``S_out = a_r S_in + b_r`` per head.
* state order: the pieces are numbered so that a piece's entry state comes from an earlier piece
  (``parent[r] < r``) or is given (``parent[r] = -1``: the initial state, or zero).

The math (per head; the convention of :mod:`harts_kernels.ssd.naive`)
---------------------------------------------------------------------
Token t (log decay ``g_t <= 0``, one scalar per head; ``k_t [K]``, ``v_t [V]``) maps the state as
``S_t = exp(g_t) S_{t-1} + k_t v_t^T``. Over a piece of tokens ``1..n`` that is affine in the
entering state with a *scalar* linear part:

    a = exp(g_1 + ... + g_n)                    (one number per head: A = a I)
    b = the piece's final state from S_0 = 0    ([K, V] per head)

so unlike KDA / GDN (a K x K matrix per head, :mod:`harts_kernels.kda.cp`) the summary costs one
ordinary call of the operator from the zero state plus a sum of ``g``: no widened values, no extra
work beyond the piece itself. :func:`piece_summary` computes ``a`` as ``exp`` of the fp32 sum of
``g`` over the piece (the kernel's own decay of an initial state is the same product, rounded per
chunk) and ``b`` with :func:`~harts_kernels.ssd.chunk_ssd_with_states`'s final state; both are
differentiable (``a`` in ``g``; ``b`` through the operator's backward).

Fold (:func:`fold_states`), in state order:

    S_in(r) = initial(r) (or 0)                          if parent[r] < 0
    S_in(r) = a_p S_in(p) + b_p,  p = parent[r]          otherwise

``parent=None`` is the chain ``parent[r] = r - 1`` (C ranks of one sequence, ``initial`` entering
piece 0). A fork whose parent is another piece's *final* state is one parent edge; a fork at a
chunk boundary inside a piece is served by cutting the piece there. Backward, each piece's rerun
returns ``dS_in(r)`` (the operator's initial-state gradient); the fold's backward is its transpose
(:func:`fold_states_backward`), in reverse state order:

    lambda_r = dS_in(r) + sum over children c of r of a_r lambda_c
    da_r = sum over children c of <lambda_c, S_in(r)>  (per head),   db_r = sum over children lambda_c
    d initial(r) = lambda_r  for every root r

and ``(da_r, db_r)`` enter the summary's backward (``da`` through ``exp(sum g)``, ``db`` as the
gradient of the summary call's final state).

State passing on C ranks: each rank summarizes its pieces from the zero state (in parallel), the
summaries are all-gathered and folded in state order on every rank, each rank reruns its pieces
from their ``S_in`` (``chunk_ssd_with_states(initial_state=S_in)``), which gives the one-process
output rows and final states. :func:`chunk_ssd_cp_reference` runs the chain form in one process,
differentiable end to end.

Interface (what the runtime integration calls)
----------------------------------------------
* ``piece_summary(q, k, v, g, *, chunk_size, backend="auto", scale=1.0, cu_seqlens=None)`` ->
  ``(a, b)``: one piece ``[1, T, H, ...]`` gives ``a [H]``, ``b [H, K, V]``; with ``cu_seqlens``
  (``P + 1`` offsets of P packed pieces) ``a [P, H]``, ``b [P, H, K, V]``, one operator call.
* ``fold_states(a [C, H], b [C, H, K, V], initial=None, parent=None)`` -> ``S_in [C, H, K, V]``;
  ``initial`` is ``[H, K, V]`` (entering every root) or ``[C, H, K, V]`` (row ``r`` entering root
  ``r``; other rows unused); ``parent`` a length-C integer sequence in state order.
* ``fold_states_backward(a, S_in, dS_in, parent=None)`` -> ``(da [C, H], db [C, H, K, V],
  d_initial [C, H, K, V])`` (``d_initial[r]`` is zero for a piece with a parent).
* ``chunk_ssd_cp_reference(q, k, v, g, cuts, *, chunk_size, initial_state=None, backend="auto",
  scale=1.0)`` -> ``(o [1, T, H, V], final_state [1, H, K, V])``.

Cost
----
* communication: one summary per piece, ``H (1 + K V) 4`` bytes (fp32), all-gathered (backward: the
  same bytes of ``dS_in``). Mamba2 at ``K = 128``, ``V = 64``, ``H = 128``: 4 MiB per piece and layer.
* the fold: ``C`` scaled additions of ``[H, K, V]``, ``O(C H K V)``.
* the pieces: the summary call plus the rerun, about twice the one-process SSD work of the piece
  (in parallel over ranks); rank 0's summary from a zero initial state is already its true run,
  and the last piece's summary is unused by a chain (a distributed version may skip both).

Errors: :class:`~harts_kernels.kda.cp.StatePassingError` (shared with KDA), a ``ValueError`` whose
``.field`` names the bad argument (``"cuts[1]"``, ``"a"``, ``"parent[2]"``, ``"initial"``) and
whose message is one line. The operator's own checks (shapes of k, v, g) raise its ``ValueError``.
"""

from __future__ import annotations

import torch

from harts_kernels.kda.cp import StatePassingError, _check_chunk_size, _check_cuts
from harts_kernels.ssd.chunk import chunk_ssd_with_states

__all__ = [
    "StatePassingError",
    "chunk_ssd_cp_reference",
    "fold_states",
    "fold_states_backward",
    "piece_summary",
]


def _state_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_piece(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> tuple[int, int, int, int]:
    if q.dim() != 4 or q.shape[0] != 1:
        raise StatePassingError("q", f"expected pieces [1, T, H, K], got shape {tuple(q.shape)}")
    _, T, H, K = q.shape
    if v.dim() != 4 or tuple(v.shape[:3]) != (1, T, H):
        raise StatePassingError("v", f"expected [1, T, H, V] = [1, {T}, {H}, V], got {tuple(v.shape)}")
    if tuple(g.shape) != (1, T, H):
        raise StatePassingError("g", f"expected [1, T, H] = {(1, T, H)}, got {tuple(g.shape)}")
    return T, H, K, v.shape[3]


def _offsets(cu_seqlens, T: int) -> list[int]:
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != T:
        raise StatePassingError("cu_seqlens", f"must start at 0 and end at T={T}, got {cu}")
    for i, (x, y) in enumerate(zip(cu[:-1], cu[1:])):
        if isinstance(y, bool) or not isinstance(y, int) or y < x:
            raise StatePassingError(f"cu_seqlens[{i + 1}]", f"must be an integer >= {x}, got {y!r}")
    return cu


def piece_summary(q, k, v, g, *, chunk_size: int, backend: str = "auto", scale: float = 1.0, cu_seqlens=None):
    """The affine summaries ``S_out = a S_in + b`` of one piece (``a [H]``, ``b [H, K, V]``) or, with
    ``cu_seqlens``, of the P packed pieces (``a [P, H]``, ``b [P, H, K, V]``; empty pieces allowed,
    their summary ``(1, 0)``).

    Inputs as :func:`~harts_kernels.ssd.chunk_ssd_with_states` takes them (``[1, T, H, ...]``, ``g``
    the fp32 log decay). ``a = exp(sum of g over the piece)``, ``b`` the final state of one operator
    call from the zero state (module docstring). fp32 (float64 for float64 inputs); differentiable
    in k, v, g (q and ``scale`` enter only the discarded outputs).
    """
    _check_chunk_size(chunk_size)
    T, H, K, V = _check_piece(q, v, g)
    sdt = _state_dtype(q)
    single = cu_seqlens is None
    cu = [0, T] if single else _offsets(cu_seqlens, T)
    P = len(cu) - 1
    seg = torch.repeat_interleave(
        torch.arange(P, device=g.device),
        torch.tensor([y - x for x, y in zip(cu[:-1], cu[1:])], device=g.device),
    )
    logs = g[0].to(sdt).new_zeros(P, H).index_add(0, seg, g[0].to(sdt))  # [P, H]
    a = logs.exp()
    b = q.new_zeros(P, H, K, V, dtype=sdt)
    live = [i for i in range(P) if cu[i + 1] > cu[i]]
    if live:
        rows = [torch.arange(cu[i], cu[i + 1], device=q.device) for i in live]
        idx = torch.cat(rows)
        sub_cu = [0]
        for r in rows:
            sub_cu.append(sub_cu[-1] + r.numel())
        pick = (lambda x: x) if len(live) == P else (lambda x: x.index_select(1, idx))
        _, final, _ = chunk_ssd_with_states(
            *(pick(x) for x in (q, k, v, g)),
            scale=scale,
            cu_seqlens=sub_cu,
            chunk_size=chunk_size,
            output_final_state=True,
            backend=backend,
        )
        final = final.to(sdt)
        b = final if len(live) == P else b.index_copy(0, torch.tensor(live, device=q.device), final)
    return (a[0], b[0]) if single else (a, b)


def _parents(parent, C: int) -> list[int]:
    if parent is None:
        return list(range(-1, C - 1))
    items = parent.tolist() if isinstance(parent, torch.Tensor) else list(parent)
    if len(items) != C:
        raise StatePassingError("parent", f"expected {C} entries (one per piece), got {len(items)}")
    for r, p in enumerate(items):
        if isinstance(p, bool) or not isinstance(p, int) or not -1 <= p < r:
            raise StatePassingError(
                f"parent[{r}]", f"must be -1 or an earlier piece (state order: 0 <= parent < {r}), got {p!r}"
            )
    return items


def _check_summaries(a, b) -> tuple[int, int, int, int]:
    if a.dim() != 2 or a.shape[0] < 1:
        raise StatePassingError("a", f"expected [C, H] with C >= 1, got shape {tuple(a.shape)}")
    C, H = a.shape
    if b.dim() != 4 or tuple(b.shape[:2]) != (C, H):
        raise StatePassingError("b", f"expected [C, H, K, V] = [{C}, {H}, K, V], got {tuple(b.shape)}")
    return C, H, b.shape[2], b.shape[3]


def _initials(initial, C: int, H: int, K: int, V: int, like: torch.Tensor) -> torch.Tensor | None:
    if initial is None:
        return None
    if tuple(initial.shape) == (H, K, V):
        return initial.to(like.dtype).expand(C, H, K, V)
    if tuple(initial.shape) == (C, H, K, V):
        return initial.to(like.dtype)
    raise StatePassingError(
        "initial",
        f"expected [H, K, V] = {(H, K, V)} or [C, H, K, V] = {(C, H, K, V)}, got {tuple(initial.shape)}",
    )


def fold_states(
    a: torch.Tensor, b: torch.Tensor, initial: torch.Tensor | None = None, parent=None
) -> torch.Tensor:
    """The state entering each piece, ``S_in [C, H, K, V]``, in state order (module docstring):
    ``S_in[r] = a[p, :, None, None] S_in[p] + b[p]`` for ``p = parent[r] >= 0``, else the initial
    state (zeros when ``initial`` is None). ``parent=None``: the chain of C ranks. In the summaries'
    dtype; differentiable, its backward is :func:`fold_states_backward`."""
    C, H, K, V = _check_summaries(a, b)
    par = _parents(parent, C)
    init = _initials(initial, C, H, K, V, b)
    out: list[torch.Tensor] = []
    for r, p in enumerate(par):
        if p >= 0:
            out.append(a[p][:, None, None] * out[p] + b[p])
        else:
            out.append(b.new_zeros(H, K, V) if init is None else init[r])
    return torch.stack(out, 0)


def fold_states_backward(a: torch.Tensor, S_in: torch.Tensor, dS_in: torch.Tensor, parent=None):
    """The fold's transpose: from the gradient ``dS_in [C, H, K, V]`` arriving at every entry state,
    ``(da [C, H], db [C, H, K, V], d_initial [C, H, K, V])`` (module docstring; ``d_initial[r]`` is
    the gradient of root ``r``'s initial state, zero for a piece with a parent; sum it over the roots
    for a shared ``[H, K, V]`` initial state). The distributed backward all-gathers ``dS_in`` and
    runs this on every rank."""
    C = a.shape[0]
    par = _parents(parent, C)
    lam = [t.clone() for t in dS_in.unbind(0)]
    da = torch.zeros_like(a)
    db = torch.zeros_like(S_in)
    d_init = torch.zeros_like(S_in)
    for r in range(C - 1, -1, -1):  # children after parents: lam[r] is complete when reached
        p = par[r]
        if p < 0:
            d_init[r] = lam[r]
            continue
        da[p] += (lam[r] * S_in[p]).sum((-2, -1))
        db[p] += lam[r]
        lam[p] = lam[p] + a[p][:, None, None] * lam[r]
    return da, db, d_init


def chunk_ssd_cp_reference(
    q,
    k,
    v,
    g,
    cuts,
    *,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
    backend: str = "auto",
    scale: float = 1.0,
):
    """State passing over ``C = len(cuts) + 1`` pieces of one sequence in one process; equals one
    :func:`~harts_kernels.ssd.chunk_ssd_with_states` call on the whole sequence.

    ``q, k, v, g``: one sequence ``[1, T, H, ...]``. ``cuts``: the ``C - 1`` interior cuts
    (multiples of ``chunk_size``, non-decreasing, in ``[0, T]``; equal cuts give empty pieces).
    ``initial_state``: ``[1, H, K, V]`` or ``[H, K, V]`` fp32 (float64 in checks), or None. The
    summaries of all pieces in one packed call (:func:`piece_summary`), :func:`fold_states`, then one
    packed rerun of all pieces from their ``S_in``. Returns ``(o [1, T, H, V], final_state [1, H, K,
    V])``, differentiable end to end.
    """
    _check_chunk_size(chunk_size)
    T, H, K, V = _check_piece(q, v, g)
    if T == 0:
        raise StatePassingError("q", "the sequence is empty (T = 0)")
    bounds = [0, *_check_cuts(cuts, T, chunk_size), T]
    h0 = None
    if initial_state is not None:
        h0 = initial_state[0] if initial_state.dim() == 4 and initial_state.shape[0] == 1 else initial_state
        if tuple(h0.shape) != (H, K, V):
            raise StatePassingError(
                "initial_state", f"expected [1, H, K, V] = {(1, H, K, V)}, got {tuple(initial_state.shape)}"
            )
        if initial_state.dtype not in (torch.float32, torch.float64):
            raise StatePassingError(
                "initial_state", f"must be float32 (float64 in checks), got {initial_state.dtype}"
            )
    # 1. summaries, every rank in parallel from the zero state (all-gathered in the distributed form)
    a, b = piece_summary(q, k, v, g, chunk_size=chunk_size, backend=backend, scale=scale, cu_seqlens=bounds)
    # 2. fold in state order
    S_in = fold_states(a, b, h0)
    # 3. rerun every non-empty piece from its true entering state (one packed call here; one per
    # rank there); an empty last piece passes its entering state through
    live = [r for r in range(len(bounds) - 1) if bounds[r + 1] > bounds[r]]
    cu = [0]
    for r in live:
        cu.append(cu[-1] + bounds[r + 1] - bounds[r])
    o, finals, _ = chunk_ssd_with_states(
        q,
        k,
        v,
        g,
        scale=scale,
        initial_state=S_in[live],
        cu_seqlens=cu,
        chunk_size=chunk_size,
        backend=backend,
    )
    final = finals[-1] if live[-1] == len(bounds) - 2 else S_in[-1]
    return o, final[None]
