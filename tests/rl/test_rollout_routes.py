"""The transformers rollout engine returns the MoE routes it used (issue 45, item 4), and syncs
through the bucketed weight stream (item 5).

* The routes a tree sampler's leaves carry (prompt, action and observation tokens, forks) equal the
  trainer's own router top-k on the same weights, token by token (fp32; on Qwen3.5-MoE's softmax
  top-k and on Kimi-Linear's group-limited, biased sigmoid top-k with a random expert bias).
* With ``routing_replay`` the trainer's log-probs of the tree equal the rollout engine's sampling
  log-probs (fp32, ``TOL_LOGPROB``).
* With the rollout engine's expert bias perturbed (a stale bias: routes flip, the gates are the
  same scores), the trainer's log-probs differ from the sampler's without replay and equal them
  with it; the numbers are printed (``-s``).
* The sync stream: any bucket size loads the same tensors as ``export_weights``.
"""

from __future__ import annotations

import pytest
import torch

from harts_runtime.engine import EngineConfig, HartsEngine
from harts_runtime.rl.sampler import TreeSampler
from harts_runtime.rl.tasks import make_task
from harts_runtime.rl.transformers_backend import TransformersRollout, weight_pairs
from harts_runtime.rollouts import Rollouts

pytest.importorskip("transformers")
pytest.importorskip("harts_planner")
pytestmark = pytest.mark.usefixtures("one_thread")

TOL_LOGPROB = 1e-5  # fp32 trainer (chunked kernels) vs fp32 transformers (recurrent decode)
FORKS = {0: 2, 1: 2}


def _engine(flavor: str, replay: bool, bias_seed: int | None = None) -> HartsEngine:
    torch.manual_seed(0)
    engine = HartsEngine.build(flavor, EngineConfig(routing_replay=replay))
    if bias_seed is not None:  # a trained-looking aux-loss-free bias, so that it changes the top-k
        gen = torch.Generator().manual_seed(bias_seed)
        for moe in engine.model.moe_layers():
            moe.expert_bias.copy_(0.2 * torch.randn(moe.expert_bias.shape, generator=gen))
    return engine


def _leaves(rollout, seed: int = 0):
    sampler = TreeSampler(make_task("token-set"), FORKS, prompts=2, temperature=1.0, seed=seed)
    return sampler.sample(rollout)


def _unrouted(leaves) -> list[torch.Tensor]:
    """Routes of -1 for every token: each MoE layer keeps its router's own top-k (no replay)."""
    return [torch.full_like(lf.routes, -1) for lf in leaves]  # type: ignore[arg-type]


def _own_topk(engine, leaves) -> torch.Tensor:
    """The trainer's router top-k of every token of ``leaves`` [S, M, k] (a trajectory-wise
    forward, one row per token, without replay)."""
    seen: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda mod, a, out: seen.append(out.topk_idx))
        for m in engine.model.moe_layers()
    ]
    try:
        plain = HartsEngine(engine.model, EngineConfig(mode="trajectory", capacity=1 << 20))
        plain.logprobs(Rollouts.from_lists([lf.tokens for lf in leaves], routes=_unrouted(leaves)))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, 1)


def _mismatch(engine, leaves, routes: bool) -> float:
    """Largest |trainer - sampler| log-prob over the leaves' action tokens, the trainer replaying
    the leaves' routes (``routes``) or its router's own top-k."""
    ro = Rollouts.from_lists(
        [lf.tokens for lf in leaves], routes=[lf.routes for lf in leaves] if routes else _unrouted(leaves)
    )
    ours = ro.to_lists(engine.logprobs(ro).double(), "logprobs")
    worst = 0.0
    for lf, lp in zip(leaves, ours):
        k = 0
        for _, a, b in lf.segments:
            for p in range(a, b):
                worst = max(worst, abs(lp[p - 1] - lf.action_logprobs[k]))
                k += 1
    return worst


@pytest.mark.parametrize(("flavor", "bias_seed"), [("qwen3.5-tiny", None), ("kimi-linear-tiny", 3)])
def test_routes_are_the_trainers_topk_and_replay_matches_sampling(flavor, bias_seed):
    engine = _engine(flavor, replay=True, bias_seed=bias_seed)
    rollout = TransformersRollout.from_engine(engine)
    leaves = _leaves(rollout)
    moe = engine.model.moe_layers()
    m, k = len(moe), moe[0].config.top_k
    for lf in leaves:
        assert lf.routes is not None and tuple(lf.routes.shape) == (len(lf.tokens), m, k)
    ours = torch.cat([lf.routes for lf in leaves]).sort(-1).values  # type: ignore[misc]
    own = _own_topk(engine, leaves).sort(-1).values
    assert torch.equal(ours, own), f"{int((ours != own).any(-1).sum())} (token, layer) routes differ"
    # forked leaves share their prefix's routes (one route per compact row: no conflict)
    a, b = leaves[0], leaves[1]
    shared = next(i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y)
    assert torch.equal(a.routes[:shared], b.routes[:shared])  # type: ignore[index]
    assert _mismatch(engine, leaves, routes=True) <= TOL_LOGPROB


