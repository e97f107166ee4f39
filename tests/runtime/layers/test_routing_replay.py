"""MoE routing replay (``EngineConfig(routing_replay=True)``): with routes chosen to differ from the
router's own top-k, the trainer's log-probs and router gradients equal a naive per-row reference
that runs exactly the given experts with the router's gates gathered at them; compact equals
trajectory-wise with replay, also where shared-prefix routes disagree (the first trajectory's wins,
counted) or are unknown (-1: the router's own choice, counted); the resolution equals a brute-force
oracle; bad routes are refused naming the field."""

import numpy as np
import pytest
import torch

from harts_runtime import HybridModel, InvalidInputError, model_config
from harts_runtime.engine import EngineConfig, HartsEngine
from harts_runtime.layers.moe import CompactMoE, MoEOutput
from harts_runtime.loss.objectives import PolicyLossConfig
from harts_runtime.ops.router import resolve_routes
from harts_runtime.rollouts import Rollouts
from harts_runtime.testing import random_batch

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = model_config("debug", dtype="float32", moe={"aux_loss_coef": 0.0, "z_loss_coef": 0.0})
E, K, M = CFG.moe.num_experts, CFG.moe.top_k, sum(f == "moe" for f in CFG.ffns)
BIG = 10_000  # capacity: one microbatch, trajectories in order (rows = semantic positions)
LOSS = PolicyLossConfig()  # no KL penalty: no reference log-probs needed
TOL = {"logprobs": (2e-5, 1e-5), "grad": (2e-6, 2e-4)}  # float32 (atol, rtol)


def _model():
    torch.manual_seed(0)
    return HybridModel(CFG)


def _tree():
    batch = random_batch(7, num=8, vocab=CFG.vocab_size, max_new=12)
    tok, off = np.asarray(batch.tokens), np.asarray(batch.offsets)
    trajs = [tok[off[i] : off[i + 1]].tolist() for i in range(len(off) - 1)]
    return batch, trajs


def _rollouts(trajs, routes):
    """Rollouts with per-token ``routes`` [S, M, K] (split per trajectory), no KL penalty."""
    lengths = [len(t) for t in trajs]
    parts = np.split(np.asarray(routes), np.cumsum(lengths)[:-1])
    rng = np.random.default_rng(0)
    return Rollouts.from_lists(
        trajs,
        advantages=rng.standard_normal(len(trajs)).tolist(),
        loss_mask=[[1] * n for n in lengths],
        old_logprobs=[[-6.0] * n for n in lengths],
        routes=list(parts),
    )


def _own_topk(trajs):
    """The router's own experts of every semantic position [S, M, K] (trajectory-wise forward)."""
    model, seen = _model(), []
    hooks = [
        m.register_forward_hook(lambda mod, a, out: seen.append(out.topk_idx)) for m in model.moe_layers()
    ]
    engine = HartsEngine(model, EngineConfig(capacity=BIG, mode="trajectory", loss_config=LOSS))
    engine.logprobs(_rollouts(trajs, np.full((sum(map(len, trajs)), M, K), -1)))
    for h in hooks:
        h.remove()
    return torch.stack(seen, 1)


def _complement_routes(batch, own):
    """Per batch compact row the K experts its first position's router did NOT pick (E = 2K), in
    reverse id order, copied to every position of the row: the replay differs from the router."""
    cmap = torch.as_tensor(np.asarray(batch.compact_map, dtype=np.int64))
    first = torch.full((int(batch.compact_tokens),), len(cmap), dtype=torch.int64)
    first.scatter_reduce_(0, cmap, torch.arange(len(cmap)), "amin")
    row = own[first]  # [C, M, K]
    taken = torch.zeros(*row.shape[:2], E, dtype=torch.bool).scatter_(2, row, True)
    comp = torch.stack([torch.nonzero(~t).flatten().flip(0) for t in taken.view(-1, E)]).view(
        *row.shape[:2], K
    )
    return comp[cmap]


