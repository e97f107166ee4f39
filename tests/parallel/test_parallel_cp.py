"""Context parallelism (gloo, 2 or 4 processes) against one process holding the whole microbatch.

Trees whose trajectories are longer than the per-rank capacity T fork on both sides of the CP
ranks' row blocks; the step plan packs microbatches of up to ``C x T`` rows
(``plan_step(..., cp_size=C)``), and one process runs the same plan (capacity ``C x T``). Compared
as in ``test_parallel_step``: both step losses, every log-prob, every gradient (full tensors), the
MoE expert-load counts and every weight after two AdamW steps. Models: the ``debug`` hybrid (KDA +
MLA + GQA + MoE; at 4 heads so that ``cp = 4`` splits them) and tiny Kimi-Linear and Qwen3.5-MoE
checkpoints. Configurations: ``cp = 2``, ``cp = 4``, ``cp = 2`` with ``dp_shard = 2``, with
``tp = 2`` (with and without SP), with ``ep = 2`` and with ``dp_replicate = 2`` (HSDP).
"""

import numpy as np
import pytest
import torch
from spawn_cases import SharedSpawns, selected_cases
from test_parallel_step import _check, _full, _tiny_checkpoint, train_parallel, train_single

from harts_runtime.parallel import ParallelConfigError, ParallelDims

T = {2: 32, 4: 16, 8: 8}  # per-rank capacity at C = 2 / 4 / 8: microbatches of up to 64 rows each way
TOL_LOGPROB_CP = 5e-5  # absolute, float32 log-probs (test_parallel_step's 2e-5 elsewhere): measured
# 2.8e-5 for the 4-head Qwen3.5 at cp = 4 (four partial outputs summed per row in another order,
# through 2 layers of init range 0.2); in float64 the same run differs by 4e-7 (the KDA / GDN
# states and gates stay float32 there), so it is summation order, not math


def _batch(vocab: int):
    from harts_runtime.testing import synthetic_tree_batch

    # a 20-token prompt, 3 turns of 6-12 tokens forking in two: trajectories of 38 to 56 tokens (> T)
    return synthetic_tree_batch(5, prompt=20, turns=3, turn_len=(6, 12), fork_prob=0.7, fanout=2, vocab=vocab)


def _build(name, path, dp, cp):
    import harts_planner as hp
    from harts_runtime import HybridModel, StepInputs, load_pretrained, model_config

    if name == "debug":
        torch.manual_seed(0)
        cfg = model_config("debug", num_heads=4, moe={"use_expert_bias": True}, dtype="float32")
        model = HybridModel(cfg)
    else:
        model = load_pretrained(path, dtype="float32")
    cfg = model.config
    batch = _batch(cfg.vocab_size)
    lengths = np.asarray(batch.lengths)
    assert lengths.max() > T[cp] and lengths.max() <= cp * T[cp], lengths
    step = StepInputs.synthetic(batch, seed=1, vocab_size=cfg.vocab_size)
    plan = hp.plan_step(batch, dp, T[cp], cfg.chunk_size, cp_size=cp)
    assert plan.cp_size == cp and plan.microbatch_capacity == cp * T[cp]
    return model, step, plan


def _worker(rank, world, name, path, dims_kw, keep):
    dims = ParallelDims(world_size=world, **dims_kw)
    mesh = dims.build_mesh()
    model, step, plan = _build(name, path, dims.dp, dims.cp)
    return train_parallel(model, step, plan, mesh, keep, cp_mode="heads")  # states: test_parallel_cp_states


def _reference(name, path, dp, cp, keep):
    return train_single(*_build(name, path, dp, cp), keep)


