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
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from harts_runtime.errors import ParallelConfigError
from harts_runtime.layout.conv import ConvWindows
from harts_runtime.layout.kda_plan import KDARound, KDASchedule
from harts_runtime.ops.rounds import run_rounds
from harts_runtime.options import CP_MODES
from harts_runtime.parallel.plans import Block
from harts_runtime.parallel.tensor import gather_rows, row_block

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


# ---------------------------------------------------------------------------------- rows
@dataclass
class CpRows:
    """Which rows each CP rank holds in one microbatch (host numpy and device index tensors).

    ``offsets`` [C + 1]: rank c holds split rows ``[offsets[c], offsets[c + 1])``; ``r2p`` [N]: the
    physical row of each split row; ``p2r`` its inverse (identity maps and ``row_block`` ranges when
    every mixer of the microbatch runs head-parallel: :meth:`blocks`). ``local``: this rank's
    :class:`LocalPlan` of the linear mixers; ``attention``: the microbatch's
    :class:`~harts_runtime.parallel.cp_attention.StatesAttentionPlan`; ``modes``: every block's mode
    (``"heads"``, ``"states"``, ``"none"``), the same on every CP rank.
    """

    offsets: list[int]
    r2p: np.ndarray
    p2r: np.ndarray
    rank: int
    local: LocalPlan | None = None
    identity: bool = True
    split: object = None
    _dev: dict | None = None
    attention: object = None
    modes: list | None = None

    @property
    def num_rows(self) -> int:
        return self.offsets[-1]

    @property
    def block(self) -> tuple[int, int]:
        return self.offsets[self.rank], self.offsets[self.rank + 1]

    @property
    def sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.offsets[:-1], self.offsets[1:])]

    def tensor(self, name: str, device) -> torch.Tensor:
        """``r2p``, ``p2r`` or ``mine`` (this rank's physical rows, in row order) on ``device``."""
        if self._dev is None:
            self._dev = {}
        key = (name, str(device))
        t = self._dev.get(key)
        if t is None:
            start, end = self.block
            arr = {"r2p": self.r2p, "p2r": self.p2r, "mine": self.r2p[start:end]}[name]
            t = self._dev[key] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64)).to(device)
        return t

    @classmethod
    def blocks(cls, n: int, size: int, rank: int) -> CpRows:
        """Heads mode: ``row_block`` ranges, identity maps."""
        offsets = [row_block(n, size, r)[0] for r in range(size)] + [n]
        ar = np.arange(n, dtype=np.int64)
        return cls(offsets, ar, ar, rank)


def cp_rows_plan(layout, split, rank: int, row_to_physical, linear: bool = True) -> CpRows:
    """This rank's :class:`CpRows` of a microbatch from its split (:func:`harts_planner.plan_cp` of the
    same trajectories as the layout's call plan), the call plan's ``row_to_physical`` and the
    ``layout`` (positions, the global KDA conv windows); ``linear``: build the :class:`LocalPlan` of
    the linear mixers."""
    n = layout.num_rows
    if int(split.num_rows) != n:
        raise ParallelConfigError("cp_split", f"splits {int(split.num_rows)} rows, the layout has {n}")
    r2p = np.asarray(row_to_physical, dtype=np.int64)
    p2r = np.empty_like(r2p)
    p2r[r2p] = np.arange(n, dtype=np.int64)
    offsets = [int(o) for o in split.rank_row_offsets]
    rows = CpRows(offsets, r2p, p2r, rank, identity=bool(np.array_equal(r2p, np.arange(n))), split=split)
    if linear and layout.kda is not None and n:
        kda = layout.kda
        w = kda.conv_width
        if w < 2:
            raise ParallelConfigError(
                "conv_size", f"cp_mode='states' needs a short convolution width >= 2, got {w}"
            )
        table = kda.conv.index.cpu().numpy()[r2p]  # [N, w] physical rows, in row order
        conv = np.where(table >= 0, p2r[np.maximum(table, 0)], -1)
        pos = layout.positions.cpu().numpy()[r2p]
        rows.local = local_plan(split, rank, pos, conv, kda.chunk_size)
    return rows


