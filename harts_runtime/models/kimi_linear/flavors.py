"""Kimi-Linear's named flavors (registered with the family, :data:`FLAVORS`).

``kimi-linear-tiny``: a tiny Kimi-Linear with random weights, for a small folder that
``save_pretrained`` writes and transformers' ``KimiLinearForCausalLM`` loads.
"""

from __future__ import annotations

from harts_runtime.models.hybrid.args import ModelConfig
from harts_runtime.models.kimi_linear.args import from_hf_config

__all__ = ["FLAVORS", "kimi_linear_tiny"]


def kimi_linear_tiny(num_layers: int | None = None, **overrides) -> ModelConfig:
    """KDA / MLA alternating (``num_layers``, None: 4), a dense first FFN, then MoE with 8 experts
    in 4 groups (top-3 of 2 groups) and a shared expert; ``overrides``: further ModelConfig fields.
    Built by the family's own ``from_hf_config``, so every option is one the checkpoint format
    carries."""
    n = 4 if num_layers is None else num_layers
    types = (["linear_attention", "full_attention"] * 8)[:n]
    cfg = from_hf_config(
        dict(
            model_type="kimi_linear",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=len(types),
            num_attention_heads=2,
            num_key_value_heads=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            v_head_dim=16,
            qk_nope_head_dim=16,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            num_local_experts=8,
            norm_topk_prob=True,
            linear_head_dim=16,
            linear_num_heads=2,
            linear_conv_kernel_dim=4,
            layer_types=types,
            mlp_layer_types=(["dense"] + ["sparse"] * 15)[: len(types)],
        ),
        dtype="float32",
    )
    return cfg.replace(**overrides) if overrides else cfg


FLAVORS = {"kimi-linear-tiny": kimi_linear_tiny}
"""Name -> ``(num_layers=None, **overrides) -> ModelConfig``."""