def _naive_forward(routes):
    """A CompactMoE.forward that runs, for trajectory-wise rows (= semantic positions in order),
    exactly ``routes[:, layer]``: per row, sum over slots of softmax(router logits)[e] * FFN_e(x)."""

    def forward(self, hidden, layout=None):
        given = routes[:, self.replay_layer_ref].long()
        assert given.shape[0] == hidden.shape[0]
        scores = (hidden.float() @ self.router.float().t()).softmax(-1)
        rows = []
        for r in range(hidden.shape[0]):
            acc = hidden.new_zeros(hidden.shape[1])
            for j in range(K):
                e = int(given[r, j])
                acc = acc + scores[r, e].to(hidden.dtype) * self._ffn(hidden[r : r + 1], e)[0]
            rows.append(acc)
        out = torch.stack(rows) if rows else torch.zeros_like(hidden)
        zero = hidden.new_zeros(())
        return MoEOutput(out, zero, zero, torch.zeros(E), given, scores.gather(1, given), zero)

    return forward


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_replay_equals_the_naive_reference_with_routes_unlike_the_routers():
    batch, trajs = _tree()
    own = _own_topk(trajs)
    routes = _complement_routes(batch, own)
    assert not (routes.sort(-1).values == own.sort(-1).values).all(-1).any()  # every route differs
    ro = _rollouts(trajs, routes)
    replay = HartsEngine(
        _model(), EngineConfig(capacity=BIG, routing_replay=True, compact_always=True, loss_config=LOSS)
    )
    out = replay.forward_backward(ro)
    assert out.metrics["routing_replay/conflicts"] == 0 and out.metrics["routing_replay/unrouted"] == 0
    # the reference: trajectory-wise rows through the naive replaying MoE
    ref_model = _model()
    for j, m in enumerate(ref_model.moe_layers()):
        m.replay_layer_ref = j
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CompactMoE, "forward", _naive_forward(routes))
        ref_engine = HartsEngine(ref_model, EngineConfig(capacity=BIG, mode="trajectory", loss_config=LOSS))
        ref = ref_engine.forward_backward(ro)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=TOL["logprobs"][0], rtol=TOL["logprobs"][1])
    g, gr = _grads(replay.model), _grads(ref_model)
    for j in range(M):  # the router is trained through the gates of the replayed experts
        name = f"blocks.{[i for i, f in enumerate(CFG.ffns) if f == 'moe'][j]}.ffn.router"
        assert g[name].abs().sum() > 0
    for n in gr:
        torch.testing.assert_close(
            g[n], gr[n], atol=TOL["grad"][0], rtol=TOL["grad"][1], msg=lambda m, n=n: f"d{n}: {m}"
        )
    # without replay the same weights give other log-probs: the routes mattered
    plain = HartsEngine(_model(), EngineConfig(capacity=BIG, loss_config=LOSS)).logprobs(ro)
    assert float((plain - out.logprobs).abs().max()) > 1e-2


def _disagreeing_routes(batch, seed):
    """Random routes per semantic position (shared-prefix positions disagree), some unknown (-1)."""
    g = torch.Generator().manual_seed(seed)
    s = int(batch.semantic_tokens)
    routes = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s * M)]).view(s, M, K)
    unknown = torch.rand(s, M, generator=g) < 0.2
    return routes.masked_fill(unknown[..., None], -1)


def _resolve_oracle(routes, cmap, c):
    """One route per (row, layer): the first position (lowest index) with a known one."""
    out = torch.full((c, routes.shape[1], routes.shape[2]), -1, dtype=torch.int64)
    conflicts = unrouted = 0
    for layer in range(routes.shape[1]):
        for row in range(c):
            known = [s for s in range(len(cmap)) if cmap[s] == row and routes[s, layer, 0] >= 0]
            if not known:
                unrouted += 1
                continue
            out[row, layer] = routes[known[0], layer]
            chosen = sorted(routes[known[0], layer].tolist())
            conflicts += sum(sorted(routes[s, layer].tolist()) != chosen for s in known)
    return out, conflicts, unrouted


@pytest.mark.parametrize("seed", range(3))
def test_resolution_equals_the_brute_force_oracle(seed):
    batch, _ = _tree()
    routes = _disagreeing_routes(batch, seed)
    cmap = np.asarray(batch.compact_map, dtype=np.int64)
    got = resolve_routes(routes, cmap, int(batch.compact_tokens), E)
    want = _resolve_oracle(routes, cmap, int(batch.compact_tokens))
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
    assert want[1] > 0 and want[2] > 0


