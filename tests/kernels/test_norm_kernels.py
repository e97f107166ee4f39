"""harts_kernels.norm: ``l2norm``, ``rms_norm_gated`` and ``rms_norm`` compile one variant per (D,
dtype, flags), whatever the row count.

* CPU: :func:`launch_config`'s rule (no row count among its inputs; blocks cover D; bounded
  registers); every launch of the three operators over row counts 1..160 passes the same
  constexprs and ``num_warps`` and differs only in the grid and the runtime row count (the kernels
  replaced by recorders); every runtime integer argument of every kernel is not specialized.
* CPU under ``TRITON_INTERPRET=1`` (``slow``): forward and backward of each operator against its
  float32 reference and fla's own function, at D in (128, 640) and row counts 1, 5, 37, 300 (one
  program up to several programs looping over several blocks with a partial last one).
* CUDA (``gpu``): bf16 against fla, and 20 row counts per operator compile one variant per (D,
  dtype) of each kernel.
"""

import importlib
import importlib.util
import textwrap

import pytest
import torch
import triton_interpreter
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_kernels.norm import l2norm, launch_config, rms_norm, rms_norm_gated
from harts_kernels.norm import launch as launch_mod

# max |ours - ref| / max |ref| under the interpreter (float32 everywhere; the references differ
# only by float32 summation order)
INTERPRETER_TOL = 2e-6
# on CUDA in bf16 against fla: outputs and input gradients are rounded to bf16 (one ulp: 2^-8 of
# the largest value); dweight is a float32 sum over the rows grouped differently from fla's
CUDA_BF16_TOL = 8e-3
CUDA_DWEIGHT_TOL = 1e-5


def _modules():
    """The modules ``harts_kernels.norm.l2norm`` and ``.rms_norm`` (the package's attributes of
    those names are the functions)."""
    return (importlib.import_module(f"harts_kernels.norm.{m}") for m in ("l2norm", "rms_norm"))


def _importable(*names: str) -> bool:
    return all(importlib.util.find_spec(n) is not None for n in names)


