"""The weight sync check on MoE models (``check_sync``): a router near-tie that flips one token's
experts on the rollout side is not a sync failure; a weight left out still is.

* Routing replay on: the trainer scores with the routes the rollout scored with
  (``TransformersRollout.scored_routes``): exact, every token judged.
* Replay off: the flipped token is ignored and counted (logged), up to ``max(1, FLIP_FRACTION)``
  of the tokens.
* One expert's or one layer's tensor left out raises in both modes; a dense model stays exact.

The flip: the rollout side's aux-loss-free bias of one expert is raised just enough (bisection) for
one (token, layer) route to change; that bias moves the selection only, not the gates.
"""

from __future__ import annotations

import logging

import pytest
import torch

from harts_runtime.engine import EngineConfig, HartsEngine
from harts_runtime.rl.rollout_engine import FLIP_FRACTION, SyncError, check_sync, judge_sync
from harts_runtime.rl.transformers_backend import TransformersRollout

pytest.importorskip("transformers")
pytest.importorskip("harts_planner")
pytestmark = pytest.mark.usefixtures("one_thread")

MOE = "kimi-linear-tiny"
ATOL = 2e-3  # check_sync's default
EXACT = 1e-5  # fp32 trainer vs fp32 transformers, same routes


def _engine(replay: bool, dense: bool = False) -> HartsEngine:
    torch.manual_seed(0)
    if dense:  # a KDA and an MLA layer, dense FFNs
        return HartsEngine.build(MOE, EngineConfig(), num_layers=2, ffns=("dense", "dense"))
    engine = HartsEngine.build(MOE, EngineConfig(routing_replay=replay))
    gen = torch.Generator().manual_seed(3)  # a trained-looking expert bias: it takes part in the top-k
    for moe in engine.model.moe_layers():
        moe.expert_bias.copy_(0.2 * torch.randn(moe.expert_bias.shape, generator=gen))
    return engine


def _seqs(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (50, 50, 40)]


def _flips(rollout, seqs, base) -> int:
    rollout.logprobs(seqs)
    now = torch.cat(rollout.scored_routes).sort(-1).values
    return int((now != base).any(-1).any(-1).sum())


@pytest.fixture(scope="module")
def flipped():
    """(trainer weights, a rollout with one token's route flipped, the sequences)."""
    engine = _engine(replay=False)
    rollout = TransformersRollout.from_engine(engine)
    seqs = _seqs(engine.vocab_size)
    rollout.logprobs(seqs)
    base = torch.cat(rollout.scored_routes).sort(-1).values
    bias = rollout.routers[-1].e_score_correction_bias  # the last layer: one log-prob moves
    keep = bias.clone()
    for e in range(bias.numel()):
        lo, hi = 0.0, 2.0
        bias.copy_(keep)
        bias[e] += hi
        if _flips(rollout, seqs, base) == 0:
            continue
        for _ in range(20):  # the smallest raise of expert e's bias that flips a route
            mid = (lo + hi) / 2
            bias.copy_(keep)
            bias[e] += mid
            lo, hi = (lo, mid) if _flips(rollout, seqs, base) else (mid, hi)
        bias.copy_(keep)
        bias[e] += hi
        if _flips(rollout, seqs, base) == 1:
            return engine.model.state_dict(), rollout, seqs
    pytest.fail("no single-token route flip found")


def test_one_flip_with_replay_is_exact(flipped, caplog):
    state, rollout, seqs = flipped
    engine = _engine(replay=True)
    engine.model.load_state_dict(state)
    with caplog.at_level(logging.INFO, logger="harts_runtime.rl.rollout_engine"):
        assert check_sync(engine, rollout, seqs, ATOL) <= EXACT
    assert "route flips" not in caplog.text  # nothing ignored
    assert len(rollout.scored_routes) == len(seqs)
    assert tuple(rollout.scored_routes[0].shape) == (
        len(seqs[0]),
        3,
        engine.model.moe_layers()[0].config.top_k,
    )
    # exact: one token off by more than atol raises (no tolerance with replay)
    lps = rollout.logprobs(seqs)
    real = rollout.logprobs
    lps[1][7] += 0.1
    rollout.logprobs = lambda s: [t.clone() for t in lps]
    try:
        with pytest.raises(SyncError, match="on 1 of 137 tokens.*a weight was not synced"):
            check_sync(engine, rollout, seqs, ATOL)
    finally:
        rollout.logprobs = real
        real(seqs)  # restore scored_routes