def test_stale_rollout_bias_flips_routes_and_replay_removes_the_mismatch():
    engine = _engine("kimi-linear-tiny", replay=True, bias_seed=3)
    rollout = TransformersRollout.from_engine(engine)
    gen = torch.Generator().manual_seed(7)
    for router in rollout.routers:  # the rollout side's bias only: selection moves, gates do not
        bias = router.e_score_correction_bias
        bias.add_(0.3 * torch.randn(bias.shape, generator=gen))
    leaves = _leaves(rollout)
    ours = torch.cat([lf.routes for lf in leaves]).sort(-1).values  # type: ignore[misc]
    own = _own_topk(engine, leaves).sort(-1).values
    flipped = float((ours != own).any(-1).float().mean())
    without = _mismatch(engine, leaves, routes=False)
    with_replay = _mismatch(engine, leaves, routes=True)
    print(
        f"\nkimi-linear-tiny, stale rollout bias: {flipped:.1%} of (token, layer) routes flipped; "
        f"max |trainer - sampler| log-prob {without:.3g} without replay, {with_replay:.3g} with"
    )
    assert flipped > 0.05
    assert without > 100 * TOL_LOGPROB
    assert with_replay <= TOL_LOGPROB


def test_bfloat16_rollout_flips_routes_and_replay_shrinks_the_mismatch():
    engine = _engine("qwen3.5-tiny", replay=True)
    rollout = TransformersRollout.from_engine(engine)
    rollout.model.to(torch.bfloat16)  # the trainer stays fp32
    leaves = _leaves(rollout, seed=1)
    ours = torch.cat([lf.routes for lf in leaves]).sort(-1).values  # type: ignore[misc]
    own = _own_topk(engine, leaves).sort(-1).values
    flipped = float((ours != own).any(-1).float().mean())
    without = _mismatch(engine, leaves, routes=False)
    with_replay = _mismatch(engine, leaves, routes=True)
    print(
        f"\nqwen3.5-tiny, bf16 rollout / fp32 trainer: {flipped:.2%} of (token, layer) routes flipped; "
        f"max |trainer - sampler| log-prob {without:.3g} without replay, {with_replay:.3g} with"
    )
    assert flipped > 0
    assert with_replay < without / 3


def test_dense_model_reports_no_routes_and_replay_refuses_it():
    from harts_runtime.errors import InvalidInputError
    from harts_runtime.rl.source import _leaf_routes

    rollout = TransformersRollout.from_engine(_engine("qwen3.5-tiny", replay=False))
    rollout.routers = []  # as a dense model: nothing recorded
    leaves = _leaves(rollout)
    assert all(lf.routes is None for lf in leaves)
    with pytest.raises(InvalidInputError, match="routing_replay"):
        _leaf_routes(leaves)


@pytest.mark.parametrize("bucket_bytes", [1, 4096, 1 << 30])
def test_bucketed_sync_loads_what_export_weights_gives(bucket_bytes):
    engine = _engine("qwen3.5-tiny", replay=False)
    want = {n: t.detach().clone() for n, t in engine.export_weights(names="transformers")}
    got = dict(weight_pairs(engine, bucket_bytes))
    assert got.keys() == want.keys()
    for n, t in want.items():
        assert torch.equal(got[n], t), n


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1])
def test_harts_rl_trains_with_routing_replay(staleness, tmp_path):
    """``harts-rl --routing-replay`` on a MoE flavor: the sampled routes reach the trainer (the
    recomputed old log-probs, each mini-batch's updates), the sync check scores both sides with
    their own routers; synchronous and asynchronous sources."""
    import numpy as np

    from harts_runtime.cli.rl import main
    from harts_runtime.trainer.metrics import read_metrics

    out = tmp_path / "rl"
    argv = ["--task", "token-set", "--flavor", "qwen3.5-tiny", "--steps", "2", "--out", str(out)]
    argv += ["--seed", "0", "--routing-replay", "--mini-batches", "2", "--prompts", "2"]
    argv += ["--max-staleness", str(staleness)]
    assert main(argv) == 0
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["sync_diff"] < 1e-4 for r in recs)


def test_in_flight_leaf_records_keep_their_routes():
    """The asynchronous source's saved in-flight leaves (JSON) carry their routes back exactly."""
    import json

    from harts_runtime.rl.async_source import _leaf_of, _leaf_record
    from harts_runtime.rl.sampler import Leaf

    routes = torch.randint(0, 8, (5, 3, 2))
    lf = Leaf(0, [1, 2, 3, 4, 5], (1,), [(0, 3, 5)], [-0.5, -1.0], 1.0, None, [False], routes)
    back, versions = _leaf_of(json.loads(json.dumps(_leaf_record(lf, [-1, -1, -1, 0, 0]))))
    assert back.routes is not None and torch.equal(back.routes, routes) and versions == [-1, -1, -1, 0, 0]
    plain, _ = _leaf_of(
        json.loads(json.dumps(_leaf_record(Leaf(0, [1, 2], (), [(0, 1, 2)], [-1.0]), [-1, 0])))
    )
    assert plain.routes is None
