"""KDA layer on compact rows, executed over a minimum-call plan (Sections 3.3, 3.4, 4.2, 4.3).

Glossary (see ``harts_planner.call_plan`` for the plan's own terms)
-------------------------------------------------------------------
* physical row: the compact row order of a microbatch shared by every layer
  (``CallPlan.physical_to_row``); hidden states enter and leave this layer as ``[C, D]`` in it.
* round: one packed ChunkLA call (:func:`harts_kernels.kda.chunk_kda_with_states`). Its packed
  input is, per sequence, the replay rows (ancestor rows ``[anchor, start)``: state updates, no
  output) followed by the sequence's own rows, gathered from the compact activations.
* state slot: a boundary state returned by one round and consumed as the initial state of
  sequences of later rounds (a slot with several consumers sums their gradients).

What runs where
---------------
* once per compact row: q/k/v/gate/beta projections, the causal short convolution (width ``w``,
  window built from the row's true ancestors through ``conv_index``, :mod:`harts_runtime._conv`),
  the L2 norm of q and k, the gated output norm and the output projection;
* once per round: one packed KDA call over the round's sequences, replay rows gathered from the
  already computed activations, initial states from earlier rounds' returned boundary states,
  requested states returned in fp32 (differentiable);
* every non-replay core output is written to its physical row exactly once.

``recompute=True`` wraps the layer in ``torch.utils.checkpoint``: backward re-executes the same
rounds from the fixed plan; no activation or state outlives the layer call.

``no_replay=True`` is the ablation of Section 5.4: every segment of the tree runs as its own
sequence from its parent's final state (its chunk grid starts at the fork, so the chunk phase of
trajectory-wise training is not restored). Exact in real arithmetic, different in floating point.

:meth:`KDALayer.forward_trajectories` is the slow reference: every trajectory through the same
layer, unshared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from harts_kernels.kda import chunk_kda_with_states
from harts_runtime._conv import causal_conv, sequence_conv_index, trajectory_conv_index

__all__ = ["KDAConfig", "KDAExecutionPlan", "KDALayer", "KDARound"]


# ---------------------------------------------------------------------------------- plans
@dataclass
class KDARound:
    """One packed call. Lists are host ints (no device sync at run time)."""

    gather: torch.Tensor  # [n] int64: physical row read by each packed row
    cu_seqlens: list[int]  # [q + 1] over the packed rows (replay included)
    init_slots: list[int]  # [q] slot each sequence starts from, -1 = zero state
    request_seq: list[int]  # [p] local sequence index of each requested boundary
    request_chunk: list[int]  # [p] boundary index on that sequence's grid
    request_slot: list[int]  # [p] slot the returned state goes to
    final_slots: list[int]  # [q] slot for the final state, -1 = not needed
    out_pos: torch.Tensor  # [m] int64: packed rows that write an output (not replay)

    def to(self, device) -> KDARound:
        return KDARound(
            self.gather.to(device),
            self.cu_seqlens,
            self.init_slots,
            self.request_seq,
            self.request_chunk,
            self.request_slot,
            self.final_slots,
            self.out_pos.to(device),
        )


@dataclass
class KDASchedule:
    """Rounds plus the permutation that puts their outputs in physical order."""

    rounds: list[KDARound]
    num_slots: int
    write_perm: torch.Tensor  # [C] int64: physical row c is cat(round outputs)[write_perm[c]]

    def to(self, device) -> KDASchedule:
        return KDASchedule([r.to(device) for r in self.rounds], self.num_slots, self.write_perm.to(device))


def _write_perm(out_rows: list[np.ndarray], num_rows: int) -> torch.Tensor:
    rows = np.concatenate(out_rows) if out_rows else np.zeros(0, np.int64)
    if len(rows) != num_rows or not np.array_equal(np.sort(rows), np.arange(num_rows)):
        raise ValueError("plan: the rounds must write every physical row exactly once")
    return torch.from_numpy(np.argsort(rows, kind="stable").astype(np.int64))


@dataclass
class KDAExecutionPlan:
    """Everything a KDA layer needs from one microbatch's ``CallPlan``; built once on the host
    and shared by all KDA layers (and by their recomputation)."""

    chunk_size: int
    conv_width: int
    num_rows: int
    conv_index: torch.Tensor  # [C, w] int64 true-ancestor windows (physical rows, -1 = zero)
    replay: KDASchedule  # the minimum-call rounds of Algorithm 1
    no_replay: KDASchedule  # the Section 5.4 ablation: one sequence per segment
    stats: dict = field(default_factory=dict)

    @property
    def num_calls(self) -> int:
        return len(self.replay.rounds)

    def to(self, device) -> KDAExecutionPlan:
        return KDAExecutionPlan(
            self.chunk_size,
            self.conv_width,
            self.num_rows,
            self.conv_index.to(device),
            self.replay.to(device),
            self.no_replay.to(device),
            dict(self.stats),
        )

    @classmethod
    def from_call_plan(cls, plan, device=None) -> KDAExecutionPlan:
        """Build from a ``harts_planner.CallPlan`` (its physical layout and round arrays)."""
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

        rounds, out_rows = [], []
        for r in range(int(plan.num_calls)):
            q0, q1 = int(so[r]), int(so[r + 1])
            rows = por[po[r] : po[r + 1]]
            keep = np.nonzero(rows >= 0)[0]
            p0, p1 = int(ro[q0]), int(ro[q1])
            rounds.append(
                KDARound(
                    gather=torch.from_numpy(gi[po[r] : po[r + 1]].copy()),
                    cu_seqlens=[int(x) for x in plan.round_cu_seqlens(r)],
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
        conv_index = torch.from_numpy(sequence_conv_index(ranges, np.asarray(plan.own_conv_context), C))

        out = cls(
            B,
            w,
            C,
            conv_index,
            replay,
            _segment_schedule(plan, C),
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
        conv_index = torch.from_numpy(trajectory_conv_index(offsets, conv_width))
        out = cls(
            chunk_size,
            conv_width,
            S,
            conv_index,
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


def _segment_schedule(plan, C: int) -> KDASchedule:
    """No-replay ablation: rounds by segment depth, each segment one sequence over its own rows,
    initial state = its parent's final state (slot = parent segment id)."""
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
        gather = np.concatenate([np.arange(pb[v], pb[v] + n) for v, n in zip(segs, lens)])
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


