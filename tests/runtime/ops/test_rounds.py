"""The round executor (:func:`harts_runtime.ops.rounds.run_rounds`) on random rollout forests
(hypothesis) against the trajectory-wise oracle (every trajectory one sequence of the same core),
float64, forward and backward (every input row, the entry state), with the token-by-token cores
of :mod:`harts_kernels` (KDA: per-key decay and beta; SSD: per-head decay) as its parameter:

* schedules: the minimum-call rounds (replay rows, boundary-state handoffs) and the no-replay
  rounds (final-state handoffs);
* ``entries``: every tree root starts from one entry state ``S0`` (slot 0) instead of zero, as a
  context-parallel rank's pieces start from states handed over; the oracle runs every trajectory
  from ``S0``;
* halo rows: the replay rows read copies placed after the written rows (and one row nobody
  reads), as a context-parallel rank's halo: the plain ``index_select`` gather;
* the one-line errors.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trees import forests

import harts_planner as hp
from harts_kernels.kda import naive_recurrent_kda_with_states
from harts_kernels.ssd import naive_recurrent_ssd_with_states
from harts_runtime.errors import InvalidInputError
from harts_runtime.layout import KDAExecutionPlan
from harts_runtime.layout.kda_plan import KDARound, KDASchedule
from harts_runtime.ops.rounds import run_rounds

B, H, K, V = 4, 2, 3, 2
TOL = {"o": (1e-12, 1e-10), "grad": (1e-11, 1e-9)}  # (atol, rtol), float64
CORES = {"kda": naive_recurrent_kda_with_states, "ssd": naive_recurrent_ssd_with_states}


def _core(name):
    real = CORES[name]

    def core(*rows, backend, save_intermediates, **kw):  # the naive cores take neither
        return real(*rows, **kw)

    return core


def _rows(n: int, core: str, seed: int) -> list[torch.Tensor]:
    """q, k [n, H, K] (unit norm), v [n, H, V], g (log decay; [n, H, K] KDA, [n, H] SSD), beta [n, H] (KDA)."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    q, k = (torch.nn.functional.normalize(torch.randn(n, H, K, **f64), dim=-1) for _ in range(2))
    v = torch.randn(n, H, V, **f64)
    if core == "ssd":
        return [q, k, v, -0.5 * torch.rand(n, H, **f64)]
    return [q, k, v, -0.5 * torch.rand(n, H, K, **f64), torch.rand(n, H, **f64)]


def _with_entry(sched: KDASchedule) -> KDASchedule:
    """Every sequence that started from zero (a tree root: position 0) starts from slot 0; the
    schedule's own slots move up by one."""
    rounds = [
        replace(
            rd,
            init_slots=[s + 1 if s >= 0 else 0 for s in rd.init_slots],
            request_slot=[s + 1 for s in rd.request_slot],
            final_slots=[s + 1 if s >= 0 else -1 for s in rd.final_slots],
        )
        for rd in sched.rounds
    ]
    return KDASchedule(rounds, sched.num_slots + 1, sched.write_perm)


def _with_halo(sched: KDASchedule, C: int) -> tuple[KDASchedule, torch.Tensor]:
    """The replay rows read rows ``C, C + 1, ...``; returns the schedule and the rows they copy."""
    gather = sched.gather.clone()
    gather[sched.replay_pos] = C + torch.arange(len(sched.replay_pos))
    sizes = [hi - lo for lo, hi in zip(sched.bounds[:-1], sched.bounds[1:])]
    rounds = [replace(rd, gather=part) for rd, part in zip(sched.rounds, torch.split(gather, sizes))]
    return KDASchedule(rounds, sched.num_slots, sched.write_perm), sched.replay_src


