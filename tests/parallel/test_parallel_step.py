"""2-process gloo runs of the ``debug`` model vs the single-process step on the same batch and plan.

* DP2: each rank runs its replica's microbatches slot by slot (``run_replica_step``), gradients
  summed over DP; the loss and every gradient equal ``train_step`` on one process with the same step
  plan (same microbatches, so even the per-microbatch load-balancing loss is identical).
* DP2 + EP2: MoE experts sharded over the two replicas (all-to-all dispatch).
* TP2: one replica, mixers and dense FFNs sharded over two ranks, embedding and LM head sharded over
  the vocabulary (masked lookup + all-reduce; fused chunked log-probs reducing per-row max / sum-exp
  and one target logit per position).
* DP2 x TP2 + SP x EP2 on 4 processes.
* TP2 + SP: as TP2 with the compact rows split over the two ranks between TP regions (embedding
  reduce-scatter, LM-head all-gather, MoE multiplicity slice and TP-summed router statistics).

Shards are compared with the matching slice of the reference gradient (vocabulary shards by their
recorded ``_harts_vocab_range``); replicated parameters must have the reference gradient on every rank.
"""

import numpy as np
import pytest
import torch

from harts_runtime.parallel import ParallelConfigError, ParallelDims, replica_schedule
from harts_runtime.parallel.launch import run_distributed

CAPACITY = 30  # 4 microbatches for D = 2 (2 slots), 2-3 for D = 1


def _setup(dp):
    import harts_planner as hp
    from harts_runtime import HybridModel, StepInputs, model_config
    from harts_runtime.testing import random_batch

    cfg = model_config("debug", use_expert_bias=True)
    torch.manual_seed(0)
    model = HybridModel(cfg)
    batch = random_batch(3, num=16, vocab=cfg.vocab_size, max_new=10)
    step = StepInputs.synthetic(batch, seed=1, vocab_size=cfg.vocab_size)
    plan = hp.plan_step(batch, dp, CAPACITY, cfg.chunk_size)
    return model, step, plan


def _parallel_worker(rank, world, dims_kw, recompute):
    from harts_runtime import run_microbatch
    from harts_runtime.parallel import parallelize, run_replica_step, sync_expert_load

    dims = ParallelDims(world_size=world, **dims_kw)
    groups = dims.build_groups()
    model, step, plan = _setup(dims.dp)
    parallelize(model, dims, groups, recompute=recompute)
    model.train()

    def microbatch(slot, traj):
        loss, _ = run_microbatch(model, step, traj, "compact")
        return loss

    res = run_replica_step(
        plan, groups.dp_rank, microbatch, params=model.parameters(), groups=groups, backward=False
    )
    sync_expert_load([b.ffn for b in model.blocks], groups)
    return {
        "loss": res.loss,
        "slots": len(res.slot_seconds),
        "coords": groups.coords,
        "grads": {_name(n): p.grad.clone() for n, p in model.named_parameters()},
        "expert": {_name(n): getattr(p, "_harts_expert", False) for n, p in model.named_parameters()},
        "vocab": {
            _name(n): p._harts_vocab_range
            for n, p in model.named_parameters()
            if hasattr(p, "_harts_vocab_range")
        },
        "counts": {
            f"blocks.{i}": b.ffn.local_tokens_per_expert.clone()
            for i, b in enumerate(model.blocks)
            if b.ffn_kind == "moe"
        },
    }


def _name(n: str) -> str:
    """A parameter name as without recomputation's ``.block.`` wrapper."""
    return n.replace(".block.", ".")


def _reference(dp, recompute):
    from harts_runtime import apply_recompute, train_step

    model, step, plan = _setup(dp)
    model.train()
    res = train_step(apply_recompute(model, recompute), None, step, step_plan=plan)
    return {
        "loss": res.loss,
        "num_microbatches": res.num_microbatches,
        "grads": {_name(n): p.grad for n, p in model.named_parameters()},
        "counts": {
            f"blocks.{i}": b.ffn.local_tokens_per_expert.clone()
            for i, b in enumerate(model.blocks)
            if b.ffn_kind == "moe"
        },
    }


def _check(results, ref, dims):
    tol = dict(rtol=2e-4, atol=2e-6)
    for r in results:
        assert abs(r["loss"] - ref["loss"]) <= 1e-5 * max(1.0, abs(ref["loss"])), (r["loss"], ref["loss"])
        assert r["slots"] * dims.dp == ref["num_microbatches"]
        for name, want in ref["counts"].items():
            torch.testing.assert_close(r["counts"][name], want, msg=lambda m, n=name: f"{n} expert load: {m}")
        if dims.tp > 1:
            assert set(r["vocab"]) == {"embed.weight", "lm_head.weight"}, r["vocab"]
        for name, want in ref["grads"].items():
            got = r["grads"][name]
            if name in r["vocab"]:  # a vocabulary shard (embedding / LM head rows)
                a, b = r["vocab"][name]
                assert got.shape[0] == b - a < want.shape[0], (name, got.shape, (a, b))
                want = want[a:b]
            elif got.shape != want.shape:  # a TP or EP shard: compare with its slice
                dim = next(i for i in range(got.dim()) if got.shape[i] != want.shape[i])
                idx = r["coords"]["ep"] if r["expert"][name] else r["coords"]["tp"]
                want = want.narrow(dim, idx * got.shape[dim], got.shape[dim])
            torch.testing.assert_close(
                got, want, **tol, msg=lambda m, n=name, c=r["coords"]: f"rank {c} d{n}: {m}"
            )


