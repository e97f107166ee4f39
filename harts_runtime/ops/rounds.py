"""The round executor: a linear-attention layer's schedule run round by round over per-row inputs
(Sections 3.3, 3.4, 4.2), its chunkwise core a parameter.

Glossary (rounds, packed rows, state slots: :mod:`harts_runtime.layout.kda_plan`)
-------------------------------------------------------------------------------
* rows: the ``R`` rows the inputs hold, ``[R, H, *]`` each: a microbatch's physical rows, or a
  context-parallel rank's own rows followed by halo rows (rows no packed row owns, read only);
* core: one packed chunkwise call (the ChunkLA contract of Equation 16, :data:`ChunkCore`):
  KDA and the gated delta net run :func:`harts_kernels.kda.chunk_kda_with_states`, Mamba2 runs
  :func:`harts_kernels.ssd.chunk_ssd_with_states`;
* entry states: states handed in from outside the schedule (a context-parallel rank's states
  from earlier ranks), the first slots ``[0, len(entries))`` before the first round.

:func:`run_rounds` computes, for a :class:`~harts_runtime.layout.kda_plan.KDASchedule` ``sched``
with rounds ``0 .. N - 1``:

1. the packed rows of all rounds, gathered once (``sched.gather``; rows ``[bounds[r],
   bounds[r + 1])`` are round r's): when ``R`` equals the rows the schedule writes, through
   :func:`~harts_runtime.ops.rows.gather_packed` (gather-only backward), else by a plain
   ``index_select`` (halo rows: no packed row owns them);
2. per round r with rows, in order: initial states ``stack(slots[s] or zeros for s in
   rd.init_slots)`` (None when every sequence starts from zero), one core call, then its
   requested boundary states into ``rd.request_slot`` and its final states into ``rd.final_slots``
   (``-1``: not kept); a slot read before it is filled raises;
3. the outputs of all rounds concatenated, each row's own output taken (``sched.own_pos``,
   :func:`~harts_runtime.ops.rows.scatter_own`): ``o [C, H, V]``, ``C = len(sched.own_pos)``.

Slots and outputs stay in the autograd graph: backward runs through the cores, the state handoffs
(a slot read by several sequences sums their gradients) and the gathers, into the rows and the
entry states. The executor holds nothing after it returns. Cost: one gather of ``P = bounds[-1]``
packed rows per input, one core call per round, one gather of ``C`` output rows; host work
O(rounds + sequences).

The layers bind it to their core (:func:`harts_runtime.layers.kda.run_kda_schedule`,
:func:`harts_runtime.layers.mamba2.run_ssd_schedule`) and mark it the kept region
``"linear_attention"`` (:mod:`harts_runtime.ops.keep`); context parallelism runs a rank's local
plan with it (``entries`` and halo rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.profiler import record_function

from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.kda_plan import KDASchedule
from harts_runtime.ops.keep import saves_are_transient
from harts_runtime.ops.rows import gather_packed, scatter_own

__all__ = ["ChunkCore", "Rounds", "run_rounds"]


ChunkCore = Callable[..., "tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]"]
"""One packed chunkwise call (ChunkLA, Equation 16), as :func:`harts_kernels.kda.chunk_kda_with_states`
and :func:`harts_kernels.ssd.chunk_ssd_with_states`::

    core(q, k, v, g, *extra, initial_state=, cu_seqlens=, chunk_size=, request_seq=, request_chunk=,
         output_final_state=, backend=, save_intermediates=) -> (o, final_state, boundary_states)

