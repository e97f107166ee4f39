"""KDA execution plans: a call plan's rounds as device index tensors (Sections 3.3, 3.4, 4.2).

Glossary (see ``harts_planner.call_plan`` for the plan's own terms)
-------------------------------------------------------------------
* physical row: the compact row order of a microbatch shared by every layer; hidden states enter
  and leave a KDA layer as ``[C, D]`` in it.
* round: one packed ChunkLA call (:func:`harts_kernels.kda.chunk_kda_with_states`). Its packed
  input is, per sequence, the replay rows (ancestor rows ``[anchor, start)``: state updates, no
  output) followed by the sequence's own rows, gathered from the compact activations.
* state slot: a boundary state returned by one round and consumed as the initial state of
  sequences of later rounds (a slot with several consumers sums their gradients).

:class:`KDAExecutionPlan` holds two schedules over the same rows and convolution windows:

* ``replay``: the minimum-call rounds of Algorithm 1 (:meth:`KDAExecutionPlan.from_call_plan`);
* ``no_replay``: the ablation of Section 5.4 (:func:`segment_schedule`): every segment of the tree
  runs as its own sequence from its parent's final state (its chunk grid starts at the fork, so
  the chunk phase of trajectory-wise training is not restored). Exact in real arithmetic,
  different in floating point.

:meth:`KDAExecutionPlan.trivial` is the trajectory-wise baseline's plan: one packed call from zero
states. Plans are built once per microbatch on the host and shared by all KDA layers (and by
their recomputation); lists are host ints, so running a plan needs no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.contract import CallLayoutArrays, check_call_layout
from harts_runtime.layout.conv import ConvWindows

__all__ = ["KDAExecutionPlan", "KDARound", "KDASchedule", "segment_schedule"]


@dataclass
class KDARound:
    """One packed call, described on the host: lists are host ints (no device sync at run time);
    ``gather`` / ``out_pos`` build the schedule's device maps (:class:`KDASchedule`) and stay on
    the host."""

    gather: torch.Tensor  # [n] int64: physical row read by each packed row
    cu_seqlens: list[int]  # [q + 1] over the packed rows (replay included)
    init_slots: list[int]  # [q] slot each sequence starts from, -1 = zero state
    request_seq: list[int]  # [p] local sequence index of each requested boundary
    request_chunk: list[int]  # [p] boundary index on that sequence's grid
    request_slot: list[int]  # [p] slot the returned state goes to
    final_slots: list[int]  # [q] slot for the final state, -1 = not needed
    out_pos: torch.Tensor  # [m] int64: packed rows that write an output (not replay)


@dataclass
class KDASchedule:
    """Rounds plus the maps between physical rows and the packed rows of all rounds.

    The packed rows of every round, back to back, are ``P = sum(len(rd.gather))`` rows:
    ``gather`` [P] (the physical row each reads), ``bounds`` [R + 1] (host: round r owns packed
    rows ``[bounds[r], bounds[r + 1])``), ``own_pos`` [C] (the packed row whose core output is
    physical row c's: every physical row is written exactly once), ``replay_pos`` / ``replay_src``
    (the other packed rows, replay, and the physical rows they read). ``identity``: the packed rows
    are the physical rows in order (the trajectory-wise baseline): no gather at all.
    """

    rounds: list[KDARound]
    num_slots: int
    write_perm: torch.Tensor  # [C] int64 (host): physical row c is cat(round outputs)[write_perm[c]]
    # Derived from the rounds by __post_init__ unless given (``to`` gives them): never None after it.
    gather: torch.Tensor | None = None
    bounds: list[int] | None = None
    own_pos: torch.Tensor | None = None
    replay_pos: torch.Tensor | None = None
    replay_src: torch.Tensor | None = None
    identity: bool = False

    def __post_init__(self):
        if self.gather is not None:
            return
        gathers = [rd.gather.cpu() for rd in self.rounds]
        sizes = [len(g) for g in gathers]
        bounds: list[int] = (
            np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist() if sizes else [0]
        )
        self.bounds = bounds
        self.gather = torch.cat(gathers) if gathers else torch.zeros(0, dtype=torch.int64)
        out_global = (
            torch.cat([rd.out_pos.cpu() + b for rd, b in zip(self.rounds, bounds)])
            if self.rounds
            else torch.zeros(0, dtype=torch.int64)
        )
        self.own_pos = out_global.index_select(0, self.write_perm.cpu())
        is_own = torch.zeros(len(self.gather), dtype=torch.bool)
        is_own[self.own_pos] = True
        self.replay_pos = torch.nonzero(~is_own).flatten()
        self.replay_src = self.gather.index_select(0, self.replay_pos)
        n = len(self.gather)
        self.identity = (
            len(self.replay_pos) == 0
            and n == len(self.write_perm)
            and torch.equal(self.gather, torch.arange(n))
            and torch.equal(self.own_pos, torch.arange(n))
        )

    @property
    def packed_rows(self) -> int:
        """P: packed rows of all rounds (physical rows + replay rows)."""
        assert self.bounds is not None  # set by __post_init__
        return self.bounds[-1]

    def to(self, device) -> KDASchedule:
        """The device maps on ``device``; the round descriptions stay on the host."""
        assert (
            self.gather is not None
            and self.own_pos is not None
            and self.replay_pos is not None
            and self.replay_src is not None
        )  # set by __post_init__
        return KDASchedule(
            self.rounds,
            self.num_slots,
            self.write_perm,
            self.gather.to(device),
            self.bounds,
            self.own_pos.to(device),
            self.replay_pos.to(device),
            self.replay_src.to(device),
            self.identity,
        )


def _write_perm(out_rows: list[np.ndarray], num_rows: int) -> torch.Tensor:
    rows = np.concatenate(out_rows) if out_rows else np.zeros(0, np.int64)
    if len(rows) != num_rows or not np.array_equal(np.sort(rows), np.arange(num_rows)):
        raise InvalidInputError("call_plan", "the rounds must write every physical row exactly once")
    return torch.from_numpy(np.argsort(rows, kind="stable").astype(np.int64))


@dataclass
class KDAExecutionPlan:
    """Everything a KDA layer needs from one microbatch's ``CallPlan``; built once on the host
    and shared by all KDA layers (and by their recomputation)."""

    chunk_size: int
    conv_width: int
    num_rows: int
    conv: ConvWindows  # true-ancestor convolution windows (table and fla's varlen form)
    replay: KDASchedule  # the minimum-call rounds of Algorithm 1
    no_replay: KDASchedule  # the Section 5.4 ablation: one sequence per segment
    stats: dict = field(default_factory=dict)

    @property
    def num_calls(self) -> int:
        return len(self.replay.rounds)

    @property
    def conv_index(self) -> torch.Tensor:
        """[C, w] int64 window table (physical rows, -1 = zero): ``conv.index``."""
        return self.conv.index

    def to(self, device) -> KDAExecutionPlan:
        return KDAExecutionPlan(
            self.chunk_size,
            self.conv_width,
            self.num_rows,
            self.conv.to(device),
            self.replay.to(device),
            self.no_replay.to(device),
            dict(self.stats),
        )

    @classmethod
    def from_call_plan(cls, plan: CallLayoutArrays, device=None) -> KDAExecutionPlan:
        """Build from a call plan's layout (:class:`~harts_runtime.layout.contract.CallLayoutArrays`,
        e.g. a ``harts_planner.CallPlan``): its round, state-handoff and physical-layout arrays.
        O(C + L) host work plus O(K) Python per round. Raises
        :class:`~harts_runtime.errors.InvalidInputError` naming a missing layout field, or
        ``field="call_plan"`` when the rounds do not write every physical row exactly once."""
        check_call_layout(plan)
        C = int(plan.compact_tokens)
        B = int(plan.chunk_size)
        w = int(plan.conv_width)
        so = np.asarray(plan.round_sequence_offsets, dtype=np.int64)
        po = np.asarray(plan.packed_offsets, dtype=np.int64)
        ro = np.asarray(plan.sequence_request_offsets, dtype=np.int64)
        gi = np.asarray(plan.gather_index, dtype=np.int64)
        por = np.asarray(plan.packed_output_row, dtype=np.int64)
        slot_of = np.asarray(plan.sequence_state_slot, dtype=np.int64)
        rq_seq = np.asarray(plan.request_sequence, dtype=np.int64)
        rq_chunk = np.asarray(plan.request_chunk, dtype=np.int64)
        rq_slot = np.asarray(plan.request_slot, dtype=np.int64)
        cu_all = np.asarray(plan.cu_seqlens, dtype=np.int64)
        cu_off = np.asarray(plan.cu_offsets, dtype=np.int64)

        rounds, out_rows = [], []
        for r in range(int(plan.num_calls)):
            q0, q1 = int(so[r]), int(so[r + 1])
            rows = por[po[r] : po[r + 1]]
            keep = np.nonzero(rows >= 0)[0]
            p0, p1 = int(ro[q0]), int(ro[q1])
            rounds.append(
                KDARound(
                    gather=torch.from_numpy(gi[po[r] : po[r + 1]].copy()),
                    cu_seqlens=[int(x) for x in cu_all[cu_off[r] : cu_off[r + 1]]],
                    init_slots=[int(s) for s in slot_of[q0:q1]],
                    request_seq=[int(s) - q0 for s in rq_seq[p0:p1]],
                    request_chunk=[int(c) for c in rq_chunk[p0:p1]],
                    request_slot=[int(s) for s in rq_slot[p0:p1]],
                    final_slots=[-1] * (q1 - q0),
                    out_pos=torch.from_numpy(keep.astype(np.int64)),
                )
            )
            out_rows.append(rows[keep])
        replay = KDASchedule(rounds, int(plan.num_state_slots), _write_perm(out_rows, C))

        # Conv windows: each sequence convolves only its own rows, with the w - 1 true-ancestor
        # rows before its first own row as context; replay rows reuse these results.
        sp = np.asarray(plan.sequence_physical_offsets, dtype=np.int64)
        ranges = np.stack([sp[:-1], sp[1:]], 1)
        conv = ConvWindows.from_sequences(ranges, np.asarray(plan.own_conv_context), C, w)

        out = cls(
            B,
            w,
            C,
            conv,
            replay,
            segment_schedule(plan, C),
            {
                "num_calls": int(plan.num_calls),
                "replay_tokens": int(plan.replay_tokens),
                "compact_tokens": C,
                "num_sequences": int(plan.num_sequences),
                "num_state_slots": int(plan.num_state_slots),
            },
        )
        return out.to(device) if device is not None else out

    @classmethod
    def trivial(cls, offsets, chunk_size: int, conv_width: int, device=None) -> KDAExecutionPlan:
        """The trajectory-wise baseline's plan: rows are trajectories packed back to back
        (``[offsets[j], offsets[j + 1])``), one packed call from zero states, no replay, no
        handoffs, convolution windows inside each trajectory."""
        offsets = np.asarray(offsets, dtype=np.int64)
        S, n = int(offsets[-1]), len(offsets) - 1
        rows = torch.arange(S, dtype=torch.int64)
        rd = KDARound(
            gather=rows,
            cu_seqlens=offsets.tolist(),
            init_slots=[-1] * n,
            request_seq=[],
            request_chunk=[],
            request_slot=[],
            final_slots=[-1] * n,
            out_pos=rows,
        )
        sched = KDASchedule([rd], 0, rows)
        out = cls(
            chunk_size,
            conv_width,
            S,
            ConvWindows.from_offsets(offsets, conv_width),
            sched,
            sched,
            {
                "num_calls": 1,
                "replay_tokens": 0,
                "compact_tokens": S,
                "num_sequences": n,
                "num_state_slots": 0,
            },
        )
        return out.to(device) if device is not None else out


def segment_schedule(plan: CallLayoutArrays, C: int) -> KDASchedule:
    """No-replay ablation: rounds by segment depth, each segment one sequence over its own rows,
    initial state = its parent's final state (slot = parent segment id). Reads the plan's segment
    forest and ``segment_physical_begin``; O(V + C)."""
    parent = np.asarray(plan.segment_parent, dtype=np.int64)
    start = np.asarray(plan.segment_start, dtype=np.int64)
    end = np.asarray(plan.segment_end, dtype=np.int64)
    pb = np.asarray(plan.segment_physical_begin, dtype=np.int64)
    co = np.asarray(plan.segment_child_offsets, dtype=np.int64)
    V = len(parent)
    depth = np.full(V, -1, dtype=np.int64)
    order = list(np.asarray(plan.segment_roots, dtype=np.int64))
    for v in order:
        depth[v] = 0
    children = np.asarray(plan.segment_children, dtype=np.int64)
    i = 0
    while i < len(order):  # BFS
        v = order[i]
        i += 1
        for u in children[co[v] : co[v + 1]]:
            depth[u] = depth[v] + 1
            order.append(int(u))
    rounds, out_rows = [], []
    for d in range(int(depth.max()) + 1 if V else 0):
        segs = [v for v in order if depth[v] == d]
        lens = [int(end[v] - start[v]) for v in segs]
        gather = np.concatenate([np.arange(int(pb[v]), int(pb[v]) + n) for v, n in zip(segs, lens)])
        rounds.append(
            KDARound(
                gather=torch.from_numpy(gather.astype(np.int64)),
                cu_seqlens=[0] + list(np.cumsum(lens).tolist()),
                init_slots=[int(parent[v]) for v in segs],
                request_seq=[],
                request_chunk=[],
                request_slot=[],
                final_slots=[v if co[v + 1] > co[v] else -1 for v in segs],
                out_pos=torch.arange(len(gather), dtype=torch.int64),
            )
        )
        out_rows.append(gather)
    return KDASchedule(rounds, V, _write_perm(out_rows, C))
