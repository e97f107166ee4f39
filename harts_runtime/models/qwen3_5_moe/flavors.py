"""Qwen3.5-MoE's named flavors (registered with the family, :data:`FLAVORS`).

``qwen3.5-35b-a3b``: Qwen3.5-35B-A3B's text model shape with random weights (for the checkpoint
use :func:`harts_runtime.load_pretrained`). ``qwen3.5-tiny``: a tiny Qwen3.5-MoE text model with
random weights, for a small ``qwen3_5_moe_text`` folder that ``save_pretrained`` writes and
transformers loads.
"""

from __future__ import annotations

from harts_runtime.models.hybrid.args import GatedAttentionArgs, GDNArgs, ModelConfig, MoEArgs
from harts_runtime.models.qwen3_next import args as _args
from harts_runtime.options import DEFAULT_CHUNK_SIZE

__all__ = ["FLAVORS", "qwen35_35b_a3b", "qwen35_tiny"]


def qwen35_35b_a3b(num_layers: int | None = None, **overrides) -> ModelConfig:
    """40 layers (``num_layers``, None: 40) of 3 Gated DeltaNet + 1 gated attention, 256 experts
    top-8 plus a gated shared expert, zero-centred norms; ``overrides``: further ModelConfig fields."""
    n = 40 if num_layers is None else num_layers
    mixers = (("gdn",) * 3 + ("gated_attention",)) * 10
    cfg = ModelConfig(
        vocab_size=248_320,
        hidden_size=2048,
        mixers=mixers[:n],
        ffns=("moe",) * n,
        num_heads=16,
        num_kv_heads=2,
        gated_attention=GatedAttentionArgs(head_dim=256, partial_rotary_factor=0.25),
        rope_theta=1e7,
        conv_size=4,
        chunk_size=DEFAULT_CHUNK_SIZE,
        gdn=GDNArgs(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, projection="split"),
        moe=MoEArgs(
            num_experts=256,
            top_k=8,
            intermediate_size=512,
            norm_topk_prob=True,
            num_shared_experts=1,
            shared_intermediate_size=512,
            shared_expert_gate=True,
            aux_loss_coef=0.0,
            z_loss_coef=0.0,
        ),
        zero_centered_norms=True,
        dtype="bfloat16",
        lm_head_rows=2048,
    )
    return cfg.replace(**overrides) if overrides else cfg


def qwen35_tiny(num_layers: int | None = None, **overrides) -> ModelConfig:
    """3 Gated DeltaNet + 1 gated attention (``num_layers``, None: 4), MoE with 4 experts top-2 and
    a gated shared expert, zero-centred norms; ``overrides``: further ModelConfig fields. Built by
    the family's own ``from_hf_config``."""
    n = 4 if num_layers is None else num_layers
    types = ((["linear_attention"] * 3 + ["full_attention"]) * 4)[:n]
    cfg = _args.from_hf_config(
        dict(
            model_type="qwen3_5_moe_text",
            vocab_size=512,
            hidden_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_hidden_layers=len(types),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            layer_types=types,
            partial_rotary_factor=0.5,
        ),
        dtype="float32",
        family="qwen3_5_moe_text",
    )
    return cfg.replace(**overrides) if overrides else cfg


FLAVORS = {"qwen3.5-35b-a3b": qwen35_35b_a3b, "qwen3.5-tiny": qwen35_tiny}
"""Name -> ``(num_layers=None, **overrides) -> ModelConfig``."""
