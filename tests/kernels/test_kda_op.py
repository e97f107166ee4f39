"""KDA ChunkLA contract (Equation 16) on the CPU reference: chunked vs recurrent, requested
boundary states vs split-and-resume, gradients (gradcheck in float64), validation."""

import subprocess
import sys

import pytest
import torch

from harts_kernels.kda import (
    chunk_kda_with_states,
    naive_chunk_kda_with_states,
    naive_recurrent_kda_with_states,
)

# Named per-tensor tolerances (fp32 reference vs fp32 reference): (atol, rtol).
TOL = {"o": (2e-5, 1e-4), "final": (2e-5, 1e-4), "states": (2e-5, 1e-4), "grad": (5e-5, 1e-4)}


def assert_close(name, ref, got, kind=None):
    atol, rtol = TOL[kind or name]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def make_inputs(lens, H=2, K=8, V=6, dtype=torch.float32, seed=0, h0=True, decay=0.5):
    g_ = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(1, T, H, K, generator=g_, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g_, dtype=dtype), dim=-1)
    v = torch.randn(1, T, H, V, generator=g_, dtype=dtype)
    g = -torch.rand(1, T, H, K, generator=g_, dtype=dtype) * decay
    beta = torch.rand(1, T, H, generator=g_, dtype=dtype)
    s0 = torch.randn(len(lens), H, K, V, generator=g_, dtype=dtype) if h0 else None
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return [q, k, v, g, beta], s0, cu