# ---------------------------------------------------------------------------------- local plan
@dataclass
class LocalPlan:
    """What rank ``rank`` runs for every linear mixer of one microbatch (host-built).

    Local rows ``E`` = its own rows (``n_own``, row order) then its halo rows ``halo`` (split rows,
    ascending). ``conv``: the short convolution's windows over E; ``sched``: the local rounds over E
    (``gather`` into E, own rows written once); slots ``[0, num_entries)`` hold the entry states
    (split states ``entries``), filled before the run. ``sends``: the slots of the split's states
    this rank produces (``send_offsets`` order). Exchange: ``recv_sizes[s]`` halo rows come from
    rank s; ``send_index`` (own-row indices, by destination) with ``send_sizes``. Fold (global):
    ``sources[k]`` the state ``S_k``'s summary is relative to (-1: zero), ``max_sends`` the most
    states one rank produces, ``send_offsets`` the split's.
    """

    rank: int
    n_own: int
    halo: np.ndarray
    conv: ConvWindows
    sched: KDASchedule
    entries: list[int]
    sends: list[int]
    recv_sizes: list[int]
    send_sizes: list[int]
    send_index: torch.Tensor
    sources: list[int]
    max_sends: int
    send_offsets: list[int]
    num_pieces: int = 0
    conv_exact: np.ndarray | None = None
    """Rows of E whose windows are read (own and replay rows): ``conv``'s table equals
    ``conv_table`` there (conv-context-only rows convolve garbage nobody reads)."""
    conv_table: np.ndarray | None = None
    summary: KDASchedule | None = None
    """The summary run's rounds (a rank with entry states and sends): the pieces whose states lead
    to a send, each cut after its last such boundary; None: ``sched`` (run once, truly)."""

    @property
    def num_entries(self) -> int:
        return len(self.entries)

    @property
    def rows(self) -> int:
        return self.n_own + len(self.halo)

    def to(self, device) -> LocalPlan:
        out = LocalPlan(**{f: getattr(self, f) for f in self.__dataclass_fields__})
        out.conv, out.sched = self.conv.to(device), self.sched.to(device)
        out.summary = None if self.summary is None else self.summary.to(device)
        out.send_index = self.send_index.to(device)
        return out


def _halo(split, r: int) -> np.ndarray:
    parts = []
    for i in range(int(split.receive_offsets[r]), int(split.receive_offsets[r + 1])):
        parts.append(np.asarray(split.replay(i), dtype=np.int64))
        ctx = np.asarray(split.conv_context(i), dtype=np.int64)
        parts.append(ctx[ctx >= 0])
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def _run_starts(pred: np.ndarray) -> np.ndarray:
    """For every row, the first row of its run (rows each the path successor of the one before)."""
    n = len(pred)
    idx = np.arange(n, dtype=np.int64)
    brk = np.ones(n, dtype=bool)
    if n > 1:
        brk[1:] = pred[1:] != idx[:-1]
    return np.maximum.accumulate(np.where(brk, idx, 0))


def fold_sources(split, pred: np.ndarray) -> list[int]:
    """``src(k)`` for every state of ``split``: the split state the producing rank's path started from
    there (the state of the receive through which the path of ``state_row[k]`` enters that rank),
    or -1 (the path starts on that rank at position 0, or from an anchor-0 receive)."""
    offsets = np.asarray(split.rank_row_offsets, dtype=np.int64)
    starts = _run_starts(pred)
    recv = {
        (int(split.receive_rank[i]), int(split.receive_row[i])): int(split.receive_state[i])
        for i in range(split.num_receives)
    }
    out = []
    for k in range(split.num_states):
        r, z = int(split.state_rank[k]), int(split.state_row[k])
        lo = int(offsets[r])
        while True:
            f = max(int(starts[z]), lo)
            u = int(pred[f])
            if u < lo:
                out.append(-1 if u < 0 else recv[(r, u)])
                break
            z = u
    return out