@pytest.mark.parametrize("halo", [False, True], ids=["rows", "halo"])
@pytest.mark.parametrize("entry", [False, True], ids=["zero", "entry"])
@pytest.mark.parametrize("schedule", ["replay", "no_replay"])
@pytest.mark.parametrize("core", list(CORES))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajs=forests(max_num=6, vocab=4, max_new=3 * B + 1), seed=st.integers(0, 2**16))
def test_rounds_equal_trajectory_wise(core, schedule, entry, halo, trajs, seed):
    plan = hp.plan_calls(hp.RolloutBatch.from_token_lists(trajs), chunk_size=B)
    sched = getattr(KDAExecutionPlan.from_call_plan(plan), schedule)
    C = int(plan.compact_tokens)
    s2p = torch.from_numpy(np.asarray(plan.semantic_to_physical, dtype=np.int64))
    offsets = [int(o) for o in plan.semantic_offsets]
    rows = [x.requires_grad_(True) for x in _rows(C, core, seed)]
    S0 = torch.randn(H, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    S0.requires_grad_(True)
    w = torch.randn(len(s2p), H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 2))

    run, inputs, entries = sched, rows, []
    if entry:
        run, entries = _with_entry(run), [S0]
    if halo:
        run, src = _with_halo(run, C)
        inputs = [torch.cat([x, x[src], torch.zeros_like(x[:1])]) for x in rows]  # + a row nobody reads
    o, slots = run_rounds(run, _core(core), inputs, chunk_size=B, backend="naive", entries=entries)
    assert o.shape == (C, H, V) and len(slots) == run.num_slots
    assert all(s is not None for s in slots[: len(entries)])
    wrt = rows + ([S0] if entry else [])
    got = torch.autograd.grad((o[s2p] * w).sum(), wrt)

    init = S0.expand(len(offsets) - 1, H, K, V) if entry else None
    want_o, _, _ = CORES[core](
        *(x[s2p].unsqueeze(0) for x in rows),
        initial_state=init,
        cu_seqlens=offsets,
        chunk_size=B,
        output_final_state=False,
    )
    want_o = want_o.squeeze(0)
    want = torch.autograd.grad((want_o * w).sum(), wrt)

    atol, rtol = TOL["o"]
    torch.testing.assert_close(o[s2p], want_o, atol=atol, rtol=rtol, msg=lambda m: f"o: {m}")
    names = ["dq", "dk", "dv", "dg", "dbeta"][: len(rows)] + (["dS0"] if entry else [])
    atol, rtol = TOL["grad"]
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


def _one_round(init_slots) -> KDASchedule:
    n = 2 * len(init_slots)
    rows = torch.arange(n)
    rd = KDARound(
        gather=rows,
        cu_seqlens=list(range(0, n + 1, 2)),
        init_slots=list(init_slots),
        request_seq=[],
        request_chunk=[],
        request_slot=[],
        final_slots=[-1] * len(init_slots),
        out_pos=rows,
    )
    return KDASchedule([rd], max(init_slots) + 1, rows)


def test_errors_name_the_field():
    rows = _rows(4, "ssd", 0)
    core = _core("ssd")
    with pytest.raises(InvalidInputError, match=r"layout\.kda.*slot 1 before it is produced"):
        run_rounds(_one_round([-1, 1]), core, rows, chunk_size=B)
    state = torch.zeros(H, K, V, dtype=torch.float64)
    with pytest.raises(InvalidInputError, match=r"entries.*3 entry states for a schedule of 2 slots"):
        run_rounds(_one_round([-1, 1]), core, rows, chunk_size=B, entries=[state] * 3)
    state = torch.randn(H, K, V, dtype=torch.float64)
    o, slots = run_rounds(_one_round([-1, 1]), core, rows, chunk_size=B, entries=[state, state])
    want, _, _ = CORES["ssd"](
        *(x.unsqueeze(0) for x in rows),
        initial_state=torch.stack([torch.zeros_like(state), state]),
        cu_seqlens=[0, 2, 4],
        chunk_size=B,
    )
    assert slots == [state, state] and torch.equal(o, want.squeeze(0))
