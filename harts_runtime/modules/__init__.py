"""Building blocks of the layers (as ``fla.modules``): norms, the short convolution through a
window table, rotary embeddings, the SwiGLU MLP, and the ``backend`` switch between their fused
kernels and their references (:mod:`~harts_runtime.modules.fused`)."""

from harts_runtime.modules.convolution import ShortConvolution, causal_conv
from harts_runtime.modules.norms import GatedRMSNorm, RMSNorm, l2_norm
from harts_runtime.modules.rope import apply_rope, rope_cos_sin
from harts_runtime.modules.swiglu import SwiGLU

__all__ = [
    "GatedRMSNorm",
    "RMSNorm",
    "ShortConvolution",
    "SwiGLU",
    "apply_rope",
    "causal_conv",
    "l2_norm",
    "rope_cos_sin",
]
