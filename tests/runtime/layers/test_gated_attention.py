"""Qwen3-Next / Qwen3.5 gated full attention on compact rows against transformers (CPU, float32).

A tiny transformers ``Qwen3NextAttention`` (and ``Qwen3_5MoeAttention``) with a fixed seed and
non-trivial q/k norm weights gives its state dict to :class:`CompactGatedAttention`
(``strict=True``). Every trajectory's rows of our layer must equal transformers run on that
trajectory alone (eager attention, causal mask): outputs, and the gradients of the input rows and of
every parameter under a loss whose weights differ between semantic positions that share a compact
row (so gradient accumulation into shared rows is checked). Layouts: the baseline's trajectory
layout (rows = semantic positions) and the compact layout of a call plan over a rollout tree.
The norms are checked against transformers' norms directly.
"""

import numpy as np
import pytest
import torch

import harts_planner as hp
from harts_runtime.layers.gated_attention import CompactGatedAttention, GatedAttentionConfig
from harts_runtime.layout import compact_layout, trajectory_layout
from harts_runtime.modules.norms import GatedRMSNorm, RMSNorm
from harts_runtime.testing import random_trajectories

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
from transformers import Qwen3NextConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# float32 tolerances per tensor (transformers' eager attention and ours do the same math in a
# different order; the measured maxima are 4-20x below these: out 2.4e-7, dhidden 6.6e-7,
# dparam 1.1e-5 absolute, all under 7e-7 relative to the largest entry)
TOL_OUT = {"rtol": 1e-5, "atol": 1e-6}  # layer outputs, |y| ~ 0.5
TOL_DHIDDEN = {"rtol": 1e-5, "atol": 1e-5}  # input-row gradients, summed over many positions
TOL_DPARAM = {"rtol": 1e-5, "atol": 1e-4}  # weight gradients, summed over all rows (|g| ~ 10-100)
TOL_BF16_OUT = {"rtol": 2e-2, "atol": 1e-2}  # bfloat16 layer outputs (measured max |diff| 2e-3)

VARIANTS = {  # heads, kv heads, head_dim, partial_rotary_factor, attention_bias
    "gqa_partial_rope": (4, 2, 16, 0.25, False),
    "mha_full_rope_bias": (4, 4, 8, 1.0, True),
}
HIDDEN = 64


