"""The planner package's own contracts: the CallPlan's layout / debug split, the NativeField attributes,
the shared argument checks, and an import graph without cycles (the in-process planner never
imports the rpc package)."""

from __future__ import annotations

import ast
import inspect
import pydoc
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import harts_planner as hp
from harts_planner import call_plan, checks, step_plan
from harts_planner.call_plan import CallLayout, CallPlan, CallPlanDebug
from harts_planner.fields import NativeField

PACKAGE = Path(hp.__file__).resolve().parent


@pytest.fixture(scope="module")
def plan() -> CallPlan:
    batch = hp.RolloutBatch.from_token_lists([[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10], [11, 12]])
    return hp.plan_calls(batch, 2, conv_width=3)


def _public(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


# ---------------------------------------------------------------------------------- layout / debug
def test_field_tables_split_the_wire_arrays():
    assert len(call_plan.SCALAR_FIELDS) == 8
    assert len(call_plan.LAYOUT_FIELDS) == 27 and len(call_plan.DEBUG_FIELDS) == 19
    assert not call_plan.LAYOUT_FIELDS.keys() & call_plan.DEBUG_FIELDS.keys()
    assert call_plan.ARRAY_FIELDS == {**call_plan.LAYOUT_FIELDS, **call_plan.DEBUG_FIELDS}
    assert len(call_plan.ARRAY_FIELDS) == 46


def test_layout_is_the_scalars_and_layout_arrays_only(plan):
    layout = plan.layout
    assert isinstance(layout, CallLayout) and not isinstance(layout, CallPlanDebug)
    assert _public(CallLayout) == set(call_plan.SCALAR_FIELDS) | set(call_plan.LAYOUT_FIELDS)
    for name in call_plan.SCALAR_FIELDS:
        assert getattr(layout, name) == getattr(plan, name), name
    for name in call_plan.LAYOUT_FIELDS:
        value = getattr(layout, name)
        assert np.shares_memory(value, getattr(plan, name)) or value.size == 0, name  # a view, no copy
        assert not value.flags.writeable, name
    assert layout.own_conv_context.shape == (plan.num_sequences, plan.conv_width - 1)
    for name in call_plan.DEBUG_FIELDS:
        assert not hasattr(layout, name), name
    assert layout == plan.layout and layout == plan.without_debug().layout


def test_debug_part_holds_algorithm_1s_choices(plan):
    debug = plan.debug
    assert _public(CallPlanDebug) == set(call_plan.DEBUG_FIELDS) | {"chain"}
    for name in call_plan.DEBUG_FIELDS:
        assert np.array_equal(getattr(debug, name), getattr(plan, name)), name
    assert debug.conv_context.shape == (plan.num_sequences, plan.conv_width - 1)
    for q in range(plan.num_sequences):
        assert np.array_equal(debug.chain(q), plan.chain(q))
    assert debug == plan.debug


def test_a_call_plan_has_every_array_by_its_wire_name(plan):
    assert _public(CallLayout) | _public(CallPlanDebug) <= _public(CallPlan)
    for name, dtype in call_plan.ARRAY_FIELDS.items():
        assert getattr(plan, name).dtype == dtype, name


def test_attributes_are_read_only(plan):
    for target, name in (
        (plan, "gather_index"),
        (plan, "t_pre"),
        (plan.layout, "num_calls"),
        (plan.debug, "t_in"),
    ):
        with pytest.raises(AttributeError, match="read-only"):
            setattr(target, name, np.zeros(3))
        with pytest.raises(AttributeError, match="read-only"):
            delattr(target, name)


def test_a_plan_without_debug(plan):
    lean = plan.without_debug()
    assert not lean.has_debug and plan.has_debug and lean.without_debug() is lean
    assert lean != plan and lean == plan.without_debug() and lean.layout == plan.layout
    for read in (
        lambda: lean.debug,
        lambda: lean.sequence_chain,
        lambda: lean.to_dict(),
        lambda: lean.conv_context,
    ):
        with pytest.raises(hp.InvalidArgumentError, match="debug=True") as e:
            read()
        assert e.value.field == "debug"
    assert np.array_equal(lean.round_cu_seqlens(0), plan.round_cu_seqlens(0))  # layout helpers work


def test_from_fields_needs_every_layout_field_and_all_or_no_debug(plan):
    fields = {f: getattr(plan._native, f) for f in (*call_plan.SCALAR_FIELDS, *call_plan.ARRAY_FIELDS)}
    assert CallPlan.from_fields(fields) == plan
    layout_only = {f: v for f, v in fields.items() if f not in call_plan.DEBUG_FIELDS}
    assert CallPlan.from_fields(layout_only) == plan.without_debug()
    with pytest.raises(ValueError, match="gather_index"):
        CallPlan.from_fields({f: v for f, v in fields.items() if f != "gather_index"})
    with pytest.raises(ValueError, match="t_pre"):
        CallPlan.from_fields({f: v for f, v in fields.items() if f != "t_pre"})


def test_runtime_protocol_names_the_layout(plan):
    """After the runtime's layout package exists: its Protocol is exactly the layout, and a CallPlan
    (and its layout) satisfies it."""
    contract = pytest.importorskip("harts_runtime.layout.contract")
    protocol = contract.CallLayoutArrays
    assert set(protocol.__annotations__) == set(call_plan.SCALAR_FIELDS) | set(call_plan.LAYOUT_FIELDS)
    if getattr(protocol, "_is_runtime_protocol", False):
        assert isinstance(plan, protocol) and isinstance(plan.layout, protocol)


# ---------------------------------------------------------------------------------- NativeField
@pytest.mark.parametrize("cls", [CallLayout, CallPlanDebug, CallPlan, hp.RolloutBatch, hp.StepPlan])
def test_every_native_field_has_a_docstring_shown_by_help(cls):
    fields = {n: v for klass in cls.__mro__ for n, v in vars(klass).items() if isinstance(v, NativeField)}
    assert fields
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    for name, field in fields.items():
        doc = inspect.getdoc(getattr(cls, name))
        assert doc and doc == field.__doc__ and field.name == name, name
        assert doc.split()[0] in text, name


def test_step_plan_and_batch_fields_read_the_native_object():
    batch = hp.RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4], [5]])
    step = hp.plan_step(batch, 1, 8)
    assert step.dp_size == step._native.dp_size == 1
    assert np.array_equal(step.replica, step._native.replica) and not step.replica.flags.writeable
    assert batch.compact_tokens == 5 and np.array_equal(batch.segment_start, batch._native.segment_start)


