"""The memory-bound steps of the grouped MoE path, fused.

* :func:`gather_sum` ``(y [M, D], index [N*k], k, base=None) -> [N, D]``: ``base[n] + sum_j
  y[index[n*k + j]]`` in float32, rounded once: the combine of the expert-sorted slots back into
  their rows (plus the shared experts' output), and the backward of the dispatch, without the
  [N*k, D] gathered temporary.
* :func:`swiglu_weighted` / :func:`swiglu_weighted_bwd`: ``silu(a) * b * w`` per row for
  ``gu = [a | b]`` [M, 2I], and its gradients ``d gu`` [M, 2I] (written in place, no
  concatenation) and ``d w`` [M] (a row dot product in the same kernel).
* :mod:`~harts_kernels.moe.naive`: the float32 references with the same signatures.

No kernel specializes on a row count (``M``, ``N`` are runtime, not-specialized arguments), so a
never-seen microbatch compiles nothing. Importing this package needs only torch; triton loads on
the first call.
"""

from harts_kernels.moe.gather_sum import gather_sum
from harts_kernels.moe.naive import naive_gather_sum, naive_swiglu_weighted, naive_swiglu_weighted_bwd
from harts_kernels.moe.swiglu import swiglu_weighted, swiglu_weighted_bwd

__all__ = [
    "gather_sum",
    "naive_gather_sum",
    "naive_swiglu_weighted",
    "naive_swiglu_weighted_bwd",
    "swiglu_weighted",
    "swiglu_weighted_bwd",
]
