"""Mamba2 (Nemotron-H) under tensor and head-parallel context parallelism (gloo, 2 processes)
against one process running the same step.

A tiny Nemotron-H checkpoint (layers ``ME*-``: Mamba2 with 4 heads in 2 groups, relu2 MoE,
attention without RoPE sharing one KV head, relu2 MLP; the Mamba2 per-head vectors, gated-norm
weights and convolution biases perturbed so that a wrong head or group slice shows) is written with
``save_pretrained`` and loaded in every process at chunk size 8 (forks on and off the chunk grid,
several rounds of boundary states). Two AdamW steps under ``tp = 2`` (with and without sequence
parallelism, with kept regions), ``cp = 2`` (trees whose trajectories are longer than the
per-rank capacity T, forking on both sides of the rank blocks) and ``cp = 2 x tp = 2`` with SP and
recomputation (a 2-layer checkpoint with 4 groups: one per rank) equal one process in both losses,
every log-prob, every gradient (full tensors), the expert-load counts and every weight, within
``test_parallel_step``'s named tolerances (``test_parallel_cp``'s log-prob tolerance under CP).

Every rank also loads the checkpoint sharded (``load_pretrained(path, mesh=...)``: its slices of
transformers' fused ``in_proj`` / ``conv1d``), which equals the whole load exactly.

Also: the Mamba2 TP plan places every parameter by head or group blocks, and a degree that does
not divide ``n_groups`` is one line naming the field.
"""

import numpy as np
import pytest
import torch
from spawn_cases import SharedSpawns, selected_cases
from test_parallel_cp import TOL_LOGPROB_CP, T
from test_parallel_cp import _batch as tree_batch
from test_parallel_step import TOL_LOGPROB, _check, _full, train_parallel, train_single

from harts_runtime.parallel import ParallelConfigError, ParallelDims, run_distributed

CHUNK = 8
TOL_LOCAL = 1e-6  # relative to the largest element: the float64 layer's SSD core runs in float32
# (as transformers' torch path), batched over 2 heads instead of 4; measured 3e-8 absolute


