"""KDA layer over minimum-call plans: compact execution equals trajectory-wise execution.

Every root-to-leaf trajectory is run unshared through the same layer
(:meth:`KDALayer.forward_trajectories`); the compact layer runs the plan's rounds with replay,
boundary-state handoffs and true-ancestor convolution context. Outputs at every semantic
position and the gradients of all parameters and of the compact input must agree (fp32), also
when the layer is recomputed in backward (``torch.utils.checkpoint``, as ``apply_recompute`` wraps
a block).
"""

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import harts_planner as hp
import harts_runtime.layers.kda as kda_mod
from harts_runtime.layers.kda import KDAConfig, KDALayer
from harts_runtime.layout import KDAExecutionPlan, RowLayout
from harts_runtime.testing import FreshTokens as Tokens
from harts_runtime.testing import random_trajectories

B = 8  # small chunk so that trees stay small
D = 16

# Named tolerances (atol, rtol) for compact vs trajectory-wise, fp32.
TOL = {"y": (2e-6, 1e-5), "dx": (1e-5, 1e-4), "param": (2e-5, 1e-4)}


def forks_around_chunk_boundary(t=None):
    t = t or Tokens()
    trunk = t(3 * B + 5)
    return [trunk] + [trunk[:p] + t(B + 3) for p in (B - 1, B, B + 1, 2 * B - 1, 2 * B, 2 * B + 1)]


def nested_forks_in_one_chunk(t=None):
    t = t or Tokens()
    trunk = t(3 * B)
    a = trunk[: B + 2] + t(2 * B)  # fork inside chunk 1
    b = a[: B + 5] + t(B + 1)  # nested fork, same chunk
    c = b[: B + 6] + t(3)  # and again
    d = trunk[:2] + t(B)  # nested forks inside chunk 0
    e = d[:3] + t(5)
    return [trunk, a, b, c, d, e]


def deep_chain(t=None, depth=7, step=3):
    t = t or Tokens()
    trajs = [t(depth * step + B)]
    for i in range(1, depth):
        p = i * step + (i % 3)  # a fork deeper on each previous branch
        trajs.append(trajs[-1][:p] + t(depth * step + B - p))
    return trajs


def high_fan_out(t=None):
    t = t or Tokens()
    trunk = t(2 * B + 4)
    out = [trunk] + [trunk[: B + 3] + t(2 + i) for i in range(8)]  # 9 children mid-chunk
    out += [trunk[: 2 * B] + t(1 + i) for i in range(5)]  # 6 children at a boundary
    return out


def binary_tree(t=None, depth=3, seg=B + 3):
    """Every segment crosses a chunk boundary and forks mid-chunk: depth + 1 rounds, so states
    returned by round r >= 2 feed round r + 1."""
    t = t or Tokens()

    def grow(prefix, d):
        path = prefix + t(seg)
        return [path] if d == 0 else grow(path, d - 1) + grow(path, d - 1)

    return grow([], depth)


def random_tree(t, rng, n=8, length=30):
    """One tree of ``n`` trajectories from the suites' generator: prefixes copied, fresh tokens appended
    (so the only sharing is the copied prefixes), first trajectory 5..length tokens, tails 1..length."""
    return random_trajectories(
        rng, n, max_new=length, new_tree_prob=0.0, min_new=1, first_len=(5, length), tokens=t
    )


def many_trees():
    t, rng = Tokens(), np.random.default_rng(7)
    out = forks_around_chunk_boundary(t) + deep_chain(t, depth=4) + high_fan_out(t)
    for _ in range(4):
        out += random_tree(t, rng)
    out += [t(1), t(B), t(B + 1)]  # unshared trajectories, one a single token
    return out


def random_forest_seed(seed):
    def build():
        t, rng = Tokens(), np.random.default_rng(seed)
        out = []
        for _ in range(3):
            out += random_tree(t, rng, n=int(rng.integers(2, 10)), length=3 * B)
        return out

    return build


SCENARIOS = {
    "forks_B-1_B_B+1": forks_around_chunk_boundary,
    "nested_in_chunk": nested_forks_in_one_chunk,
    "deep_chain": deep_chain,
    "high_fan_out": high_fan_out,
    "binary_tree": binary_tree,
    "many_trees": many_trees,
    "random_1": random_forest_seed(1),
    "random_2": random_forest_seed(2),
}


def setup(trajs, seed=0):
    batch = hp.RolloutBatch.from_token_lists(trajs)
    plan = hp.plan_calls(batch, chunk_size=B, conv_width=4)
    torch.manual_seed(seed)
    layer = KDALayer(KDAConfig(hidden_size=D, num_heads=2, head_k_dim=8, head_v_dim=8, chunk_size=B))
    x = torch.randn(plan.compact_tokens, D)
    s2p = torch.from_numpy(np.asarray(plan.semantic_to_physical, dtype=np.int64))
    ep = KDAExecutionPlan.from_call_plan(plan)
    return plan, RowLayout(ep.num_rows, kda=ep), layer, x, s2p