# ---------------------------------------------------------------------------------- checks
@pytest.mark.parametrize("value", [3, np.int32(3), np.int64(3), np.uint8(3)])
def test_integer_accepts_python_and_numpy_integers(value):
    assert checks.integer(value, "x", 0, 5) == 3 and type(checks.integer(value, "x")) is int


@pytest.mark.parametrize(
    "value, lo, hi, message",
    [
        (True, None, None, "x: must be an integer, got True"),
        (np.True_, None, None, "x: must be an integer, got"),
        (1.0, None, None, "x: must be an integer, got 1.0"),
        ("3", None, None, "x: must be an integer, got '3'"),
        (None, None, None, "x: must be an integer, got None"),
        (0, 1, None, "x: must be >= 1, got 0"),
        (9, None, 8, "x: must be <= 8, got 9"),
        (9, 1, 8, "x: must be in [1, 8], got 9"),
    ],
)
def test_integer_rejects(value, lo, hi, message):
    with pytest.raises(hp.InvalidArgumentError) as e:
        checks.integer(value, "x", lo, hi)
    assert e.value.field == "x" and str(e.value).startswith(message)


def test_int64_index_boolean_string():
    assert checks.int64(2**63 - 1, "x") == 2**63 - 1
    for bad, message in ((2**63, "must fit int64"), (-(2**63) - 1, "must fit int64"), (0, "must be >= 1")):
        with pytest.raises(hp.InvalidArgumentError, match=message):
            checks.int64(bad, "x", 1)
    assert checks.index(2, "r", 3) == 2
    with pytest.raises(hp.InvalidArgumentError, match=r"r: must be in \[0, 3\), got 3"):
        checks.index(3, "r", 3)
    assert checks.boolean(np.False_, "b") is False and checks.boolean(True, "b") is True
    with pytest.raises(hp.InvalidArgumentError, match="b: must be a bool, got 1"):
        checks.boolean(1, "b")
    assert checks.string("auto", "s") == "auto"
    with pytest.raises(hp.InvalidArgumentError, match="s: must be a string"):
        checks.string(b"auto", "s")
    assert checks.chunk_size(checks.MAX_CHUNK_SIZE) == checks.MAX_CHUNK_SIZE
    with pytest.raises(hp.InvalidArgumentError, match=r"conv_width: must be in \[1, 1024\], got 0"):
        checks.conv_width(0)


