"""KDA with the ChunkLA contract of Equation (16): packed varlen calls that return requested
chunk-boundary states in fp32 and take gradients at them.

* :func:`chunk_kda_with_states`: the operator (Triton on CUDA, the chunked reference on CPU).
* :func:`naive_chunk_kda_with_states`, :func:`naive_recurrent_kda_with_states`: fp32 references.
* :func:`naive_piece_summary`, :func:`naive_fold_states`: fp32 references of the state-passing
  summary and fold of :mod:`harts_kernels.kda.cp` (context parallelism).

Importing this package needs only torch; fla and triton load on the first GPU call.
"""

from harts_kernels.kda.chunk import chunk_kda_with_states
from harts_kernels.kda.naive import (
    naive_chunk_kda_with_states,
    naive_fold_states,
    naive_piece_summary,
    naive_recurrent_kda_with_states,
)
from harts_kernels.kda.utils import PackedRequests, validate_requests

__all__ = [
    "PackedRequests",
    "chunk_kda_with_states",
    "naive_chunk_kda_with_states",
    "naive_fold_states",
    "naive_piece_summary",
    "naive_recurrent_kda_with_states",
    "validate_requests",
]
