"""Qwen3.5-MoE text (transformers ``Qwen3_5MoeForCausalLM``, ``model_type`` ``qwen3_5_moe_text``, and
the text part of ``qwen3_5_moe`` checkpoints) as a :class:`~harts_runtime.models.hybrid.HybridModel`.

The formats are Qwen3-Next's (:mod:`harts_runtime.models.qwen3_next`, whose code this shares) but
for: the gated delta net's split input projections (``in_proj_qkv``, ours ``in_proj_q`` /
``in_proj_k`` / ``in_proj_v``; ``in_proj_z``, ``in_proj_b``, ``in_proj_a``;
``gdn.projection="split"``), every layer sparse, top-k always renormalised, and the
``model.language_model.`` prefix of the vision-language checkpoints (the vision tower and the MTP
head are skipped). Saving writes a ``qwen3_5_moe_text`` folder. Flavors (:mod:`.flavors`):
``qwen3.5-35b-a3b``, ``qwen3.5-tiny``; the family registers itself (:data:`FAMILY`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from harts_runtime.models.hybrid.args import ModelConfig
from harts_runtime.models.qwen3_5_moe.flavors import FLAVORS
from harts_runtime.models.qwen3_next import args as _args
from harts_runtime.models.qwen3_next.state_dict_adapter import QwenStateDictAdapter
from harts_runtime.models.registry import Family, register_family
from harts_runtime.options import DEFAULT_CHUNK_SIZE

__all__ = [
    "FAMILY",
    "FLAVORS",
    "MODEL_TYPE",
    "Qwen35MoeStateDictAdapter",
    "from_hf",
    "from_hf_config",
    "to_hf",
    "to_hf_config",
]

MODEL_TYPE = "qwen3_5_moe_text"
"""The ``model_type`` written (``qwen3_5_moe``, the vision-language folders, is read only)."""


def from_hf_config(
    cfg, *, dtype: str | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE, **overrides
) -> ModelConfig:
    """Our :class:`ModelConfig` of a ``Qwen3_5MoeTextConfig`` / ``Qwen3_5MoeConfig`` (its text part)
    or their ``config.json`` dict; see :func:`harts_runtime.models.qwen3_next.from_hf_config`."""
    return _args.from_hf_config(cfg, dtype=dtype, family=MODEL_TYPE, chunk_size=chunk_size, **overrides)


def to_hf_config(cfg: ModelConfig, base: Mapping | None = None) -> dict:
    """The ``qwen3_5_moe_text`` ``config.json`` dict of ``cfg``."""
    return _args.to_hf_config(cfg, base, family=MODEL_TYPE)


class Qwen35MoeStateDictAdapter(QwenStateDictAdapter):
    """:class:`QwenStateDictAdapter` for Qwen3.5-MoE (``prefix="model.language_model."`` for the
    vision-language spelling)."""

    family = "Qwen3.5-MoE"


def from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``Qwen3_5MoeForCausalLM`` (or ``...ForConditionalGeneration``: its text part) state dict ->
    our :class:`HybridModel` state dict."""
    return Qwen35MoeStateDictAdapter(config).from_hf(hf_state_dict)


def to_hf(state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our :class:`HybridModel` state dict -> a ``Qwen3_5MoeForCausalLM`` state dict."""
    return Qwen35MoeStateDictAdapter(config).to_hf(state_dict)


def owns(cfg) -> bool:
    """A model with split-projection GDN layers has Qwen3.5-MoE's marks."""
    return "gdn" in cfg.mixers and cfg.gdn.projection == "split"


FAMILY = register_family(
    Family(
        name="qwen3_5_moe",
        model_types=(MODEL_TYPE, "qwen3_5_moe"),
        from_hf_config=from_hf_config,
        to_hf_config=to_hf_config,
        adapter=Qwen35MoeStateDictAdapter,
        owns=owns,
        priority=20,
        flavors=FLAVORS,
        transformers_min="5.2.0",  # the first release with its model_type
        prefixes={"qwen3_5_moe": "model.language_model."},
        read_only=("qwen3_5_moe",),
    )
)
"""The registered family (:mod:`harts_runtime.models.registry`): reads ``qwen3_5_moe_text`` and the
text part of ``qwen3_5_moe`` folders (tensors under ``model.language_model.``), writes
``qwen3_5_moe_text``."""