def test_array_checks():
    a = np.arange(4, dtype=np.int32)
    assert checks.int_array(a, np.int32, "a") is a  # canonical input: no copy
    assert checks.int_array([1, 2], np.int64, "a").dtype == np.int64
    assert checks.int_array(np.array([], dtype=np.float64), np.int32, "a").dtype == np.int32
    for bad, message in (
        ([[1]], "a: must be one-dimensional, got shape (1, 1)"),
        ([0.5], "a: must hold integers, got dtype float64"),
        ([2**40], "a: value 1099511627776 does not fit int32"),
    ):
        with pytest.raises(hp.InvalidArgumentError) as e:
            checks.int_array(bad, np.int32, "a")
        assert str(e.value) == message
    assert checks.trajectory_ids([3, 1], "m").dtype == np.int32
    with pytest.raises(hp.InvalidArgumentError, match="needs at least one trajectory"):
        checks.trajectory_ids([], "m")
    with pytest.raises(hp.InvalidArgumentError) as e:
        checks.trajectory_ids([0, -(2**40)], "m")
    assert e.value.field == "m[1]"


def test_step_options_checks_names_and_types():
    defaults = step_plan.DEFAULT_OPTIONS
    got = checks.step_options({"greedy": np.True_, "max_sampled_k": np.int64(4), "search": "exact"}, defaults)
    assert got == {"greedy": True, "max_sampled_k": 4, "search": "exact"}
    assert type(got["greedy"]) is bool and type(got["max_sampled_k"]) is int
    for options, field in (
        ({"nope": 1}, "nope"),
        ({"greedy": 1}, "greedy"),
        ({"refine_window": 2.0}, "refine_window"),
        ({"refine_window": 2**64}, "refine_window"),
        ({"search": 3}, "search"),
    ):
        with pytest.raises(hp.InvalidArgumentError) as e:
            checks.step_options(options, defaults, prefix="options.")
        assert e.value.field == "options." + field


def test_default_options_come_from_cpp():
    assert step_plan.DEFAULT_OPTIONS == hp._native.default_step_options()
    assert hp._native.default_step_options() is not hp._native.default_step_options()  # a new dict each call
    # the binding's keyword defaults are the same values (pybind's signature line shows them)
    signature = hp._native.plan_step.__doc__.splitlines()[0]
    shown = dict(re.findall(r"(\w+): [^=,]+ = ([^,)]+)", signature))
    assert shown == {
        name: repr(v) if isinstance(v, str) else str(v) for name, v in step_plan.DEFAULT_OPTIONS.items()
    }


# ---------------------------------------------------------------------------------- imports
def _imports(path: Path) -> set[str]:
    """harts_planner modules a file imports (anywhere in it, lazily or not)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("harts_planner")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harts_planner"):
            out.add(node.module)
            for a in node.names:
                candidate = f"{node.module}.{a.name}"
                if (PACKAGE.parent / (candidate.replace(".", "/") + ".py")).exists() or (
                    PACKAGE.parent / candidate.replace(".", "/")
                ).is_dir():
                    out.add(candidate)
    return out


def test_the_package_import_graph_has_no_cycle():
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = _imports(path)
    packages = {"harts_planner", "harts_planner.rpc"}  # package __init__s only re-export
    graph = {
        m: {d for d in deps if d in modules and d not in packages and d != m} for m, deps in modules.items()
    }
    assert "harts_planner.rpc.codec" in graph["harts_planner.planner"]  # lazily, for a sidecar

    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join([*stack[stack.index(d) :], d]))
            if d not in state:
                visit(d, [*stack, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    for m in graph:  # in particular no rpc module reaches back to the Planner
        if m.startswith("harts_planner.rpc"):
            assert "harts_planner.planner" not in graph[m], m


def test_in_process_planning_never_imports_rpc():
    code = (
        "import sys, harts_planner as hp\n"
        "b = hp.RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4]])\n"
        "hp.Planner().plan_step(b, 1, 8, call_plans=True); hp.Planner().plan_calls(b, 2, debug=False)\n"
        "hp.Planner().plan_step(hp.SegmentTree([-1], [2], [0]), 1, 4)\n"
        "assert not [m for m in sys.modules if m.startswith(('harts_planner.rpc', 'grpc'))], sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
