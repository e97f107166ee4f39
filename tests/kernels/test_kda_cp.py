"""State passing for context-parallel KDA / GDN (harts_kernels.kda.cp) on the CPU reference:
piece summaries vs the token-by-token reference, the fold vs a plain loop and its backward vs the
transposed fold, and the whole C-piece algorithm vs one call over the sequence, forward and backward
(KDA and GDN gates, with and without an initial state); bad cuts and shapes name the field."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_kernels.kda import chunk_kda_with_states, naive_fold_states, naive_piece_summary
from harts_kernels.kda.cp import (
    StatePassingError,
    chunk_kda_cp_reference,
    fold_states,
    fold_states_backward,
    piece_summary,
)

# Named tolerances (atol, rtol) per tensor and dtype. Max abs errors measured over 60 random cases:
# fp32 A 4e-7, b 1.2e-6, S_in 1e-6, o 1e-6, final 5e-7, grads 1.4e-6 (dq) .. 1.5e-5 (dg);
# fp64 all <= 2e-14.
TOL = {
    torch.float32: {
        "A": (1e-5, 1e-5),
        "b": (1e-5, 1e-5),
        "S_in": (1e-5, 1e-5),
        "o": (2e-5, 1e-5),
        "final": (2e-5, 1e-5),
        "grad": (1e-4, 1e-5),
    },
    torch.float64: {
        "A": (1e-12, 1e-12),
        "b": (1e-12, 1e-12),
        "S_in": (1e-12, 1e-12),
        "o": (1e-12, 1e-12),
        "final": (1e-12, 1e-12),
        "grad": (1e-11, 1e-11),
    },
}
FAST = settings(max_examples=20, deadline=None, derandomize=True)


def close(name, got, ref, kind=None):
    atol, rtol = TOL[ref.dtype][kind or name]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def make(T, H, K, V, *, seed, dtype=torch.float32, decay=0.5, gdn=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen, dtype=dtype)
    shape = (1, T, H, 1) if gdn else (1, T, H, K)
    g = -torch.rand(*shape, generator=gen, dtype=dtype) * decay  # GDN: one decay per head
    beta = torch.rand(1, T, H, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@FAST
@given(
    T=st.integers(1, 100),
    B=st.sampled_from([16, 64]),
    K=st.integers(8, 16),
    V=st.integers(8, 16),
    decay=st.sampled_from([0.02, 0.5]),
    gdn=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_piece_summary_matches_token_recurrence(T, B, K, V, decay, gdn, dtype, seed):
    q, k, v, g, beta = make(T, 2, K, V, seed=seed, dtype=dtype, decay=decay, gdn=gdn)
    g = g.expand(1, T, 2, K)
    A, b = piece_summary(q, k, v, g, beta, chunk_size=B)
    An, bn = naive_piece_summary(q, k, v, g, beta, chunk_size=B)
    assert A.shape == (2, K, K) and b.shape == (2, K, V)
    assert A.dtype == b.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    close("A", A, An)
    close("b", b, bn)
    # the summary is the piece's affine map: from any entering state it gives the call's final state
    s0 = torch.randn(1, 2, K, V, dtype=A.dtype, generator=torch.Generator().manual_seed(seed + 1))
    _, final, _ = chunk_kda_with_states(q, k, v, g, beta, chunk_size=B, initial_state=s0)
    close("final", A @ s0[0] + b, final[0])


def test_empty_piece_is_identity():
    q, k, v, g, beta = make(0, 2, 8, 6, seed=0)
    A, b = piece_summary(q, k, v, g, beta, chunk_size=16)
    An, bn = naive_piece_summary(q, k, v, g, beta)
    assert torch.equal(A, torch.eye(8).expand(2, 8, 8)) and torch.equal(A, An)
    assert torch.equal(b, torch.zeros(2, 8, 6)) and torch.equal(b, bn)


def random_summaries(C, H, K, V, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(C, H, K, K, generator=gen, dtype=dtype) / K**0.5  # spectral radius ~1
    b = torch.randn(C, H, K, V, generator=gen, dtype=dtype)
    s0 = torch.randn(H, K, V, generator=gen, dtype=dtype)
    return A, b, s0


@FAST
@given(
    C=st.integers(1, 6),
    K=st.integers(1, 16),
    V=st.integers(1, 16),
    init=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_fold_matches_plain_loop_and_backward_is_transpose(C, K, V, init, dtype, seed):
    A, b, s0 = random_summaries(C, 2, K, V, seed, dtype)
    s0 = s0 if init else None
    S = fold_states(A, b, s0)
    assert S.shape == (C, 2, K, V)
    close("S_in", S, naive_fold_states(A, b, s0))
    if s0 is None:
        assert torch.equal(S[0], torch.zeros(2, K, V, dtype=dtype))
    # backward: autograd of the fold == the explicit reverse fold with A^T
    xs = [x.clone().requires_grad_() for x in (A, b, s0 if init else torch.zeros_like(b[0]))]
    S = fold_states(*xs)
    dS = torch.randn_like(S)
    gA, gb, g0 = torch.autograd.grad((S * dS).sum(), xs, allow_unused=True, materialize_grads=True)
    dA, db, d0 = fold_states_backward(A, S.detach(), dS)
    close("dA", dA, gA, "grad")
    close("db", db, gb, "grad")
    close("d_initial", d0, g0, "grad")


def test_fold_gradcheck():
    A, b, s0 = random_summaries(3, 2, 3, 2, 7, torch.float64)
    assert torch.autograd.gradcheck(fold_states, [x.requires_grad_() for x in (A, b, s0)])


def random_cuts(data, T, B, C):
    grid = list(range(0, T + 1, B))
    cuts = sorted(data.draw(st.lists(st.sampled_from(grid), min_size=C - 1, max_size=C - 1)))
    return cuts


def grads(out, final, inputs, do, df):
    loss = (out * do).sum() + (final * df).sum()
    return torch.autograd.grad(loss, inputs)


def check_cp_equals_one_call(T, B, K, V, C, cuts, seed, dtype, decay, gdn, init):
    base = make(T, 2, K, V, seed=seed, dtype=dtype, decay=decay, gdn=gdn)
    gen = torch.Generator().manual_seed(seed + 1)
    s0 = torch.randn(1, 2, K, V, generator=gen, dtype=dtype) if init else None
    names = ["q", "k", "v", "g", "beta"] + (["initial_state"] if init else [])
    leaves = list(base) + ([s0] if init else [])

    def run(fn):
        xs = [x.clone().requires_grad_() for x in leaves]
        g = xs[3].expand(1, T, 2, K)  # GDN: the per-head decay broadcast over K
        args = (xs[0], xs[1], xs[2], g, xs[4])
        o, f = fn(args, xs[5] if init else None)
        return xs, o, f

    xs1, o1, f1 = run(
        lambda a, h0: chunk_kda_with_states(*a, chunk_size=B, initial_state=h0)[:2]
    )  # one process
    xsc, oc, fc = run(lambda a, h0: chunk_kda_cp_reference(*a, cuts, chunk_size=B, initial_state=h0))
    assert oc.shape == o1.shape and fc.shape == f1.shape
    close("o", oc, o1)
    close("final", fc, f1)
    do = torch.randn(o1.shape, generator=gen, dtype=dtype)
    df = torch.randn(f1.shape, generator=gen, dtype=f1.dtype)
    g1 = grads(o1, f1, xs1, do, df)
    gc = grads(oc, fc, xsc, do, df)
    errs = {}
    for name, a, r in zip(names, gc, g1):
        close(f"d{name}", a, r, "grad")
        errs[name] = (a - r).abs().max().item()
    return errs


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    data=st.data(),
    T=st.integers(1, 200),
    B=st.sampled_from([16, 64]),
    K=st.integers(8, 16),
    V=st.integers(8, 16),
    C=st.integers(2, 4),
    decay=st.sampled_from([0.02, 0.5]),
    gdn=st.booleans(),
    init=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_cp_reference_equals_one_call(data, T, B, K, V, C, decay, gdn, init, seed):
    cuts = random_cuts(data, T, B, C)
    check_cp_equals_one_call(T, B, K, V, C, cuts, seed, torch.float32, decay, gdn, init)


@pytest.mark.parametrize(
    "T, B, cuts, gdn, init",
    [
        (200, 16, [48, 112, 192], False, True),  # four pieces, partial last chunk
        (130, 64, [64], True, True),  # GDN, two pieces
        (160, 16, [32, 32, 160], False, False),  # an empty piece in the middle and at the end
        (64, 64, [0], True, False),  # an empty first piece
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cp_reference_cases(T, B, cuts, gdn, init, dtype):
    check_cp_equals_one_call(T, B, 12, 10, len(cuts) + 1, cuts, 3, dtype, 0.05, gdn, init)


@pytest.mark.parametrize(
    "cuts, field, words",
    [
        ([40], "cuts[0]", "not on the chunk grid"),
        ([32, 16], "cuts[1]", "non-decreasing"),
        ([-16], "cuts[0]", "out of range"),
        ([128], "cuts[0]", "out of range"),
        ([16.0], "cuts[0]", "must be an integer"),
        (torch.tensor([16.0]), "cuts", "integer"),
        (16, "cuts", "list of integers"),
    ],
)
def test_bad_cuts_name_the_field(cuts, field, words):
    x = make(100, 2, 8, 8, seed=0)
    with pytest.raises(StatePassingError) as e:
        chunk_kda_cp_reference(*x, cuts, chunk_size=16)
    msg = str(e.value)
    assert e.value.field == field and msg.startswith(f"{field}: ") and words in msg and "\n" not in msg
    assert isinstance(e.value, ValueError)


def test_bad_shapes_name_the_field():
    q, k, v, g, beta = make(32, 2, 8, 6, seed=0)
    cases = [
        (lambda: chunk_kda_cp_reference(q, k, v, g, beta, [16], chunk_size=0), "chunk_size"),
        (lambda: chunk_kda_cp_reference(q[0], k, v, g, beta, [16], chunk_size=16), "q"),
        (lambda: chunk_kda_cp_reference(q, k, v[:, :8], g, beta, [16], chunk_size=16), "v"),
        (
            lambda: chunk_kda_cp_reference(
                q, k, v, g, beta, [16], chunk_size=16, initial_state=torch.zeros(2, 2, 8, 6)
            ),
            "initial_state",
        ),
        (lambda: piece_summary(q.expand(2, 32, 2, 8), k, v, g, beta, chunk_size=16), "q"),
        (lambda: fold_states(torch.zeros(2, 2, 8, 7), torch.zeros(2, 2, 8, 6)), "A"),
        (lambda: fold_states(torch.zeros(2, 2, 8, 8), torch.zeros(3, 2, 8, 6)), "b"),
        (
            lambda: fold_states(torch.zeros(2, 2, 8, 8), torch.zeros(2, 2, 8, 6), torch.zeros(2, 8, 5)),
            "initial",
        ),
    ]
    for fn, field in cases:
        with pytest.raises(StatePassingError) as e:
            fn()
        assert e.value.field == field and str(e.value).startswith(f"{field}: ") and "\n" not in str(e.value)
