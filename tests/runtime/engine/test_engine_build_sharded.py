"""``HartsEngine.build(folder, config, dims)`` on 2 gloo processes: the engine makes the model on the
meta device and parallelizes it, then ``harts_runtime.hf`` reads each rank's slices into it; every
parameter equals the one-process load, the model is parallelized once (the engine's constructor
leaves it as it is), and a forward-backward step runs."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from harts_runtime.parallel.launch import run_distributed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("safetensors") is None, reason="needs the hf extra")


def _worker(rank, world, folder, dims_kw):
    import harts_runtime.parallel as package
    from harts_runtime import StepInputs
    from harts_runtime.engine import EngineConfig, HartsEngine
    from harts_runtime.parallel import ParallelDims
    from harts_runtime.testing import random_batch

    module = sys.modules["harts_runtime.parallel.parallelize"]  # the package's name is the function
    original, calls = module.parallelize, []

    def counted(model, mesh, **kw):
        calls.append(kw)
        return original(model, mesh, **kw)

    module.parallelize = package.parallelize = counted  # the loader's and the constructor's
    try:
        engine = HartsEngine.build(
            folder, EngineConfig(capacity=64), ParallelDims(world_size=world, **dims_kw), dtype="float32"
        )
    finally:
        module.parallelize = package.parallelize = original
    sd = {  # before the step (which counts expert loads into buffers)
        k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
        for k, v in engine.model.state_dict().items()
    }
    batch = random_batch(3, num=6, vocab=engine.vocab_size, max_new=8)
    step = StepInputs.synthetic(batch, seed=1, vocab_size=engine.vocab_size)
    loss = engine.forward_backward(step).loss
    return {"state": sd, "parallelize_calls": len(calls), "frozen": engine.frozen, "loss": loss}


@pytest.mark.slow
@pytest.mark.parametrize("dims_kw", [dict(tp=2), dict(dp_shard=2, ep=2)], ids=["tp2", "dp_shard2-ep2"])
def test_build_reads_a_folder_into_the_parallelized_model(tmp_path, dims_kw):
    from harts_runtime import HybridModel, StepInputs, model_config
    from harts_runtime.engine import EngineConfig, HartsEngine
    from harts_runtime.hf import save_pretrained
    from harts_runtime.testing import random_batch

    torch.manual_seed(0)
    save_pretrained(HybridModel(model_config("kimi-linear-tiny", 2)), tmp_path)
    one = HartsEngine.build(tmp_path, EngineConfig(capacity=64), dtype="float32")
    want = {k: v.clone() for k, v in one.model.state_dict().items()}  # before its step
    batch = random_batch(3, num=6, vocab=one.vocab_size, max_new=8)
    want_loss = one.forward_backward(StepInputs.synthetic(batch, seed=1, vocab_size=one.vocab_size)).loss
    for r in run_distributed(_worker, 2, str(tmp_path), dims_kw, timeout=300):
        assert r["parallelize_calls"] == 1 and r["frozen"] == one.frozen
        assert r["state"].keys() == want.keys()
        for k in want:
            torch.testing.assert_close(r["state"][k], want[k], rtol=0, atol=0, msg=k)
        assert r["loss"] == pytest.approx(want_loss, rel=1e-4, abs=1e-6)