def hf_config(variant: str, **overrides) -> Qwen3NextConfig:
    heads, kv, dh, prf, bias = VARIANTS[variant]
    kw = dict(
        hidden_size=HIDDEN,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=dh,
        partial_rotary_factor=prf,
        attention_bias=bias,
        num_hidden_layers=1,
        vocab_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=2,
        num_experts_per_tok=1,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return Qwen3NextConfig(**kw)


def ours_config(c) -> GatedAttentionConfig:
    return GatedAttentionConfig(
        hidden_size=c.hidden_size,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rope_theta=c.rope_parameters["rope_theta"],
        partial_rotary_factor=c.rope_parameters["partial_rotary_factor"],
        rms_norm_eps=c.rms_norm_eps,
        attention_bias=c.attention_bias,
    )


def make_pair(variant: str, seed: int = 0):
    """(transformers attention, its rotary embedding, our layer with the same weights)."""
    cfg = hf_config(variant)
    torch.manual_seed(seed)
    hf = qwen3_next.Qwen3NextAttention(cfg, layer_idx=0)
    with torch.no_grad():  # zero-init norm weights would not exercise ``1 + w``; biases likewise
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(0.0, 0.3)
    ours = CompactGatedAttention(ours_config(cfg))
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, qwen3_next.Qwen3NextRotaryEmbedding(cfg), ours


def hf_trajectory(hf, rotary, x: torch.Tensor) -> torch.Tensor:
    """transformers on one trajectory x [L, D] (positions 0..L-1, causal) -> [L, D]."""
    n = x.shape[0]
    cos, sin = rotary(x[None], torch.arange(n)[None])
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    return hf(x[None], (cos, sin), mask)[0][0]


def tree_batch(seed: int):
    """A rollout forest with shared prompts, forks, prefix trajectories and duplicates."""
    return hp.RolloutBatch.from_token_lists(
        random_trajectories(np.random.default_rng(seed), num=7, max_new=8)
    )


def max_err(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, that over max |b|)."""
    a, b = a.detach(), b.detach()
    err = float((a - b).abs().max())
    return err, err / max(float(b.abs().max()), 1e-30)


def compare(ours, hf, hidden, out, rows_of_trajectory, weights, errors: dict | None = None):
    """Backward ours ``(out[sem] * weights).sum()`` and transformers' per-trajectory loss with the same
    weights; compare outputs, d(hidden) and every parameter gradient (name by name)."""
    sem = torch.from_numpy(np.concatenate(rows_of_trajectory))
    (out[sem] * weights).sum().backward()
    got_dh = hidden.grad.clone()

    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ref = torch.cat(
        [hf_trajectory(hf, hf.rotary, ref_hidden[torch.from_numpy(r)]) for r in rows_of_trajectory]
    )
    (ref * weights).sum().backward()

    torch.testing.assert_close(out[sem], ref, **TOL_OUT)
    torch.testing.assert_close(got_dh, ref_hidden.grad, **TOL_DHIDDEN)
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[name].grad, **TOL_DPARAM, msg=f"d{name}")
    if errors is not None:
        errors["out"] = max_err(out[sem], ref)
        errors["dhidden"] = max_err(got_dh, ref_hidden.grad)
        errors["dparam"] = max(max_err(p.grad, hf_params[n].grad) for n, p in ours.named_parameters())


# ------------------------------------------------------------------------------------ the layer
def test_config_maps_and_state_dict_names_match_transformers():
    hf, _, ours = make_pair("gqa_partial_rope")
    assert ours.config.rotary_dim == 4
    assert {n: p.shape for n, p in ours.state_dict().items()} == {
        n: p.shape for n, p in hf.state_dict().items()
    }
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        GatedAttentionConfig(hidden_size=64, num_heads=4, head_dim=16, partial_rotary_factor=0.1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_trajectory_matches_transformers(variant):
    """One causal sequence through forward_trajectory: the same ops as transformers' eager path."""
    hf, rotary, ours = make_pair(variant)
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours.forward_trajectory(x), hf_trajectory(hf, rotary, x), **TOL_OUT)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trajectory_layout_matches_transformers(variant, backend):
    """(a) The baseline's rows: every trajectory expanded and packed back to back."""
    hf, rotary, ours = make_pair(variant)
    hf.rotary = rotary
    batch = tree_batch(3)
    layout = trajectory_layout(batch, np.arange(batch.num_trajectories), chunk_size=8, conv_width=4)
    off = np.asarray(batch.offsets, dtype=np.int64)
    rows = [np.arange(off[i], off[i + 1]) for i in range(batch.num_trajectories)]  # local rows = offsets
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(layout.num_rows, HIDDEN, generator=gen, requires_grad=True)
    weights = torch.randn(layout.num_rows, HIDDEN, generator=gen)
    out = ours(hidden, layout, backend=backend)
    compare(ours, hf, hidden, out, rows, weights)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "dense_tree"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("seed", [0, 5])
def test_compact_layout_matches_transformers_per_trajectory(variant, backend, seed):
    """(b) A rollout tree through a call plan's compact layout: shared prefix rows run once; each
    trajectory's rows (semantic_to_physical) equal transformers run on that trajectory alone."""
    hf, rotary, ours = make_pair(variant, seed)
    hf.rotary = rotary
    batch = tree_batch(seed)
    plan = hp.plan_calls(batch, 8, conv_width=4)
    layout = compact_layout(batch, plan)
    assert layout.num_rows < batch.semantic_tokens  # the tree shares rows
    s2p, off = np.asarray(plan.semantic_to_physical, dtype=np.int64), np.asarray(batch.offsets)
    rows = [s2p[off[i] : off[i + 1]] for i in range(batch.num_trajectories)]
    gen = torch.Generator().manual_seed(seed + 10)
    hidden = torch.randn(layout.num_rows, HIDDEN, generator=gen, requires_grad=True)
    weights = torch.randn(batch.semantic_tokens, HIDDEN, generator=gen)
    out = ours(hidden, layout, backend=backend)
    errors = {}
    compare(ours, hf, hidden, out, rows, weights, errors)
    print(f"{variant} {backend} seed={seed} max (abs, rel) errors: {errors}")