def test_compact_equals_trajectory_with_replay_and_disagreeing_routes():
    batch, trajs = _tree()
    routes = _disagreeing_routes(batch, 5)
    ro = _rollouts(trajs, routes)
    runs = {}
    for mode, recompute in (("compact", False), ("trajectory", False), ("compact", True)):
        cfg = EngineConfig(
            capacity=40,
            mode=mode,
            routing_replay=True,
            compact_always=True,
            loss_config=LOSS,
            recompute=recompute,
        )
        engine = HartsEngine(_model(), cfg)
        runs[mode, recompute] = (engine.forward_backward(ro), _grads(engine.model))
    (oc, gc), (ot, gt) = runs["compact", False], runs["trajectory", False]
    ore, gre = runs["compact", True]  # recomputation replays the same routes in its second forward
    torch.testing.assert_close(ore.logprobs, oc.logprobs, rtol=0, atol=0)
    assert gre.keys() == gc.keys()
    for n, g in gc.items():
        torch.testing.assert_close(gre[n], g)
    _, conflicts, unrouted = _resolve_oracle(routes, np.asarray(batch.compact_map), int(batch.compact_tokens))
    for o in (oc, ot):
        assert o.metrics["routing_replay/conflicts"] == conflicts > 0
        assert o.metrics["routing_replay/unrouted"] == unrouted > 0
    assert oc.metrics["rows"] < ot.metrics["rows"] and oc.metrics["microbatches"] >= 2
    torch.testing.assert_close(oc.logprobs, ot.logprobs, atol=TOL["logprobs"][0], rtol=TOL["logprobs"][1])
    assert oc.loss == pytest.approx(ot.loss, rel=1e-5, abs=1e-7)
    for n, g in gt.items():
        torch.testing.assert_close(
            gc[n], g, atol=TOL["grad"][0], rtol=TOL["grad"][1], msg=lambda m, n=n: f"d{n}: {m}"
        )


def test_bad_routes_are_refused_naming_the_field():
    batch, trajs = _tree()
    s = int(batch.semantic_tokens)
    good = _disagreeing_routes(batch, 0)
    replay = EngineConfig(capacity=BIG, routing_replay=True, loss_config=LOSS)
    for bad, field in (
        (
            good.clone().index_fill_(0, torch.tensor([3]), E),
            r"^routes\[3\]\[0\]: .*distinct expert ids in \[0, 4\)",
        ),
        (good.clone().index_put_((torch.tensor([4]),), torch.tensor([1, 1])), r"^routes\[4\]\[0\]"),
        (good.clone().index_put_((torch.tensor([5]),), torch.tensor([-1, 2])), r"^routes\[5\]\[0\]"),
        (good[:, :1], r"^routes: expected \[S, M = 2 MoE layers, k = 2\]"),
    ):
        with pytest.raises(InvalidInputError, match=field):
            HartsEngine(_model(), replay).forward_backward(_rollouts(trajs, bad))
    with pytest.raises(InvalidInputError, match=r"^routes\[1\]\[1\]\[0\]: expert ids are >= 0"):
        _rollouts(trajs, good.clone().index_fill_(0, torch.tensor([len(trajs[0]) + 1]), -3))
    with pytest.raises(InvalidInputError, match=r"^routes\[1\]: expected \["):
        Rollouts.from_lists(
            trajs, routes=[np.zeros((len(t) + (i == 1), M, K), np.int64) for i, t in enumerate(trajs)]
        )
    plain = _rollouts(trajs, good)
    plain.routes = None
    with pytest.raises(InvalidInputError, match="^routes: routing_replay is on but the step has none"):
        HartsEngine(_model(), replay).forward_backward(plain)
    dense = HybridModel(CFG.replace(ffns=("dense",) * len(CFG.ffns)))
    with pytest.raises(InvalidInputError, match="^routing_replay: the model has no MoE layer"):
        HartsEngine(dense, replay)
    assert s == len(good)