def _checkpoint(tmp_path_factory, num_layers, **overrides):
    from harts_runtime import HybridModel, model_config, save_pretrained

    torch.manual_seed(5)
    model = HybridModel(model_config("nemotron-h-tiny", num_layers=num_layers, dtype="float32", **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("dt_bias", ".D", "mixer.norm.weight", "conv1d.bias")):
                p.add_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("nemotron_h")
    save_pretrained(model, path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory, 4)


@pytest.fixture(scope="module")
def checkpoint_g4(tmp_path_factory):
    """Layers ``ME`` with 4 groups of one head each: ``tp = 2`` x ``cp = 2`` gives each rank one."""
    return _checkpoint(tmp_path_factory, 2, mamba2={"n_groups": 4})


def _build(path, dp, cp):
    import harts_planner as hp
    from harts_runtime import StepInputs, load_pretrained

    model = load_pretrained(path, dtype="float32", chunk_size=CHUNK)
    vocab = model.config.vocab_size
    batch = tree_batch(vocab)  # trajectories of 38 to 56 tokens forking on and off the chunk grid
    if cp > 1:
        assert max(batch.lengths) > T[cp]
        plan = hp.plan_step(batch, dp, T[cp], CHUNK, cp_size=cp)
    else:  # the same microbatches as cp = 2 in one process
        plan = hp.plan_step(batch, dp, 2 * T[2], CHUNK)
    step = StepInputs.synthetic(batch, seed=1, vocab_size=vocab)
    return model, step, plan


def _worker(rank, world, path, dims_kw, keep):
    from harts_runtime import load_pretrained

    dims = ParallelDims(world_size=world, **dims_kw)
    mesh = dims.build_mesh()
    model, step, plan = _build(path, dims.dp, dims.cp)
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = train_parallel(model, step, plan, mesh, keep)
    # each rank reading only its slices of the HF tensors (the fused in_proj / conv1d too)
    sharded = load_pretrained(path, mesh=mesh, dtype="float32", chunk_size=CHUNK)
    out["sharded_load_diff"] = max(
        float((_full(p.detach()) - whole[n]).abs().max()) for n, p in sharded.named_parameters()
    )
    return out


BOTH = ("attention", "linear_attention")
CASES = {
    # name: (dims, keep (None: no recomputation))
    "tp2": (dict(tp=2), None),
    "tp2-sp-kept": (dict(tp=2, sequence_parallel=True), BOTH),
    "cp2": (dict(cp=2), None),
}


@pytest.fixture(scope="module")
def spawns(request, checkpoint):
    """The cases' ranks, one spawn (``spawn_cases``)."""
    cases = {case: (2, _worker, (checkpoint, dims_kw, keep)) for case, (dims_kw, keep) in CASES.items()}
    return SharedSpawns(cases, selected_cases(request, "test_nemotron_h_step_matches_one_process"))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_nemotron_h_step_matches_one_process(case, checkpoint, spawns):
    dims_kw, keep = CASES[case]
    results = spawns.results(case)
    dims = ParallelDims(world_size=2, **dims_kw)
    ref = train_single(*_build(checkpoint, dims.dp, dims.cp), keep)
    _check(results, ref, tol_logprob=TOL_LOGPROB_CP if dims.cp > 1 else TOL_LOGPROB)
    assert all(r["sharded_load_diff"] == 0.0 for r in results)


@pytest.mark.slow
def test_nemotron_h_cp2_tp2_sp_matches_one_process(checkpoint_g4):
    """CP slices of the TP rank's local blocks: each of the 4 ranks holds one group of Mamba2."""
    dims_kw = dict(cp=2, tp=2, sequence_parallel=True)
    results = run_distributed(_worker, 4, checkpoint_g4, dims_kw, (), timeout=300)
    ref = train_single(*_build(checkpoint_g4, 1, 2), ())
    _check(results, ref, tol_logprob=TOL_LOGPROB_CP)
    assert all(r["sharded_load_diff"] == 0.0 for r in results)


def test_mamba2_plan_places_blocks_and_names_n_groups():
    from harts_runtime import HybridModel, model_config
    from harts_runtime.parallel.context import cp_plan
    from harts_runtime.parallel.plans import COL, ROW, tp_plan

    model = HybridModel(model_config("nemotron-h-tiny", num_layers=4, dtype="float32"))
    mixer = model.blocks[0].mixer  # 4 heads in 2 groups
    plan = tp_plan(mixer, 2)
    assert plan.placements["out_proj.weight"] == ROW
    assert all(pl == COL for n, pl in plan.placements.items() if n != "out_proj.weight")
    assert cp_plan(mixer, 1, 2)["in_proj_B.weight"] == COL
    for tp, cp in ((4, 1), (2, 2), (1, 4)):
        with pytest.raises(ParallelConfigError) as e:
            cp_plan(mixer, tp, cp, " (blocks[0].mixer)") if cp > 1 else tp_plan(mixer, tp)
        assert e.value.field == "n_groups" and "\n" not in str(e.value), (tp, cp, str(e.value))
    with pytest.raises(ParallelConfigError) as e:
        tp_plan(mixer, 3)
    assert e.value.field == "num_heads"
    biased = HybridModel(model_config("nemotron-h-tiny", num_layers=1, mamba2={"use_bias": True}))
    with pytest.raises(ParallelConfigError) as e:
        tp_plan(biased.blocks[0].mixer, 2)
    assert e.value.field == "use_bias"


def test_local_blocks_of_a_rank_equal_the_whole_layer_on_its_groups():
    """The layer on one rank's blocks (the plan's slices, as TP and CP give them) computes exactly
    the whole layer's output restricted to that rank's heads: the sum over ranks of their partial
    ``out_proj`` outputs is the one-process output (forward and input gradient)."""
    import harts_planner as hp
    from harts_runtime import HybridModel, InvalidInputError, model_config
    from harts_runtime.layout import KDAExecutionPlan, RowLayout
    from harts_runtime.parallel.context import _slice, cp_plan
    from harts_runtime.parallel.tensor import _params, local_parameters

    torch.manual_seed(0)
    model = HybridModel(model_config("nemotron-h-tiny", num_layers=1, dtype="float64", chunk_size=CHUNK))
    mixer = model.blocks[0].mixer
    with torch.no_grad():
        for _name, p in mixer.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    rng = np.random.default_rng(0)
    trunk = rng.integers(1, 100, 19).tolist()
    trajs = [trunk + rng.integers(1, 100, n).tolist() for n in (5, 14)] + [trunk[:9] + [1, 2]]
    call = hp.plan_calls(hp.RolloutBatch.from_token_lists(trajs), chunk_size=CHUNK, conv_width=4)
    ep = KDAExecutionPlan.from_call_plan(call)
    layout = RowLayout(ep.num_rows, kda=ep)
    x = torch.randn(ep.num_rows, 64, dtype=torch.float64, requires_grad=True)
    want = mixer(x, layout)
    (dx_want,) = torch.autograd.grad(want.square().sum(), x)
    slices = cp_plan(mixer, 1, 2)
    names = list(slices)
    parts = []
    for rank in range(2):
        local = [_slice(p, slices[n], rank, 2, 0) for n, p in zip(names, _params(mixer, names))]
        with local_parameters(mixer, names, local):
            parts.append(mixer(x, layout))
    got = parts[0] + parts[1]
    scale = float(want.detach().abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=TOL_LOCAL * scale)
    (dx,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(dx, dx_want, rtol=0, atol=TOL_LOCAL * float(dx_want.abs().max()))
    # a block that splits a group (one head of a 2-head group) is one line naming n_groups
    local = [_slice(p, slices[n], 0, 4, 0) for n, p in zip(names, _params(mixer, names))]
    with local_parameters(mixer, names, local), pytest.raises(InvalidInputError) as e:
        mixer(x, layout)
    assert e.value.field == "n_groups" and "\n" not in str(e.value)