Positional: the round's packed rows as ``[1, n, H, *]`` (the executor's ``rows`` gathered, in their
order); q, k ``[1, n, H, K]``, v ``[1, n, H, V]``; g and extra as the core defines them (a core may
broadcast g, e.g. :func:`harts_runtime.layers.kda.kda_core` a per-head decay over K). Keywords:
``initial_state`` ``[N, H, K, V]`` fp32 or None (zeros), ``cu_seqlens`` (host ints ``[N + 1]``, each
sequence's chunk grid starting at its first row), ``chunk_size``, ``request_seq`` and
``request_chunk`` (``p`` boundaries: sequence i's state after its first ``c * chunk_size`` rows),
``output_final_state``, ``backend``, ``save_intermediates``. Returns ``o [1, n, H, V]``,
``final_state [N, H, K, V]`` or None, ``boundary_states [p, H, K, V]``; states fp32 (fp64 for fp64
inputs), differentiable."""


class Rounds(NamedTuple):
    """What :func:`run_rounds` returns."""

    o: torch.Tensor
    """[C, H, V]: every written row's core output, in the schedule's row order (``own_pos``)."""
    slots: list[torch.Tensor | None]
    """[sched.num_slots]: the entry states, then every state the rounds produced ([H, K, V] fp32;
    None where none was)."""


def run_rounds(
    sched: KDASchedule,
    core: ChunkCore,
    rows: Sequence[torch.Tensor],
    *,
    chunk_size: int,
    backend: str = "auto",
    entries: Sequence[torch.Tensor] = (),
    label: str = "rounds",
) -> Rounds:
    """Run ``sched``'s rounds with ``core`` (module docstring).

    Parameters
    ----------
    sched
        The rounds, on the rows' device (``KDASchedule.to``).
    core
        The chunkwise kernel (:data:`ChunkCore`).
    rows
        ``(q, k, v, g, *extra)``, ``[R, H, *]`` each (q ``[R, H, K]``, v ``[R, H, V]``), in the
        core's positional order; ``R >= len(sched.own_pos)`` (rows beyond the written ones are
        read only).
    chunk_size, backend
        Passed to every core call (``chunk_size``: the plan's B).
    entries
        States ``[H, K, V]`` fp32 for slots ``0 .. len(entries) - 1`` (differentiable).
    label
        Profiler ranges ``harts.<label>.gather`` / ``.states`` / ``.core``.

    Raises
    ------
    InvalidInputError
        ``entries`` longer than ``sched.num_slots``; a round reading a slot no earlier round (or
        entry) filled (``layout.kda``).
    """
    q, v = rows[0], rows[2]
    H, K, Vd = q.shape[1], q.shape[2], v.shape[2]
    if len(entries) > sched.num_slots:
        raise InvalidInputError(
            "entries", f"{len(entries)} entry states for a schedule of {sched.num_slots} slots"
        )
    transient = saves_are_transient()  # in a recomputed block: the core saves its intermediates
    slots: list[torch.Tensor | None] = [*entries] + [None] * (sched.num_slots - len(entries))
    zero = None
    with record_function(f"harts.{label}.gather"):
        if q.shape[0] == sched.own_pos.shape[0]:
            packed = [gather_packed(x, sched) for x in rows]
        else:  # halo rows: no packed row owns them
            packed = [x.index_select(0, sched.gather) for x in rows]
        # split, not slices: the backward of a split is one concatenation per tensor, that of R
        # slices R full-size zero tensors summed
        sizes = [hi - lo for lo, hi in zip(sched.bounds[:-1], sched.bounds[1:])]
        per_round = list(zip(*(torch.split(x, sizes) for x in packed))) if len(sizes) > 1 else [packed]
    outs = []
    for rd, parts in zip(sched.rounds, per_round):
        if parts[0].shape[0] == 0:  # a round without rows (an empty microbatch: DP padding)
            continue
        init = None
        if any(s >= 0 for s in rd.init_slots):
            if zero is None:
                zero = q.new_zeros(H, K, Vd, dtype=torch.float32)
            missing = [s for s in rd.init_slots if s >= 0 and slots[s] is None]
            if missing:
                raise InvalidInputError(
                    "layout.kda", f"a round reads state slot {missing[0]} before it is produced"
                )
            with record_function(f"harts.{label}.states"):
                init = torch.stack([slots[s] if s >= 0 else zero for s in rd.init_slots])
        with record_function(f"harts.{label}.core"):
            o, final, bstates = core(
                *(x.unsqueeze(0) for x in parts),
                initial_state=init,
                cu_seqlens=rd.cu_seqlens,
                chunk_size=chunk_size,
                request_seq=rd.request_seq,
                request_chunk=rd.request_chunk,
                output_final_state=any(s >= 0 for s in rd.final_slots),
                backend=backend,
                save_intermediates=transient,
            )
        for j, s in enumerate(rd.request_slot):
            slots[s] = bstates[j]
        for j, s in enumerate(rd.final_slots):
            if s >= 0:
                slots[s] = final[j]
        outs.append(o.squeeze(0))
    if not outs:  # no rows
        return Rounds(v.new_zeros(0, H, Vd), slots)
    o = outs[0] if len(outs) == 1 else torch.cat(outs)
    return Rounds(scatter_own(o, sched), slots)
