"""The planner -> runtime contract and the runtime's public surface.

* a ``harts_planner.CallPlan`` satisfies :class:`harts_runtime.layout.CallLayoutArrays`;
* the runtime reads nothing but the layout: a stand-in that has only the 8 scalars and 27 arrays
  gives the same microbatch (every index tensor) and the same log-probs as the CallPlan itself;
* a missing layout field is named; step inputs need a real ``RolloutBatch`` (no duck typing);
* the runtime imports no private planner name; the public API is importable from ``harts_runtime``,
  whose names load on first use (the layers, ops and test helpers import without the planner).
"""

import ast
import pathlib
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
import torch

import harts_planner as hp
import harts_runtime
from harts_runtime import (
    CallLayoutArrays,
    HybridModel,
    InvalidInputError,
    StepInputs,
    compact_microbatch,
    forward_microbatch,
    model_config,
)
from harts_runtime.layout import LAYOUT_ARRAYS, LAYOUT_SCALARS, check_call_layout
from harts_runtime.testing import random_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def layout_only(plan) -> types.SimpleNamespace:
    """An object with exactly the layout's attributes of ``plan`` (copies), nothing else."""
    return types.SimpleNamespace(**{n: np.array(getattr(plan, n)) for n in LAYOUT_SCALARS + LAYOUT_ARRAYS})


def tensors(obj, prefix=""):
    """Every tensor reachable from a microbatch (dataclasses, lists, dicts), by path."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            yield from tensors(x, f"{prefix}[{i}]")
    elif isinstance(obj, dict):
        for k, x in obj.items():
            yield from tensors(x, f"{prefix}.{k}")
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            yield from tensors(getattr(obj, k), f"{prefix}.{k}")


def test_the_layout_is_8_scalars_and_27_distinct_call_plan_arrays():
    assert len(LAYOUT_SCALARS) == 8 and len(LAYOUT_ARRAYS) == 27
    assert len(set(LAYOUT_SCALARS + LAYOUT_ARRAYS)) == 35
    plan = hp.plan_calls(random_batch(0, num=6), 8, conv_width=4)
    assert isinstance(plan, CallLayoutArrays)
    for name in LAYOUT_ARRAYS:
        assert isinstance(getattr(plan, name), np.ndarray), name
    declared = set(CallLayoutArrays.__annotations__)
    assert declared == set(LAYOUT_SCALARS + LAYOUT_ARRAYS)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_runtime_reads_only_the_layout(seed):
    cfg = model_config("debug")
    batch = random_batch(seed, num=14, max_new=12)  # small vocabulary: forks, two rounds, replay
    step = StepInputs.synthetic(batch, seed)
    traj = np.arange(0, batch.num_trajectories, 2)
    plan = hp.plan_calls(batch, cfg.chunk_size, microbatch=traj, conv_width=cfg.conv_size)
    assert plan.num_calls >= 2 and plan.replay_tokens > 0
    bare = layout_only(plan)
    assert not isinstance(bare, hp.CallPlan) and isinstance(bare, CallLayoutArrays)
    a, b = compact_microbatch(step, plan, cfg), compact_microbatch(step, bare, cfg)
    ta, tb = dict(tensors(a)), dict(tensors(b))
    assert ta.keys() == tb.keys() and len(ta) > 20
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    torch.manual_seed(0)
    model = HybridModel(cfg)
    with torch.no_grad():
        assert torch.equal(forward_microbatch(model, a)[1], forward_microbatch(model, b)[1])


def test_a_missing_layout_field_is_named():
    plan = hp.plan_calls(random_batch(2, num=5), 8, conv_width=4)
    bare = layout_only(plan)
    del bare.own_conv_context
    with pytest.raises(InvalidInputError) as e:
        check_call_layout(bare)
    assert e.value.field == "call_plan.own_conv_context"
    cfg = model_config("debug")
    with pytest.raises(InvalidInputError) as e:
        compact_microbatch(StepInputs.synthetic(random_batch(2, num=5), 0), bare, cfg)
    assert e.value.field == "call_plan.own_conv_context"


def test_step_inputs_need_a_rollout_batch():
    batch = random_batch(3, num=4)
    p = batch.semantic_tokens - batch.num_trajectories
    duck = types.SimpleNamespace(
        **{n: getattr(batch, n) for n in ("compact_map", "segment_row_begin", "offsets")}
    )
    with pytest.raises(InvalidInputError) as e:
        StepInputs(duck, torch.zeros(p), torch.ones(p), torch.zeros(p), objective="ppo")
    assert e.value.field == "batch" and "RolloutBatch" in str(e.value)
    tokenless = hp.RolloutBatch.from_segment_tree(batch.segment_tree())
    with pytest.raises(InvalidInputError) as e:
        StepInputs(tokenless, torch.zeros(p), torch.ones(p), torch.zeros(p), objective="ppo")
    assert e.value.field == "batch"


def _planner_names_used(path: pathlib.Path):
    """(module, name) of every ``harts_planner`` import in a source file."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harts_planner"):
            for alias in node.names:
                yield node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("harts_planner"):
                    yield alias.name, ""
        elif isinstance(node, ast.Attribute) and node.attr in ("_native", "_progress"):
            yield "<attribute>", node.attr


def test_the_runtime_uses_only_public_planner_names():
    root = pathlib.Path(harts_runtime.__file__).parent
    used = [(str(p.relative_to(root)), m, n) for p in root.rglob("*.py") for m, n in _planner_names_used(p)]
    assert used, "the runtime plans through harts_planner"
    private = [u for u in used if any(part.startswith("_") for part in u[1].split(".") + [u[2]])]
    assert not private, private


def test_the_public_api_is_importable_from_the_package():
    for name in harts_runtime.__all__:
        assert getattr(harts_runtime, name) is not None, name
    for alias in ("StepInputsError", "ConfigError", "ParallelConfigError"):
        assert getattr(harts_runtime, alias) is InvalidInputError
    assert issubclass(InvalidInputError, ValueError)


def test_importing_the_package_and_the_layers_needs_no_planner():
    code = textwrap.dedent("""
        import sys
        import harts_runtime
        assert "torch" not in sys.modules and "harts_planner" not in sys.modules
        import harts_runtime.layers, harts_runtime.ops.attention, harts_runtime.testing
        assert "harts_planner" not in sys.modules, "a layer imported the planner"
        assert harts_runtime.HybridModel.__name__ == "HybridModel"
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
