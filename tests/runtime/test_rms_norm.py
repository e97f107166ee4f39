"""harts_kernels.norm: RMSNorm on fla's kernels with the backward's rows per program bucketed
(no compile per row count). The bucketing rule's properties, and the operator against its float32
reference and fla's own ``rms_norm`` under the Triton interpreter, on both of fla's backward paths
(D > 512: the row kernel launched here; D <= 512: fla's) and row counts that give grids of one
program up to one program per row."""

import importlib.util

import pytest
import triton_interpreter
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_kernels.norm import rows_per_program


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 1 << 22), st.integers(1, 1024))
def test_rows_per_program_covers_every_row_within_a_quarter(rows, programs):
    need = -(-rows // programs)
    bs = rows_per_program(rows, programs)
    assert need <= bs <= max(need, need * 5 // 4 + 1)
    assert -(-rows // bs) <= programs  # the grid it implies never exceeds the programs asked for


def test_rows_per_program_has_few_variants():
    # at T <= 65,536 on 132 SMs fla's ceil(T / 132) has 497 values; the buckets have 32
    assert len({rows_per_program(t, min(132, t)) for t in range(1, 65_537)}) <= 40
    assert [rows_per_program(n, 1) for n in (8, 9, 243, 256, 257, 497)] == [8, 10, 256, 256, 320, 512]


@pytest.mark.slow
@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("triton", "fla")), reason="needs triton and fla-core"
)
def test_matches_reference_and_fla_under_the_interpreter():
    code = (
        triton_interpreter.prelude("fla.modules.layernorm")
        + """
import torch
import fla.modules.norm.layernorm as fla_ln
import fla.utils
from fla.modules.layernorm import rms_norm as fla_rms_norm
from harts_kernels.norm import naive_rms_norm, rms_norm

# the interpreter has one "SM": pretend seven, so grids have several programs and a partial last one
fla.utils.get_multiprocessor_count = fla_ln.get_multiprocessor_count = lambda *a, **k: 7
torch.manual_seed(0)
for D in (640, 48):
    for T in (1, 5, 37, 300):
        for wdtype in (torch.float32,):
            x = torch.randn(T, D, requires_grad=True)
            w = (1.0 + 0.3 * torch.randn(D, dtype=wdtype)).requires_grad_(True)
            gy = torch.randn(T, D)
            out = {}
            for name, fn in (("ours", lambda: rms_norm(x, w, 1e-6)), ("naive", lambda: naive_rms_norm(x, w, 1e-6)),
                             ("fla", lambda: fla_rms_norm(x, w, None, eps=1e-6))):
                y = fn()
                out[name] = (y,) + torch.autograd.grad(y, (x, w), gy)
            for ref in ("naive", "fla"):
                for i, (a, b) in enumerate(zip(out["ours"], out[ref])):
                    err = ((a - b).abs().max() / b.abs().max()).item()
                    print(D, T, ref, i, err)
                    assert err < 2e-6, (D, T, ref, i, err)
# a 3-D input keeps its shape
x = torch.randn(4, 3, 640, requires_grad=True)
w = torch.ones(640, requires_grad=True)
y = rms_norm(x, w, 1e-6)
assert y.shape == x.shape
(gx,) = torch.autograd.grad(y.sum(), x)
assert gx.shape == x.shape
print("ok")
"""
    )
    r = triton_interpreter.run(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout[-2000:], r.stderr[-3000:])


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core")
def test_cuda_matches_fla_and_compiles_once_per_bucket():
    """On CUDA, bf16 at the model's width: dx bit-equal to fla's ``rms_norm`` (same per-row math),
    dweight within float32 regrouping; 21 row counts whose fla launches take 16 values of ``BS``
    compile at most two variants of the row kernel here."""
    import torch
    from fla.modules.layernorm import rms_norm as fla_rms_norm
    from fla.modules.norm.layernorm import layer_norm_bwd_kernel_row

    from harts_kernels.norm import rms_norm

    dev = torch.device("cuda")
    torch.manual_seed(0)
    D = 2304
    w = (1.0 + 0.1 * torch.randn(D, device=dev)).requires_grad_(True)
    for T in (1, 131, 5_000, 50_123):
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        ours = (rms_norm(x, w, 1e-6),)
        ours += torch.autograd.grad(ours[0], (x, w), gy)
        ref = (fla_rms_norm(x, w, None, eps=1e-6),)
        ref += torch.autograd.grad(ref[0], (x, w), gy)
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1]), T
        assert ((ours[2] - ref[2]).abs().max() / ref[2].abs().max()).item() < 1e-5, T

    jit = layer_norm_bwd_kernel_row
    while not hasattr(jit, "device_caches"):  # through the autotuner(s) to the JITFunction
        jit = jit.fn
    cache = lambda: sum(len(c[0]) for c in jit.device_caches.values())  # noqa: E731
    before = cache()
    for T in range(40_000, 42_001, 100):
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        torch.autograd.grad(rms_norm(x, w, 1e-6).sum(), x)
    torch.cuda.synchronize()
    assert cache() - before <= 2, cache() - before
