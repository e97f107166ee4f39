"""Context parallelism by state passing (``cp_mode="states"``, gloo) against one process holding the
whole microbatch.

Each CP rank holds its ``plan_cp`` row range through the whole model; KDA / GDN layers run their
rows from entry states folded from every rank's affine summaries (forks reading states produced
one, two or more ranks back), attention head-parallel on the same rows. Trees: trajectories longer
than the per-rank capacity T, forking on both sides of the split's cuts. Compared as in
``test_parallel_step``: both step losses, every log-prob, every gradient, the MoE expert-load
counts and every weight after two AdamW steps.
"""

import pytest
import torch
from test_parallel_cp import TOL_LOGPROB_CP, T, _batch
from test_parallel_step import _check, train_parallel, train_single

from harts_runtime.parallel import ParallelDims, run_distributed


def _build(dp, cp, heads=4):
    import harts_planner as hp
    from harts_runtime import HybridModel, StepInputs, model_config

    torch.manual_seed(0)
    cfg = model_config("debug", num_heads=heads, moe={"use_expert_bias": True}, dtype="float32")
    model = HybridModel(cfg)
    batch = _batch(cfg.vocab_size)
    step = StepInputs.synthetic(batch, seed=1, vocab_size=cfg.vocab_size)
    plan = hp.plan_step(batch, dp, T[cp], cfg.chunk_size, cp_size=cp)
    return model, step, plan


def _worker(rank, world, dims_kw, keep, cp_mode):
    dims = ParallelDims(world_size=world, **dims_kw)
    mesh = dims.build_mesh()
    model, step, plan = _build(dims.dp, dims.cp)
    out = train_parallel(model, step, plan, mesh, keep, cp_mode=cp_mode)
    out["modes"] = list(model._harts_cp_modes)
    return out


CASES = {
    # name: (world, dims, keep (None: no recomputation), cp_mode)
    "cp2": (2, dict(cp=2), None, "states"),
    "cp4-recompute": (4, dict(cp=4), (), "states"),
    "cp4": (4, dict(cp=4), None, "states"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_cp_states_step_matches_one_process(case):
    world, dims_kw, keep, cp_mode = CASES[case]
    results = run_distributed(_worker, world, dims_kw, keep, cp_mode, timeout=200)
    dims = ParallelDims(world_size=world, **dims_kw)
    assert all(m == ("states",) for m in results[0]["modes"])
    _check(results, train_single(*_build(dims.dp, dims.cp), keep), tol_logprob=TOL_LOGPROB_CP)
