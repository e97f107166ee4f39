"""harts_kernels.moe: the fused gather-sum and weighted SwiGLU against their float32 references.

* CPU: the references' backward equals autograd's on the reference forward (float64), and the
  launch rules take widths only (no row count reaches a constexpr).
* Triton interpreter (``TRITON_INTERPRET=1``, a subprocess): the kernels against the references on
  random shapes (row counts 1 to 200, k 1 to 8, widths across one and several column blocks),
  float32 and bfloat16, with named tolerances.
* GPU (``gpu``): the same on CUDA at MoE sizes, and one compiled variant per kernel for twenty
  row counts.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from harts_kernels.moe import naive_gather_sum, naive_swiglu_weighted, naive_swiglu_weighted_bwd
from harts_kernels.moe.gather_sum import block_columns
from harts_kernels.moe.swiglu import launch_blocks

HAS_TRITON = importlib.util.find_spec("triton") is not None

TOL = {
    # (atol, rtol) of kernel vs reference. float32: both float32 math, summation orders equal
    # (gather-sum) or elementwise, so rounding only. bfloat16: each output is rounded once by the
    # kernel and once by the reference from float32 values that agree to ~1e-6: one bf16 ulp
    # (2^-8 relative) at most, plus dw's I-long row sum in float32.
    torch.float32: {"out": (1e-5, 1e-5), "h": (1e-5, 1e-5), "dgu": (1e-5, 1e-5), "dw": (1e-4, 1e-5)},
    torch.bfloat16: {"out": (1e-2, 8e-3), "h": (1e-2, 8e-3), "dgu": (1e-2, 8e-3), "dw": (2e-2, 8e-3)},
}


def test_reference_backward_is_autograds():
    gen = torch.Generator().manual_seed(0)
    for weighted in (True, False):
        gu = torch.randn(9, 14, generator=gen, dtype=torch.float64, requires_grad=True)
        w = torch.rand(9, generator=gen, dtype=torch.float64, requires_grad=True) if weighted else None
        g = torch.randn(9, 7, generator=gen, dtype=torch.float64)
        a, b = gu.chunk(2, -1)
        h = F.silu(a) * b * (w[:, None] if weighted else 1)
        torch.testing.assert_close(naive_swiglu_weighted(gu, w), h)
        h.backward(g)
        dgu, dw = naive_swiglu_weighted_bwd(gu.detach(), None if w is None else w.detach(), g)
        torch.testing.assert_close(dgu, gu.grad)
        assert (dw is None) == (not weighted)
        if weighted:
            torch.testing.assert_close(dw, w.grad)
    y = torch.randn(11, 5, generator=gen, dtype=torch.float64)
    idx = torch.randint(0, 11, (4 * 3,), generator=gen)
    ref = torch.stack([y[idx[3 * n : 3 * n + 3]].sum(0) for n in range(4)])
    torch.testing.assert_close(naive_gather_sum(y, idx, 3), ref)
    base = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(naive_gather_sum(y, idx, 3, base), base + ref)


def test_launch_rules_depend_on_widths_only():
    assert [block_columns(d) for d in (1, 16, 40, 1024, 1536, 4096)] == [16, 16, 64, 1024, 1024, 1024]
    for i in (1, 24, 128, 512, 600, 2048):
        bm, bi = launch_blocks(i)
        assert bi >= min(i, 512) and bi <= 512 and bm * bi <= 4096 and bm >= 1


def _interpret(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


CASES = textwrap.dedent(
    """
    import random, torch
    from harts_kernels.moe import *
    TOL = {tol!r}
    rnd = random.Random(0)
    dev = {device!r}
    for trial in range({trials}):
        for dt in (torch.float32, torch.bfloat16):
            tol = TOL[str(dt)]
            close = lambda name, a, b: torch.testing.assert_close(
                a.float(), b.float(), atol=tol[name][0], rtol=tol[name][1], msg=lambda m: f"{{name}} {{dt}}: {{m}}")
            m, d, k = rnd.randint(1, {max_rows}), rnd.choice({widths}), rnd.randint(1, 8)
            n = rnd.randint(0, {max_rows})
            y = torch.randn(m, d, device=dev).to(dt)
            idx = torch.randint(0, m, (n * k,), device=dev)
            close("out", gather_sum(y, idx, k), naive_gather_sum(y, idx, k))
            base = torch.randn(n, d, device=dev).to(dt)
            close("out", gather_sum(y, idx, k, base), naive_gather_sum(y, idx, k, base))
            i = rnd.choice({widths}) // 2 or 1
            gu = torch.randn(m, 2 * i, device=dev).to(dt)
            g = torch.randn(m, i, device=dev).to(dt)
            for w in (torch.rand(m, device=dev).to(dt), None):
                close("h", swiglu_weighted(gu, w), naive_swiglu_weighted(gu, w))
                dgu, dw = swiglu_weighted_bwd(gu, w, g)
                rgu, rw = naive_swiglu_weighted_bwd(gu, w, g)
                close("dgu", dgu, rgu)
                assert (dw is None) == (w is None)
                if w is not None:
                    close("dw", dw, rw)
    print("OK")
    """
)


def _cases(device, trials, max_rows, widths):
    tol = {str(dt): v for dt, v in TOL.items()}
    return CASES.format(tol=tol, device=device, trials=trials, max_rows=max_rows, widths=widths)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernels_match_the_references_under_the_interpreter():
    r = _interpret(_cases("cpu", 8, 200, [2, 16, 40, 130, 1100]))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.gpu
def test_kernels_match_the_references_on_cuda_with_one_compile_per_width():
    exec(_cases("cuda", 6, 70_000, [128, 1024, 1536, 2048]), {})
    from harts_kernels.moe import gather_sum, swiglu_weighted, swiglu_weighted_bwd
    from harts_kernels.moe.triton_kernels import gather_sum_kernel, swiglu_bwd_kernel, swiglu_fwd_kernel

    def variants(kernel):  # compiled variants over devices (triton 3.x: device -> (kernel cache, ...))
        return sum(len(entry[0]) for entry in kernel.device_caches.values())

    before = [variants(kern) for kern in (gather_sum_kernel, swiglu_fwd_kernel, swiglu_bwd_kernel)]
    for rows in [1, 7, 16, 17, 100, 128, 1000, 4095, 4096, 4097] + list(range(30_000, 30_010)):
        y = torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16)
        gather_sum(y, torch.randint(0, rows, (rows * 8,), device="cuda"), 8)
        gu = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(rows, device="cuda", dtype=torch.bfloat16)
        swiglu_weighted(gu, w)
        swiglu_weighted_bwd(gu, w, torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16))
    after = [variants(kern) for kern in (gather_sum_kernel, swiglu_fwd_kernel, swiglu_bwd_kernel)]
    assert all(a - b <= 1 for a, b in zip(after, before)), (before, after)


def test_clipped_reference_backward_is_autograds():
    """The clipped SwiGLU reference (``limit``) against autograd of ``min(silu(a), L) * clamp(b,
    -L, L) * w``, with values on both sides of the limits (and the limits hit exactly)."""
    gen = torch.Generator().manual_seed(1)
    lim = 0.7
    for weighted in (True, False):
        gu = (3 * torch.randn(9, 14, generator=gen, dtype=torch.float64)).requires_grad_()
        with torch.no_grad():
            gu[0, 7] = lim  # b exactly at the limit: the gradient passes (torch's clamp)
        w = torch.rand(9, generator=gen, dtype=torch.float64, requires_grad=True) if weighted else None
        g = torch.randn(9, 7, generator=gen, dtype=torch.float64)
        a, b = gu.chunk(2, -1)
        h = F.silu(a).clamp(max=lim) * b.clamp(-lim, lim) * (w[:, None] if weighted else 1)
        torch.testing.assert_close(naive_swiglu_weighted(gu, w, lim), h)
        h.backward(g)
        dgu, dw = naive_swiglu_weighted_bwd(gu.detach(), None if w is None else w.detach(), g, lim)
        torch.testing.assert_close(dgu, gu.grad)
        if weighted:
            torch.testing.assert_close(dw, w.grad)


CLIPPED = textwrap.dedent(
    """
    import torch
    from harts_kernels.moe import *
    torch.manual_seed(0)
    for m, i in ((1, 3), (17, 20), (40, 70)):
        for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            gu = (3 * torch.randn(m, 2 * i)).to(dt)
            g = torch.randn(m, i).to(dt)
            for w in (torch.rand(m).to(dt), None):
                for lim in (0.5, 7.0, None):
                    close = lambda x, y: torch.testing.assert_close(x.float(), y.float(), atol=tol, rtol=tol)
                    close(swiglu_weighted(gu, w, lim), naive_swiglu_weighted(gu, w, lim))
                    dgu, dw = swiglu_weighted_bwd(gu, w, g, lim)
                    rgu, rw = naive_swiglu_weighted_bwd(gu, w, g, lim)
                    close(dgu, rgu)
                    if w is not None:
                        close(dw, rw)
    print("OK")
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_clipped_swiglu_kernels_match_the_reference_under_the_interpreter():
    """The weighted SwiGLU kernels with a limit (Ling-3.0's clipped experts), forward and
    backward, on small shapes under ``TRITON_INTERPRET=1``."""
    r = _interpret(CLIPPED)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
