"""Ops the layers call, one job per module:

* :mod:`~harts_runtime.ops.attention`: compact attention and its backends (re-exported here);
* :mod:`~harts_runtime.ops.rows`: packed-row gathers and plain permutations with gather-only backwards;
* :mod:`~harts_runtime.ops.keep`: kept regions for selective recomputation;
* :mod:`~harts_runtime.ops.rounds`: the round executor of the linear-attention layers (``run_rounds``:
  a schedule's rounds, state handoffs and entry states, the chunkwise core a parameter);
* :mod:`~harts_runtime.ops.grouped_gemm`: grouped matmul of expert-sorted rows (``grouped_mm``,
  ``gate_up_mm``) on ``torch._grouped_mm``'s device-offset kernel or a padded bmm;
* :mod:`~harts_runtime.ops.dispatch`: the MoE's one permutation (``sort_assignments``) and its
  row dispatch / combine (``dispatch_rows``, ``combine_rows``; the combine's gather and sum one
  kernel on CUDA);
* :mod:`~harts_runtime.ops.swiglu`: SwiGLU on rows with per-row weights (``swiglu_rows``; the
  fused kernels of :mod:`harts_kernels.moe` or the reference);
* :mod:`~harts_runtime.ops.router`: the router's float32 logits (``router_logits``; bf16 operands
  on TF32 tensor cores on CUDA).
"""

from harts_runtime.ops.attention import BACKENDS, available_backends, compact_attention, trajectory_attention

__all__ = ["BACKENDS", "available_backends", "compact_attention", "trajectory_attention"]
