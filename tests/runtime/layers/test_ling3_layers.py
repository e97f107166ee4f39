"""Ling-3.0's layer pieces (transformers ``bailing_hybrid``) built directly from their layer
configs, against transformers' modules of the same name (fp32, CPU):

* the bounded KDA gate (``kda_safe_gate``): :func:`~harts_runtime.layers.kda.kda_gate` against
  ``BailingHybridForgetGate`` and fla's ``naive_kda_lowerbound_gate``, forward and backward;
* the KDA layer with that gate and full-rank gate projections against ``BailingHybridDeltaAttention``
  (its one depthwise ``conv1d`` is our three short convolutions stacked), and compact execution
  over a tree against trajectory-wise execution;
* MLA with interleaved RoPE and the head-wise output gate against ``BailingHybridAttention``;
* DeepSeek-V3 group routing with ``e_score_correction_bias`` against ``BailingHybridTopkRouter``;
* the clipped SwiGLU MoE (routed and shared limits) against ``BailingHybridMoE``, both expert
  paths (loop and grouped), and the clipped shared / dense SwiGLU against ``BailingHybridMLP``.
"""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
mb = pytest.importorskip("transformers.models.bailing_hybrid.modeling_bailing_hybrid")
hp = pytest.importorskip("harts_planner")

from harts_runtime.errors import InvalidInputError  # noqa: E402
from harts_runtime.layers.kda import KDAConfig, KDALayer, kda_gate  # noqa: E402
from harts_runtime.layers.mla import CompactMLA, MLAConfig  # noqa: E402
from harts_runtime.layers.moe import CompactMoE, MoEConfig, route  # noqa: E402
from harts_runtime.layout import KDAExecutionPlan, RowLayout  # noqa: E402
from harts_runtime.modules.swiglu import SwiGLU  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

D, H, K = 32, 2, 8
TOL = 1e-5  # fp32, max |ours - HF| over max |HF|


def hf_config(**changes):
    kw = dict(
        vocab_size=64,
        hidden_size=D,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_key_value_heads=H,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=12,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        v_head_dim=8,
        qk_nope_head_dim=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        num_local_experts=8,
        first_k_dense_replace=0,
        head_dim=K,
        layer_group_size=2,
        expert_swiglu_limit_list=[0.3, 0],
        share_expert_swiglu_limit_list=[0.2, 0],
        rope_theta=10_000.0,
        pad_token_id=None,
        eos_token_id=None,
    )
    kw.update(changes)
    return transformers.BailingHybridConfig(**kw)


