"""The transformers rollout backend for the Ling-3.0 and Nemotron-H families (issue 37):
``export_weights(names="transformers")`` of ``ling3-tiny`` / ``nemotron-h-tiny`` (the adapter's
in-memory table: transformers' names, fused conv1d and stacked experts) loads strictly into the transformers
model and gives HARTS's logits (fp32, CPU); Nemotron-H's infinite ``time_step_limit`` (written as
``{"__float__": "Infinity"}``) builds the config; one ``harts-rl`` step runs for each."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts_runtime.cli.rl import main
from harts_runtime.rl import check_sync
from harts_runtime.trainer.metrics import read_metrics

pytest.importorskip("transformers")
hp = pytest.importorskip("harts_planner")
pytestmark = pytest.mark.usefixtures("one_thread")

FLAVORS = ["ling3-tiny", "nemotron-h-tiny"]
TOL_LOGITS = 1e-4  # fp32: max |ours - HF| logit over max |HF| logit


def _ours_logits(model, trajs) -> torch.Tensor:
    """HARTS's logits of every position of ``trajs`` packed back to back (trajectory execution)."""
    from harts_runtime.layout import trajectory_layout

    batch = hp.RolloutBatch.from_token_lists(trajs)
    cfg = model.config
    layout = trajectory_layout(batch, np.arange(len(trajs)), cfg.chunk_size, cfg.conv_size)
    with torch.no_grad():
        hidden, _ = model.forward_hidden(layout)
        return model.logits(hidden)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_export_weights_load_strictly_and_give_harts_logits(flavor):
    from harts_runtime.engine import HartsEngine
    from harts_runtime.rl.transformers_backend import TransformersRollout

    torch.manual_seed(0)
    engine = HartsEngine.build(flavor)
    rollout = TransformersRollout.from_engine(engine)  # load_state_dict(strict=True) inside
    names = dict(engine.export_weights(names="transformers"))
    assert names.keys() == rollout.model.state_dict().keys()
    for name, tensor in rollout.model.state_dict().items():
        assert names[name].shape == tensor.shape, name
    gen = torch.Generator().manual_seed(1)
    trajs = [torch.randint(0, engine.vocab_size, (n,), generator=gen).tolist() for n in (17, 9)]
    ours = _ours_logits(engine.model.eval(), trajs)
    off = 0
    for t in trajs:
        theirs = rollout._logits(torch.tensor([t]))[0][0].float()
        worst = float((ours[off : off + len(t)] - theirs).abs().max() / theirs.abs().max())
        assert worst <= TOL_LOGITS, (flavor, worst)
        off += len(t)
    assert check_sync(engine, rollout, trajs, atol=1e-4) < 1e-4


@pytest.mark.parametrize("flavor", FLAVORS)
def test_one_harts_rl_step_runs(flavor, tmp_path):
    out = tmp_path / "rl"
    argv = ["--task", "token-set", "--flavor", flavor, "--steps", "1", "--out", str(out), "--seed", "0"]
    assert main(argv) == 0
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1] and np.isfinite(recs[0]["loss"])
