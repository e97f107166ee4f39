"""One file per layer; every mixer and FFN is called as ``forward(x [N, D], layout)`` with the
microbatch's :class:`~harts_runtime.layout.rows.RowLayout`:

* :mod:`~harts_runtime.layers.kda`: Kimi Delta Attention over the layout's KDA plan (fla's parameter names);
* :mod:`~harts_runtime.layers.gdn`: Qwen3-Next / Qwen3.5 Gated DeltaNet over the same plan (transformers' names);
* :mod:`~harts_runtime.layers.mamba2`: Nemotron-H's Mamba2 (SSD) mixer over the same plan (transformers' names);
* :mod:`~harts_runtime.layers.attention`: MHA / GQA over the layout's ancestor-KV views;
* :mod:`~harts_runtime.layers.gated_attention`: Qwen3-Next / Qwen3.5 gated GQA, likewise;
* :mod:`~harts_runtime.layers.mla`: multi-head latent attention, likewise;
* :mod:`~harts_runtime.layers.moe`: routed SwiGLU experts with multiplicity-weighted statistics;
* :mod:`~harts_runtime.layers.moe_routing`: the MoE router's top-k and its statistics;
* :mod:`~harts_runtime.layers.ffn`: the dense SwiGLU FFN;
* :mod:`~harts_runtime.layers.relu2_mlp`: Nemotron-H's non-gated squared-ReLU MLP.
"""

from harts_runtime.layers.attention import AttentionConfig, CompactAttention
from harts_runtime.layers.ffn import DenseFFN
from harts_runtime.layers.gated_attention import CompactGatedAttention, GatedAttentionConfig
from harts_runtime.layers.gdn import CompactGatedDeltaNet, GatedDeltaNetConfig
from harts_runtime.layers.kda import KDAConfig, KDALayer
from harts_runtime.layers.mamba2 import Mamba2Config, Mamba2Mixer
from harts_runtime.layers.mla import CompactMLA, MLAConfig
from harts_runtime.layers.moe import CompactMoE, MoEConfig, MoEOutput
from harts_runtime.layers.relu2_mlp import Relu2MLP

__all__ = [
    "AttentionConfig",
    "CompactAttention",
    "CompactGatedAttention",
    "CompactGatedDeltaNet",
    "CompactMLA",
    "CompactMoE",
    "DenseFFN",
    "GatedAttentionConfig",
    "GatedDeltaNetConfig",
    "KDAConfig",
    "KDALayer",
    "MLAConfig",
    "Mamba2Config",
    "Mamba2Mixer",
    "MoEConfig",
    "MoEOutput",
    "Relu2MLP",
]