def perturbed(module, seed=0):
    """``module`` with every floating tensor redrawn, so no default initialisation hides a mapping
    error (norm weights near 1, the rest N(0, 0.3^2)); returns it in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if t.is_floating_point():
                noise = torch.randn(t.shape, generator=g)
                t.copy_(1 + 0.3 * noise if "norm" in name else 0.3 * noise)
    return module.float().eval()


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------ KDA gate
def test_bounded_gate_matches_transformers_and_fla_forward_and_backward():
    from fla.ops.kda.gate import naive_kda_lowerbound_gate

    gate = perturbed(mb.BailingHybridForgetGate(hf_config()))
    gate.A_log.data.uniform_(-1, 2)  # decay rates 0.4 .. 7: the sigmoid neither saturated nor flat
    x = torch.randn(1, 11, D)
    ref = gate(x)[0]  # [L, H, K]
    f = gate.f_proj(x)[0].view(11, H, K).detach().requires_grad_()
    a = gate.A_log.detach().clone().requires_grad_()
    dt = gate.dt_bias.detach().clone().requires_grad_()
    ours = kda_gate(f, a, dt, -5.0)
    assert rel(ours.detach(), ref) <= TOL and float(ours.min()) >= -5.0 and float(ours.max()) < 0
    g = torch.randn_like(ours)
    grads = torch.autograd.grad((ours * g).sum(), [f, a, dt])
    f2, a2, dt2 = (t.detach().clone().requires_grad_() for t in (f, a, dt))
    fla = naive_kda_lowerbound_gate(f2, a2, dt2, lower_bound=-5.0)
    torch.testing.assert_close(ours, fla, rtol=1e-6, atol=1e-6)
    for mine, theirs in zip(grads, torch.autograd.grad((fla * g).sum(), [f2, a2, dt2])):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    # the unbounded gate is still fla's softplus one
    from fla.ops.kda.gate import naive_kda_gate

    torch.testing.assert_close(kda_gate(f, a, dt), naive_kda_gate(f, a, dt), rtol=1e-6, atol=1e-6)


def test_bad_lower_bound_is_named():
    for lb in (0.0, 2.0, float("-inf")):
        with pytest.raises(InvalidInputError, match="gate_lower_bound"):
            KDAConfig(gate_lower_bound=lb)


# ------------------------------------------------------------------------------ KDA layer
def ling_kda(chunk_size=8) -> KDALayer:
    return KDALayer(
        KDAConfig(
            hidden_size=D,
            num_heads=H,
            head_k_dim=K,
            head_v_dim=K,
            chunk_size=chunk_size,
            norm_eps=1e-6,
            backend="naive",
            output_gate_bias=False,
            gate_lower_bound=-5.0,
            low_rank_gates=False,
        )
    )


def kda_from_hf(hf) -> KDALayer:
    ours = ling_kda()
    sd = hf.state_dict()
    q, k, v = sd["conv1d.weight"].chunk(3, dim=0)
    ours.load_state_dict(
        {
            "q_proj.weight": sd["q_proj.weight"],
            "k_proj.weight": sd["k_proj.weight"],
            "v_proj.weight": sd["v_proj.weight"],
            "q_conv1d.weight": q,
            "k_conv1d.weight": k,
            "v_conv1d.weight": v,
            "f_proj.0.weight": sd["forget_gate.f_proj.weight"],
            "b_proj.weight": sd["b_proj.weight"],
            "A_log": sd["forget_gate.A_log"],
            "dt_bias": sd["forget_gate.dt_bias"],
            "g_proj.0.weight": sd["g_proj.weight"],
            "o_norm.weight": sd["o_norm.weight"],
            "o_proj.weight": sd["o_proj.weight"],
        },
        strict=True,
    )
    return ours


def test_kda_layer_matches_transformers():
    hf = perturbed(mb.BailingHybridDeltaAttention(hf_config(), 0))
    hf.forget_gate.A_log.data.uniform_(-1, 2)
    ours = kda_from_hf(hf)
    lengths = (13, 21, 5)
    x = torch.randn(sum(lengths), D)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    y = ours.forward_trajectories(x, offsets)
    with torch.no_grad():
        ref = torch.cat([hf(x[a:b][None])[0] for a, b in zip(offsets[:-1], offsets[1:])])
    err = rel(y.detach(), ref)
    print(f"Ling KDA layer: max relative error {err:.1e}")
    assert err <= TOL


def test_kda_layer_compact_equals_trajectory_wise():
    rng = np.random.default_rng(0)
    trunk = rng.integers(0, 50, 19).tolist()
    trajs = [trunk + rng.integers(0, 50, n).tolist() for n in (4, 9)] + [trunk[:7] + [1, 2, 3]]
    trajs.append(trunk[:8] + [4] * 6)  # a fork on the chunk boundary
    plan = hp.plan_calls(hp.RolloutBatch.from_token_lists(trajs), chunk_size=8, conv_width=4)
    torch.manual_seed(1)
    layer = perturbed(ling_kda(), seed=1)
    layer.A_log.data.uniform_(-1, 2)
    ep = KDAExecutionPlan.from_call_plan(plan)
    s2p = torch.from_numpy(np.asarray(plan.semantic_to_physical, dtype=np.int64))
    x = torch.randn(plan.compact_tokens, D, requires_grad=True)
    y = layer(x, RowLayout(ep.num_rows, kda=ep))[s2p]
    w = torch.randn_like(y)
    params = list(layer.parameters())
    gc = torch.autograd.grad((y * w).sum(), [x] + params)
    yt = layer.forward_trajectories(x[s2p], plan.semantic_offsets)
    gt = torch.autograd.grad((yt * w).sum(), [x] + params)
    torch.testing.assert_close(y, yt, atol=2e-6, rtol=1e-5)
    for a, b in zip(gc, gt):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------------------ MLA
def test_gated_interleaved_mla_matches_transformers():
    cfg = hf_config()
    hf = perturbed(mb.BailingHybridAttention(cfg, 1))
    rope = mb.BailingHybridRotaryEmbedding(cfg)
    ours = CompactMLA(
        MLAConfig(
            hidden_size=D,
            num_heads=H,
            kv_lora_rank=12,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            rope_theta=10_000.0,
            rope_interleave=True,
            output_gate=True,
        )
    )
    sd = hf.state_dict()
    names = {"kv_a_proj_with_mqa": "kv_a_proj", "kv_a_layernorm": "kv_a_norm"}
    ours.load_state_dict({names.get(k.split(".")[0], k.split(".")[0]) + ".weight": v for k, v in sd.items()})
    x = torch.randn(1, 17, D)
    pos = torch.arange(17)[None]
    mask = torch.full((17, 17), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref = hf(x, rope(x, pos), mask)[0][0]
    y = ours.forward_trajectory(x[0])
    err = rel(y.detach(), ref)
    print(f"Ling MLA: max relative error {err:.1e}")
    assert err <= TOL
    # without the gate or with rotate-half RoPE it is measurably different
    ours.config.output_gate = False
    assert rel(ours.forward_trajectory(x[0]).detach(), ref) > 1e-2
    ours.config.output_gate, ours.config.rope_interleave = True, False
    assert rel(ours.forward_trajectory(x[0]).detach(), ref) > 1e-3


# ------------------------------------------------------------------------------ router, MoE
def test_group_routing_matches_transformers():
    cfg = hf_config()
    hf = perturbed(mb.BailingHybridTopkRouter(cfg))
    x = torch.randn(200, D)
    logits, w_ref, idx_ref = hf(x)
    _, idx, w = route(
        logits,
        3,
        "sigmoid",
        expert_bias=hf.e_score_correction_bias,
        norm_topk_prob=True,
        scaling=2.5,
        num_groups=4,
        topk_groups=2,
    )
    order = idx_ref.sort(-1).indices
    idx_ref, w_ref = idx_ref.gather(1, order), w_ref.gather(1, order)
    mine = idx.sort(-1).indices
    assert torch.equal(idx.gather(1, mine), idx_ref)
    torch.testing.assert_close(w.gather(1, mine), w_ref, rtol=1e-6, atol=1e-7)


def moe_from_hf(hf, limit, shared_limit, grouped):
    ours = CompactMoE(
        MoEConfig(
            hidden_size=D,
            num_experts=8,
            top_k=3,
            intermediate_size=16,
            score_func="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            use_expert_bias=True,
            num_expert_groups=4,
            topk_groups=2,
            num_shared_experts=1,
            swiglu_limit=limit,
            shared_swiglu_limit=shared_limit,
            grouped=grouped,
            backend="naive",
        )
    )
    sd = hf.state_dict()
    gate, up = sd["experts.gate_up_proj"].chunk(2, dim=1)
    ours.load_state_dict(
        {
            "router": sd["gate.weight"],
            "expert_bias": sd["gate.e_score_correction_bias"],
            "local_tokens_per_expert": torch.zeros(8),
            "w_gate": gate.transpose(1, 2),
            "w_up": up.transpose(1, 2),
            "w_down": sd["experts.down_proj"].transpose(1, 2),
            "shared_experts.gate.weight": sd["shared_experts.gate_proj.weight"],
            "shared_experts.up.weight": sd["shared_experts.up_proj.weight"],
            "shared_experts.down.weight": sd["shared_experts.down_proj.weight"],
        }
    )
    return ours.eval()


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_clipped_moe_matches_transformers(grouped):
    cfg = hf_config()
    x = torch.randn(1, 40, D)
    for layer, (limit, shared) in enumerate([(0.3, 0.2), (0.0, 0.0)]):
        hf = perturbed(mb.BailingHybridMoE(cfg, layer), seed=layer)
        ours = moe_from_hf(hf, limit, shared, grouped)
        with torch.no_grad():
            ref = hf(x)[0]
        y = ours(x[0]).hidden
        err = rel(y.detach(), ref)
        print(f"Ling MoE layer {layer} (limits {limit}, {shared}): max relative error {err:.1e}")
        assert err <= TOL
    # the limits bite: a model without them differs
    hf = perturbed(mb.BailingHybridMoE(cfg, 0), seed=0)
    with torch.no_grad():
        assert rel(moe_from_hf(hf, 0.0, 0.0, grouped)(x[0]).hidden, hf(x)[0]) > 1e-2


def test_clipped_swiglu_matches_transformers_mlp():
    cfg = hf_config()
    for layer_idx, limit in ((0, 0.2), (None, None)):  # a shared expert of layer 0; a dense MLP
        hf = perturbed(mb.BailingHybridMLP(cfg, intermediate_size=16, layer_idx=layer_idx))
        ours = SwiGLU(D, 16, limit=limit)
        sd = hf.state_dict()
        ours.load_state_dict({k.replace("_proj", ""): v for k, v in sd.items()})
        x = torch.randn(30, D)
        with torch.no_grad():
            assert rel(ours(x), hf(x)) <= TOL


@pytest.mark.gpu
def test_fused_kda_features_with_the_bounded_gate_match_the_reference_on_cuda():
    """The fused token-wise path (fla's ``fused_kda_gate`` with ``lower_bound``, the one-GEMM
    full-rank gate projections) against the reference path, forward and backward (not run in CI:
    needs CUDA)."""
    from harts_runtime.layout.conv import ConvWindows

    torch.manual_seed(0)
    layer = perturbed(ling_kda()).cuda()
    layer.A_log.data.uniform_(-1, 2)
    offsets = np.array([0, 37, 100, 129])
    windows = ConvWindows.trajectories(offsets, 4, torch.device("cuda"))
    x = torch.randn(int(offsets[-1]), D, device="cuda", requires_grad=True)
    outs = {}
    for backend in ("naive", "triton"):
        for m in layer.modules():
            if hasattr(m, "backend"):
                m.backend = backend
        layer.config.backend = backend
        layer.zero_grad()
        x.grad = None
        feats = layer._features(x, windows)
        gen = torch.Generator("cuda").manual_seed(1)
        w = [torch.randn(f.shape, device="cuda", generator=gen) for f in feats]
        sum((f.float() * g.float()).sum() for f, g in zip(feats, w)).backward()
        outs[backend] = (
            [f.detach() for f in feats] + [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
        )
    for a, b in zip(outs["naive"], outs["triton"]):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_tensor_parallel_plans_cover_the_ling_layers():
    """The TP plans of the Ling KDA (full-rank gates sharded by head rows) and the gated MLA
    (``g_proj`` by head rows) name every parameter and split by heads."""
    from harts_runtime.parallel.plans import COL, tp_plan

    kda = tp_plan(ling_kda(), 2, "kda")
    assert kda.placements["f_proj.0.weight"] == COL and kda.placements["g_proj.0.weight"] == COL
    assert set(kda.placements) == {n for n, _ in ling_kda().named_parameters()}
    mla = CompactMLA(
        MLAConfig(
            hidden_size=D,
            num_heads=H,
            kv_lora_rank=12,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            rope_interleave=True,
            output_gate=True,
        )
    )
    plan = tp_plan(mla, 2, "mla")
    assert plan.placements["g_proj.weight"] == COL
    assert set(plan.placements) == {n for n, _ in mla.named_parameters()}
