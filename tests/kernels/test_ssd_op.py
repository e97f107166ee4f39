"""The SSD (Mamba2) ChunkLA operator :func:`harts_kernels.ssd.chunk_ssd_with_states`: its chunked
reference and the operator against the token-by-token reference (float64), outputs, final and
requested boundary states and all gradients (initial states included), on random packed calls
(hypothesis: sequence lengths, chunk sizes 1..8, boundaries requested or not)."""

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harts_kernels.ssd import (
    chunk_ssd_with_states,
    naive_chunk_ssd_with_states,
    naive_recurrent_ssd_with_states,
)


@st.composite
def ssd_calls(draw):
    lens = draw(st.lists(st.integers(1, 13), min_size=1, max_size=4))
    chunk = draw(st.sampled_from([1, 2, 3, 4, 8]))
    reqs = [(i, c) for i, n in enumerate(lens) for c in range(1, n // chunk + 1)]
    picked = draw(st.lists(st.sampled_from(reqs), max_size=4)) if reqs else []
    return lens, chunk, picked, draw(st.booleans()), draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ssd_calls())
def test_chunked_reference_equals_recurrent(call):
    lens, chunk, picked, with_h0, seed = call
    gen = torch.Generator().manual_seed(seed)
    T, H, K, V, N = sum(lens), 2, 3, 4, len(lens)
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, T, H, generator=gen, dtype=torch.float64) * 2
    h0 = torch.randn(N, H, K, V, generator=gen, dtype=torch.float64) if with_h0 else None
    inputs = [t.requires_grad_(True) for t in (q, k, v, g) + ((h0,) if with_h0 else ())]
    kw = dict(
        cu_seqlens=np.concatenate([[0], np.cumsum(lens)]).tolist(),
        chunk_size=chunk,
        request_seq=[i for i, _ in picked],
        request_chunk=[c for _, c in picked],
    )
    outs = []
    for fn in (naive_chunk_ssd_with_states, chunk_ssd_with_states, naive_recurrent_ssd_with_states):
        o, final, bs = fn(*inputs[:4], initial_state=inputs[4] if with_h0 else None, **kw)
        w = [
            torch.randn(t.shape, generator=torch.Generator().manual_seed(1), dtype=t.dtype)
            for t in (o, final, bs)
        ]
        loss = sum((t * wt).sum() for t, wt in zip((o, final, bs), w))
        outs.append([o, final, bs, *torch.autograd.grad(loss, inputs)])
    for got in outs[:2]:
        for a, b in zip(got, outs[2]):
            assert torch.allclose(a, b, rtol=1e-9, atol=1e-9)
