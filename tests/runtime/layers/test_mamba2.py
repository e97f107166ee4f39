"""Mamba2 (SSD) over rollout trees (the operator itself: tests/kernels/test_ssd_op.py) against its references and transformers' Nemotron-H mixer.

* :class:`Mamba2Mixer` loads transformers' ``NemotronHMamba2Mixer`` state dict (``strict=True``,
  perturbed weights, conv bias, 2 groups of heads) and ``forward_trajectories`` equals HF run on
  each trajectory alone;
* the compact forward over a rollout tree's minimum-call plan (forks on and off the chunk grid:
  replay rows and several rounds of boundary-state handoffs) equals HF per trajectory, outputs
  and the gradients of the input and every parameter, plain and recomputed; the no-replay
  ablation too;
* on random forests (hypothesis) the compact forward and backward equal the brute-force
  per-trajectory run of the same layer.
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch.utils.checkpoint import checkpoint
from trees import forests

transformers = pytest.importorskip("transformers")
hp = pytest.importorskip("harts_planner")

from harts_runtime.layers.mamba2 import Mamba2Config, Mamba2Mixer  # noqa: E402
from harts_runtime.layout import KDAExecutionPlan, RowLayout  # noqa: E402
from harts_runtime.testing import FreshTokens as Tokens  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

B = 8  # our chunk size (HF's own: 128 by default, 16 here)
D = 32
TOL = {"y": 1e-5, "dx": 1e-4, "param": 1e-4, "no_replay": 1e-4}
SHAPE = dict(
    hidden_size=D,
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=6,
    n_groups=2,
    conv_kernel=4,
    chunk_size=16,
    layer_norm_epsilon=1e-5,
)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- the layer against transformers
def hf_mixer(seed: int = 0, **shape):
    """transformers' Nemotron-H Mamba2 mixer with seed-fixed, perturbed weights."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    torch.manual_seed(seed)
    cfg = transformers.NemotronHConfig(**{**SHAPE, **shape}, layers_block_type=["mamba"])
    mixer = NemotronHMamba2Mixer(cfg, 0).float().eval()
    with torch.no_grad():
        for name, t in mixer.named_parameters():
            if name.endswith("weight") and t.dim() == 2:
                t.copy_(torch.randn_like(t) * t.shape[1] ** -0.5)
            elif name == "conv1d.weight":
                t.copy_(torch.randn_like(t) * 0.5)
            elif name == "A_log":
                t.copy_(torch.log(torch.empty_like(t).uniform_(0.5, 4)))
            else:  # conv bias, dt_bias, D, norm weight
                t.copy_(t + 0.3 * torch.randn_like(t))
    return mixer, cfg


def ours_from(hf, cfg, chunk_size=B) -> Mamba2Mixer:
    ours = Mamba2Mixer(
        Mamba2Config(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.mamba_num_heads,
            head_dim=cfg.mamba_head_dim,
            state_size=cfg.ssm_state_size,
            n_groups=cfg.n_groups,
            conv_kernel_size=cfg.conv_kernel,
            use_conv_bias=cfg.use_conv_bias,
            use_bias=cfg.use_bias,
            norm_eps=cfg.layer_norm_epsilon,
            time_step_limit=tuple(cfg.time_step_limit),
            chunk_size=chunk_size,
        )
    )
    ours.load_state_dict(hf.state_dict(), strict=True)
    return ours


def hf_per_trajectory(hf, x_sem, offsets):
    return torch.cat([hf(x_sem[None, offsets[j] : offsets[j + 1]])[0] for j in range(len(offsets) - 1)])


def tree(b=B):
    """Forks off and on the chunk grid, nested forks, an unshared and a one-token trajectory."""
    t = Tokens()
    trunk = t(3 * b + 5)
    a = trunk[: b + 3] + t(2 * b + 1)
    c = a[: 2 * b + 2] + t(b + 4)
    d = trunk[:b] + t(b - 2)
    e = trunk[: 2 * b] + t(3)
    f = trunk[:3] + t(4)
    return [trunk, a, c, d, e, f, t(b + 1), t(1)]


def plan_of(trajs, conv=4):
    plan = hp.plan_calls(hp.RolloutBatch.from_token_lists(trajs), chunk_size=B, conv_width=conv)
    ep = KDAExecutionPlan.from_call_plan(plan)
    s2p = torch.from_numpy(np.asarray(plan.semantic_to_physical, dtype=np.int64))
    return plan, RowLayout(ep.num_rows, kda=ep), s2p, np.asarray(plan.semantic_offsets, dtype=np.int64)