def _four_head_checkpoint(tmp_path_factory, family):
    """The tiny checkpoints at 4 heads per mixer (``cp = 4`` splits them one head per rank; the
    Qwen3.5 gated attention keeps 2 KV heads: two ranks read each)."""
    from hf_configs import kimi_linear_config, qwen_config

    from harts_runtime import HybridModel, save_pretrained
    from harts_runtime.models import kimi_linear, qwen3_5_moe

    layers = ["linear_attention", "full_attention"]
    if family == "kimi_linear":
        hf = kimi_linear_config(
            num_hidden_layers=2, n_group=2, topk_group=1, num_experts_per_tok=2, num_local_experts=4,
            layer_types=layers, mlp_layer_types=["dense", "sparse"], num_attention_heads=4,
            num_key_value_heads=4, linear_num_heads=4,
        )  # fmt: skip
        cfg = kimi_linear.from_hf_config(hf, dtype="float32", chunk_size=8)
    else:
        hf = qwen_config(family, layers, linear_num_key_heads=4, linear_num_value_heads=8)
        cfg = qwen3_5_moe.from_hf_config(hf, dtype="float32", chunk_size=8)
    torch.manual_seed(4)
    path = tmp_path_factory.mktemp(family + "-4heads")
    save_pretrained(HybridModel(cfg), path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {f: _tiny_checkpoint(tmp_path_factory, f) for f in ("kimi_linear", "qwen3_5_moe_text")}
    for f in ("kimi_linear", "qwen3_5_moe_text"):
        out[f + "@4"] = _four_head_checkpoint(tmp_path_factory, f)
    return out


BOTH = ("attention", "linear_attention")
CASES = {
    # name: (model, world, dims, keep (None: no recomputation))
    "debug-cp2": ("debug", 2, dict(cp=2), None),
    "debug-cp4-recompute": ("debug", 4, dict(cp=4), ()),
    "debug-cp2-dp_shard2": ("debug", 4, dict(cp=2, dp_shard=2), None),
    "debug-cp2-tp2-sp-kept": ("debug", 4, dict(cp=2, tp=2, sequence_parallel=True), BOTH),
    "debug-cp2-ep2": ("debug", 4, dict(cp=2, dp_shard=2, ep=2), None),
    "debug-cp2-tp2": ("debug", 4, dict(cp=2, tp=2), None),
    "debug-cp2-hsdp": ("debug", 4, dict(cp=2, dp_replicate=2), None),
    "kimi-cp2": ("kimi_linear", 2, dict(cp=2), None),
    "qwen35-cp2-kept": ("qwen3_5_moe_text", 2, dict(cp=2), BOTH),
    "kimi-cp4": ("kimi_linear@4", 4, dict(cp=4), None),
    "qwen35-cp4-recompute": ("qwen3_5_moe_text@4", 4, dict(cp=4), ()),
}


@pytest.fixture(scope="module")
def spawns(request, checkpoints, tmp_path_factory):
    """The ranks of this module's multi-process tests, one spawn per world size (``spawn_cases``)."""
    engine = "test_engine_with_cp_trains_trajectories_longer_than_capacity_and_resumes_in_one_process"
    edge = "test_cp_microbatches_with_fewer_rows_than_ranks_and_empty_ones"
    cases = {engine: (2, _engine_worker, (str(tmp_path_factory.mktemp("cp_engine") / "ckpt"),))}
    for cp_mode in ("heads", "states"):
        cases[f"{edge}[{cp_mode}]"] = (4, _edge_worker, (cp_mode,))
    for case, (name, world, dims_kw, keep) in CASES.items():
        cases[case] = (world, _worker, (name, checkpoints.get(name), dims_kw, keep))
    return SharedSpawns(cases, selected_cases(request, "test_cp_step_matches_one_process", engine, edge))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_cp_step_matches_one_process(case, checkpoints, spawns):
    name, world, dims_kw, keep = CASES[case]
    path = checkpoints.get(name)
    results = spawns.results(case)
    dims = ParallelDims(world_size=world, **dims_kw)
    _check(results, _reference(name, path, dims.dp, dims.cp, keep), tol_logprob=TOL_LOGPROB_CP)


def test_cp_dims_errors_name_the_field():
    with pytest.raises(ParallelConfigError) as e:
        ParallelDims(cp=3, world_size=4)
    assert e.value.field == "cp" and "\n" not in str(e.value)
    with pytest.raises(ParallelConfigError) as e:
        ParallelDims.from_world(6, cp=4)
    assert e.value.field == "cp"
    dims = ParallelDims(dp_shard=2, cp=2, tp=2, world_size=8)
    assert dims.coords(5) == {
        "dp_replicate": 0,
        "dp_shard": 1,
        "tp": 1,
        "efsdp": 1,
        "ep": 0,
        "replica": 1,
        "cp": 0,
    }
    assert ParallelDims.from_world(8, cp=2, tp=2).dp_shard == 2


def test_cp_plan_caps_the_degree_by_the_heads():
    from harts_runtime import HybridModel, model_config
    from harts_runtime.parallel.context import GROUP, cp_plan

    model = HybridModel(model_config("debug", num_heads=4, dtype="float32"))
    kda, mla, gqa = model.blocks[0].mixer, model.blocks[1].mixer, model.blocks[3].mixer
    assert cp_plan(kda, 1, 4)["q_proj.weight"] == cp_plan(kda, 1, 2)["q_proj.weight"]
    assert cp_plan(gqa, 1, 4)["k_proj.weight"] == GROUP  # one KV head: every rank reads it
    for layer, field in ((kda, "num_heads"), (mla, "num_heads")):
        with pytest.raises(ParallelConfigError) as e:
            cp_plan(layer, 1, 8, " (blocks[0].mixer)")
        assert e.value.field == field and "cp = 1 * 8" in str(e.value) and "\n" not in str(e.value)


def _engine_config(capacity):
    from harts_runtime.engine import EngineConfig

    return EngineConfig(lr=1e-3, eps=1e-6, capacity=capacity, max_grad_norm=0.05, warmup_steps=1)


def _engine_steps(engine, step, n):
    out = []
    for _ in range(n):
        o = engine.forward_backward(step)
        r = engine.optimizer_step()
        out.append((o.loss, o.logprobs, r.grad_norm, o.metrics["microbatches"]))
    return out


def _engine_worker(rank, world, ckpt):
    from harts_runtime import StepInputs
    from harts_runtime.engine import HartsEngine

    torch.manual_seed(0)
    dims = ParallelDims(world_size=world, cp=2)
    engine = HartsEngine.build("debug", _engine_config(T[2]), dims, dtype="float32", num_heads=4)
    batch = _batch(engine.vocab_size)
    step = StepInputs.synthetic(batch, seed=1, vocab_size=engine.vocab_size)
    first = _engine_steps(engine, step, 1)
    engine.save(ckpt)
    rest = _engine_steps(engine, step, 1)
    return {
        "steps": first + rest,
        "params": {n: _full(p).clone() for n, p in engine.model.named_parameters()},
    }


def _engine_single(ckpt=None):
    from harts_runtime import StepInputs
    from harts_runtime.engine import HartsEngine

    torch.manual_seed(0)
    engine = HartsEngine.build("debug", _engine_config(2 * T[2]), None, dtype="float32", num_heads=4)
    step = StepInputs.synthetic(_batch(engine.vocab_size), seed=1, vocab_size=engine.vocab_size)
    if ckpt is not None:
        engine.load(ckpt)
    steps = _engine_steps(engine, step, 1 if ckpt else 2)
    return {"steps": steps, "params": {n: p.detach().clone() for n, p in engine.model.named_parameters()}}


@pytest.mark.slow
def test_engine_with_cp_trains_trajectories_longer_than_capacity_and_resumes_in_one_process(request, spawns):
    """``HartsEngine.build(..., ParallelDims(cp=2))`` at capacity T runs trajectories longer than T
    (microbatches of up to 2T rows) like one process at capacity 2T, and its checkpoint resumes in
    one process."""
    results = spawns.results(request.node.name)
    ckpt = spawns.cases[request.node.name][2][0]
    ref = _engine_single()
    for r in results:
        for (loss, lp, norm, mbs), (rl, rlp, rn, rmbs) in zip(r["steps"], ref["steps"]):
            assert mbs == rmbs
            assert abs(loss - rl) <= 1e-5 * max(1.0, abs(rl))
            torch.testing.assert_close(lp, rlp, rtol=0, atol=2e-5)
            assert norm == pytest.approx(rn, rel=1e-4)
        for n, p in ref["params"].items():
            torch.testing.assert_close(r["params"][n], p, rtol=0, atol=5e-6, msg=lambda m, n=n: f"{n}: {m}")
    resumed = _engine_single(ckpt)
    loss, lp, _, _ = resumed["steps"][0]
    assert abs(loss - ref["steps"][1][0]) <= 1e-5 * max(1.0, abs(loss))
    torch.testing.assert_close(lp, ref["steps"][1][1], rtol=0, atol=2e-5)


def test_a_tree_longer_than_c_times_t_is_one_line():
    import harts_planner as hp

    batch = hp.RolloutBatch.from_token_lists([list(range(1, 101))])
    with pytest.raises(ValueError) as e:
        hp.plan_step(batch, 1, 16, 8, cp_size=4)
    msg = str(e.value)
    assert "\n" not in msg and "64" in msg and "100" in msg, msg


def test_a_mixer_without_a_head_plan_is_refused_under_cp():
    from harts_runtime.parallel.context import cp_plan

    with pytest.raises(ParallelConfigError) as e:
        cp_plan(torch.nn.Linear(4, 4), 1, 2, " (blocks[0].mixer)")
    assert e.value.field == "cp" and "no head-parallel plan" in str(e.value)


def _edge_runs(mesh=None, cp_mode="heads"):
    """A 3-row microbatch (fewer rows than cp = 4 ranks: one holds none), the empty microbatch (DP
    padding) and a 2-trajectory one, each forward and backward with recomputation, under
    ``cp_mode``."""
    import harts_planner as hp
    from harts_runtime import HybridModel, StepInputs, apply_recompute, model_config, run_microbatch
    from harts_runtime.engine import microbatch_call_plan
    from harts_runtime.parallel import parallelize

    torch.manual_seed(0)
    model = HybridModel(model_config("debug", num_heads=4, dtype="float32"))
    if mesh is None:
        apply_recompute(model, True)
    else:
        parallelize(model, mesh, recompute=True, cp_mode=cp_mode)
    batch = hp.RolloutBatch.from_token_lists([[1, 2, 3], [5, 6, 7, 8, 9]])
    step = StepInputs.synthetic(batch, seed=1, vocab_size=model.config.vocab_size)
    out = []
    for traj in (np.array([0]), np.zeros(0, dtype=np.int64), np.array([0, 1])):
        loss, st = run_microbatch(
            model, step, traj, "compact", call_plan=microbatch_call_plan(model, step, traj)
        )
        out.append((float(loss), st["logprobs"].tolist()))
    grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _edge_worker(rank, world, cp_mode="heads"):
    return _edge_runs(ParallelDims(world_size=world, cp=4).build_mesh(), cp_mode)


@pytest.mark.slow
@pytest.mark.parametrize("cp_mode", ["heads", "states"])
def test_cp_microbatches_with_fewer_rows_than_ranks_and_empty_ones(cp_mode, request, spawns):
    results = spawns.results(request.node.name)
    want, want_grads = _edge_runs()
    for got, grads in results:
        for (loss, lp), (wl, wlp) in zip(got, want):
            assert abs(loss - wl) <= 1e-6 and np.allclose(lp, wlp, rtol=0, atol=TOL_LOGPROB_CP)
        for n, g in want_grads.items():
            err = float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
            assert err <= 1e-4, f"d{n}: {err:.2e}"