def local_plan(split, rank: int, pos: np.ndarray, conv: np.ndarray, chunk_size: int) -> LocalPlan:
    """Rank ``rank``'s :class:`LocalPlan` from the split, every row's position ``pos`` [N] and its
    conv window ``conv`` [N, w] (split rows, oldest first, -1 below position 0), all in row order.
    Raises :class:`ParallelConfigError` (``cp_split``) when the split misses a row or state the
    local plan needs (an inconsistent split)."""
    B = int(chunk_size)
    n, w = conv.shape
    C = int(split.cp_size)
    offsets = [int(o) for o in split.rank_row_offsets]
    lo, hi = offsets[rank], offsets[rank + 1]
    n_own = hi - lo
    pred = conv[:, w - 2].astype(np.int64)
    halo = _halo(split, rank)
    E = np.concatenate([np.arange(lo, hi, dtype=np.int64), halo])
    emap = np.full(n, -1, dtype=np.int64)
    emap[E] = np.arange(len(E))

    def bad(what):
        return ParallelConfigError("cp_split", f"rank {rank}: {what}")

    # conv windows over E: own and replay rows must find their whole window in E
    replay_rows = set()
    for i in range(int(split.receive_offsets[rank]), int(split.receive_offsets[rank + 1])):
        replay_rows.update(int(x) for x in split.replay(i))
    win = conv[E]
    ewin = np.where(win >= 0, emap[np.maximum(win, 0)], -1)
    missing = (win >= 0) & (ewin < 0)
    needed = np.zeros(len(E), dtype=bool)
    needed[:n_own] = True
    needed[n_own:] = [int(x) in replay_rows for x in halo]
    if (missing.any(axis=1) & needed).any():
        raise bad("a convolution window reaches a row neither held nor received")
    partial = np.asarray(missing.any(axis=1))  # conv-context-only rows: their outputs are never read
    ewin[partial] = -1
    ewin[partial, w - 1] = np.arange(len(E))[partial]
    epred = ewin[:, w - 2]
    ie = np.arange(len(E))
    first = np.ones(len(E), dtype=bool)
    first[1:] = (epred[1:] != ie[:-1]) | partial[:-1]  # a run never continues a cut-off window
    heads = np.nonzero(first)[0]
    ranges = np.stack([heads, np.append(heads[1:], len(E))], 1) if len(E) else np.zeros((0, 2), np.int64)
    windows = ConvWindows.from_sequences(ranges, ewin[heads, : w - 1], len(E), w)

    # pieces over the own rows
    piece_of = np.full(n_own, -1, dtype=np.int64)
    pieces = []  # dict(first, end, anchor, replay [E idx], init ("zero"|"ext"|"local", ...))
    entries: list[int] = []
    entry_slot: dict[int, int] = {}
    state_ids = {int(z): k for k, z in enumerate(split.state_row)}
    x = lo
    while x < hi:
        end = x + 1
        while end < hi and pred[end] == end - 1:
            end += 1
        p = int(pos[x])
        a = B * (p // B)
        rep = []
        z = int(pred[x])
        for _ in range(p - a):  # the path's rows at positions [a, p), newest first
            rep.append(z)
            z = int(pred[z])
        rep.reverse()
        if any(emap[r] < 0 for r in rep):
            raise bad(f"replay rows of row {x} are neither held nor received")
        # z is now the state row of S_a (the row at position a - 1), -1 when a == 0
        if a == 0:
            init = ("zero",)
        elif z >= lo:
            init = ("local", z)
        else:
            k = state_ids.get(z)
            if k is None:
                raise bad(f"state after row {z} (position {a}) is not in the split")
            if k not in entry_slot:
                entry_slot[k] = len(entries)
                entries.append(k)
            init = ("ext", entry_slot[k])
        piece_of[x - lo : end - lo] = len(pieces)
        pieces.append(
            {"first": x, "end": end, "anchor": a, "replay": [int(emap[r]) for r in rep], "init": init}
        )
        x = end

    # states produced here: those local pieces start from, and the split's sends
    num_slots = len(entries)
    slot_of_row: dict[int, int] = {}

    def local_slot(zrow: int) -> int:
        nonlocal num_slots
        s = slot_of_row.get(zrow)
        if s is None:
            s = slot_of_row[zrow] = num_slots
            num_slots += 1
        return s

    for pc in pieces:
        if pc["init"][0] == "local":
            pc["slot"] = local_slot(pc["init"][1])
        elif pc["init"][0] == "ext":
            pc["slot"] = pc["init"][1]
        else:
            pc["slot"] = -1
    send_offsets = [int(o) for o in split.send_offsets]
    sends = [local_slot(int(split.state_row[k])) for k in range(send_offsets[rank], send_offsets[rank + 1])]

    # rounds by dependency depth
    depth = []
    for pc in pieces:
        if pc["init"][0] == "local":
            zrow = pc["init"][1]
            depth.append(depth[int(piece_of[zrow - lo])] + 1)
        else:
            depth.append(0)
    requests: dict[int, list[tuple[int, int]]] = {}  # piece -> [(chunk, slot)]
    for zrow, s in slot_of_row.items():
        j = int(piece_of[zrow - lo])
        P = int(pos[zrow]) + 1
        if P % B:
            raise bad(f"state after row {zrow} is not on the chunk grid")
        requests.setdefault(j, []).append(((P - pieces[j]["anchor"]) // B, s))
    sched = _schedule(pieces, depth, requests, lo, B, num_slots, bad)
    # the summary run: only the pieces whose states lead to a send, each cut after its last such
    # boundary (the states before a boundary do not read the rows after it)
    summary = None
    if entries and sends:
        need = set(sends)
        for j in sorted(range(len(pieces)), key=lambda j: -depth[j]):  # producers after readers
            if pieces[j]["init"][0] == "local" and any(s in need for _, s in requests.get(j, [])):
                need.add(pieces[j]["slot"])
        summary = _schedule(pieces, depth, requests, lo, B, num_slots, bad, need)

    # halo exchange
    def owner(rows):
        return np.searchsorted(np.asarray(offsets), rows, side="right") - 1

    recv_sizes = np.bincount(owner(halo), minlength=C).tolist() if len(halo) else [0] * C
    send_parts, send_sizes = [], []
    for r in range(C):
        h = _halo(split, r) if r != rank else np.zeros(0, np.int64)
        m = h[(h >= lo) & (h < hi)] - lo
        send_parts.append(m)
        send_sizes.append(len(m))
    send_index = torch.from_numpy(np.concatenate(send_parts).astype(np.int64))
    counts = np.diff(np.asarray(send_offsets))
    return LocalPlan(
        rank=rank,
        n_own=n_own,
        halo=halo,
        conv=windows,
        sched=sched,
        entries=entries,
        sends=sends,
        recv_sizes=[int(v) for v in recv_sizes],
        send_sizes=send_sizes,
        send_index=send_index,
        sources=fold_sources(split, pred),
        max_sends=int(counts.max()) if len(counts) else 0,
        send_offsets=send_offsets,
        num_pieces=len(pieces),
        conv_exact=needed,
        conv_table=ewin,
        summary=summary,
    )


def _schedule(pieces, depth, requests, lo, B, num_slots, bad, need=None) -> KDASchedule:
    """The rounds of ``pieces`` by dependency depth (each piece one sequence: its replay rows, then
    its own rows, written once). ``need`` (the summary run): only the requests whose slots are in
    ``need``, only the pieces with one, each cut after its last needed boundary, nothing written."""
    rounds, out_rows = [], []
    for d in range(max(depth) + 1 if depth else 0):
        gather, cu, init, rq_seq, rq_chunk, rq_slot, out_pos = [], [0], [], [], [], [], []
        for j in (j for j in range(len(pieces)) if depth[j] == d):
            pc = pieces[j]
            own = list(range(pc["first"] - lo, pc["end"] - lo))
            seq = pc["replay"] + own
            reqs = sorted(requests.get(j, []))
            for c, _ in reqs:
                if not 1 <= c or c * B > len(seq):
                    raise bad(f"requested boundary {c} outside piece {j}")
            if need is not None:
                reqs = [(c, s) for c, s in reqs if s in need]
                if not reqs:
                    continue
                seq = seq[: reqs[-1][0] * B]
            else:
                out_pos.extend(range(len(gather) + len(pc["replay"]), len(gather) + len(seq)))
                out_rows.append(np.asarray(own, dtype=np.int64))
            for c, s in reqs:
                rq_seq.append(len(init))
                rq_chunk.append(c)
                rq_slot.append(s)
            gather.extend(seq)
            cu.append(len(gather))
            init.append(pc["slot"])
        if not init:
            continue
        rounds.append(
            KDARound(
                gather=torch.tensor(gather, dtype=torch.int64),
                cu_seqlens=cu,
                init_slots=init,
                request_seq=rq_seq,
                request_chunk=rq_chunk,
                request_slot=rq_slot,
                final_slots=[-1] * len(init),
                out_pos=torch.tensor(out_pos, dtype=torch.int64),
            )
        )
    rows_written = np.concatenate(out_rows) if out_rows else np.zeros(0, np.int64)
    write_perm = torch.from_numpy(np.argsort(rows_written, kind="stable").astype(np.int64))
    return KDASchedule(rounds, num_slots, write_perm)


def empty_plan(cp_size: int, rank: int, width: int) -> LocalPlan:
    """The :class:`LocalPlan` of an empty microbatch (DP padding): no rows, no states; the halo
    exchange still runs (every rank of the group takes part)."""
    none = np.zeros(0, np.int64)
    sched = KDASchedule([], 0, torch.zeros(0, dtype=torch.int64))
    conv = ConvWindows.from_sequences(
        np.zeros((0, 2), np.int64), np.zeros((0, width - 1), np.int64), 0, width
    )
    z = [0] * cp_size
    return LocalPlan(
        rank,
        0,
        none,
        conv,
        sched,
        [],
        [],
        z,
        list(z),
        torch.zeros(0, dtype=torch.int64),
        [],
        0,
        [0] * (cp_size + 1),
    )


# ---------------------------------------------------------------------------------- execution
def run_local(sched: KDASchedule, q, k, v, g, beta, slots: list, *, chunk_size: int, backend: str = "auto"):
    """The local rounds over E rows (q, k [E, H, K]; v [E, H, V']; g [E, H, K] or [E, H]; beta [E, H],
    or None for the SSD core of Mamba2) from the entry states ``slots`` (``[H, K, V']`` fp32, slots
    ``0 .. len(slots) - 1``). Returns ``(o [n_own, H, V'], slots)``: the own rows' core outputs in
    row order and every slot. The round executor :func:`~harts_runtime.ops.rounds.run_rounds` with
    the KDA core (:func:`~harts_runtime.layers.kda.kda_core`) or the SSD core, its entry states the
    handed-over ones and its rows E (halo rows read only)."""
    from harts_kernels.ssd import chunk_ssd_with_states
    from harts_runtime.layers.kda import kda_core

    if beta is None:
        core, rows = chunk_ssd_with_states, (q, k, v, g)
    else:
        core, rows = kda_core, (q, k, v, g, beta)
    out = run_rounds(sched, core, rows, chunk_size=chunk_size, backend=backend, entries=slots, label="cp")
    return out.o, out.slots


def _sent(slots: list[torch.Tensor | None], sends) -> list[torch.Tensor]:
    """The states of the slots a rank sends (every one written by its run)."""
    out = [slots[s] for s in sends]
    assert all(t is not None for t in out), "a sent slot was never written"
    return cast(list[torch.Tensor], out)


def summaries(plan: LocalPlan, q, k, v, g, beta, *, chunk_size: int, backend: str = "auto"):
    """``[len(plan.sends), H, W]``: the summary of every state this rank hands on, ``S_k = A_k S_entry +
    b_k`` relative to the entry state its path started from here, flat per head: ``[A_k | b_k]``
    (``W = K K + K V``), or for the SSD core (``beta`` None: Mamba2, whose ``A_k = a_k I``) ``[a_k |
    b_k]`` (``W = 1 + K V``). One run of the summary rounds (``plan.summary``: the pieces leading to the
    sends, cut after their last needed boundary) with values ``[v | 0_K]`` from entry states
    ``[0 | I]`` (the requested states are ``[b | A]``; the SSD core one column, ``[v | 0]`` from
    ``[0 | e_0]``: its states are ``[b | a e_0]``). A rank without entry states runs its plan
    once, truly (``A = 0``), and returns that run's output too: ``(packed, o or None)``; a rank
    without sends ``(None, None)``."""
    H, K, Vd = q.shape[1], q.shape[2], v.shape[2]
    if not plan.sends:
        return None, None
    if plan.num_entries == 0:
        o, slots = run_local(plan.sched, q, k, v, g, beta, [], chunk_size=chunk_size, backend=backend)
        b = torch.stack(_sent(slots, plan.sends))
        A = b.new_zeros(len(plan.sends), H, 1 if beta is None else K * K)
        return torch.cat([A, b.flatten(2)], -1), o
    extra = 1 if beta is None else K  # SSD: A = a I, so one column from e_0 carries a
    v_wide = torch.cat([v, v.new_zeros(v.shape[0], H, extra)], -1)
    eye = torch.zeros(H, K, Vd + extra, dtype=torch.float32, device=q.device)
    if beta is None:
        eye[:, 0, Vd] = 1.0
    else:
        eye[..., Vd:] = torch.eye(K, dtype=torch.float32, device=q.device)
    sched = plan.sched if plan.summary is None else plan.summary
    _, slots = run_local(
        sched, q, k, v_wide, g, beta, [eye] * plan.num_entries, chunk_size=chunk_size, backend=backend
    )
    st = torch.stack(_sent(slots, plan.sends))  # [n, H, K, V + extra] = [b | A] (SSD: [b | a e_0])
    A = st[..., 0, Vd : Vd + 1] if beta is None else st[..., Vd:].flatten(2)  # SSD: A = a I
    return torch.cat([A, st[..., :Vd].flatten(2)], -1), None


def fold(plan: LocalPlan, gathered: torch.Tensor, K: int, V: int) -> list[torch.Tensor]:
    """The entry states ``[H, K, V]`` of this rank from every rank's gathered summaries ``[C *
    max_sends, H, W]`` (:func:`summaries`' layout; rank r's states at rows ``r * max_sends + j``),
    folded in state order."""
    scalar = gathered.shape[-1] == 1 + K * V
    states: list[torch.Tensor] = []
    rank_of = np.searchsorted(np.asarray(plan.send_offsets), np.arange(len(plan.sources)), side="right") - 1
    need = max(plan.entries) + 1 if plan.entries else 0
    for kk in range(need):
        r = int(rank_of[kk])
        row = gathered[r * plan.max_sends + kk - plan.send_offsets[r]]
        H = row.shape[0]
        a = row[:, :1] if scalar else row[:, : K * K]
        b = row[:, a.shape[1] :].reshape(H, K, V)
        src = plan.sources[kk]
        if src < 0:
            states.append(b)
        elif scalar:
            states.append(a[:, :, None] * states[src] + b)
        else:
            states.append(torch.matmul(a.reshape(H, K, K), states[src]) + b)
    return [states[kk] for kk in plan.entries]


def exchange_halo(x: torch.Tensor, plan: LocalPlan, cp_mesh) -> torch.Tensor:
    """``[n_own + halo, D]``: this rank's rows then its halo rows, fetched from the ranks holding
    them (all-to-all; backward: the reverse)."""
    send = x.index_select(0, plan.send_index)
    got = all_to_all_single_autograd(send, plan.recv_sizes, plan.send_sizes, cp_mesh.get_group())
    return torch.cat([x, got])


class _MixerConfig(Protocol):
    chunk_size: int | None
    backend: str


class LinearMixer(Protocol):
    """What state passing runs of a linear mixer (KDA, Gated DeltaNet, Mamba2): its config's chunk
    size and backend, the features of its rows (``q, k, v, g[, beta], *rest``) and its output from
    the core's and the rest."""

    config: _MixerConfig

    def _features(self, x: torch.Tensor, windows: ConvWindows) -> Any: ...

    def _output(self, o: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor: ...


class StatesMixer:
    """Installs the state-passing forward on a KDA or gated delta net layer: ``forward(x, layout)``
    takes this rank's rows ``x`` ``[n_c, D]`` (row order) and returns their mixer output. Reads
    ``layout.info["cp_rows"]`` (:class:`CpRows` with its :class:`LocalPlan`)."""

    def __init__(self, cp_mesh):
        self.mesh = cp_mesh

    def apply(self, module: nn.Module) -> nn.Module:
        module.forward = self.forward_of(module)
        # torch's stub types Module.__setattr__'s value as Tensor | Module; any attribute is allowed.
        module._harts_cp = {"mode": "states", "cp": self.mesh.size()}  # pyright: ignore[reportArgumentType]
        return module

    def forward_of(self, module: nn.Module):
        """The state-passing forward of ``module`` (not installed)."""
        from harts_runtime.layers.mamba2 import Mamba2Mixer

        mesh = self.mesh
        orig = module.forward
        ssd = isinstance(module, Mamba2Mixer)
        # A KDA, Gated DeltaNet or Mamba2 layer (CpChooser gives states mode to no other mixer);
        # nn.Module does not say so, hence the cast.
        mixer = cast(LinearMixer, module)

        def forward(x, layout=None):
            rows = layout.info.get("cp_rows") if layout is not None else None
            plan = getattr(rows, "local", None)
            if plan is None:
                raise ParallelConfigError(
                    "cp_mode",
                    "'states' needs the microbatch's CP split in layout.info['cp_rows'] "
                    "(build microbatches with make_microbatch on the parallelized model)",
                )
            assert layout is not None  # a plan came from it
            if layout.no_replay:
                raise ParallelConfigError(
                    "no_replay", "the no-replay ablation does not run under cp_mode 'states'; use 'heads'"
                )
            c = mixer.config
            B = layout.kda.chunk_size if layout.kda is not None else c.chunk_size
            assert B is not None  # the layout's, or the layer's own
            backend = c.backend
            plan = plan if plan.send_index.device == x.device else plan.to(x.device)
            xe = exchange_halo(x, plan, mesh)
            feats = mixer._features(xe, plan.conv)
            if ssd:  # Mamba2: q, k, v, g, xs, z
                (q, k, v, g), beta, rest = feats[:4], None, feats[4:]
            else:  # KDA / GDN: q, k, v, g, beta, gate
                (q, k, v, g, beta), rest = feats[:5], feats[5:]
            H, K, Vd = q.shape[1], q.shape[2], v.shape[2]
            local, o_first = summaries(plan, q, k, v, g, beta, chunk_size=B, backend=backend)
            m, C = plan.max_sends, mesh.size()
            # every rank's all-gather takes part in backward, after its later ops and before the
            # halo exchange's (autograd orders a rank's collectives by these dependencies alone)
            anchor = xe.sum() * 0
            gathered = None
            if m:
                width = K * Vd + (1 if ssd else K * K)
                if local is None:
                    local = q.new_zeros(0, H, width, dtype=torch.float32)
                pad = local.new_zeros(m - local.shape[0], H, width)
                local = torch.cat([local, pad]) + anchor.float()
                gathered = gather_rows(local, mesh, C * m)
            if o_first is not None:
                o = o_first
            else:
                entry = []
                if plan.num_entries:
                    assert gathered is not None  # entry states come from sends (m > 0)
                    entry = fold(plan, gathered, K, Vd)
                o, _ = run_local(plan.sched, q, k, v, g, beta, entry, chunk_size=B, backend=backend)
            out = mixer._output(o, *(t[: plan.n_own] for t in rest))
            if gathered is not None:
                out = out + (gathered.sum() * 0).to(out.dtype)
            return out

        return functools.update_wrapper(forward, orig)


ATTENTION = ("mla", "gqa", "gated_attention")
"""Mixer kinds that run under states mode by gathering their ancestor rows
(:mod:`harts_runtime.parallel.cp_attention`)."""


def states_forward(module: nn.Module, cp_mesh):
    """The states-mode forward of a mixer (not installed): a linear mixer's
    :class:`StatesMixer`, an attention layer's :func:`~harts_runtime.parallel.cp_attention.states_attention`
    over the microbatch's ``layout.info["cp_rows"].attention`` plan."""
    from harts_runtime.layers.attention import CompactAttentionBase
    from harts_runtime.layers.gated_attention import CompactGatedAttention
    from harts_runtime.layers.mla import CompactMLA

    if isinstance(module, (CompactMLA, CompactGatedAttention, CompactAttentionBase)):
        from harts_runtime.parallel.cp_attention import states_attention

        def forward(x, layout=None):
            assert layout is not None  # a CP mixer runs on the microbatch's layout
            plan = getattr(layout.info.get("cp_rows"), "attention", None)
            if plan is None:
                raise ParallelConfigError("cp_mode", "'states' attention needs the microbatch's split plan")
            return states_attention(module, x, plan, cp_mesh)

        return functools.update_wrapper(forward, module.forward)
    return StatesMixer(cp_mesh).forward_of(module)


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