def all_boundaries(lens, B):
    seq, chunk = [], []
    for i, n in enumerate(lens):
        for c in range(1, n // B + 1):
            seq.append(i)
            chunk.append(c)
    return seq, chunk


CASES = [
    # (lens, chunk_size, initial state)
    ([64], 64, False),
    ([130, 1, 64, 200, 65], 64, True),  # varlen, lengths at / around the 64 grid
    ([63, 128, 129], 64, True),
    ([37, 5, 16, 17], 16, True),  # any B on the reference
    ([23, 9], 7, False),
    ([5, 3], 1, True),
]


@pytest.mark.parametrize(
    "lens,B,h0", CASES, ids=[f"lens{'-'.join(map(str, c[0]))}-B{c[1]}-h0{int(c[2])}" for c in CASES]
)
def test_chunked_matches_recurrent(lens, B, h0):
    x, s0, cu = make_inputs(lens, h0=h0)
    rs, rc = all_boundaries(lens, B)
    ref = naive_recurrent_kda_with_states(
        *x, initial_state=s0, cu_seqlens=cu, chunk_size=B, request_seq=rs, request_chunk=rc
    )
    got = naive_chunk_kda_with_states(
        *x, initial_state=s0, cu_seqlens=cu, chunk_size=B, request_seq=rs, request_chunk=rc
    )
    assert got[0].shape == (1, sum(lens), 2, 6) and got[1].shape == (len(lens), 2, 8, 6)
    assert got[2].shape == (len(rs), 2, 8, 6) and got[2].dtype == torch.float32
    for name, a, b in zip(("o", "final", "states"), ref, got):
        assert_close(name, a, b)


def test_public_op_dispatches_to_reference_on_cpu():
    x, s0, cu = make_inputs([70, 64])
    a = chunk_kda_with_states(*x, initial_state=s0, cu_seqlens=cu, request_seq=[0, 1], request_chunk=[1, 1])
    b = naive_chunk_kda_with_states(
        *x, initial_state=s0, cu_seqlens=cu, request_seq=[0, 1], request_chunk=[1, 1]
    )
    for name, u, w in zip(("o", "final", "states"), a, b):
        torch.testing.assert_close(u, w, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_batched_form_equals_varlen():
    x, s0, cu = make_inputs([48, 48], h0=True)
    xb = [t.reshape(2, 48, *t.shape[2:]) for t in x]
    ob, fb, _ = naive_chunk_kda_with_states(*xb, initial_state=s0, chunk_size=16)
    ov, fv, _ = naive_chunk_kda_with_states(*x, initial_state=s0, cu_seqlens=cu, chunk_size=16)
    assert_close("o", ov.reshape(2, 48, 2, 6), ob)
    assert_close("final", fv, fb)


@pytest.mark.parametrize("B", [64, 16, 5])
def test_requested_states_equal_split_and_resume(B):
    lens = [3 * B + 7, 2 * B, B + 1]
    x, s0, cu = make_inputs(lens, seed=1)
    rs, rc = all_boundaries(lens, B)
    o, final, states = naive_chunk_kda_with_states(
        *x, initial_state=s0, cu_seqlens=cu, chunk_size=B, request_seq=rs, request_chunk=rc
    )
    for r, (i, c) in enumerate(zip(rs, rc)):
        lo, cut, hi = cu[i], cu[i] + c * B, cu[i + 1]
        head = [t[:, lo:cut] for t in x]
        _, s_head, _ = naive_chunk_kda_with_states(*head, initial_state=s0[i : i + 1], chunk_size=B)
        assert_close(f"states[{r}] vs head final", s_head[0], states[r], "states")
        if cut < hi:  # resume from the returned state: same outputs and final state
            tail = [t[:, cut:hi] for t in x]
            o_t, f_t, _ = naive_chunk_kda_with_states(*tail, initial_state=states[r : r + 1], chunk_size=B)
            assert_close(f"o tail after boundary {c} of seq {i}", o[:, cut:hi], o_t, "o")
            assert_close(f"final after resume (seq {i})", final[i], f_t[0], "final")


def test_duplicate_and_unordered_requests():
    x, s0, cu = make_inputs([40, 40])
    _, _, s = naive_chunk_kda_with_states(
        *x, initial_state=s0, cu_seqlens=cu, chunk_size=8, request_seq=[1, 0, 1], request_chunk=[3, 2, 3]
    )
    _, _, t = naive_chunk_kda_with_states(
        *x, initial_state=s0, cu_seqlens=cu, chunk_size=8, request_seq=[0, 1], request_chunk=[2, 3]
    )
    torch.testing.assert_close(s, torch.stack([t[1], t[0], t[1]]), atol=0, rtol=0)


# ------------------------------------------------------------------------------- gradients
def _gradcheck(fn, lens, B, rs, rc, outputs, fast_mode=False):
    x, s0, cu = make_inputs(lens, H=1, K=3, V=2, dtype=torch.float64, seed=3, decay=1.0)
    inputs = [t.clone().requires_grad_(True) for t in x + [s0]]

    def f(q, k, v, g, beta, h0):
        o, final, states = fn(
            q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, chunk_size=B, request_seq=rs, request_chunk=rc
        )
        picked = {"o": o, "final": final, "states": states}
        return tuple(picked[name] for name in outputs)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=fast_mode)


@pytest.mark.parametrize("outputs", [("o", "final", "states"), ("states",)], ids=["all", "states-only"])
def test_gradcheck_chunked_requested_states(outputs):
    # full Jacobian for all outputs; random projections (fast mode) when only states flow back
    _gradcheck(
        naive_chunk_kda_with_states,
        [9, 6],
        4,
        [0, 0, 1],
        [1, 2, 1],
        outputs,
        fast_mode=outputs == ("states",),
    )


def test_gradcheck_recurrent_requested_states():
    _gradcheck(
        naive_recurrent_kda_with_states,
        [7, 5],
        3,
        [0, 1, 0],
        [2, 1, 1],
        ("o", "final", "states"),
        fast_mode=True,
    )


def test_state_gradient_reaches_earlier_chunks_and_initial_state_only():
    B, lens = 8, [40, 24]
    x, s0, cu = make_inputs(lens, seed=5)
    xs = [t.clone().requires_grad_(True) for t in x + [s0]]
    _, _, states = naive_chunk_kda_with_states(
        *xs[:5],
        initial_state=xs[5],
        cu_seqlens=cu,
        chunk_size=B,
        request_seq=[0],
        request_chunk=[2],
        output_final_state=False,
    )
    (states * torch.randn_like(states)).sum().backward()
    q, k, v, g, beta, h0 = (t.grad for t in xs)
    cut = 2 * B
    for name, grad in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        assert grad[0, :cut].abs().sum() > 0, f"d{name}: no gradient before the boundary"
        assert grad[0, cut:].abs().sum() == 0, f"d{name}: gradient after the boundary or in another sequence"
    assert q is None or q.abs().sum() == 0, "dq: a state does not depend on q"
    assert h0[0].abs().sum() > 0 and h0[1].abs().sum() == 0, (
        "dh0: only the producing sequence's initial state"
    )


def test_state_gradient_matches_split_chain():
    """A consumer starting from S_c sends its gradient into the producer's earlier chunks exactly
    as if the two halves were one sequence."""
    B, L = 8, 45
    x, s0, _ = make_inputs([L], seed=6)
    cut = 3 * B
    w_o = torch.randn(1, L, 2, 6, generator=torch.Generator().manual_seed(9))

    def grads(split):
        xs = [t.clone().requires_grad_(True) for t in x + [s0]]
        if split:
            o1, _, st = naive_chunk_kda_with_states(
                *[t[:, :L] for t in xs[:5]],
                initial_state=xs[5],
                chunk_size=B,
                request_seq=[0],
                request_chunk=[3],
                output_final_state=False,
            )
            o2, _, _ = naive_chunk_kda_with_states(
                *[t[:, cut:] for t in xs[:5]], initial_state=st, chunk_size=B
            )
            o = torch.cat([o1[:, :cut], o2], 1)
        else:
            o, _, _ = naive_chunk_kda_with_states(*xs[:5], initial_state=xs[5], chunk_size=B)
        (o * w_o).sum().backward()
        return [t.grad for t in xs]

    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads(False), grads(True)):
        assert_close(name, a, b, "grad")


