"""harts_runtime.rl's parts: the advantage formulas, the calculator task's tool flow through the tree
sampler, the weight sync (transformers' in-memory names, the sync check failing on a left-out
weight), and bad environment output refused with the last checkpoint intact."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl import RLConfig, RLRun, SyncError, check_sync
from harts_runtime.rl.advantages import grpo_advantages, tree_advantages
from harts_runtime.rl.sampler import Leaf
from harts_runtime.rl.tasks import CALL, PLUS, RES, CalculatorTask, TokenSetTask
from harts_runtime.trainer_state import latest_checkpoint

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

FLAVOR = "qwen3.5-tiny"  # its transformers model builds in a fraction of a second


def _leaf(prompt, path, reward, turns=2, n=2):
    segs = [(t, 1 + t * n, 1 + (t + 1) * n) for t in range(turns)]
    return Leaf(prompt, [0] * (1 + turns * n), path, segs, [0.0] * (turns * n), reward)


def test_grpo_and_tree_advantages_follow_their_formulas():
    rewards = [1.0, 0.0, 0.5, 0.5]  # prompt 0: forks {0: 2, 1: 2}
    leaves = [_leaf(0, p, r) for p, r in zip([(0, 0), (0, 1), (1, 0), (1, 1)], rewards)]
    std = float(np.std(rewards))
    grpo = grpo_advantages(leaves)
    for lf, a in zip(leaves, grpo):
        assert a == pytest.approx([(lf.reward - 0.5) / (std + 1e-6)] * 4)
    tree = tree_advantages(leaves, {0: 2, 1: 2})
    # turn 0: subtree value vs the root; turn 1: the leaf vs its fork's siblings
    assert tree[0] == pytest.approx([0.0, 0.0, 0.5 / (std + 1e-6), 0.5 / (std + 1e-6)])
    assert tree[2] == pytest.approx([0.0] * 4)
    for lf, a in zip(leaves, tree):  # the path telescopes to GRPO's unnormalised advantage
        assert a[0] + a[2] == pytest.approx((lf.reward - 0.5) / (std + 1e-6))
    # no fork above a turn: no siblings, advantage 0
    assert tree_advantages([_leaf(0, (0,), 1.0), _leaf(0, (1,), 0.0)], {1: 2})[0][:2] == [0.0, 0.0]


def test_calculator_tool_calls_observations_forks_and_rewards_flow():
    task = CalculatorTask()
    assert task.call_value([CALL, 11, 12, PLUS, 10, 13]) == 12 + 3
    run = RLRun(RLConfig(flavor=FLAVOR, task="calculator", prompts=2, steps=0), {"lr": 1e-2}, "unused")
    leaves = run.sampler.sample(run.rollout)
    assert len(leaves) == 2 * 4 * 2 and {lf.path for lf in leaves} == {
        (i, j) for i in range(4) for j in range(2)
    }
    for lf in leaves:
        prompt, call, obs, answer = lf.tokens[:7], lf.tokens[7:13], lf.tokens[13:18], lf.tokens[18:]
        assert len(answer) == 4 and lf.segments == [(0, 7, 13), (1, 18, 22)]
        v = task.call_value(call)
        assert obs == (
            task.observe(None, 0, None, call) if v is None else [RES, *[10 + int(c) for c in f"{v:04d}"]]
        )
        a, b = int(f"{prompt[1] - 10}{prompt[2] - 10}"), int(f"{prompt[4] - 10}{prompt[5] - 10}")
        assert lf.reward == pytest.approx(task.reward((a, b), lf.tokens, lf.actions()))
        assert lf.loss_mask() == [False] * 7 + [True] * 6 + [False] * 5 + [True] * 4
    # siblings of the second fork share the prompt, the call and the observation
    for i in range(0, len(leaves), 2):
        assert (
            leaves[i].tokens[:18] == leaves[i + 1].tokens[:18] and leaves[i].path[0] == leaves[i + 1].path[0]
        )


def test_export_weights_in_transformers_names_load_strictly():
    import transformers

    from harts_runtime.engine import HartsEngine
    from harts_runtime.rl.transformers_backend import TransformersRollout

    torch.manual_seed(0)
    engine = HartsEngine.build(FLAVOR)
    rollout = TransformersRollout.from_engine(engine)  # load_state_dict(strict=True) inside
    names = dict(engine.export_weights(names="transformers"))
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)  # fused experts
    assert names.keys() == rollout.model.state_dict().keys()
    with pytest.raises(InvalidInputError, match="names"):
        engine.export_weights(names="vllm")
    assert isinstance(rollout.model, transformers.PreTrainedModel)


def test_sync_check_fails_when_a_weight_is_left_out():
    import transformers

    from harts_runtime.engine import HartsEngine
    from harts_runtime.rl.transformers_backend import TransformersRollout

    torch.manual_seed(0)
    engine = HartsEngine.build(FLAVOR)
    good = TransformersRollout.from_engine(engine)
    seqs = [[1, 5, 9, 33, 70, 2], [1, 5, 9, 40]]
    assert check_sync(engine, good, seqs) < 1e-4
    fresh = transformers.AutoModelForCausalLM.from_config(good.model.config)  # other random weights
    bad = TransformersRollout(fresh, engine.vocab_size)
    pairs = [
        (n, t) for n, t in engine.export_weights(names="transformers") if not n.endswith("lm_head.weight")
    ]
    with pytest.raises(InvalidInputError, match="lm_head"):  # a strict load names what is missing
        bad.load_weights(pairs)
    bad.load_weights(pairs, strict=False)
    with pytest.raises(SyncError, match="not synced"):
        check_sync(engine, bad, seqs)


def test_streamed_sync_names_a_bad_tensor_and_equals_a_state_dict_load():
    """The in-place streamed load equals ``load_state_dict`` of the same pairs; an unknown name or a
    wrong shape is an InvalidInputError naming the tensor."""
    from harts_runtime.engine import HartsEngine
    from harts_runtime.rl.transformers_backend import TransformersRollout

    torch.manual_seed(1)
    engine = HartsEngine.build(FLAVOR)
    ro = TransformersRollout.from_engine(engine)
    pairs = list(engine.export_weights(names="transformers"))
    want = {n: t.clone() for n, t in pairs}
    assert set(want) == set(ro.model.state_dict())
    for n, t in ro.model.state_dict().items():
        assert torch.equal(t, want[n]), n
    name, t = pairs[0]
    with pytest.raises(InvalidInputError, match="model.nope"):
        ro.load_weights([("model.nope", t)])
    with pytest.raises(InvalidInputError, match=name.replace(".", r"\.")):
        ro.load_weights([(name, t[..., :-1])], strict=False)


class _BadTask(TokenSetTask):
    """token-set whose observation (or reward) turns bad at a given step."""

    def __init__(self, bad_step, what):
        super().__init__()
        self.calls, self.bad_step, self.what = 0, bad_step, what

    def prompt(self, rng):
        self.calls += 1
        return super().prompt(rng)

    def observe(self, state, turn, tokens, action):
        step = (self.calls - 1) // 2 + 1
        return [10**6] if self.what == "token" and step >= self.bad_step else [3]

    def reward(self, state, tokens, actions):
        step = (self.calls - 1) // 2 + 1
        return (
            math.nan
            if self.what == "nan" and step >= self.bad_step
            else super().reward(state, tokens, actions)
        )


@pytest.mark.parametrize("what,field", [("token", "observation[0][0]"), ("nan", "reward[0]")])
def test_bad_environment_output_is_refused_and_the_last_checkpoint_stays(tmp_path, what, field):
    cfg = RLConfig(flavor=FLAVOR, prompts=2, steps=4, save_every=2, forks={0: 2}, sync_sequences=1)
    run = RLRun(cfg, {"lr": 1e-2}, tmp_path, task=_BadTask(3, what))
    with pytest.raises(InvalidInputError) as e:
        run.run()
    assert e.value.field == field
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step-2"
    again = RLRun.resume(tmp_path, task=TokenSetTask())
    assert again.step == 2
