"""The engine and ``harts-train`` defects the RL loop found (issue 36), each with the test that
would have caught it: ``logprobs`` without ``ref_logprobs``; a forward-only step leaving the MoE
expert-load counts and the train / eval mode as they were; a resumed cosine run training at lr 0;
a resumed run inheriting ``--export``; ``export_weights`` in transformers' in-memory names (Kimi-Linear)."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from harts_runtime.engine import EngineConfig, HartsEngine
from harts_runtime.errors import InvalidInputError
from harts_runtime.loss.objectives import PolicyLossConfig
from harts_runtime.rollouts import Rollouts

pytestmark = pytest.mark.usefixtures("one_thread")

_NO_KL = PolicyLossConfig(kl_coef=0.0)
TRAJ = [[1, 5, 9, 33, 70, 2, 8], [1, 5, 9, 40, 41], [1, 5, 7]]


def test_logprobs_need_no_ref_logprobs_under_the_default_kl():
    torch.manual_seed(0)
    engine = HartsEngine.build("kimi-linear-tiny", EngineConfig())  # grpo: kl_coef 0.001
    lp = engine.logprobs(Rollouts.from_lists(TRAJ))
    assert lp.shape == (sum(len(t) - 1 for t in TRAJ),) and bool((lp < 0).all())
    m = engine.forward_backward(Rollouts.from_lists(TRAJ), forward_only=True).metrics
    assert m["compression_with_replay"] == m["semantic_tokens"] / (m["rows"] + m["replay_tokens"])
    with pytest.raises(InvalidInputError, match="ref_logprobs"):  # a training step still needs them
        engine.forward_backward(Rollouts.from_lists(TRAJ, advantages=[1.0, -1.0, 0.5]))


def _train_step(engine, with_logprobs: bool):
    ro = Rollouts.from_lists(TRAJ, advantages=[1.0, -1.0, 0.5])
    engine.forward_backward(ro)
    if with_logprobs:
        counts = [m.local_tokens_per_expert.clone() for m in engine.model.moe_layers()]
        engine.logprobs(Rollouts.from_lists(TRAJ * 3))
        after = [m.local_tokens_per_expert for m in engine.model.moe_layers()]
        assert counts and all(torch.equal(a, b) for a, b in zip(counts, after))
        assert engine.model.training
    engine.optimizer_step()
    return {n: t.clone() for n, t in engine.model.state_dict().items()}


def test_forward_only_logprobs_leave_expert_counts_and_mode_alone():
    states = []
    for with_logprobs in (False, True):
        torch.manual_seed(0)
        engine = HartsEngine.build("kimi-linear-tiny", EngineConfig(lr=1e-2, loss_config=_NO_KL))
        states.append(_train_step(engine, with_logprobs))
    a, b = states
    assert any("expert_bias" in k for k in a)  # sigmoid routing with a load-balancing bias
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    torch.manual_seed(0)
    engine = HartsEngine.build("kimi-linear-tiny")
    engine.model.eval()
    engine.logprobs(Rollouts.from_lists(TRAJ))
    assert not engine.model.training  # the caller's mode, either way


def _rows(path, steps, seed):
    r = random.Random(seed)
    rows = []
    for step in range(steps):
        prompt = [r.randrange(512) for _ in range(6)]
        for _ in range(2):
            toks = prompt + [r.randrange(512) for _ in range(4)]
            n = len(toks) - 1
            rows.append(
                {
                    "tokens": toks,
                    "advantages": r.choice([1.0, -1.0]),
                    "loss_mask": [0] * 5 + [1] * (n - 5),
                    "old_logprobs": [-6.2] * n,
                    "step": step,
                }
            )
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return str(path)


def test_resumed_cosine_run_does_not_train_at_lr_0_nor_overwrite_the_export(tmp_path, capsys):
    from harts_runtime.cli import main

    base = ["--flavor", "kimi-linear-tiny", "--device", "cpu", "--progress", "off", "--kl-coef", "0"]
    ck, ex, m = tmp_path / "ck", tmp_path / "ex", tmp_path / "m.jsonl"
    d1, d2 = _rows(tmp_path / "d1.jsonl", 2, 1), _rows(tmp_path / "d2.jsonl", 2, 2)
    argv = [*base, "--data", d1, "--lr-schedule", "cosine", "--save", str(ck), "--export", str(ex)]
    assert main([*argv, "--metrics", str(m)]) == 0
    stamp = {p.name: os.stat(p).st_mtime_ns for p in ex.iterdir()}
    assert main(["--resume", str(ck), "--data", d2]) == 0  # the documented outer loop
    recs = [json.loads(x) for x in m.read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]  # --metrics continues (a log)
    assert all(r["lr"] > 0 for r in recs), [r["lr"] for r in recs]  # the decay now ends at step 4
    assert {p.name: os.stat(p).st_mtime_ns for p in ex.iterdir()} == stamp  # --export is per run
    capsys.readouterr()
    assert main(["--resume", str(ck), "--data", d1, "--total-steps", "4", "--steps", "6"]) == 2
    assert "--total-steps: the cosine schedule ended at step 4" in capsys.readouterr().err


@pytest.mark.slow
def test_export_weights_load_strictly_into_transformers_kimi_linear(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    engine = HartsEngine.build("kimi-linear-tiny")
    engine.save_pretrained(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    ours = dict(engine.export_weights(names="transformers"))
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) for k in ours)
    fresh = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    fresh.load_state_dict(ours, strict=True)
