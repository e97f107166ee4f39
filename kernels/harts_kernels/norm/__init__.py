"""RMSNorm on fla's kernels, launched so that a new row count does not compile a new kernel.

* :func:`rms_norm`: the operator (fla's forward; its backward with bucketed rows per program).
* :func:`naive_rms_norm`: the float32 reference with the same signature.
* :func:`rows_per_program`: the bucketing rule.

Importing this package needs only torch; fla and triton load on the first call.
"""

from harts_kernels.norm.naive import naive_rms_norm
from harts_kernels.norm.rms_norm import rms_norm, rows_per_program

__all__ = ["naive_rms_norm", "rms_norm", "rows_per_program"]
