"""Ling-3.0's named flavors (registered with the family, :data:`FLAVORS`).

``ling3-tiny``: a tiny Ling-3.0 with random weights, for a small folder that ``save_pretrained``
writes and transformers' ``BailingHybridForCausalLM`` loads.
"""

from __future__ import annotations

from harts_runtime.models.hybrid.args import ModelConfig
from harts_runtime.models.ling3.args import from_hf_config

__all__ = ["FLAVORS", "ling3_tiny"]


def ling3_tiny(num_layers: int | None = None, **overrides) -> ModelConfig:
    """KDA / MLA 2:1 (``num_layers``, None: 4; every third layer MLA as ``layer_group_size`` 3
    gives), a dense first FFN, then MoE with 8 experts in 4 groups (top-3 of 2 groups), a shared
    expert and SwiGLU limits on the MoE layers; the bounded KDA gate; ``overrides``: further
    ModelConfig fields. Built by the family's own ``from_hf_config``, so every option is one the
    checkpoint format carries."""
    n = 4 if num_layers is None else num_layers
    cfg = from_hf_config(
        dict(
            model_type="bailing_hybrid",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=n,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_shared_experts=1,
            routed_scaling_factor=2.5,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            v_head_dim=16,
            qk_nope_head_dim=16,
            num_expert_group=4,
            topk_group=2,
            num_experts_per_token=3,
            num_experts=8,
            moe_renormalize=True,
            head_dim=16,
            short_conv_kernel_size=4,
            layer_group_size=3,
            first_k_dense_replace=1,
            kda_safe_gate=True,
            kda_lower_bound=-5.0,
            rope_theta=10_000.0,
            rms_norm_eps=1e-6,
            expert_swiglu_limit_list=[0.0] + [0.5 + 0.25 * i for i in range(n - 1)],
            share_expert_swiglu_limit_list=[0.0] + [0.75] * (n - 1),
            num_nextn_predict_layers=0,
        ),
        dtype="float32",
    )
    return cfg.replace(**overrides) if overrides else cfg


FLAVORS = {"ling3-tiny": ling3_tiny}
"""Name -> ``(num_layers=None, **overrides) -> ModelConfig``."""
