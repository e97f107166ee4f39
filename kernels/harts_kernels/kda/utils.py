"""Shared, torch-only helpers of the KDA operator: packing, validation, boundary requests.

Glossary (Section 3.4, Equation 16 of the paper):

* packed call: ``N`` input sequences concatenated along the token axis, ``cu_seqlens [N+1]``;
  tensors are ``[1, T, H, *]`` with ``T = cu_seqlens[-1]``.
* chunk grid: sequence ``i`` (length ``L_i``) is cut into ``n_i = ceil(L_i / B)`` chunks of ``B``
  tokens starting at its first packed row; the last one may be partial.
* boundary ``c`` of sequence ``i``: the recurrent state after its first ``c * B`` tokens,
  ``S^(i)_[c]`` (``S_[0]`` is the initial state). A request ``(request_seq[r], request_chunk[r])``
  asks for ``S^(i)_[c]`` with ``1 <= c`` and ``c * B <= L_i`` (a boundary that exists; when
  ``L_i = n_i * B``, ``c = n_i`` is the final state).
* distinct requests (GPU path): the requested ``(i, c)`` pairs without duplicates, sorted by
  sequence then boundary; the state scan writes one fp32 state per pair, in that order, and
  ``req_off[i]`` is the first pair of sequence ``i``.

Nothing here imports triton or fla.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def as_int_list(x, field: str) -> list[int]:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{field}: must be one-dimensional, got shape {tuple(x.shape)}")
        if x.numel() and (x.dtype.is_floating_point or x.dtype.is_complex):
            raise ValueError(f"{field}: must hold integers, got dtype {x.dtype}")
        return [int(v) for v in x.tolist()]
    try:
        return [int(v) for v in x]
    except TypeError as e:  # pragma: no cover - message only
        raise ValueError(f"{field}: must be a sequence of integers") from e


@dataclass(frozen=True)
class PackedRequests:
    """Validated boundary-state requests of one packed call.

    Attributes
    ----------
    seq_lens : list[int]     # [N] lengths of the packed sequences
    num_chunks : list[int]   # [N] n_i = ceil(L_i / B)
    chunk_offsets : list[int]  # [N+1] exclusive prefix sums of num_chunks
    request_seq, request_chunk : list[int]  # [R] as given (order kept; duplicates allowed)
    chunk_size : int
    """

    seq_lens: list[int]
    num_chunks: list[int]
    chunk_offsets: list[int]
    request_seq: list[int]
    request_chunk: list[int]
    chunk_size: int

    @property
    def num_requests(self) -> int:
        return len(self.request_seq)

    def distinct_requests(self) -> tuple[list[tuple[int, int]], list[int], list[int]]:
        """``(pairs [U], inverse [R], req_off [N+1])``: the distinct ``(i, c)`` sorted by
        ``(i, c)``, the row of each request in ``pairs``, and the first row of each sequence."""
        pairs = sorted(set(zip(self.request_seq, self.request_chunk)))
        row = {p: j for j, p in enumerate(pairs)}
        req_off = [0] * (len(self.seq_lens) + 1)
        for i, _ in pairs:
            req_off[i + 1] += 1
        for i in range(len(self.seq_lens)):
            req_off[i + 1] += req_off[i]
        return pairs, [row[p] for p in zip(self.request_seq, self.request_chunk)], req_off


def seq_lens_from_cu_seqlens(cu_seqlens, total: int) -> list[int]:
    """Validate ``cu_seqlens [N+1]`` against ``T = total`` and return the N lengths (>= 1 each)."""
    cu = as_int_list(cu_seqlens, "cu_seqlens")
    if len(cu) < 2:
        raise ValueError("cu_seqlens: needs at least two entries [0, T]")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens[0]: must be 0, got {cu[0]}")
    if cu[-1] != total:
        raise ValueError(f"cu_seqlens[-1]: must equal the packed length T={total}, got {cu[-1]}")
    lens = []
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        if n <= 0:
            raise ValueError(f"cu_seqlens[{i + 1}]: sequence {i} is empty or negative (length {n})")
        lens.append(n)
    return lens


def validate_requests(
    seq_lens: Sequence[int], chunk_size: int, request_seq=None, request_chunk=None
) -> PackedRequests:
    """Check the requests against the chunk grid; raise ``ValueError`` naming the bad entry."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size: must be >= 1, got {chunk_size}")
    rs = as_int_list(request_seq, "request_seq")
    rc = as_int_list(request_chunk, "request_chunk")
    if len(rs) != len(rc):
        raise ValueError(f"request_seq/request_chunk: lengths differ ({len(rs)} vs {len(rc)})")
    n = len(seq_lens)
    num_chunks = [(L + chunk_size - 1) // chunk_size for L in seq_lens]
    offsets = [0]
    for nc in num_chunks:
        offsets.append(offsets[-1] + nc)
    for r, (i, c) in enumerate(zip(rs, rc)):
        if not 0 <= i < n:
            raise ValueError(f"request_seq[{r}]: sequence {i} out of range [0, {n})")
        if c < 1 or c * chunk_size > seq_lens[i]:
            raise ValueError(
                f"request_chunk[{r}]: boundary {c} of sequence {i} does not exist "
                f"(need 1 <= c and c * {chunk_size} <= length {seq_lens[i]})"
            )
    return PackedRequests(list(seq_lens), num_chunks, offsets, rs, rc, chunk_size)


def pack_inputs(q, k, v, g, beta, cu_seqlens):
    """Return ``(q, k, v, g, beta, cu_seqlens_list, batch_shape)`` in packed ``[1, T, ...]`` form.

    Without ``cu_seqlens`` a ``[B, T, ...]`` batch is packed into ``B`` sequences of length ``T``;
    ``batch_shape = (B, T)`` lets the caller unpack ``o``. With ``cu_seqlens`` the batch must be 1.
    """
    if q.dim() != 4:
        raise ValueError(f"q: expected [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v: expected [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if g.shape != (B, T, H, K):
        raise ValueError(f"g: expected shape {(B, T, H, K)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta: expected shape {(B, T, H)}, got {tuple(beta.shape)}")
    if cu_seqlens is None:
        cu = [b * T for b in range(B + 1)]
        batch_shape = (B, T)
        if B != 1:
            q, k, v, g, beta = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    else:
        if B != 1:
            raise ValueError(f"q: batch must be 1 with cu_seqlens (packed varlen), got {B}")
        cu = as_int_list(cu_seqlens, "cu_seqlens")
        batch_shape = None
    return q, k, v, g, beta, cu, batch_shape


def check_initial_state(initial_state, n: int, H: int, K: int, V: int) -> None:
    if initial_state is None:
        return
    if tuple(initial_state.shape) != (n, H, K, V):
        raise ValueError(
            f"initial_state: expected [N, H, K, V] = {(n, H, K, V)}, got {tuple(initial_state.shape)}"
        )
    if initial_state.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"initial_state: must be float32 (float64 in reference checks), got {initial_state.dtype}"
        )
