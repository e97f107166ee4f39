"""Nemotron-H's FFN layers against transformers' modules (fp32, CPU, perturbed weights):
the relu2 MLP (``NemotronHMLP``) and the MoE with non-gated relu2 experts, sigmoid group routing
with ``e_score_correction_bias`` and a relu2 shared expert (``NemotronHMoE``; our
``CompactMoE(activation="relu2")``, grouped and per-expert-loop paths), outputs and gradients."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harts_runtime.layers.moe import CompactMoE, MoEConfig  # noqa: E402
from harts_runtime.layers.relu2_mlp import Relu2MLP  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

D = 24
CFG = dict(
    hidden_size=D,
    intermediate_size=40,
    n_routed_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=12,
    moe_shared_expert_intermediate_size=20,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=1.7,
    layers_block_type=["moe"],
)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def perturb(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in sorted(module.named_parameters()) + sorted(module.named_buffers()):
            t.copy_(torch.randn(t.shape, generator=g) * (t.shape[-1] ** -0.5 if t.dim() > 1 else 0.1))


def test_relu2_mlp_is_transformers():
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMLP

    hf = NemotronHMLP(transformers.NemotronHConfig(**CFG)).float()
    perturb(hf)
    ours = Relu2MLP(D, CFG["intermediate_size"])
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(17, D, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ours(x), hf(x))


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
def test_relu2_moe_is_transformers(grouped):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    hf = NemotronHMoE(transformers.NemotronHConfig(**CFG)).float()
    perturb(hf)
    ours = CompactMoE(
        MoEConfig(
            hidden_size=D,
            num_experts=8,
            top_k=3,
            intermediate_size=12,
            score_func="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=1.7,
            use_expert_bias=True,
            num_expert_groups=4,
            topk_groups=2,
            num_shared_experts=1,
            shared_intermediate_size=20,
            activation="relu2",
            grouped=grouped,
            backend="naive",
        )
    )
    sd = hf.state_dict()
    with torch.no_grad():
        ours.router.copy_(sd["gate.weight"])
        ours.expert_bias.copy_(sd["gate.e_score_correction_bias"])
        ours.w_up.copy_(sd["experts.up_proj"].transpose(1, 2))
        ours.w_down.copy_(sd["experts.down_proj"].transpose(1, 2))
        ours.shared_experts.load_state_dict(
            {k.removeprefix("shared_experts."): v for k, v in sd.items() if k.startswith("shared_experts.")}
        )
    assert not hasattr(ours, "w_gate")
    x = torch.randn(29, D, generator=torch.Generator().manual_seed(2))
    w = torch.randn(29, D, generator=torch.Generator().manual_seed(3))
    xo, xh = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y = ours(xo).hidden
    yh = hf(xh[None])[0]
    assert rel(y, yh) <= 1e-6
    (y * w).sum().backward()
    (yh * w).sum().backward()
    assert rel(xo.grad, xh.grad) <= 1e-5
    assert rel(ours.w_up.grad, hf.experts.up_proj.grad.transpose(1, 2)) <= 1e-5
    assert rel(ours.w_down.grad, hf.experts.down_proj.grad.transpose(1, 2)) <= 1e-5
    assert rel(ours.router.grad, hf.gate.weight.grad) <= 1e-5
