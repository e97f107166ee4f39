"""``HartsEngine`` with a mesh (2 gloo processes) against one process: the whole step on every rank,
the planner's replicas and slots, log-probs of every target back on every rank, the global gradient
norm over DTensor shards, clipping, and a checkpoint saved under ``dp_shard=2`` resumed in one
process (another world size) continuing like the uninterrupted run."""

import pytest
import torch
from spawn_cases import SharedSpawns, selected_cases

from harts_runtime.parallel import ParallelDims

CAP = 30
TOL_LOSS = 1e-5
TOL_LP = 2e-5
TOL_PARAM = 5e-6  # after two clipped AdamW steps at lr 1e-3 (Adam divides by sqrt(v): eps 1e-6)


def _config():
    from harts_runtime.engine import EngineConfig

    return EngineConfig(lr=1e-3, eps=1e-6, capacity=CAP, max_grad_norm=0.05, warmup_steps=1)


def _setup():
    from harts_runtime import HybridModel, StepInputs, model_config
    from harts_runtime.testing import random_batch

    cfg = model_config("debug", dtype="float32", moe={"use_expert_bias": True})
    torch.manual_seed(0)
    model = HybridModel(cfg)
    batch = random_batch(3, num=16, vocab=cfg.vocab_size, max_new=10)
    return model, StepInputs.synthetic(batch, seed=1, vocab_size=cfg.vocab_size)


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _run(engine, step, n):
    out = []
    for _ in range(n):
        o = engine.forward_backward(step)
        r = engine.optimizer_step()
        out.append((o.loss, o.logprobs, r.grad_norm))
    return out


def _worker(rank, world, dims_kw, ckpt):
    from harts_runtime.engine import HartsEngine

    model, step = _setup()
    mesh = ParallelDims(world_size=world, **dims_kw).build_mesh()
    engine = HartsEngine(model, _config(), mesh=mesh)
    first = _run(engine, step, 1)
    engine.save(ckpt)
    rest = _run(engine, step, 1)
    return {"steps": first + rest, "params": {n: _full(p) for n, p in engine.model.named_parameters()}}


def _single(ckpt=None):
    from harts_runtime.engine import HartsEngine

    model, step = _setup()
    engine = HartsEngine(model, _config())
    if ckpt is None:
        steps = _run(engine, step, 2)
    else:
        engine.load(ckpt)
        steps = _run(engine, step, 1)
    return {"steps": steps, "params": {n: p.detach().clone() for n, p in engine.model.named_parameters()}}


CASES = {"dp_shard2": dict(dp_shard=2), "tp2-sp": dict(tp=2, sequence_parallel=True)}


@pytest.fixture(scope="module")
def spawns(request, tmp_path_factory):
    """Both cases' ranks in one spawn (``spawn_cases``), each saving to a folder of its own."""
    cases = {}
    for case, dims_kw in CASES.items():
        cases[case] = (2, _worker, (dims_kw, str(tmp_path_factory.mktemp(case) / "ckpt")))
    return SharedSpawns(
        cases,
        selected_cases(request, "test_engine_on_a_mesh_matches_one_process_and_resumes_elsewhere"),
        timeout=240,
    )


@pytest.fixture(scope="module")
def single():
    """The uninterrupted run in one process (the same for every case)."""
    return _single()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_engine_on_a_mesh_matches_one_process_and_resumes_elsewhere(case, spawns, single):
    results = spawns.results(case)
    ckpt = spawns.cases[case][2][1]
    ref = single
    for r in results:
        for (loss, lp, norm), (rl, rlp, rn) in zip(r["steps"], ref["steps"]):
            assert abs(loss - rl) <= TOL_LOSS * max(1.0, abs(rl))
            torch.testing.assert_close(lp, rlp, rtol=0, atol=TOL_LP)
            assert norm == pytest.approx(rn, rel=1e-4) and norm > 0.05  # the clipping was active
        for n, p in ref["params"].items():
            torch.testing.assert_close(
                r["params"][n], p, rtol=0, atol=TOL_PARAM, msg=lambda m, n=n: f"{n}: {m}"
            )
    resumed = _single(ckpt)  # saved by 2 processes after step 1, continued by one
    (loss, lp, norm) = resumed["steps"][0]
    assert abs(loss - ref["steps"][1][0]) <= TOL_LOSS * max(1.0, abs(loss))
    torch.testing.assert_close(lp, ref["steps"][1][1], rtol=0, atol=TOL_LP)
    for n, p in ref["params"].items():
        torch.testing.assert_close(
            resumed["params"][n], p, rtol=0, atol=TOL_PARAM, msg=lambda m, n=n: f"{n}: {m}"
        )
