"""The SSD (Mamba2) ChunkLA operator :func:`harts_kernels.ssd.chunk_ssd_with_states`: its chunked
reference and the operator against the token-by-token reference (float64), outputs, final and
requested boundary states and all gradients (initial states included), on random packed calls
(hypothesis: sequence lengths, chunk sizes 1..8, boundaries requested or not)."""

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harts_kernels.ssd import (
    chunk_ssd_with_states,
    fla_gated_backward_refused,
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


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [32, 64])
def test_triton_path_matches_reference_on_cuda(chunk):
    """fla's simple-GLA kernel under the operator (prefix sequences for the requested boundaries)
    against the chunked reference on CUDA, fp32: outputs, states and all gradients."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    lens = [3 * chunk + 5, chunk, 1, 2 * chunk - 1, 70]
    T, H, K, V, N = sum(lens), 4, 64, 32, len(lens)
    q, k = (torch.randn(1, T, H, K, generator=gen, device=dev) * K**-0.5 for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, device=dev)
    g = -torch.rand(1, T, H, generator=gen, device=dev) * 0.5
    h0 = torch.randn(N, H, K, V, generator=gen, device=dev)
    kw = dict(
        cu_seqlens=np.concatenate([[0], np.cumsum(lens)]).tolist(),
        chunk_size=chunk,
        request_seq=[0, 0, 1, 3],
        request_chunk=[1, 3, 1, 1],
    )
    if fla_gated_backward_refused() is not None:  # fla #640 (Hopper, Triton < 3.7.1): forward only
        with torch.no_grad():
            fwd = [
                chunk_ssd_with_states(q, k, v, g, initial_state=h0, backend=b, **kw)
                for b in ("triton", "naive")
            ]
        for name, a, b in zip(["o", "final", "bstates"], *fwd):
            err = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert err < 2e-3, (name, err)
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v, g, h0)]
        with pytest.raises(ValueError, match="^backend: 'triton' cannot be differentiated here"):
            chunk_ssd_with_states(*inputs[:4], initial_state=inputs[4], backend="triton", **kw)
        with warnings.catch_warnings():  # the fallback warns once per process
            warnings.simplefilter("ignore")
            auto = chunk_ssd_with_states(*inputs[:4], initial_state=inputs[4], backend="auto", **kw)
        ref_in = [t.clone().requires_grad_(True) for t in (q, k, v, g, h0)]
        ref = chunk_ssd_with_states(*ref_in[:4], initial_state=ref_in[4], backend="naive", **kw)
        for a, b in zip(auto, ref):  # "auto" ran the reference: the same values and gradients
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        w = torch.randn(auto[0].shape, generator=torch.Generator(device=dev).manual_seed(1), device=dev)
        ga = torch.autograd.grad((auto[0] * w).sum(), inputs)
        gr = torch.autograd.grad((ref[0] * w).sum(), ref_in)
        for a, b in zip(ga, gr):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        return
    res = {}
    for backend in ("triton", "naive"):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v, g, h0)]
        o, final, bs = chunk_ssd_with_states(*inputs[:4], initial_state=inputs[4], backend=backend, **kw)
        w = [
            torch.randn(t.shape, generator=torch.Generator(device=dev).manual_seed(1), device=dev)
            for t in (o, final, bs)
        ]
        loss = sum((t.float() * wt).sum() for t, wt in zip((o, final, bs), w))
        res[backend] = [o, final, bs, *torch.autograd.grad(loss, inputs)]
    for name, a, b in zip(
        ["o", "final", "bstates", "dq", "dk", "dv", "dg", "dh0"], res["triton"], res["naive"]
    ):
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err < 2e-3, (name, err)


_INTERP_CASE = """
import sys
sys.path.insert(0, {runtime!r})
from triton_interpreter import prelude
exec(prelude("fla.ops.simple_gla.chunk", "fla.ops.common.chunk_h", "fla.ops.common.chunk_o", "fla.ops.utils.cumsum"))
import torch
from harts_kernels.ssd import chunk_ssd_with_states
torch.manual_seed(0)
lens = [21, 16, 1, 9]
T, H, K, V, N = sum(lens), 1, 16, 16, len(lens)
q, k, v = torch.randn(1, T, H, K), torch.randn(1, T, H, K), torch.randn(1, T, H, V)
g = -torch.rand(1, T, H) * 0.5
h0 = torch.randn(N, H, K, V)
kw = dict(cu_seqlens=[0, 21, 37, 38, 47], chunk_size=16, request_seq=[0, 1, 0], request_chunk=[1, 1, 1])
res = {{}}
for b in ("triton", "naive"):
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, h0)]
    o, f, bs = chunk_ssd_with_states(*ins[:4], initial_state=ins[4], backend=b, **kw)
    w = [torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) for t in (o, f, bs)]
    loss = sum((t.float() * wt).sum() for t, wt in zip((o, f, bs), w))
    res[b] = [o, f, bs, *torch.autograd.grad(loss, ins)]
for a, b in zip(res["triton"], res["naive"]):
    assert ((a - b).norm() / b.norm()).item() < 1e-5, ((a - b).norm() / b.norm()).item()
print("ok")
"""


@pytest.mark.slow
def test_triton_path_under_interpreter_matches_reference():
    """The CUDA path (fla's simple-GLA stages, prefix sequences for the requested boundaries,
    duplicated requests, initial states, partial chunks) under ``TRITON_INTERPRET=1`` on the CPU
    against the chunked reference: outputs, states and all gradients (about 30 s: fla's imports
    and the interpreter)."""
    pytest.importorskip("triton")
    pytest.importorskip("fla")
    runtime = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helpers
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", _INTERP_CASE.format(runtime=runtime)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
