"""Nemotron-H's named flavors (registered with the family, :data:`FLAVORS`).

``nemotron-h-tiny``: a tiny Nemotron-H with random weights (Mamba2, attention without RoPE, relu2
MLP and relu2 MoE layers), for a small folder that ``save_pretrained`` writes and transformers'
``NemotronHForCausalLM`` loads.
"""

from __future__ import annotations

from harts_runtime.models.hybrid.args import ModelConfig
from harts_runtime.models.nemotron_h.args import from_hf_config

__all__ = ["FLAVORS", "nemotron_h_tiny"]

TINY_PATTERN = "ME*-ME*-"
"""``hybrid_override_pattern`` of the tiny flavor (cut to ``num_layers``)."""


def nemotron_h_tiny(num_layers: int | None = None, **overrides) -> ModelConfig:
    """Layers ``ME*-ME*-`` (``num_layers``, None: 8): Mamba2 with 4 heads of 16 in 2 groups (state
    16), 2 attention heads of 32 sharing one KV head, relu2 MLPs of 96, MoE with 8 relu2 experts in
    4 groups (top-3 of 2 groups) and a shared expert; ``overrides``: further ModelConfig fields.
    Built by the family's own ``from_hf_config``, so every option is one the checkpoint format
    carries."""
    n = 8 if num_layers is None else num_layers
    cfg = from_hf_config(
        dict(
            model_type="nemotron_h",
            vocab_size=512,
            hidden_size=64,
            hybrid_override_pattern=(TINY_PATTERN * 8)[:n],
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            intermediate_size=96,
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=4,
            n_routed_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
        dtype="float32",
    )
    return cfg.replace(**overrides) if overrides else cfg


FLAVORS = {"nemotron-h-tiny": nemotron_h_tiny}
"""Name -> ``(num_layers=None, **overrides) -> ModelConfig``."""