def test_bfloat16_compact_layout_close_to_transformers():
    """bfloat16 weights and rows: transformers' eager path rounds scores and probabilities to
    bfloat16, ours keeps the core in float32, so they agree to bfloat16 rounding."""
    hf, rotary, ours = make_pair("gqa_partial_rope", 1)
    hf, ours = hf.bfloat16(), ours.bfloat16()
    batch = tree_batch(1)
    plan = hp.plan_calls(batch, 8, conv_width=4)
    layout = compact_layout(batch, plan)
    s2p, off = np.asarray(plan.semantic_to_physical, dtype=np.int64), np.asarray(batch.offsets)
    hidden = torch.randn(layout.num_rows, HIDDEN, generator=torch.Generator().manual_seed(7)).bfloat16()
    with torch.no_grad():
        out = ours(hidden, layout, backend="sdpa")
        assert out.dtype == torch.bfloat16
        for i in range(batch.num_trajectories):
            rows = torch.from_numpy(s2p[off[i] : off[i + 1]])
            torch.testing.assert_close(out[rows], hf_trajectory(hf, rotary, hidden[rows]), **TOL_BF16_OUT)


def test_qwen3_5_attention_matches():
    """Qwen3.5's attention is Qwen3-Next's; its text M-RoPE reduces to plain partial RoPE."""
    q35 = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = q35.Qwen3_5MoeAttention(cfg, layer_idx=0)
    with torch.no_grad():
        hf.q_norm.weight.normal_(0.0, 0.3)
        hf.k_norm.weight.normal_(0.0, 0.3)
    ours = CompactGatedAttention(ours_config(cfg))
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(
        ours.forward_trajectory(x), hf_trajectory(hf, q35.Qwen3_5MoeTextRotaryEmbedding(cfg), x), **TOL_OUT
    )


# ------------------------------------------------------------------------------------ the norms
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rmsnorm_equals_transformers(dtype):
    hf = qwen3_next.Qwen3NextRMSNorm(24, eps=1e-6)
    ours = RMSNorm(24, 1e-6, zero_centered=True)
    assert torch.equal(ours.weight, torch.zeros(24))  # zero at init, as transformers
    with torch.no_grad():
        hf.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))
    ours.load_state_dict(hf.state_dict(), strict=True)
    hf, ours = hf.to(dtype), ours.to(dtype)
    x = torch.randn(5, 3, 24, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_(True)
    y = ours(x)
    assert y.dtype == dtype
    assert torch.equal(y, hf(x))  # same float32 ops in the same order: bit-identical
    g = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, ours.weight), g)
    rdx, rdw = torch.autograd.grad(hf(x), (x, hf.weight), g)
    assert torch.equal(dx, rdx) and torch.equal(dw, rdw)


def test_default_rmsnorm_is_unchanged():
    norm = RMSNorm(8, 1e-5)
    assert torch.equal(norm.weight, torch.ones(8)) and not norm.zero_centered
    x = torch.randn(4, 8)
    with torch.no_grad():
        norm.weight.normal_()
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert torch.equal(norm(x), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_gated_rmsnorm_equals_transformers(dtype):
    """Qwen3-Next's gated-delta-net output norm: rmsnorm(x) * w * silu(gate)."""
    hf = qwen3_next.Qwen3NextRMSNormGated(16, eps=1e-6)
    ours = GatedRMSNorm(16, eps=1e-6, activation="silu")
    with torch.no_grad():
        hf.weight.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(0))
    ours.load_state_dict(hf.state_dict(), strict=True)
    hf, ours = hf.to(dtype), ours.to(dtype)
    gen = torch.Generator().manual_seed(1)
    x, gate = (torch.randn(6, 2, 16, generator=gen).to(dtype) for _ in range(2))
    y, ref = ours(x, gate), hf(x, gate)
    assert y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    else:  # transformers rounds rmsnorm(x) to bfloat16 before the weight; fla and we do not
        torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
    sig = GatedRMSNorm(16, eps=1e-6)  # the default stays KDA's sigmoid gate
    xf = x.float()
    expected = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.sigmoid(gate.float())
    assert torch.equal(sig.to(dtype)(x, gate), expected.to(dtype))
    with pytest.raises(ValueError, match="activation"):
        GatedRMSNorm(16, activation="relu")