@pytest.mark.parametrize(
    "shape", [{}, dict(n_groups=1, conv_kernel=3, use_conv_bias=False, time_step_limit=(0.05, 2.0))]
)
def test_state_dict_is_hf_and_trajectories_match(shape):
    hf, cfg = hf_mixer(**shape)
    ours = ours_from(hf, cfg)
    assert set(Mamba2Mixer.as_hf(ours.state_dict())) == set(hf.state_dict())
    for name, t in Mamba2Mixer.as_hf(ours.state_dict()).items():
        assert torch.equal(t, hf.state_dict()[name]), name
    lens = [1, 5, B, 3 * B + 3, 37]  # 37 > HF's chunk of 16
    offsets = np.concatenate([[0], np.cumsum(lens)])
    x = torch.randn(int(offsets[-1]), D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_per_trajectory(hf, x, offsets)
        for chunk in (B, 64):
            got = ours.forward_trajectories(x, offsets, chunk_size=chunk)
            assert rel(got, want) <= TOL["y"], (chunk, rel(got, want))


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_compact_equals_hf_per_trajectory(recompute):
    hf, cfg = hf_mixer()
    ours = ours_from(hf, cfg)
    plan, lay, s2p, offsets = plan_of(tree(), cfg.conv_kernel)
    assert plan.num_calls >= 3 and plan.replay_tokens > 0 and plan.num_state_slots > 0
    x = torch.randn(plan.compact_tokens, D, generator=torch.Generator().manual_seed(2))
    w_out = torch.randn(len(s2p), D, generator=torch.Generator().manual_seed(3))

    xc = x.clone().requires_grad_(True)
    y = (checkpoint(ours, xc, lay, use_reentrant=False) if recompute else ours(xc, lay))[s2p]
    params = dict(ours.named_parameters())
    g_ours = torch.autograd.grad((y * w_out).sum(), [xc, *params.values()])

    xh = x.clone().requires_grad_(True)
    yh = hf_per_trajectory(hf, xh[s2p], offsets)
    hf_params = dict(hf.named_parameters())
    g_hf = torch.autograd.grad((yh * w_out).sum(), [xh, *hf_params.values()])
    mapped = Mamba2Mixer.as_hf(dict(zip(params, g_ours[1:])))  # our split blocks -> HF's fused tensors
    g_ours = (g_ours[0], *(mapped[n] for n in hf_params))
    params = hf_params

    if not recompute:
        with torch.no_grad():
            y_nr = ours(x, lay.replace(no_replay=True))[s2p]
        assert rel(y_nr, yh.detach()) <= TOL["no_replay"]
    errs = {"y": rel(y.detach(), yh.detach())}
    for name, a, b in zip(["x", *params], g_ours, g_hf):
        errs[name] = rel(a, b)
    for name, e in errs.items():
        tol = TOL["y" if name == "y" else "dx" if name == "x" else "param"]
        assert e <= tol, f"d{name}: relative error {e:.2e} > {tol:.0e} (all: {errs})"


# ---------------------------------------------------------------- random forests: brute force
_LAYER = {}


def _layer():
    if not _LAYER:
        hf, cfg = hf_mixer(seed=5, conv_kernel=3)
        _LAYER["m"] = ours_from(hf, cfg)
    return _LAYER["m"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forests(max_num=6, vocab=5, max_new=2 * B + 3))
def test_compact_equals_brute_force_on_random_forests(trajs):
    ours = _layer()
    plan, lay, s2p, offsets = plan_of(trajs, 3)
    x = torch.randn(plan.compact_tokens, D, generator=torch.Generator().manual_seed(4))
    w_out = torch.randn(len(s2p), D, generator=torch.Generator().manual_seed(5))
    params = list(ours.parameters())
    xc = x.clone().requires_grad_(True)
    y = ours(xc, lay)[s2p]
    g = torch.autograd.grad((y * w_out).sum(), [xc, *params])
    xb = x.clone().requires_grad_(True)
    yb = ours.forward_trajectories(xb[s2p], offsets, chunk_size=B)
    gb = torch.autograd.grad((yb * w_out).sum(), [xb, *params])
    assert rel(y.detach(), yb.detach()) <= 1e-5
    for a, b in zip(g, gb):
        assert rel(a, b) <= 1e-4


@pytest.mark.gpu
def test_compact_matches_hf_on_cuda():
    """The compact layer on CUDA (fla's simple-GLA core, chunk 64, forks on and off the grid)
    against HF's PyTorch mixer on each trajectory alone, fp32: outputs and all gradients."""
    dev, b = torch.device("cuda"), 64
    hf, cfg = hf_mixer(
        hidden_size=256, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=64, chunk_size=128
    )
    ours = ours_from(hf, cfg, chunk_size=b).to(dev)
    hf = hf.to(dev)
    plan = hp.plan_calls(hp.RolloutBatch.from_token_lists(tree(b)), chunk_size=b, conv_width=cfg.conv_kernel)
    assert plan.num_calls >= 3 and plan.replay_tokens > 0
    lay = RowLayout(plan.compact_tokens, kda=KDAExecutionPlan.from_call_plan(plan).to(dev))
    s2p = torch.from_numpy(np.asarray(plan.semantic_to_physical, dtype=np.int64)).to(dev)
    offsets = np.asarray(plan.semantic_offsets, dtype=np.int64)
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(plan.compact_tokens, 256, generator=gen, device=dev)
    w_out = torch.randn(len(s2p), 256, generator=gen, device=dev)
    xc = x.clone().requires_grad_(True)
    (ours(xc, lay)[s2p] * w_out).sum().backward()
    xh = x.clone().requires_grad_(True)
    y = ours(x, lay)[s2p]
    yh = hf_per_trajectory(hf, xh[s2p], offsets)
    (yh * w_out).sum().backward()

    def ratio(a, ref):
        return ((a.double() - ref.double()).norm() / ref.double().norm()).item()

    errs = {"y": ratio(y.detach(), yh.detach()), "dx": ratio(xc.grad, xh.grad)}
    hp_ = dict(hf.named_parameters())
    for n, g in Mamba2Mixer.as_hf({n: p.grad for n, p in ours.named_parameters()}).items():
        errs["d" + n] = ratio(g, hp_[n].grad)
    print({n: f"{e:.2e}" for n, e in errs.items()})
    for n, e in errs.items():
        assert e < 5e-3, (n, e)