CONFIGS = {
    "dp2": (dict(dp=2), False),
    "dp2-recompute": (dict(dp=2), True),
    "dp2-ep2": (dict(dp=2, ep=2), False),
    "tp2": (dict(tp=2), False),
    "tp2-sp": (dict(tp=2, sequence_parallel=True), False),
    "tp2-sp-recompute": (dict(tp=2, sequence_parallel=True), True),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_process_step_matches_single_process(name):
    dims_kw, recompute = CONFIGS[name]
    results = run_distributed(_parallel_worker, 2, dims_kw, recompute, timeout=120)
    dims = ParallelDims(world_size=2, **dims_kw)
    _check(results, _reference(dims.dp, recompute), dims)


@pytest.mark.slow
def test_four_process_dp2_tp2_sp_ep2_matches_single_process():
    """All of it at once (4 gloo processes, ~8 s): two replicas, each TP2 with sequence parallelism,
    experts sharded over the replicas. Checks that EP keeps what SP set on the MoE (the row shard and
    the TP-partial tags of router and experts), and the TP -> DP / expert-DP gradient sums."""
    dims_kw = dict(dp=2, tp=2, ep=2, sequence_parallel=True)
    results = run_distributed(_parallel_worker, 4, dims_kw, False, timeout=180)
    dims = ParallelDims(world_size=4, **dims_kw)
    assert sorted((r["coords"]["dp"], r["coords"]["tp"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _check(results, _reference(dims.dp, False), dims)


def test_parallel_dims_validation_names_the_field():
    cases = [
        (dict(dp=2, world_size=4), "world_size"),
        (dict(dp=2, ep=4, world_size=2), "ep"),
        (dict(pp=2, world_size=2), "pp"),
        (dict(tp=0), "tp"),
        (dict(dp=1.5), "dp"),
        (dict(sequence_parallel=True), "sequence_parallel"),
    ]
    for kw, field in cases:
        with pytest.raises(ParallelConfigError) as e:
            ParallelDims(**kw)
        assert e.value.field == field and field in str(e.value)
    dims = ParallelDims(dp=2, tp=2, ep=2, world_size=4)
    assert dims.coords(3) == {"pp": 0, "dp": 1, "tp": 1, "ep": 1}
    g = dims.group_ranks()
    assert g["tp"] == [[0, 1], [2, 3]] and g["dp"] == [[0, 2], [1, 3]] and g["ep"] == [[0, 2], [1, 3]]
    assert g["edp"] == [[0], [2], [1], [3]]


def test_replica_schedule_is_slot_ordered_and_covers_the_step():
    _, _, plan = _setup(2)
    seen = []
    for d in range(2):
        sched = replica_schedule(plan, d)
        assert len(sched) == plan.num_slots
        for j, members in enumerate(sched):
            np.testing.assert_array_equal(members, plan.microbatch_at(d, j))
            seen.extend(members.tolist())
    assert sorted(seen) == list(range(plan.batch.num_trajectories))
    with pytest.raises(ParallelConfigError) as e:
        replica_schedule(plan, 2)
    assert e.value.field == "replica"


def test_apply_recompute_keeps_loss_and_gradients():
    from harts_runtime import recompute_enabled, train_step
    from harts_runtime.parallel import apply_recompute

    grads, losses = [], []
    for wrap in (False, True):
        model, step, plan = _setup(1)
        if wrap:
            apply_recompute(model)
            assert all(type(b).__name__ == "_Checkpointed" for b in model.blocks) and recompute_enabled(model)
        losses.append(train_step(model.train(), None, step, step_plan=plan).loss)
        grads.append({_name(n): p.grad for n, p in model.named_parameters()})
    apply_recompute(model, False)  # off again: the plain blocks, the plain names
    assert not recompute_enabled(model) and all(type(b).__name__ == "Block" for b in model.blocks)
    assert {n for n, _ in model.named_parameters()} == set(grads[0])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(
            grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"d{n}: {m}"
        )


def test_sequence_parallel_needs_an_embedding_and_lm_head():
    from torch import nn

    from harts_runtime.parallel import ParallelGroups, apply_tp

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer, self.ffn = nn.Identity(), nn.Identity()

    model = nn.Sequential(Block())
    dims = ParallelDims(tp=2, world_size=2, sequence_parallel=True)
    with pytest.raises(ParallelConfigError) as e:
        apply_tp(model, ParallelGroups(dims, 0, dp=None, tp=None, ep=None, edp=None))
    assert e.value.field == "sequence_parallel" and "embed" in str(e.value)
