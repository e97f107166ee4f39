"""State passing for context-parallel KDA / GDN on the GPU (``harts_kernels.kda.cp`` on the Triton
chunk kernel, at real head dims): piece summaries against the fp32 token-by-token reference, and the
C-piece algorithm (summaries, fold, rerun) against one whole-sequence call, forward and backward.

Tolerances are relative to each reference tensor's largest magnitude (the Triton kernel's matmuls
run in TF32 / bf16 internally): ``TOL_REL`` per tensor, named below with what was measured."""

import pytest
import torch

from harts_kernels.kda import chunk_kda_with_states, naive_piece_summary
from harts_kernels.kda.cp import chunk_kda_cp_reference, piece_summary

pytestmark = pytest.mark.gpu

TOL_REL = {  # max |got - want| / max |want|; measured on one H200 (Triton 3.6) in brackets
    "A": 5e-3,  # vs the fp64 recurrence [1.1e-3]
    "b": 5e-3,  # [1.3e-3]
    "o": 1e-3,  # four pieces vs one call [1.8e-4]
    "final": 1e-4,  # [8.4e-6]
    "grad": 1e-3,  # dq [2.3e-4], dk dv dg dbeta dh0 [<= 7.1e-5]
}


def _rel(got, want) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _make(T, H, K, V, seed, gdn=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = dict(device="cuda", generator=gen)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, **dev), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, **dev), dim=-1)
    v = torch.randn(1, T, H, V, **dev)
    g = -torch.rand(1, T, H, 1 if gdn else K, **dev) * 0.1
    beta = torch.rand(1, T, H, **dev)
    return q, k, v, g.expand(1, T, H, K).contiguous(), beta


@pytest.mark.parametrize("gdn", [False, True], ids=["kda", "gdn"])
def test_piece_summary_on_the_triton_kernel(gdn):
    q, k, v, g, beta = _make(192, 2, 128, 128, seed=1, gdn=gdn)
    A, b = piece_summary(q, k, v, g, beta, chunk_size=64, backend="triton")
    A_ref, b_ref = naive_piece_summary(
        q.double(), k.double(), v.double(), g.double(), beta.double(), chunk_size=64
    )
    errs = {"A": _rel(A, A_ref), "b": _rel(b, b_ref)}
    print("summary rel errors", errs)
    for name, err in errs.items():
        assert err <= TOL_REL[name], f"{name}: {err:.2e}"


@pytest.mark.parametrize("gdn", [False, True], ids=["kda", "gdn"])
def test_state_passing_equals_one_call_on_the_triton_kernel(gdn):
    T, B = 1000, 64
    cuts = [192, 448, 768]  # four pieces on the chunk grid; the last one partial
    base = _make(T, 4, 128, 128, seed=2, gdn=gdn)
    s0 = torch.randn(1, 4, 128, 128, device="cuda") * 0.1

    def run(fn):
        xs = [x.clone().requires_grad_() for x in (*base, s0)]
        o, f = fn(xs[:5], xs[5])
        do = torch.randn_like(o)
        df = torch.randn_like(f)
        grads = torch.autograd.grad((o * do).sum() + (f * df).sum(), xs)
        return o, f, grads

    torch.manual_seed(0)
    o1, f1, g1 = run(
        lambda a, h0: chunk_kda_with_states(*a, chunk_size=B, initial_state=h0, backend="triton")[:2]
    )
    torch.manual_seed(0)
    oc, fc, gc = run(
        lambda a, h0: chunk_kda_cp_reference(*a, cuts, chunk_size=B, initial_state=h0, backend="triton")
    )
    errs = {"o": _rel(oc, o1), "final": _rel(fc, f1)}
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), gc, g1):
        errs[name] = _rel(a, r)
    print("state passing rel errors", errs)
    for name, err in errs.items():
        assert err <= TOL_REL.get(name, TOL_REL["grad"]), f"{name}: {err:.2e}"
