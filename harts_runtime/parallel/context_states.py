"""Context parallelism by state passing (``cp_mode`` ``"states"`` and ``"auto"``; ``docs/parallel.md``,
"Context parallelism", "States mode: execution").

Each of the C ranks of a CP group holds the rows ``[rank_row_offsets[c], rank_row_offsets[c + 1])``
of the microbatch's split (:func:`harts_planner.plan_cp`: balanced contiguous row ranges whose
interior cuts lie on the chunk grid) through the whole model: embedding, norms, FFN / MoE and LM
head run on those rows only. A linear mixer (KDA, gated delta net, Mamba2) runs its core on them
too, with what the rows need from earlier ranks:

===========================  ====================================================================
piece                        what rank ``c`` does
===========================  ====================================================================
halo rows                    the mixer input of the split's replay rows and conv-context rows of
                             its receives (fewer than ``B + w`` rows per receive), fetched from
                             the ranks holding them (one all-to-all; backward: the reverse)
local call plan              :func:`local_plan`: its rows cut into *pieces* (runs of rows each
                             the path successor of the one before); each piece is one sequence
                             starting at its chunk anchor ``a = B floor(pos / B)`` with the
                             path's rows ``[a, pos)`` replayed before it and the state ``S_a``
                             as its initial state: zero, a state produced by an earlier piece of
                             the rank (a requested chunk boundary) or an *entry state* handed
                             over from an earlier rank (a pre-filled state slot). Rounds by
                             dependency depth. Every chunk is the one process's chunk (the
                             split's grid rule), so the outputs are the one process's
summaries                    every state the rank hands on (``S_k`` of the split's sends) as an
                             affine function of the entry state its path started from on this
                             rank, ``S_k = A_k S_entry + b_k``: one run with values ``[v | 0_K]``
                             from entry states ``[0 | I]`` of the pieces whose states lead to a
                             send, each cut after its last such boundary (``LocalPlan.summary``)
                             (:func:`harts_kernels.kda.cp.piece_summary`'s identity, on the whole
                             local plan; Mamba2's SSD core gives ``A_k = a_k I``: one extra
                             value column from ``e_0``, and it sends ``[a_k | b_k]``); a rank
                             without entry states gets ``S_k`` directly
fold                         the summaries all-gathered (fp32, padded to the most sends of one
                             rank) and folded in state order, ``S_k = A_k S_src(k) + b_k``
                             (``src(k)``: the state the producing rank's path started from, or
                             zero), on every rank, so a fork reads its parent's state wherever
                             the parent lives, two or more ranks back included
rerun                        the local plan from the true entry states: the rank's core outputs
backward                     autograd through the rerun, the fold, the all-gather (backward:
                             reduce-scatter) and the summary run: exact (autograd computes the
                             transposed fold of :func:`harts_kernels.kda.cp.fold_states_backward`)
===========================  ====================================================================

Attention layers under ``"states"`` gather the ancestor rows their queries see
(:func:`harts_runtime.parallel.cp_attention.states_attention`); a layer ``"auto"`` runs
head-parallel does so on the same rows (:mod:`harts_runtime.parallel.context`'s ``RowMap``: rows
all-gathered to the microbatch's physical order, partial outputs reduce-scattered back).
:class:`CpChooser` fixes which modes each mixer may run and picks one per microbatch;
:func:`attach_cp_rows` (called by :func:`harts_runtime.microbatch.make_microbatch`) builds a
microbatch's :class:`CpRows`.

The split's rows are numbered in the planner's row order (lexicographic DFS preorder); the
layout's physical rows are a permutation of them (``CallPlan.row_to_physical``). Each rank's
local tensors hold its rows in row order; :class:`CpRows` keeps both maps.

The plan side (:class:`CpRows`, :func:`local_plan`) lives in
:mod:`harts_runtime.parallel.context_states_plan`, the execution (summaries, fold, rerun, the
mixers' forwards) in :mod:`harts_runtime.parallel.context_states_run`; this module chooses the modes
and attaches a microbatch's rows, and re-exports both.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import numpy as np
from torch import nn

from harts_runtime.errors import ParallelConfigError
from harts_runtime.options import CP_MODES
from harts_runtime.parallel.context_states_plan import (
    CpRows,
    LocalPlan,
    cp_rows_plan,
    empty_plan,
    fold_sources,
    local_plan,
)
from harts_runtime.parallel.context_states_run import (
    StatesMixer,
    exchange_halo,
    fold,
    run_local,
    states_forward,
    summaries,
)
from harts_runtime.parallel.plans import Block

__all__ = [
    "CP_MODES",
    "CpChooser",
    "CpRows",
    "LocalPlan",
    "StatesMixer",
    "attach_cp_rows",
    "cp_rows_plan",
    "empty_plan",
    "exchange_halo",
    "fold",
    "fold_sources",
    "local_plan",
    "run_local",
    "states_forward",
    "summaries",
]


LINEAR = ("kda", "gdn", "mamba2")
"""Mixer kinds that run by state passing."""


ATTENTION = ("mla", "gqa", "gated_attention")
"""Mixer kinds that run under states mode by gathering their ancestor rows
(:mod:`harts_runtime.parallel.cp_attention`)."""


class CpChooser:
    """Which CP mode each mixer may run (``possible``, fixed when the model is parallelized) and
    runs in a microbatch (:meth:`choose`). ``"states"``: every mixer by state passing (KDA / GDN:
    :class:`StatesMixer`; attention: ancestor rows gathered); ``"auto"``: per layer and microbatch,
    :func:`harts_runtime.parallel.cp_cost.choose_cp_mode` (the counted-bytes model on one NVLink node;
    ``"states"`` wherever the heads do not divide), the same on every CP rank (it reads only the
    split)."""

    def __init__(self, mode, possible: list[tuple[str, ...]], mixers, hidden, act_bytes, cp, tp, recompute):
        self.mode, self.possible, self.mixers = mode, possible, mixers
        self.hidden, self.act_bytes, self.cp, self.tp, self.recompute = hidden, act_bytes, cp, tp, recompute

    @classmethod
    def of(cls, model: nn.Module, mode: str, cp: int, tp: int = 1, recompute: bool = False) -> CpChooser:
        """Raises :class:`ParallelConfigError` naming ``cp_mode`` for an unknown mode, ``"states"``
        on a mixer kind it does not run, or the head field (:func:`cp_plan`) when no mode can run a
        layer."""
        from harts_runtime.parallel.cp_heads import cp_plan

        if mode not in CP_MODES:
            raise ParallelConfigError("cp_mode", f"unknown {mode!r}; choose one of {CP_MODES}")
        possible: list[tuple[str, ...]] = []
        for i, b in enumerate(cast(Iterable[Block], model.blocks)):  # the model's blocks, as read here
            if b.mixer is None:
                possible.append(("none",))
                continue
            kind = getattr(b, "mixer_kind", None)
            where = f" (blocks[{i}].mixer)"
            states_ok = kind in LINEAR + ATTENTION
            if mode == "heads":
                cp_plan(b.mixer, tp, cp, where)  # raises naming the head field
                possible.append(("heads",))
                continue
            if mode == "states":
                if not states_ok:
                    raise ParallelConfigError(
                        "cp_mode", f"'states' does not run {kind} mixers yet (blocks[{i}].mixer); use 'heads'"
                    )
                possible.append(("states",))
                continue
            try:
                cp_plan(b.mixer, tp, cp, where)
                heads = True
            except ParallelConfigError:
                if not states_ok:
                    raise
                heads = False
            possible.append(tuple(m for m, ok in (("heads", heads), ("states", states_ok)) if ok))
        mixers, hidden, act = None, 0, 4
        if mode == "auto":
            from harts_runtime.parallel.cp_cost import dims_of

            d = dims_of(model.config)
            mixers, hidden, act = d.mixers, d.hidden, d.act_bytes
        return cls(mode, possible, mixers, hidden, act, cp, tp, recompute)

    def choose(self, split, n: int) -> list[str]:
        """The mode of every block (``"none"`` without a mixer) for a microbatch of ``n`` rows split by
        ``split`` (None: an empty microbatch)."""
        out = []
        for i, can in enumerate(self.possible):
            if len(can) == 1 or split is None:
                out.append(can[0])
                continue
            from harts_runtime.parallel.cp_cost import Link, SplitShape, choose_cp_mode

            out.append(
                choose_cp_mode(
                    self.mixers[i],
                    self.hidden,
                    n,
                    self.cp,
                    Link.NVLINK,
                    split=SplitShape.of_split(split),
                    act_bytes=self.act_bytes,
                    recompute=self.recompute,
                    tp=self.tp,
                )
            )
        return out


def attach_cp_rows(step, mb, call_plan, *, cp_mesh, chooser: CpChooser, capacity: int | None = None) -> None:
    """The hook :func:`harts_runtime.microbatch.make_microbatch` calls on a model under ``cp_mode``
    ``"states"`` or ``"auto"``: splits the microbatch (:func:`harts_planner.plan_cp`, the layout's
    chunk size and convolution width), chooses each mixer's mode (:class:`CpChooser`) and puts this
    rank's :class:`CpRows` in ``mb.layout.info["cp_rows"]``: ``row_block`` rows when every mixer runs
    head-parallel, else the split's rows with the :class:`LocalPlan` of the linear mixers and the
    attention plan (:class:`~harts_runtime.parallel.cp_attention.StatesAttentionPlan`). The choice
    goes into ``mb.stats`` as ``cp_states/blocks.<i>`` (1: states, 0: heads). ``capacity``: the
    per-rank row capacity T, when known; a split that leaves a rank more rows than T (the chunk grid
    allows no better cut) is refused naming ``cp``."""
    from harts_planner import plan_cp
    from harts_runtime.parallel.cp_attention import StatesAttentionPlan

    layout = mb.layout
    size, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    kda = layout.kda
    n = layout.num_rows
    split = None
    if n and call_plan is not None:
        split = plan_cp(
            step.batch,
            np.asarray(call_plan.trajectories, dtype=np.int64),
            size,
            kda.chunk_size,
            conv_width=kda.conv_width,
        )
        held = np.diff(np.asarray(split.rank_row_offsets, dtype=np.int64))
        if capacity is not None and int(held.max()) > capacity:
            r = int(np.argmax(held))
            raise ParallelConfigError(
                "cp",
                f"the split of a {n}-row microbatch over cp = {size} gives rank {r} {int(held[r])} "
                f"rows, more than the per-rank capacity {capacity} (cuts fall on the chunk grid, "
                f"B = {kda.chunk_size})",
            )
    if n and call_plan is None:  # a trajectory-wise microbatch (no call plan): head-parallel only
        if any("heads" not in can for can in chooser.possible):
            raise ParallelConfigError(
                "mode",
                "a trajectory-wise microbatch cannot run cp_mode='states' (its mixers need a compact "
                "call plan): train compact (compact_always=True) or use cp_mode='heads'",
            )
        modes = ["none" if can == ("none",) else "heads" for can in chooser.possible]
    else:
        modes = chooser.choose(split, n)
    for i, m in enumerate(modes):
        if m != "none":
            mb.stats[f"cp_states/blocks.{i}"] = int(m == "states")
    kinds = {m for m in modes if m != "none"}
    if kinds <= {"heads"}:
        rows = CpRows.blocks(n, size, rank)
    elif split is None:  # an empty microbatch: every collective still runs, on no rows
        rows = CpRows.blocks(n, size, rank)
        rows.local = empty_plan(size, rank, max(kda.conv_width if kda is not None else 2, 2))
        rows.attention = StatesAttentionPlan.build(
            np.full(n, -1, np.int64), [0] * (size + 1), positions=np.zeros(n, np.int64)
        )
    else:
        assert call_plan is not None  # the split came from it
        rows = cp_rows_plan(layout, split, rank, call_plan.row_to_physical)
        device = layout.input_ids.device if layout.input_ids is not None else "cpu"
        if rows.local is not None:
            rows.local = rows.local.to(device)
        rows.attention = StatesAttentionPlan.from_call_plan(step.batch, call_plan, split)
    rows.modes = modes
    layout.info["cp_rows"] = rows
