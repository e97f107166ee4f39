"""Distributed steps (gloo, 2 or 4 processes) against one process running the same step.

Every case trains two AdamW steps of a float32 model on the same batch and step plan, in one
process (``train_step``) and under a parallel configuration (``parallelize`` + ``run_replica_step``),
and compares: the two step losses, every per-token log-prob of the first step, every gradient of
the first step (gathered full tensors: FSDP, TP and EP shards alike), the MoE expert-load counts,
and every parameter after the second step. Models: the ``debug`` hybrid (KDA + MLA + MoE with an
expert bias) and tiny Kimi-Linear and Qwen3.5-MoE checkpoints written with ``save_pretrained`` and
loaded in every process. Configurations: ``dp_shard=2``, ``tp=2`` + SP, ``ep=2``, ``dp_shard=2 x
tp=2``, ``dp_shard=4`` with ``ep=2`` (experts FSDP-sharded too), HSDP, and TP + SP + EP, several with
recomputation and kept regions.

Also: a step whose replicas have different microbatch counts (the short replica pads with an empty
microbatch, with EP's all-to-alls and FSDP's reduce-scatters still matched) neither deadlocks nor
changes the result, and bad configurations are refused with one-line errors naming the field.
"""

import numpy as np
import pytest
import torch
from spawn_cases import SharedSpawns, selected_cases

from harts_runtime.parallel import (
    ParallelConfigError,
    ParallelDims,
    replica_schedule,
    run_distributed,
    step_slots,
)

CAPACITY = 30  # the debug batch: 4 microbatches at D = 2 (2 slots each)
LR = 1e-3
EPS = 1e-6  # AdamW's eps: an element whose gradient is far below eps moves by lr * g / eps, so float32
# noise in g (1e-9 next to a 1e-2 maximum) moves it by 1e-3 lr here, not by 0.1 lr as with eps = 1e-8
TOL_LOSS = 1e-5  # relative, float32
TOL_LOGPROB = 2e-5  # absolute, float32 log-probs
TOL_GRAD = (
    1e-4  # max |parallel - single| over max |single|, per tensor (float32; TP sums heads in another order)
)
TOL_PARAM_MAX = 0.1 * LR  # per element, after two AdamW steps: Adam divides by sqrt(v), so an element
# whose gradient is near eps can move by a few percent of lr on float32 summation-order noise
TOL_PARAM_MEAN = 1e-3 * LR  # per tensor: mean |difference|, which any real error (a missed reduction,
# a wrong shard) raises to the order of lr


class UnevenPlan:
    """A step plan whose replica 0 has one microbatch more than replica 1 (the planner never makes
    one; a caller's own plan can)."""

    def __init__(self, microbatches):
        self.microbatches = microbatches
        self.dp_size = 2
        self.replica = np.array([0, 1, 0][: len(microbatches)])
        self.slot = np.array([0, 0, 1][: len(microbatches)])


def _build(name, path, dp, plan_kind="planner"):
    import harts_planner as hp
    from harts_runtime import HybridModel, StepInputs, load_pretrained, model_config
    from harts_runtime.testing import random_batch

    if name == "debug":
        torch.manual_seed(0)
        model = HybridModel(model_config("debug", moe={"use_expert_bias": True}, dtype="float32"))
    else:
        model = load_pretrained(path, dtype="float32")
    cfg = model.config
    batch = random_batch(3, num=16, vocab=cfg.vocab_size, max_new=10)
    step = StepInputs.synthetic(batch, seed=1, vocab_size=cfg.vocab_size)
    plan = hp.plan_step(batch, dp, CAPACITY, cfg.chunk_size)
    if plan_kind == "uneven":
        mbs = list(hp.plan_step(batch, 1, 36, cfg.chunk_size).microbatches)
        assert len(mbs) == 3, len(mbs)
        plan = UnevenPlan(mbs)
    return model, step, plan


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _worker(rank, world, name, path, dims_kw, keep, plan_kind):
    dims = ParallelDims(world_size=world, **dims_kw)
    mesh = dims.build_mesh()
    model, step, plan = _build(name, path, dims.dp, plan_kind)
    return train_parallel(model, step, plan, mesh, keep)


