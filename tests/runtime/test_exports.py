"""``harts_runtime``'s public names (:data:`harts_runtime.__all__`): every one resolves, lazily, to
the object its defining module exports under that name; the engine's door (``HartsEngine`` and its
option types, ``Rollouts``) is among them; ``import harts_runtime`` alone loads neither torch nor the
engine."""

import importlib
import subprocess
import sys
import textwrap

import pytest

import harts_runtime

ENGINE_NAMES = (
    "DEFAULT_CAPACITY",
    "EngineConfig",
    "EngineOutput",
    "ExecutionOptions",
    "HartsEngine",
    "OptimizerOptions",
    "Rollouts",
    "StepReport",
    "train_step",
)


@pytest.mark.parametrize("name", harts_runtime.__all__)
def test_every_public_name_resolves_to_its_module_s_object(name):
    module = importlib.import_module(harts_runtime._EXPORTS[name])
    assert getattr(harts_runtime, name) is getattr(module, name)
    assert name in getattr(module, "__all__", (name,)), f"{module.__name__}.__all__ lacks {name}"
    assert name in dir(harts_runtime)


def test_the_engine_s_names_are_exported():
    assert set(ENGINE_NAMES) <= set(harts_runtime.__all__)
    assert harts_runtime.__all__ == sorted(harts_runtime._EXPORTS)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        _ = harts_runtime.Engine


def test_importing_the_package_loads_no_engine():
    code = textwrap.dedent("""
        import sys
        import harts_runtime
        assert "torch" not in sys.modules and "harts_runtime.engine" not in sys.modules
        assert harts_runtime.DEFAULT_CAPACITY > 0
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
