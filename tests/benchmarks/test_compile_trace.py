"""benchmarks/compile_trace.py: the tracer restores what it patches, aggregates its events, and
sees torch.compile graphs (Triton and CuTe compiles need a GPU; the GPU runs exercise them)."""

import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "compile_trace.py")


def _mod():
    spec = importlib.util.spec_from_file_location("compile_trace", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_patches_are_restored_and_graphs_counted():
    mod = _mod()
    triton = pytest.importorskip("triton")
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    before = (Autotuner.run, getattr(JITFunction, "_do_compile", None))
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    with mod.CompileTrace() as trace:
        assert Autotuner.run is not before[0]
        f(torch.ones(3))
        f(torch.ones(3))  # same shape: no new graph
    assert (Autotuner.run, getattr(JITFunction, "_do_compile", None)) == before
    s = trace.summary()
    assert s["kinds"]["torch_compile"]["count"] == 1 and trace.events[-1]["key"] == "1"
    assert s["wall_s"] > 0 and triton is not None


def test_summary_aggregates_per_kernel():
    mod = _mod()
    t = mod.CompileTrace()
    t.events = [
        {"kind": "triton_compile", "name": "a", "seconds": 1.0, "key": "k1"},
        {"kind": "triton_compile", "name": "a", "seconds": 2.0, "key": "k2"},
        {"kind": "triton_compile", "name": "b", "seconds": 0.5, "key": "k1"},
        {"kind": "autotune", "name": "a", "seconds": 4.0, "key": "T=1"},
    ]
    s = t.summary(top=2)
    assert s["kinds"]["triton_compile"] == {"count": 3, "seconds": 3.5}
    assert [(r["kind"], r["name"], r["count"], r["distinct_keys"]) for r in s["top"]] == [
        ("autotune", "a", 1, 1),
        ("triton_compile", "a", 2, 2),
    ]
    assert s["top"][1]["sample_keys"] == ["k1", "k2"]
