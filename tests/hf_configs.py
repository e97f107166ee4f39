"""Tiny transformers models of the checkpoint families (random weights), shared by the family tests
(``tests/runtime/models/test_kimi_linear.py``, ``test_qwen3_next.py``) and the parallel tests: the config
classes' keyword sets in one place. transformers is imported inside the functions, so a module
that imports this one (and the processes it spawns) does not load it until a config is built."""

from __future__ import annotations

V = 96
"""Vocabulary of the tiny configs."""
MIXED = ["linear_attention", "full_attention", "linear_attention"]
"""The Qwen tests' default layer pattern."""


def kimi_linear_config(**changes):
    """A ``KimiLinearConfig`` of 4 layers (KDA / MLA alternating, a dense first FFN), 8 experts in
    4 groups, one shared expert; ``changes`` override any keyword."""
    import transformers

    kw = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        v_head_dim=8,
        qk_nope_head_dim=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        num_local_experts=8,
        norm_topk_prob=True,
        initializer_range=0.2,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        linear_head_dim=8,
        linear_num_heads=2,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    )
    kw.update(changes)
    return transformers.KimiLinearConfig(**kw)


def qwen_config(family: str, layer_types=MIXED, **changes):
    """A ``Qwen3NextConfig`` (``family="qwen3_next"``; layer 1 dense) or ``Qwen3_5MoeTextConfig``
    with ``layer_types``, 4 experts and a gated shared expert; ``changes`` override any keyword."""
    import transformers

    kw = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=list(layer_types),
        initializer_range=0.2,
        partial_rotary_factor=0.5,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    if family == "qwen3_next":
        kw.update(mlp_only_layers=[1], norm_topk_prob=True)
        kw.update(changes)
        return transformers.Qwen3NextConfig(**kw)
    kw.update(changes)
    return transformers.Qwen3_5MoeTextConfig(**kw)


def perturb_kimi_linear(model):
    """Every floating parameter of a Kimi-Linear model moved off its initialisation, in place (norm
    weights and the MoE correction bias redrawn, all others given noise), so that a swapped or
    dropped tensor shows; returns the model. Draws from torch's global generator."""
    import torch

    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            if "norm" in name:
                t.copy_(1 + 0.3 * torch.randn_like(t))
            elif "e_score_correction_bias" in name:
                t.copy_(0.3 * torch.randn_like(t))
            else:  # every other parameter too: no default initialisation hides a mapping error
                t.add_(0.02 * torch.randn_like(t))
    return model