# ---------------------------------------------------------------- the launch rule (CPU)
@settings(max_examples=300, deadline=None)
@given(st.integers(1, 16384), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_launch_config_covers_a_row_within_bounded_registers(D, dtype):
    if D * torch.empty((), dtype=dtype).element_size() > launch_mod.MAX_ROW_BYTES:
        with pytest.raises(ValueError, match="feature dim"):
            launch_config(D, dtype)
        return
    cfg = launch_config(D, dtype)
    assert cfg.BD >= D and cfg.BD & (cfg.BD - 1) == 0 and cfg.BD < 2 * D + 1
    assert cfg.BT >= 1 and cfg.BT & (cfg.BT - 1) == 0
    assert cfg.BT * cfg.BD <= max(launch_mod.TILE, cfg.BD)
    assert 1 <= cfg.num_warps <= launch_mod.MAX_WARPS and cfg.num_warps & (cfg.num_warps - 1) == 0


def test_launch_config_takes_no_row_count():
    import inspect

    assert list(inspect.signature(launch_config).parameters) == ["D", "dtype"]
    assert [(c.BD, c.BT) for c in (launch_config(d, torch.bfloat16) for d in (8, 128, 640, 2304))] == [
        (8, 64),
        (128, 32),
        (1024, 4),
        (4096, 1),
    ]


def test_backward_programs_never_exceed_the_row_blocks_or_the_sm_budget():
    cfg = launch_config(128, torch.bfloat16)
    for T in range(1, 5000, 7):
        ns = launch_mod.backward_programs(T, cfg, 132)
        assert 1 <= ns <= min(launch_mod.PROGRAMS_PER_SM * 132, launch_mod.row_blocks(T, cfg))
    assert launch_mod.backward_programs(10**6, cfg, 132) == launch_mod.PROGRAMS_PER_SM * 132


class _Recorder:
    """Stands for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, grid, args, kwargs))


@pytest.mark.parametrize("D", [8, 128, 640, 2304])
def test_launches_differ_only_in_grid_and_row_count(monkeypatch, D):
    l2_mod, rms_mod = _modules()
    calls = []
    for mod, prefix in ((l2_mod, "l2"), (rms_mod, "rms")):
        monkeypatch.setattr(mod, "_KERNELS", {k: _Recorder(calls, f"{prefix}_{k}") for k in ("fwd", "bwd")})
    ops = {
        "l2": lambda x, g, w: l2norm(x),
        "rms": lambda x, g, w: rms_norm(x, w, 1e-6),
        "sigmoid": lambda x, g, w: rms_norm_gated(x, g, w, 1e-6, "sigmoid"),
        "silu": lambda x, g, w: rms_norm_gated(x, g, w, 1e-6, "swish"),
    }
    cfg = launch_config(D, torch.float32)
    per_op = {}
    for name, op in ops.items():
        for T in range(1, 161):
            del calls[:]
            x, g = torch.zeros(T, D, requires_grad=True), torch.zeros(T, D, requires_grad=True)
            w = torch.ones(D, requires_grad=True)
            y = op(x, g, w)
            y.backward(torch.ones_like(y))
            assert [c[0] for c in calls] == [f"{'l2' if name == 'l2' else 'rms'}_{k}" for k in ("fwd", "bwd")]
            for kernel, grid, args, kwargs in calls:
                blocks = launch_mod.row_blocks(T, cfg)
                if kernel == "rms_bwd":  # the looping backward: its program count is a runtime argument too
                    ns = launch_mod.backward_programs(T, cfg, launch_mod.sm_count(x.device))
                    assert grid == (ns,) and args[-2:] == (T, ns), (kernel, T)
                else:
                    assert grid == (blocks,) and args[-1] == T, (kernel, T)
                ints = [a for a in args if isinstance(a, int)]
                assert ints == ([T, ns] if kernel == "rms_bwd" else [T]), (kernel, ints)
                per_op.setdefault((name, kernel), set()).add(tuple(sorted(kwargs.items())))
    for key, variants in per_op.items():
        assert len(variants) == 1, (key, variants)
        (kw,) = variants
        assert (
            dict(kw)["BD"] == cfg.BD and dict(kw)["BT"] == cfg.BT and dict(kw)["num_warps"] == cfg.num_warps
        )


@pytest.mark.skipif(not _importable("triton"), reason="needs triton")
def test_every_runtime_integer_of_the_kernels_is_not_specialized():
    l2_mod, rms_mod = _modules()
    for mod in (l2_mod, rms_mod):
        for name, kernel in mod.kernels().items():
            dns = {p.name for p in kernel.params if p.do_not_specialize}
            constexprs = {p.name for p in kernel.params if p.is_constexpr}
            assert "T" in dns and "NB" not in constexprs and "BS" not in constexprs, (mod.__name__, name)
            assert constexprs <= {"D", "BD", "BT", "ACTIVATION"}, (mod.__name__, name, constexprs)
    assert {p.name for p in rms_mod.kernels()["bwd"].params if p.do_not_specialize} == {"T", "NP"}


def test_no_rows_launch_nothing_and_give_a_zero_dweight():
    x = torch.zeros(0, 3, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    for op, n in (
        (lambda: rms_norm(x, w, 1e-6), 2),
        (lambda: rms_norm_gated(x, x, w, 1e-6), 2),
        (lambda: l2norm(x), 1),
    ):
        y = op()
        assert y.shape == x.shape
        grads = torch.autograd.grad((y * 2).sum(), (x, w)[:n])
        assert grads[0].shape == x.shape and (n == 1 or torch.equal(grads[1], torch.zeros(8)))


def test_rms_norm_gated_rejects_unknown_activation_and_shape():
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="activation"):
        rms_norm_gated(x, x, torch.ones(8), 1e-6, "relu")
    with pytest.raises(ValueError, match="activation"):
        rms_norm_gated(x, x, torch.ones(8), 1e-6, "none")
    with pytest.raises(ValueError, match="gate"):
        rms_norm_gated(x, torch.zeros(3, 4), torch.ones(8), 1e-6)


# ---------------------------------------------------------------- the interpreter (CPU, slow)
_CASES = {
    "l2norm": (
        "fla.modules.l2norm",
        """
        from fla.modules.l2norm import l2norm as fla_l2norm
        from harts_kernels.norm import l2norm, naive_l2norm
        fns = {"ours": lambda x, g, w: l2norm(x, 1e-6), "naive": lambda x, g, w: naive_l2norm(x, 1e-6),
               "fla": lambda x, g, w: fla_l2norm(x, 1e-6)}
        wrt = lambda x, g, w: (x,)
        """,
    ),
    "rms_norm_gated": (
        "fla.modules.fused_norm_gate",
        """
        from fla.modules.fused_norm_gate import rms_norm_gated as fla_rms_norm_gated
        from harts_kernels.norm import naive_rms_norm_gated, rms_norm_gated
        ACT = ["sigmoid"]  # switched to silu for the second half of the row counts
        fns = {"ours": lambda x, g, w: rms_norm_gated(x, g, w, 1e-6, ACT[0]),
               "naive": lambda x, g, w: naive_rms_norm_gated(x, g, w, 1e-6, ACT[0]),
               "fla": lambda x, g, w: fla_rms_norm_gated(x, g, w, None, activation=ACT[0], eps=1e-6)}
        wrt = lambda x, g, w: (x, g, w)
        """,
    ),
    "rms_norm": (
        "fla.modules.layernorm",
        """
        from fla.modules.layernorm import rms_norm as fla_rms_norm
        from harts_kernels.norm import naive_rms_norm, rms_norm
        fns = {"ours": lambda x, g, w: rms_norm(x, w, 1e-6), "naive": lambda x, g, w: naive_rms_norm(x, w, 1e-6),
               "fla": lambda x, g, w: fla_rms_norm(x, w, None, eps=1e-6)}
        wrt = lambda x, g, w: (x, w)
        """,
    ),
}


@pytest.mark.slow
@pytest.mark.skipif(not _importable("triton", "fla"), reason="needs triton and fla-core")
@pytest.mark.parametrize("op", list(_CASES))
def test_matches_reference_and_fla_under_the_interpreter(op):
    fla_module, setup = _CASES[op]
    code = (
        triton_interpreter.prelude(fla_module)
        + textwrap.dedent(setup)
        + textwrap.dedent(f"""
        import torch
        torch.manual_seed(0)
        for D in (128, 640):
            for i, T in enumerate((1, 5, 37, 300)):
                if "ACT" in globals():
                    ACT[0] = "sigmoid" if i < 2 else "silu"
                x = torch.randn(T, D, requires_grad=True)
                g = torch.randn(T, D, requires_grad=True)
                w = (1.0 + 0.3 * torch.randn(D)).requires_grad_(True)
                gy = torch.randn(T, D)
                out = {{}}
                for name, fn in fns.items():
                    y = fn(x, g, w)
                    out[name] = (y,) + torch.autograd.grad(y, wrt(x, g, w), gy)
                for ref in ("naive", "fla"):
                    for j, (a, b) in enumerate(zip(out["ours"], out[ref])):
                        assert a.dtype == b.dtype and a.shape == b.shape, (D, T, ref, j)
                        err = ((a - b).abs().max() / b.abs().max()).item()
                        print(D, T, ref, j, err)
                        assert err < {INTERPRETER_TOL}, (D, T, ref, j, err)
        # a 3-D input keeps its shape
        x = torch.randn(4, 3, 128, requires_grad=True)
        g = torch.randn(4, 3, 128, requires_grad=True)
        w = torch.ones(128, requires_grad=True)
        y = fns["ours"](x, g, w)
        assert y.shape == x.shape
        for t in torch.autograd.grad(y.sum(), wrt(x, g, w)):
            assert t.shape in (x.shape, w.shape)
        print("ok")
        """)
    )
    r = triton_interpreter.run(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout[-2000:], r.stderr[-3000:])


# ---------------------------------------------------------------- CUDA
def _compiled_variants(kernel) -> int:
    """Compiled variants of a Triton JIT function over all devices (Triton 3.x: ``device_caches``
    maps a device to a tuple whose first item is the kernel cache)."""
    while not hasattr(kernel, "device_caches"):  # through any wrapper to the JITFunction
        kernel = kernel.fn
    return sum(len(c[0]) for c in kernel.device_caches.values())


@pytest.mark.gpu
@pytest.mark.skipif(not _importable("fla"), reason="needs fla-core")
def test_cuda_matches_fla_and_compiles_once_per_width_and_dtype(monkeypatch):
    """bf16 on CUDA: each operator against fla's function; then 20 never-seen row counts per
    operator (forward and backward) at two widths compile exactly one variant per (D, dtype, gate)
    of each kernel (fresh kernels, so the count is this test's own)."""
    from fla.modules.fused_norm_gate import rms_norm_gated as fla_rms_norm_gated
    from fla.modules.l2norm import l2norm as fla_l2norm
    from fla.modules.layernorm import rms_norm as fla_rms_norm

    l2_mod, rms_mod = _modules()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bf = torch.bfloat16
    ops = {
        "l2norm": (lambda x, g, w: l2norm(x), lambda x, g, w: fla_l2norm(x), lambda x, g, w: (x,)),
        "rms_norm": (
            lambda x, g, w: rms_norm(x, w, 1e-6),
            lambda x, g, w: fla_rms_norm(x, w, None, eps=1e-6),
            lambda x, g, w: (x, w),
        ),
        "sigmoid": (
            lambda x, g, w: rms_norm_gated(x, g, w, 1e-6, "sigmoid"),
            lambda x, g, w: fla_rms_norm_gated(x, g, w, None, activation="sigmoid", eps=1e-6),
            lambda x, g, w: (x, g, w),
        ),
        "silu": (
            lambda x, g, w: rms_norm_gated(x, g, w, 1e-6, "silu"),
            lambda x, g, w: fla_rms_norm_gated(x, g, w, None, activation="silu", eps=1e-6),
            lambda x, g, w: (x, g, w),
        ),
    }

    def inputs(T, D):
        x = torch.randn(T, D, device=dev, dtype=bf, requires_grad=True)
        g = torch.randn(T, D, device=dev, dtype=bf, requires_grad=True)
        w = (1.0 + 0.1 * torch.randn(D, device=dev)).requires_grad_(True)
        return x, g, w, torch.randn(T, D, device=dev, dtype=bf)

    for name, (ours, ref, wrt) in ops.items():
        for D in (128, 2304):
            for T in (1, 131, 5_000, 50_123):
                x, g, w, gy = inputs(T, D)
                res = []
                for fn in (ours, ref):
                    y = fn(x, g, w)
                    res.append((y,) + torch.autograd.grad(y, wrt(x, g, w), gy))
                for i, (a, b) in enumerate(zip(*res)):
                    err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                    tol = CUDA_DWEIGHT_TOL if a.dtype == torch.float32 else CUDA_BF16_TOL
                    assert err < tol, (name, D, T, i, err)

    # fresh JIT functions (empty compile caches; Triton's disk cache keeps this quick)
    monkeypatch.setattr(l2_mod, "_KERNELS", l2_mod._build_kernels())
    monkeypatch.setattr(rms_mod, "_KERNELS", rms_mod._build_kernels())
    for D in (128, 2304):
        for T in range(40_000, 42_000, 100):  # 20 row counts
            x, g, w, gy = inputs(T, D)
            for ours, _, wrt in ops.values():
                torch.autograd.grad(ours(x, g, w), wrt(x, g, w), gy)
    torch.cuda.synchronize()
    counts = {
        f"{m}_{k}": _compiled_variants(v)
        for m, mod in (("l2norm", l2_mod), ("rms_norm", rms_mod))
        for k, v in mod.kernels().items()
    }
    # one variant per (D: 2 widths, bf16) of l2norm's kernels; per (D, gate: none, sigmoid, silu) of rms_norm's
    assert counts == {"l2norm_fwd": 2, "l2norm_bwd": 2, "rms_norm_fwd": 6, "rms_norm_bwd": 6}, counts
