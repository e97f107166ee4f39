"""Context parallelism by state passing, the execution: a rank's local rounds (:func:`run_local`),
the summaries of the states it hands on, their fold into its entry states, the halo exchange, and
the states-mode forward of a mixer (:class:`StatesMixer`, :func:`states_forward`);
:mod:`harts_runtime.parallel.context_states` describes the scheme."""

from __future__ import annotations

import functools
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from harts_runtime.errors import ParallelConfigError
from harts_runtime.layout.conv import ConvWindows
from harts_runtime.layout.kda_plan import KDASchedule
from harts_runtime.ops.rounds import run_rounds
from harts_runtime.parallel.context_states_plan import LocalPlan
from harts_runtime.parallel.tensor import gather_rows

__all__ = ["LinearMixer", "StatesMixer", "exchange_halo", "fold", "run_local", "states_forward", "summaries"]


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
