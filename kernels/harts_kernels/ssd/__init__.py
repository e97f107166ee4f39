"""SSD (Mamba2's state space duality) with the ChunkLA contract: packed varlen calls with a
scalar decay per token and head that take initial states and return the final and requested
chunk-boundary states, differentiably.

* :func:`chunk_ssd_with_states`: the operator (fla's simple-GLA Triton kernel on CUDA, the
  chunked reference on CPU).
* :func:`naive_chunk_ssd_with_states`, :func:`naive_recurrent_ssd_with_states`: fp32 references.
* :mod:`harts_kernels.ssd.cp`: state passing for context parallelism (piece summaries, the fold in
  state order and its transpose); :func:`naive_piece_summary`, :func:`naive_fold_states`: their
  fp32 references.

Importing this package needs only torch; fla and triton load on the first GPU call.
"""

from harts_kernels.ssd.chunk import chunk_ssd_with_states, fla_gated_backward_refused
from harts_kernels.ssd.naive import (
    naive_chunk_ssd_with_states,
    naive_fold_states,
    naive_piece_summary,
    naive_recurrent_ssd_with_states,
)

__all__ = [
    "chunk_ssd_with_states",
    "fla_gated_backward_refused",
    "naive_chunk_ssd_with_states",
    "naive_fold_states",
    "naive_piece_summary",
    "naive_recurrent_ssd_with_states",
]