# ------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "rs,rc,field",
    [
        ([0], [0], "request_chunk[0]"),  # c = 0 is the initial state, not a request
        ([0], [3], "request_chunk[0]"),  # 3 * 8 > 20: boundary does not exist
        ([2], [1], "request_seq[0]"),
        ([0, 1], [1], "request_seq/request_chunk"),
    ],
)
def test_bad_requests_name_the_field(rs, rc, field):
    x, _, cu = make_inputs([20, 9])
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        naive_chunk_kda_with_states(*x, cu_seqlens=cu, chunk_size=8, request_seq=rs, request_chunk=rc)


def test_bad_cu_seqlens_and_state_shape():
    x, s0, cu = make_inputs([20, 9])
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]"):
        naive_chunk_kda_with_states(*x, cu_seqlens=[0, 20, 28])
    with pytest.raises(ValueError, match="initial_state"):
        naive_chunk_kda_with_states(*x, cu_seqlens=cu, initial_state=s0[:1])
    with pytest.raises(ValueError, match="backend"):
        chunk_kda_with_states(*x, cu_seqlens=cu, backend="cuda")


def test_cpu_import_needs_only_torch():
    code = (
        "import sys, harts_kernels.kda, harts_kernels.kda.naive; "
        "bad = [m for m in ('triton', 'fla') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------- GPU-path plan
def test_device_plan_layout_and_cache():
    """The Triton path's index tensors (built on the host, one copy) and their LRU cache: chunk
    indices match the chunk grid, requests are deduplicated and sorted per sequence, a repeated
    call gets the same plan object, and bad requests still raise (nothing bad is cached)."""
    from harts_kernels.kda import chunk as ck

    cu, B = [0, 70, 100, 228], 32
    plan = ck._plan_for(cu, 228, B, [2, 0, 2, 2], [4, 2, 1, 4], torch.device("cpu"))
    grid = [(i, c) for i in range(3) for c in range(-(-(cu[i + 1] - cu[i]) // B))]
    assert plan.chunk_indices.tolist() == [list(p) for p in grid]
    assert plan.cu_seqlens.tolist() == cu and plan.chunk_offsets.tolist() == [0, 3, 4, 8]
    req_off, req_chunk, req_row = plan.requests
    assert req_off.tolist() == [0, 1, 1, 3] and req_chunk.tolist() == [2, 1, 4]
    assert req_row.tolist() == [0, 1, 2] and plan.inverse.tolist() == [2, 0, 1, 2]  # duplicates
    assert plan.num_boundaries == 3
    for t in (plan.cu_seqlens, plan.chunk_offsets, plan.chunk_indices, *plan.requests):
        assert t.data_ptr() % 16 == 0  # aligned views: one Triton specialization for any N
    distinct = ck._plan_for(cu, 228, B, [2, 0, 2], [4, 2, 1], torch.device("cpu"))
    assert distinct.requests[1].tolist() == [2, 1, 4] and distinct.inverse is None
    assert distinct.requests[2].tolist() == [1, 2, 0]  # written straight into request order
    assert ck._plan_for(cu, 228, B, [2, 0, 2, 2], [4, 2, 1, 4], torch.device("cpu")) is plan
    assert ck._plan_for(cu, 228, B, [2, 0], [4, 2], torch.device("cpu")) is not plan
    for _ in range(2):
        with pytest.raises(ValueError, match=r"request_chunk\[0\]"):
            ck._plan_for(cu, 228, B, [1], [1], torch.device("cpu"))  # sequence 1 has 30 < 32 tokens
    plain = ck._plan_for(cu, 228, B, [], [], torch.device("cpu"))
    assert plain.requests is None and plain.inverse is None and plain.num_boundaries == 0