def test_one_flip_without_replay_is_ignored_and_counted(flipped, caplog):
    state, rollout, seqs = flipped
    engine = _engine(replay=False)
    engine.model.load_state_dict(state)
    # the flip moves the log-probs by more than atol: the strict rule would fail the sync
    from harts_runtime.rl.rollout_engine import own_routes_rollouts

    ours = engine.logprobs(own_routes_rollouts(engine, seqs)).double()
    theirs = torch.cat(rollout.logprobs(seqs)).double()
    beyond = int(((ours - theirs).abs() > ATOL).sum())
    assert 1 <= beyond <= max(1, int(FLIP_FRACTION * ours.numel()))
    with pytest.raises(SyncError):
        judge_sync(ours, theirs, len(seqs), ATOL, flips=False)
    with caplog.at_level(logging.INFO, logger="harts_runtime.rl.rollout_engine"):
        diff = check_sync(engine, rollout, seqs, ATOL)
    assert diff <= EXACT  # the max over the tokens judged
    assert f"{beyond} of {ours.numel()} tokens beyond atol" in caplog.text


def test_judge_sync_rule():
    ours = torch.zeros(100, dtype=torch.float64)
    theirs = ours.clone()
    theirs[5], theirs[9] = 0.5, 1e-4
    assert judge_sync(ours, theirs, 1, ATOL, flips=True) == (1e-4, 1)
    theirs[6] = 0.3  # 2 of 100 beyond atol: max(1, 2%) = 2 ignored
    assert judge_sync(ours, theirs, 1, ATOL, flips=True) == (1e-4, 2)
    theirs[7] = 0.3
    with pytest.raises(SyncError, match=r"on 3 of 100 tokens.*more than the 2.*routing_replay"):
        judge_sync(ours, theirs, 1, ATOL, flips=True)
    theirs[:] = 0.0
    theirs[3] = float("nan")  # a NaN is never a route flip
    for flips in (True, False):
        with pytest.raises(SyncError, match="NaN log-probs .* on 1 of 100 tokens"):
            judge_sync(ours, theirs, 1, ATOL, flips=flips)


@pytest.mark.parametrize("replay", [True, False])
@pytest.mark.parametrize(
    ("name", "index"),
    [("model.layers.1.mlp.experts.down_proj", 3), ("model.layers.2.self_attn.o_proj.weight", None)],
)
def test_a_weight_left_out_raises(replay, name, index):
    engine = _engine(replay=replay)
    rollout = TransformersRollout.from_engine(engine)
    seqs = _seqs(engine.vocab_size)
    assert check_sync(engine, rollout, seqs, ATOL) <= EXACT
    stale = dict(rollout.model.named_parameters())[name]
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a stale (other) value of the one expert's or the layer's tensor
        target = stale if index is None else stale[index]
        target.copy_(0.2 * torch.randn(target.shape, generator=gen))
    with pytest.raises(SyncError, match="not synced"):
        check_sync(engine, rollout, seqs, ATOL)


def test_dense_model_is_exact():
    engine = _engine(replay=False, dense=True)
    rollout = TransformersRollout.from_engine(engine)
    seqs = _seqs(engine.vocab_size)
    assert not engine.model.moe_layers() and not rollout.routers
    assert check_sync(engine, rollout, seqs, ATOL) <= EXACT
    assert rollout.scored_routes is None
    lps = rollout.logprobs(seqs)
    lps[0][10] += 0.1  # one token beyond atol: raises (no tolerance on a dense model)
    rollout.logprobs = lambda s: [t.clone() for t in lps]
    with pytest.raises(SyncError, match="on 1 of 137 tokens.*a weight was not synced"):
        check_sync(engine, rollout, seqs, ATOL)
