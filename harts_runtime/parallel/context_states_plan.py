"""Context parallelism by state passing, the plan side: each CP rank's rows of a microbatch's split
(:class:`CpRows`) and the local call plan its linear mixers run (:class:`LocalPlan`, built by
:func:`local_plan`); :mod:`harts_runtime.parallel.context_states` describes the scheme."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harts_runtime.errors import ParallelConfigError
from harts_runtime.layout.conv import ConvWindows
from harts_runtime.layout.kda_plan import KDARound, KDASchedule
from harts_runtime.parallel.tensor import row_block

__all__ = ["CpRows", "LocalPlan", "cp_rows_plan", "empty_plan", "fold_sources", "local_plan"]


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
