"""The transformers frontier on ragged branches: prompts of different lengths, actions that stop at
a stop token, observations of different lengths, each branch on a cache of its own group. Oracle:
each sampled token's log-prob equals the model's teacher-forced log-prob of the whole sequence
(``TransformersRollout.logprobs``), through groups that split and join again. A frontier whose branches keep one length runs as one batch:
its leaves equal, bit for bit, those of the lockstep frontier it replaced (kept here as the
reference)."""

from __future__ import annotations

import pytest
import torch

from harts_runtime.rl.sampler import TreeSampler
from harts_runtime.rl.tasks import CalculatorTask, RaggedSetTask, TokenSetTask

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def _rollout(flavor):
    from harts_runtime.engine import HartsEngine
    from harts_runtime.rl.transformers_backend import TransformersRollout

    torch.manual_seed(0)
    return TransformersRollout.from_engine(HartsEngine.build(flavor, chunk_size=8))


@pytest.fixture(scope="module")
def qwen():
    return _rollout("qwen3.5-tiny")


def _ragged_leaves_match_teacher_forcing(rollout, seed, monkeypatch):
    from harts_runtime.rl import transformers_backend

    # 64 stop ids of 512: most actions stop before their cap, at different tokens
    task = RaggedSetTask(set_start=64, stop_start=192, stop_count=64, cap=6, turns=3)
    opened, merged = [], []
    real_open, real_concat = rollout.open, transformers_backend._concat_rows
    monkeypatch.setattr(rollout, "open", lambda prompts: opened.append(real_open(prompts)) or opened[-1])
    monkeypatch.setattr(
        transformers_backend, "_concat_rows", lambda a, b: merged.append(real_concat(a, b)) or merged[-1]
    )
    leaves = TreeSampler(task, {0: 3, 1: 2}, 3, 1.0, seed).sample(rollout)
    monkeypatch.undo()
    assert merged and all(merged)  # groups that came to one length again joined
    lengths = {len(lf.tokens) for lf in leaves}
    assert len(lengths) > 3 and any(b - a < 6 for lf in leaves for _, a, b in lf.segments)
    assert len({lf.segments[0][1] for lf in leaves}) > 1  # ragged prompts
    assert opened[0].groups > 1
    ref = rollout.logprobs([lf.tokens for lf in leaves])
    for lf, r in zip(leaves, ref):
        pos = [p for _, a, b in lf.segments for p in range(a, b)]
        got = torch.tensor(lf.action_logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, r[[p - 1 for p in pos]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_ragged_branches_sample_the_models_logprobs(qwen, seed, monkeypatch):
    _ragged_leaves_match_teacher_forcing(qwen, seed, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("flavor", ["kimi-linear-tiny", "nemotron-h-tiny", "ling3-tiny"])
def test_ragged_branches_sample_the_models_logprobs_on_each_family(flavor, monkeypatch):
    _ragged_leaves_match_teacher_forcing(_rollout(flavor), 0, monkeypatch)


class _Lockstep:
    """The lockstep frontier the ragged one replaced: one cache, one length for every branch."""

    def __init__(self, rollout, prompts):
        from transformers import DynamicCache

        self.rollout, self.tokens = rollout, [list(p) for p in prompts]
        self._cache = DynamicCache(config=rollout.model.config)
        logits, self._cache = rollout._logits(torch.tensor(self.tokens, dtype=torch.long), self._cache)
        self._next = logits[:, -1]

    def _feed(self, ids):
        logits, self._cache = self.rollout._logits(ids, self._cache)
        self._next = logits[:, -1]

    def sample(self, n, generator, temperature=1.0):
        out_lp = []
        for _ in range(n):
            logp = torch.log_softmax(self._next / temperature, -1).cpu()
            tok = torch.multinomial(logp.exp(), 1, generator=generator)
            out_lp.append(logp.gather(-1, tok)[:, 0])
            for row, t in zip(self.tokens, tok[:, 0].tolist()):
                row.append(t)
            self._feed(tok)
        return torch.stack(out_lp, 1).float()

    def extend(self, rows):
        for row, r in zip(self.tokens, rows):
            row.extend(int(t) for t in r)
        if len(rows[0]):
            self._feed(torch.tensor([list(r) for r in rows], dtype=torch.long))

    def fork(self, index):
        idx = torch.as_tensor(list(index), dtype=torch.long)
        self._cache.reorder_cache(idx)
        self._next = self._next[idx]
        self.tokens = [list(self.tokens[i]) for i in idx.tolist()]


@pytest.mark.parametrize("task", [TokenSetTask, pytest.param(CalculatorTask, marks=pytest.mark.slow)])
def test_one_length_frontiers_equal_the_lockstep_frontier_bit_for_bit(qwen, task):
    def leaves(open_):
        qwen.open = open_
        try:
            return TreeSampler(task(), {0: 2, 1: 2}, 2, 0.9, 5).sample(qwen)
        finally:
            del qwen.open

    from harts_runtime.rl.transformers_backend import _Frontier

    new = leaves(lambda p: _Frontier(qwen, p))
    old = leaves(lambda p: _Lockstep(qwen, p))
    assert [(lf.tokens, lf.action_logprobs, lf.reward, lf.path, lf.segments) for lf in new] == [
        (lf.tokens, lf.action_logprobs, lf.reward, lf.path, lf.segments) for lf in old
    ]