def train_parallel(model, step, plan, mesh, keep, **parallel_kw):
    """Two AdamW steps of ``model`` parallelized over ``mesh`` (recomputation with ``keep`` unless
    None; ``parallel_kw``: more options of ``parallelize``, e.g. ``cp_mode``): the losses, this
    rank's log-probs of the first step, its gradients (full tensors), the expert-load counts and the
    weights after the second step."""
    from harts_runtime import recompute_enabled, run_microbatch
    from harts_runtime.engine import microbatch_call_plan
    from harts_runtime.parallel import parallelize, run_replica_step, sync_expert_load

    parallelize(model, mesh, recompute=keep is not None, keep=tuple(keep or ()), **parallel_kw)
    assert recompute_enabled(model) == (keep is not None)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    out = {"losses": [], "logprobs": {}, "coords": mesh.coords}
    for it in range(2):
        opt.zero_grad(set_to_none=True)

        def microbatch(slot, traj, it=it):
            loss, stats = run_microbatch(
                model, step, traj, "compact", call_plan=microbatch_call_plan(model, step, traj)
            )
            if it == 0:
                for i, lp in zip(stats["target_index"].tolist(), stats["logprobs"].tolist()):
                    out["logprobs"][i] = lp
            return loss

        res = run_replica_step(plan, mesh, microbatch)
        out["losses"].append(res.loss)
        out.setdefault("padded", res.padded_slots)
        sync_expert_load(model, mesh)
        if it == 0:
            out["grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
            out["counts"] = {
                n: b.clone() for n, b in model.named_buffers() if n.endswith("tokens_per_expert")
            }
        opt.step()
        model.update_expert_bias()
    out["params"] = {n: _full(p.detach()) for n, p in model.named_parameters()}
    return out


def _reference(name, path, dp, keep, plan_kind):
    model, step, plan = _build(name, path, dp, plan_kind)
    return train_single(model, step, plan, keep)


def train_single(model, step, plan, keep):
    """:func:`train_parallel`'s two steps in one process, every microbatch of ``plan``."""
    from harts_runtime import apply_recompute, run_microbatch
    from harts_runtime.engine import microbatch_call_plan

    apply_recompute(model, keep is not None, keep=tuple(keep or ()))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    out = {"losses": [], "logprobs": {}}
    for it in range(2):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in plan.microbatches:
            traj = np.asarray(mb, dtype=np.int64)
            calls = microbatch_call_plan(model, step, traj)
            loss, stats = run_microbatch(model, step, traj, "compact", call_plan=calls)
            total += float(loss)
            if it == 0:
                out["logprobs"].update(zip(stats["target_index"].tolist(), stats["logprobs"].tolist()))
        out["losses"].append(total)
        if it == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            out["counts"] = {
                n: b.clone() for n, b in model.named_buffers() if n.endswith("tokens_per_expert")
            }
        opt.step()
        model.update_expert_bias()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _check(results, ref, tol_logprob=TOL_LOGPROB):
    for r in results:
        where = f"rank {r['coords']}"
        for got, want in zip(r["losses"], ref["losses"]):
            assert abs(got - want) <= TOL_LOSS * max(1.0, abs(want)), (where, r["losses"], ref["losses"])
        assert set(ref["logprobs"]) == set(range(len(ref["logprobs"])))
    merged = {}
    for r in results:
        merged.update(r["logprobs"])
    assert sorted(merged) == sorted(ref["logprobs"]), "the replicas together must score every target once"
    lp = np.array([merged[i] for i in sorted(merged)])
    want = np.array([ref["logprobs"][i] for i in sorted(merged)])
    np.testing.assert_allclose(lp, want, rtol=0, atol=tol_logprob)
    for r in results:
        where = f"rank {r['coords']}"
        for n, c in ref["counts"].items():
            torch.testing.assert_close(r["counts"][n], c, msg=lambda m, n=n, w=where: f"{w} {n}: {m}")
        for n, g in ref["grads"].items():
            err = float((r["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
            assert err <= TOL_GRAD, f"{where} d{n}: relative error {err:.2e} > {TOL_GRAD}"
        for n, p in ref["params"].items():
            diff = (r["params"][n] - p).abs()
            assert float(diff.max()) <= TOL_PARAM_MAX, (
                f"{where} {n} after 2 steps: max diff {float(diff.max()):.2e}"
            )
            assert float(diff.mean()) <= TOL_PARAM_MEAN, (
                f"{where} {n} after 2 steps: mean diff {float(diff.mean()):.2e}"
            )


def _tiny_checkpoint(tmp_path_factory, family):
    """A random-weight Kimi-Linear or Qwen3.5-MoE checkpoint folder (the family tests' tiny
    transformers configs at 2 layers, our ``save_pretrained``), with head and expert counts that
    ``tp=2`` and ``ep=2`` divide."""
    from hf_configs import kimi_linear_config, qwen_config

    from harts_runtime import HybridModel, save_pretrained
    from harts_runtime.models import kimi_linear, qwen3_5_moe

    layers = ["linear_attention", "full_attention"]
    if family == "kimi_linear":
        hf = kimi_linear_config(
            num_hidden_layers=2, n_group=2, topk_group=1, num_experts_per_tok=2, num_local_experts=4,
            layer_types=layers, mlp_layer_types=["dense", "sparse"],
        )  # fmt: skip
        cfg = kimi_linear.from_hf_config(hf, dtype="float32", chunk_size=8)
    else:
        cfg = qwen3_5_moe.from_hf_config(qwen_config(family, layers), dtype="float32", chunk_size=8)
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp(family)
    save_pretrained(HybridModel(cfg), path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {f: _tiny_checkpoint(tmp_path_factory, f) for f in ("kimi_linear", "qwen3_5_moe_text")}


BOTH = ("attention", "linear_attention")
CASES = {
    # name: (model, world, dims, keep (None: no recomputation), plan)
    "debug-dp_shard2": ("debug", 2, dict(dp_shard=2), None, "planner"),
    "debug-tp2-sp-kept": ("debug", 2, dict(tp=2, sequence_parallel=True), BOTH, "planner"),
    "debug-ep2-recompute": ("debug", 2, dict(dp_shard=2, ep=2), (), "planner"),
    "debug-dp_shard2-tp2": ("debug", 4, dict(dp_shard=2, tp=2), None, "planner"),
    "debug-dp_shard4-ep2": ("debug", 4, dict(dp_shard=4, ep=2), ("attention",), "planner"),
    "debug-hsdp": ("debug", 4, dict(dp_replicate=2, dp_shard=2), None, "planner"),
    "debug-tp2-sp-ep2": ("debug", 4, dict(dp_shard=2, tp=2, ep=2, sequence_parallel=True), BOTH, "planner"),
    "kimi-tp2-sp-kept": ("kimi_linear", 2, dict(tp=2, sequence_parallel=True), BOTH, "planner"),
    "kimi-dp_shard2-ep2": ("kimi_linear", 2, dict(dp_shard=2, ep=2), None, "planner"),
    "qwen35-tp2-sp": ("qwen3_5_moe_text", 2, dict(tp=2, sequence_parallel=True), None, "planner"),
    "qwen35-dp_shard2-ep2-kept": ("qwen3_5_moe_text", 2, dict(dp_shard=2, ep=2), BOTH, "planner"),
    "uneven-dp_shard2-ep2": ("debug", 2, dict(dp_shard=2, ep=2), None, "uneven"),
    "uneven-tp2-sp": ("debug", 4, dict(dp_shard=2, tp=2, sequence_parallel=True), (), "uneven"),
}


@pytest.fixture(scope="module")
def spawns(request, checkpoints):
    """The cases' ranks, one spawn per world size (``spawn_cases``)."""
    cases = {}
    for case, (name, world, dims_kw, keep, plan_kind) in CASES.items():
        cases[case] = (world, _worker, (name, checkpoints.get(name), dims_kw, keep, plan_kind))
    return SharedSpawns(cases, selected_cases(request, "test_parallel_step_matches_single_process"))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_parallel_step_matches_single_process(case, checkpoints, spawns):
    name, world, dims_kw, keep, plan_kind = CASES[case]
    path = checkpoints.get(name)
    results = spawns.results(case)
    dims = ParallelDims(world_size=world, **dims_kw)
    if plan_kind == "uneven":  # replica 1 ran an empty microbatch in its second slot
        assert sorted(r["padded"] for r in results) == sorted(
            int(r["coords"]["replica"] == 1) for r in results
        )
    _check(results, _reference(name, path, dims.dp, keep, plan_kind))


def test_parallel_dims_validation_names_the_field():
    cases = [
        (dict(dp_shard=2, world_size=4), "world_size"),
        (dict(dp_shard=2, ep=4, world_size=2), "ep"),
        (dict(dp_shard=3, ep=2, world_size=3), "ep"),
        (dict(pp=2, world_size=2), "pp"),
        (dict(tp=0), "tp"),
        (dict(dp_shard=1.5), "dp_shard"),
        (dict(sequence_parallel=True), "sequence_parallel"),
    ]
    for kw, field in cases:
        with pytest.raises(ParallelConfigError) as e:
            ParallelDims(**kw)
        assert e.value.field == field and field in str(e.value) and "\n" not in str(e.value)
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, ep=2, world_size=8)
    assert dims.coords(5) == {"dp_replicate": 1, "dp_shard": 0, "tp": 1, "efsdp": 0, "ep": 0, "replica": 2}
    assert dims.coords(3) == {"dp_replicate": 0, "dp_shard": 1, "tp": 1, "efsdp": 0, "ep": 1, "replica": 1}
    assert ParallelDims.from_world(8, tp=2).dp_shard == 4
    with pytest.raises(ParallelConfigError) as e:
        ParallelDims.from_world(6, tp=4)
    assert e.value.field == "world_size"


def test_replica_schedule_pads_short_replicas():
    _, _, plan = _build("debug", None, 2)
    seen = []
    for d in range(2):
        sched = replica_schedule(plan, d)
        assert len(sched) == plan.num_slots
        for j, members in enumerate(sched):
            np.testing.assert_array_equal(members, plan.microbatch_at(d, j))
            seen.extend(members.tolist())
    assert sorted(seen) == list(range(plan.batch.num_trajectories))
    assert step_slots(plan) == plan.num_slots
    _, _, uneven = _build("debug", None, 2, "uneven")
    assert [len(replica_schedule(uneven, d)) for d in range(2)] == [2, 1] and step_slots(uneven) == 2
    with pytest.raises(ParallelConfigError) as e:
        replica_schedule(plan, 2)
    assert e.value.field == "replica"


def _bad_config_worker(rank, world, case):
    from harts_runtime import HybridModel, model_config
    from harts_runtime.parallel import parallelize

    errors = {}
    try:
        ParallelDims(dp_shard=4, world_size=4).build_mesh()
    except ParallelConfigError as e:
        errors["world"] = (e.field, str(e))
    cfgs = {
        "heads": dict(num_heads=3, kda={"num_heads": 3}),  # tp=2 does not divide 3 heads
        "experts": dict(moe={"num_experts": 3, "top_k": 1}),  # ep=2 does not divide 3 experts
    }
    dims = {"heads": dict(tp=2), "experts": dict(dp_shard=2, ep=2)}
    for name in ("heads", "experts"):
        model = HybridModel(model_config("debug", **cfgs[name]))
        try:
            parallelize(model, ParallelDims(world_size=world, **dims[name]).build_mesh())
        except ParallelConfigError as e:
            errors[name] = (e.field, str(e))
    return errors


def test_bad_configurations_give_one_line_errors():
    (errors, _) = run_distributed(_bad_config_worker, 2, None, timeout=120)
    assert errors["world"][0] == "world_size"
    assert errors["heads"][0] == "num_heads" and "tp=2" in errors["heads"][1]
    assert errors["experts"][0] == "num_experts" and "ep=2" in errors["experts"][1]
    assert all("\n" not in msg for _, msg in errors.values())