# ---------------------------------------------------------------------------------- layer
@dataclass
class KDAConfig:
    """Shape and execution options of a :class:`KDALayer`."""

    hidden_size: int = 64
    """D, model width."""
    num_heads: int = 2
    """H (query/key heads = value heads)."""
    head_k_dim: int = 16
    """K, key/query head dim (the state is K x V per head)."""
    head_v_dim: int = 16
    """V, value head dim."""
    conv_size: int = 4
    """w, width of the causal short convolution on q, k and v (SiLU, no bias)."""
    chunk_size: int = 64
    """B, the chunk size of the KDA core; must match the plan's."""
    norm_eps: float = 1e-5
    """epsilon of the gated RMS norm on the core output."""
    recompute: bool = False
    """default for ``forward(recompute=...)``: full-layer activation recomputation."""
    no_replay: bool = False
    """default for ``forward(no_replay=...)``: the Section 5.4 ablation."""
    backend: str = "auto"
    """KDA core backend: "auto" (Triton on CUDA, reference on CPU), "triton" or "naive"."""


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x.float() * x.float()).sum(-1, keepdim=True) + eps).to(x.dtype)


class KDALayer(nn.Module):
    """Kimi Delta Attention (fla's ``KimiDeltaAttention`` structure, H == HV) on compact rows."""

    def __init__(self, config: KDAConfig):
        super().__init__()
        c = self.config = config
        D, H, K, Vd, w = c.hidden_size, c.num_heads, c.head_k_dim, c.head_v_dim, c.conv_size
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * Vd, bias=False)
        self.q_conv = nn.Parameter(torch.randn(H * K, w) / math.sqrt(w))  # depthwise [channels, w]
        self.k_conv = nn.Parameter(torch.randn(H * K, w) / math.sqrt(w))
        self.v_conv = nn.Parameter(torch.randn(H * Vd, w) / math.sqrt(w))
        self.f_proj = nn.Sequential(nn.Linear(D, Vd, bias=False), nn.Linear(Vd, H * K, bias=False))
        self.b_proj = nn.Linear(D, H, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16)))
        dt = torch.exp(torch.rand(H * K) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(
            min=1e-4
        )
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.g_proj = nn.Sequential(nn.Linear(D, Vd, bias=False), nn.Linear(Vd, H * Vd, bias=True))
        self.o_norm_weight = nn.Parameter(torch.ones(Vd))
        self.o_proj = nn.Linear(H * Vd, D, bias=False)

    # ---------------------------------------------------------------- token-wise parts
    def _features(self, x: torch.Tensor, conv_index: torch.Tensor):
        """Per-row KDA inputs. x: [R, D] -> q, k [R, H, K]; v [R, H, V]; g [R, H, K] (fp32 log
        decay); beta [R, H]; out_gate [R, H, V]."""
        c = self.config
        R, H, K, Vd = x.shape[0], c.num_heads, c.head_k_dim, c.head_v_dim
        q = _l2norm(causal_conv(self.q_proj(x), self.q_conv, conv_index).view(R, H, K))
        k = _l2norm(causal_conv(self.k_proj(x), self.k_conv, conv_index).view(R, H, K))
        v = causal_conv(self.v_proj(x), self.v_conv, conv_index).view(R, H, Vd)
        f = self.f_proj(x).view(R, H, K).float() + self.dt_bias.view(H, K).float()
        g = -self.A_log.float().exp().view(H, 1) * F.softplus(f)  # <= 0
        beta = torch.sigmoid(self.b_proj(x).float()).to(x.dtype)
        out_gate = self.g_proj(x).view(R, H, Vd)
        return q, k, v, g, beta, out_gate

    def _output(self, o: torch.Tensor, out_gate: torch.Tensor) -> torch.Tensor:
        """Gated RMS norm per head, then the output projection. o: [R, H, V] -> [R, D]."""
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.config.norm_eps)
        y = (of * self.o_norm_weight.float() * torch.sigmoid(out_gate.float())).to(o.dtype)
        return self.o_proj(y.reshape(o.shape[0], -1))

    # ---------------------------------------------------------------- rounds
    def _run_schedule(self, sched: KDASchedule, q, k, v, g, beta) -> torch.Tensor:
        """Execute the rounds; returns the core output [C, H, V] in physical order."""
        c = self.config
        H, K, Vd = c.num_heads, c.head_k_dim, c.head_v_dim
        slots: list[torch.Tensor | None] = [None] * sched.num_slots  # live for this call only
        zero = None
        outs = []
        for rd in sched.rounds:
            with record_function("harts.kda.gather"):
                packed = [x.index_select(0, rd.gather).unsqueeze(0) for x in (q, k, v, g, beta)]
            init = None
            if any(s >= 0 for s in rd.init_slots):
                if zero is None:
                    zero = q.new_zeros(H, K, Vd, dtype=torch.float32)
                missing = [s for s in rd.init_slots if s >= 0 and slots[s] is None]
                if missing:
                    raise RuntimeError(f"plan: round reads state slot {missing[0]} before it is produced")
                with record_function("harts.kda.states"):
                    init = torch.stack([slots[s] if s >= 0 else zero for s in rd.init_slots])
            want_final = any(s >= 0 for s in rd.final_slots)
            with record_function("harts.kda.core"):
                o, final, bstates = chunk_kda_with_states(
                    *packed,
                    initial_state=init,
                    cu_seqlens=rd.cu_seqlens,
                    chunk_size=c.chunk_size,
                    request_seq=rd.request_seq,
                    request_chunk=rd.request_chunk,
                    output_final_state=want_final,
                    backend=c.backend,
                )
            for j, s in enumerate(rd.request_slot):
                slots[s] = bstates[j]
            for j, s in enumerate(rd.final_slots):
                if s >= 0:
                    slots[s] = final[j]
            o = o[0]
            outs.append(o if rd.out_pos.numel() == o.shape[0] else o.index_select(0, rd.out_pos))
        return torch.cat(outs).index_select(0, sched.write_perm)

    def _forward_impl(self, x: torch.Tensor, plan: KDAExecutionPlan, no_replay: bool) -> torch.Tensor:
        q, k, v, g, beta, out_gate = self._features(x, plan.conv_index)
        sched = plan.no_replay if no_replay else plan.replay
        o = self._run_schedule(sched, q, k, v, g, beta)
        return self._output(o, out_gate)

    def forward(
        self,
        x: torch.Tensor,
        plan: KDAExecutionPlan,
        *,
        no_replay: bool | None = None,
        recompute: bool | None = None,
    ) -> torch.Tensor:
        """x: [C, D] compact hidden states in physical order -> [C, D] layer output."""
        if plan.chunk_size != self.config.chunk_size:
            raise ValueError(
                f"plan: chunk_size {plan.chunk_size} != layer chunk_size {self.config.chunk_size}"
            )
        if plan.conv_width != self.config.conv_size:
            raise ValueError(f"plan: conv_width {plan.conv_width} != layer conv_size {self.config.conv_size}")
        if x.shape[0] != plan.num_rows:
            raise ValueError(f"x: expected {plan.num_rows} compact rows, got {x.shape[0]}")
        no_replay = self.config.no_replay if no_replay is None else no_replay
        recompute = self.config.recompute if recompute is None else recompute
        if recompute and torch.is_grad_enabled():
            return checkpoint(self._forward_impl, x, plan, no_replay, use_reentrant=False)
        return self._forward_impl(x, plan, no_replay)

    def forward_trajectories(self, x: torch.Tensor, offsets) -> torch.Tensor:
        """Reference: every trajectory unshared. x: [S, D] semantic rows, trajectories at
        ``[offsets[j], offsets[j+1])`` -> [S, D]. One packed call from zero states."""
        offsets = np.asarray(offsets, dtype=np.int64)
        conv_index = torch.from_numpy(trajectory_conv_index(offsets, self.config.conv_size)).to(x.device)
        q, k, v, g, beta, out_gate = self._features(x, conv_index)
        o, _, _ = chunk_kda_with_states(
            *(t.unsqueeze(0) for t in (q, k, v, g, beta)),
            cu_seqlens=offsets.tolist(),
            chunk_size=self.config.chunk_size,
            output_final_state=False,
            backend=self.config.backend,
        )
        return self._output(o[0], out_gate)
