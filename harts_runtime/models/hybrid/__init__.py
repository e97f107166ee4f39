"""The hybrid-attention MoE family: ``args`` (config and flavors) and ``model`` (the modules)."""

from harts_runtime.models.hybrid.args import FFNS, FLAVORS, MIXERS, ModelConfig, model_config
from harts_runtime.models.hybrid.model import FFN_BUILDERS, MIXER_BUILDERS, Block, HybridModel

__all__ = [
    "FFNS",
    "FFN_BUILDERS",
    "FLAVORS",
    "MIXERS",
    "MIXER_BUILDERS",
    "Block",
    "HybridModel",
    "ModelConfig",
    "model_config",
]
