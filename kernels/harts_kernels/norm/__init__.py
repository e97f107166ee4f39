"""Norm kernels whose compiled variants do not depend on the row count.

* :func:`rms_norm`: RMSNorm ``x * rstd * weight`` (fla's ``rms_norm`` math).
* :func:`rms_norm_gated`: ``x * rstd * weight * act(gate)``, act sigmoid or silu (fla's
  ``rms_norm_gated``, norm before gate, no bias).
* :func:`l2norm`: ``x * rsqrt(sum(x^2) + eps)`` (fla's ``l2norm``).
* :func:`naive_rms_norm`, :func:`naive_rms_norm_gated`, :func:`naive_l2norm`: the float32
  references with the same signatures.
* :func:`launch_config`: the launch rule, a function of (D, dtype) only (:mod:`.launch`).

Each is forward and backward in Triton, with the row count a runtime argument that Triton does not
specialize: one compile per (D, dtype, flags) serves every microbatch. Importing this package needs
only torch; triton loads on the first call.
"""

from harts_kernels.norm.l2norm import l2norm
from harts_kernels.norm.launch import LaunchConfig, launch_config
from harts_kernels.norm.naive import naive_l2norm, naive_rms_norm, naive_rms_norm_gated
from harts_kernels.norm.rms_norm import rms_norm
from harts_kernels.norm.rms_norm_gated import rms_norm_gated

__all__ = [
    "LaunchConfig",
    "l2norm",
    "launch_config",
    "naive_l2norm",
    "naive_rms_norm",
    "naive_rms_norm_gated",
    "rms_norm",
    "rms_norm_gated",
]