@pytest.mark.parametrize("score_func,norm", [("softmax", False), ("sigmoid", True), ("softmax", True)])
def test_the_layer_gathers_the_familys_gates_at_the_given_experts(score_func, norm):
    from harts_runtime.layers.moe import MoEConfig
    from harts_runtime.layout.rows import RowLayout

    torch.manual_seed(1)
    cfg = MoEConfig(
        hidden_size=16,
        num_experts=6,
        top_k=2,
        intermediate_size=8,
        score_func=score_func,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
        grouped=True,
    )
    moe = CompactMoE(cfg).double()
    x = torch.randn(9, 16, dtype=torch.float64)
    own = moe(x).topk_idx
    given = torch.stack([torch.randperm(6)[:2] for _ in range(9)])
    given[4] = -1  # unknown: the router's own choice
    moe.replay_layer = 0
    layout = RowLayout(9, info={"routes": given[:, None, :]})
    out = moe(x, layout)
    scores = (x @ moe.router.t()).softmax(-1) if score_func == "softmax" else (x @ moe.router.t()).sigmoid()
    for r in range(9):
        ids = own[r] if r == 4 else given[r]
        w = scores[r, ids]
        w = w / w.sum() if norm else w
        want = sum(2.5 * w[j] * moe._ffn(x[r : r + 1], int(ids[j]))[0] for j in range(2))
        torch.testing.assert_close(out.hidden[r], want, rtol=1e-12, atol=1e-12)
        assert out.topk_idx[r].tolist() == ids.tolist()
    g = torch.autograd.grad(out.hidden.sum(), moe.router)[0]
    assert g.abs().sum() > 0  # the router is trained through the gates
    with pytest.raises(InvalidInputError, match="^routes: routing_replay is on but this microbatch has none"):
        moe(x, RowLayout(9))


def _mesh_worker(rank, world, dims_kw, routes):
    from harts_runtime.parallel import ParallelDims

    batch, trajs = _tree()
    mesh = ParallelDims(world_size=world, **dims_kw).build_mesh()
    engine = HartsEngine(
        _model(), EngineConfig(capacity=40, routing_replay=True, loss_config=LOSS), mesh=mesh
    )
    out = engine.forward_backward(_rollouts(trajs, routes))
    return out.logprobs, out.metrics["routing_replay/conflicts"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "dims_kw", [dict(dp_shard=2), dict(tp=2, sequence_parallel=True)], ids=["dp_shard2", "tp2-sp"]
)
def test_replay_on_a_mesh_equals_one_process(dims_kw):
    from harts_runtime.parallel import run_distributed

    batch, trajs = _tree()
    routes = _disagreeing_routes(batch, 9)
    engine = HartsEngine(_model(), EngineConfig(capacity=40, routing_replay=True, loss_config=LOSS))
    ref = engine.forward_backward(_rollouts(trajs, routes))
    for lp, conflicts in run_distributed(_mesh_worker, 2, dims_kw, routes, timeout=240):
        torch.testing.assert_close(lp, ref.logprobs, atol=TOL["logprobs"][0], rtol=TOL["logprobs"][1])
        assert conflicts == ref.metrics["routing_replay/conflicts"] > 0


def test_replayed_log_probs_equal_the_rollout_engines_where_routing_flips_without():
    """The rollout engine selects with an expert bias (selection only, as aux-loss-free balancing
    does) the trainer does not have: the same weights and gates, other experts. Replaying its routes,
    the trainer's compact log-probs are the rollout engine's; without, they are not."""
    bias_cfg = CFG.replace(moe={**vars(CFG.moe), "use_expert_bias": True})
    batch, trajs = _tree()
    torch.manual_seed(0)
    rollout = HybridModel(bias_cfg)
    state = {k: v.clone() for k, v in rollout.state_dict().items()}
    g = torch.Generator().manual_seed(3)
    for m in rollout.moe_layers():
        m.expert_bias.copy_(0.2 * torch.randn(E, generator=g))
    seen = []
    hooks = [
        m.register_forward_hook(lambda mod, a, out: seen.append(out.topk_idx)) for m in rollout.moe_layers()
    ]
    s = int(batch.semantic_tokens)
    unknown = _rollouts(trajs, np.full((s, M, K), -1))
    mu = HartsEngine(rollout, EngineConfig(capacity=BIG, mode="trajectory", loss_config=LOSS)).logprobs(
        unknown
    )
    for h in hooks:
        h.remove()
    routes = torch.stack(seen, 1)
    ro = _rollouts(trajs, routes)
    out = {}
    for replay in (False, True):
        trainer = HybridModel(bias_cfg)
        trainer.load_state_dict(state)  # zero expert bias
        cfg = EngineConfig(capacity=40, routing_replay=replay, compact_always=True, loss_config=LOSS)
        out[replay] = HartsEngine(trainer, cfg).forward_backward(ro)
    own = _own_topk(trajs)
    assert (own.sort(-1).values != routes.sort(-1).values).any(-1).double().mean() > 0.05  # routes flip
    assert float((out[False].logprobs - mu).abs().max()) > 1e-3
    torch.testing.assert_close(out[True].logprobs, mu, atol=TOL["logprobs"][0], rtol=TOL["logprobs"][1])
    assert out[True].metrics["routing_replay/conflicts"] == 0
