"""harts_kernels.norm.rms_norm: RMSNorm in Triton, one compile per (D, dtype) whatever the row
count. The operator against its float32 reference and fla's own ``rms_norm`` under the Triton
interpreter, at a width of one block per row (D = 640) and of many rows per block (D = 48), with
row counts that give grids of one program up to several programs looping over several blocks; on
CUDA, bf16 at the model's width against fla, and 21 row counts compile one variant of each kernel.
(tests/kernels/test_norm_kernels.py covers the launch rule and the other norms.)"""

import importlib
import importlib.util

import pytest
import triton_interpreter

# max |ours - ref| / max |ref|: float32 under the interpreter (summation order only); on CUDA, bf16
# outputs and input gradients (two bf16 ulps of the largest value) and the float32 dweight (a sum
# over the rows grouped differently from fla's)
INTERPRETER_TOL = 2e-6
CUDA_BF16_TOL = 8e-3
CUDA_DWEIGHT_TOL = 1e-5


@pytest.mark.slow
@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("triton", "fla")), reason="needs triton and fla-core"
)
def test_matches_reference_and_fla_under_the_interpreter():
    code = (
        triton_interpreter.prelude("fla.modules.layernorm")
        + f"INTERPRETER_TOL = {INTERPRETER_TOL}\n"
        + """
import sys
import torch
import fla.modules.norm.layernorm as fla_ln
import fla.utils
from fla.modules.layernorm import rms_norm as fla_rms_norm
from harts_kernels.norm import naive_rms_norm, rms_norm

# fla's backward and ours on seven "SMs": several programs, and a partial last one
fla.utils.get_multiprocessor_count = fla_ln.get_multiprocessor_count = lambda *a, **k: 7
sys.modules["harts_kernels.norm.rms_norm"].sm_count = lambda device: 7
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
                    assert err < INTERPRETER_TOL, (D, T, ref, i, err)
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
def test_cuda_matches_fla_and_compiles_once(monkeypatch):
    """On CUDA, bf16 at the model's width: output and dx within bf16 rounding of fla's
    ``rms_norm``, dweight within float32 regrouping; 21 row counts (for fla's launch: 16 values of
    its rows per program) compile one variant of each kernel (fresh kernels, so the count is this
    test's own)."""
    import torch
    from fla.modules.layernorm import rms_norm as fla_rms_norm

    from harts_kernels.norm import rms_norm

    rms_mod = importlib.import_module("harts_kernels.norm.rms_norm")
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
        for i, (a, b, tol) in enumerate(zip(ours, ref, (CUDA_BF16_TOL, CUDA_BF16_TOL, CUDA_DWEIGHT_TOL))):
            err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            assert err < tol, (T, i, err)

    monkeypatch.setattr(rms_mod, "_KERNELS", rms_mod._build_kernels())
    for T in range(40_000, 42_001, 100):
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        torch.autograd.grad(rms_norm(x, w, 1e-6).sum(), x)
    torch.cuda.synchronize()
    counts = {k: sum(len(c[0]) for c in jit.device_caches.values()) for k, jit in rms_mod.kernels().items()}
    assert counts == {"fwd": 1, "bwd": 1}, counts