def forward(layer, x, layout, recompute=False):
    """The layer, or the layer recomputed in backward (as a block under ``apply_recompute``)."""
    return checkpoint(layer, x, layout, use_reentrant=False) if recompute else layer(x, layout)


def run_both(layer, lay, plan, x, s2p, w_out, recompute=False):
    params = [p for _, p in layer.named_parameters()]
    xc = x.clone().requires_grad_(True)
    y = forward(layer, xc, lay, recompute)[s2p]
    gc = torch.autograd.grad((y * w_out).sum(), [xc] + params)
    xt = x.clone().requires_grad_(True)
    yt = layer.forward_trajectories(xt[s2p], plan.semantic_offsets)
    gt = torch.autograd.grad((yt * w_out).sum(), [xt] + params)
    return y.detach(), yt.detach(), gc, gt


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_compact_equals_trajectory_wise(scenario, recompute):
    plan, lay, layer, x, s2p = setup(SCENARIOS[scenario]())
    w_out = torch.randn(len(s2p), D, generator=torch.Generator().manual_seed(3))
    y, yt, gc, gt = run_both(layer, lay, plan, x, s2p, w_out, recompute=recompute)
    torch.testing.assert_close(
        y, yt, atol=TOL["y"][0], rtol=TOL["y"][1], msg=lambda m: f"y (every semantic position): {m}"
    )
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, gc, gt):
        atol, rtol = TOL["dx" if name == "x" else "param"]
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, n=name: f"d{n}: {m}")


def test_scenarios_exercise_handoffs_and_replay():
    for name in ("forks_B-1_B_B+1", "nested_in_chunk", "deep_chain", "high_fan_out", "many_trees"):
        plan = hp.plan_calls(hp.RolloutBatch.from_token_lists(SCENARIOS[name]()), chunk_size=B)
        assert plan.num_calls >= 2, name
        assert plan.replay_tokens > 0 and plan.num_state_slots > 0, name
    plan = hp.plan_calls(hp.RolloutBatch.from_token_lists(binary_tree()), chunk_size=B)
    assert plan.num_calls == 4


def test_one_projection_per_compact_row_and_one_call_per_round(monkeypatch):
    plan, lay, layer, x, _ = setup(forks_around_chunk_boundary())
    rows, calls = [], []
    layer.q_proj.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
    real = kda_mod.chunk_kda_with_states

    def counting(*a, **k):
        calls.append(len(k["cu_seqlens"]) - 1)
        return real(*a, **k)

    monkeypatch.setattr(kda_mod, "chunk_kda_with_states", counting)
    xc = x.clone().requires_grad_(True)
    layer(xc, lay).sum().backward()
    assert rows == [plan.compact_tokens]
    assert calls == [int(n) for n in np.diff(plan.round_sequence_offsets)]  # one call per round
    rows.clear()
    calls.clear()
    forward(layer, xc, lay, recompute=True).sum().backward()
    assert rows == [plan.compact_tokens] * 2  # forward + recompute
    assert len(calls) == 2 * plan.num_calls


def test_no_replay_is_exact_math_but_a_measurably_different_path():
    """Section 5.4 ablation: resuming from the parent's final state without restoring the chunk
    phase computes the same function (tolerance) but not the trajectory-wise floating-point path;
    replay reproduces it."""
    t = Tokens()
    trajs = []
    for _ in range(3):
        trunk = t(5 * B)
        trajs.append(trunk)
        for p in (B - 1, B + 1, 2 * B + 3, 2 * B + 5, 3 * B + 2):
            br = trunk[:p] + t(2 * B)
            trajs += [br, br[: p + 4] + t(B + 3)]
    plan, lay, layer, x, s2p = setup(trajs)
    with torch.no_grad():
        yt = layer.forward_trajectories(x[s2p], plan.semantic_offsets)
        err_replay = (layer(x, lay)[s2p] - yt).abs()
        err_no_replay = (layer(x, lay.replace(no_replay=True))[s2p] - yt).abs()
    torch.testing.assert_close(err_no_replay, torch.zeros_like(yt), atol=1e-4, rtol=0)  # same math
    assert err_replay.max() <= TOL["y"][0]
    assert err_no_replay.max() > 1e-7
    assert err_no_replay.mean() > 10 * err_replay.mean(), (err_no_replay.mean(), err_replay.mean())
    assert (err_no_replay > 0).float().mean() > 0.3  # most branch positions differ


def test_plan_mismatch_is_rejected():
    _, lay, layer, x, _ = setup(deep_chain())
    with pytest.raises(ValueError, match="x: expected"):
        layer(x[:-1], lay)
    other = KDALayer(KDAConfig(hidden_size=D, num_heads=2, head_k_dim=8, head_v_dim=8, chunk_size=16))
    with pytest.raises(ValueError, match="chunk_size"):
        other(x, lay)
    with pytest.raises(ValueError, match="layout.kda") as e:
        layer(x, RowLayout(x.shape[0]))  # a layout without a KDA plan
    assert e.value.field == "layout.kda"
