"""planner.proto as a contract: the committed descriptor snapshot (numbers and types never change
within v1), the comments that state the C++ defaults and limits, and the CallPlan's Layout / Debug
grouping against harts_planner.call_plan's tables."""

from __future__ import annotations

import copy
import inspect
import json
import re
from pathlib import Path

import pytest

import harts_planner as hp
from harts_planner import _native, call_plan, checks, step_plan
from harts_planner.rpc import codec, snapshot
from harts_planner.rpc import planner_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
PROTO = (ROOT / "proto" / "harts" / "planner" / "v1" / "planner.proto").read_text()
LIMITS = _native.planner_limits()


def _number(text: str) -> int:
    """``2^24``, ``2^31 - 1`` or ``1024`` as an int."""
    m = re.fullmatch(r"\s*(\d+)(?:\^(\d+))?(?:\s*-\s*(\d+))?\s*", text)
    assert m, text
    base, exp, minus = m.groups()
    return int(base) ** int(exp or 1) - int(minus or 0)


def _message_body(name: str) -> str:
    m = re.search(r"^message " + name + r" \{\n(.*?)^\}", PROTO, re.S | re.M)
    assert m, name
    return m.group(1)


def _field_comments(name: str, above_too: bool = True) -> dict[str, str]:
    """field name -> the comment on its line, after the comment lines just above it (``above_too``)."""
    out, above = {}, []
    for line in _message_body(name).splitlines():
        stripped = line.strip()
        if stripped.startswith("//"):
            above.append(stripped[2:].strip())
            continue
        m = re.match(r"(?:optional |repeated )?[\w.<>, ]+ (\w+) = \d+;\s*(?://\s*(.*))?$", stripped)
        if m:
            out[m.group(1)] = " ".join([*(above if above_too else []), m.group(2) or ""]).strip()
        above = []
    return out


# ---------------------------------------------------------------------------------- snapshot
def test_descriptor_matches_the_committed_snapshot():
    committed = json.loads((ROOT / snapshot.SNAPSHOT_PATH).read_text())
    breaking, additions = snapshot.compare(committed, snapshot.snapshot())
    assert not breaking, (
        "harts.planner.v1 changed incompatibly (numbers, types and labels never change and nothing is "
        "removed within a version; deprecate instead, or start harts.planner.v2):\n" + "\n".join(breaking)
    )
    assert not additions, (
        f"planner.proto has entries the snapshot lacks; regenerate it from the repository root with\n"
        f"    {snapshot.REGENERATE}\nand commit it:\n" + "\n".join(additions)
    )
    assert (ROOT / snapshot.SNAPSHOT_PATH).read_text() == snapshot.dumps(committed)  # written by the tool


def test_snapshot_comparison_classifies_changes():
    base = snapshot.snapshot()
    assert snapshot.compare(base, base) == ([], [])
    call = "harts.planner.v1.CallPlan"

    def changed(edit):
        new = copy.deepcopy(base)
        edit(new)
        return snapshot.compare(base, new)

    breaking, additions = changed(lambda s: s["messages"][call].pop("t_pre"))
    assert (
        len(breaking) == 1 and "CallPlan.t_pre" in breaking[0] and "removed" in breaking[0] and not additions
    )
    breaking, _ = changed(lambda s: s["messages"][call]["t_pre"].update(number=99))
    assert len(breaking) == 1 and "changed" in breaking[0]
    breaking, _ = changed(lambda s: s["messages"][call]["t_pre"].update(type="int64"))
    assert len(breaking) == 1 and "t_pre" in breaking[0]
    breaking, _ = changed(
        lambda s: s["messages"]["harts.planner.v1.StepOptions"]["greedy"].pop("proto3_optional")
    )
    assert len(breaking) == 1 and "greedy" in breaking[0]
    breaking, _ = changed(lambda s: s["enums"]["harts.planner.v1.SearchMode"].update(SEARCH_MODE_EXACT=5))
    assert len(breaking) == 1 and "SEARCH_MODE_EXACT" in breaking[0]
    breaking, _ = changed(lambda s: s["services"]["harts.planner.v1.PlannerService"].pop("PlanCalls"))
    assert len(breaking) == 1 and "PlanCalls" in breaking[0]
    breaking, _ = changed(lambda s: s["messages"].pop("harts.planner.v1.PlanStats"))
    assert breaking == ["message harts.planner.v1.PlanStats was removed"]
    breaking, additions = changed(
        lambda s: s["messages"][call].update(extra={"number": 99, "type": "bytes", "label": "optional"})
    )
    assert not breaking and len(additions) == 1 and "CallPlan.extra" in additions[0]
    breaking, additions = changed(
        lambda s: s["enums"]["harts.planner.v1.SearchMode"].update(SEARCH_MODE_NEW=4)
    )
    assert not breaking and len(additions) == 1


def test_snapshot_command_writes_and_checks(tmp_path, capsys):
    path = tmp_path / "snap.json"
    assert snapshot.main([str(path)]) == 0
    assert json.loads(path.read_text()) == snapshot.snapshot()
    assert snapshot.main([str(path), "--check"]) == 0
    old = json.loads(path.read_text())
    old["messages"]["harts.planner.v1.CallPlan"].pop("debug_omitted")
    path.write_text(snapshot.dumps(old))
    capsys.readouterr()
    assert snapshot.main([str(path), "--check"]) == 1
    out = capsys.readouterr().out
    assert "CallPlan.debug_omitted" in out and snapshot.REGENERATE in out


def test_snapshot_records_every_message_and_enum():
    snap = snapshot.snapshot()
    assert snap["package"] == "harts.planner.v1"
    names = {f"harts.planner.v1.{m}" for m in pb.DESCRIPTOR.message_types_by_name}
    assert names <= snap["messages"].keys()
    assert "harts.planner.v1.StepPlan.PhaseSecondsEntry" in snap["messages"]  # nested (map entry)
    assert snap["enums"]["harts.planner.v1.SearchMode"] == {
        v.name: v.number for v in pb.SearchMode.DESCRIPTOR.values
    }
    assert snap["messages"]["harts.planner.v1.Trajectories"]["tree"]["oneof"] == "source"
    assert snap["messages"]["harts.planner.v1.CallPlan"]["segment_child_offsets"] == {
        "number": 13,
        "type": "bytes",
        "label": "optional",
    }


# ---------------------------------------------------------------------------------- defaults and limits
def test_step_options_comments_state_the_cpp_defaults():
    defaults = _native.default_step_options()
    assert step_plan.DEFAULT_OPTIONS == defaults  # derived from harts::PlannerOptions
    comments = _field_comments("StepOptions")
    assert set(comments) == set(defaults)
    search_names = {"SEARCH_MODE_" + v.upper(): v for v in ("auto", "exact", "heuristic")}
    for name, default in defaults.items():
        m = re.search(r"\[([^\]]+)\]\s*(?:,|$|\s)", comments[name] + " ")
        assert m, f"StepOptions.{name}: no [default] in its comment {comments[name]!r}"
        stated = m.group(1)
        if isinstance(default, bool):
            assert stated == str(default).lower(), name
        elif isinstance(default, int):
            assert _number(stated) == default, name
        else:
            assert search_names[stated] == default, name


def test_stated_option_minimums_are_the_planners():
    batch = hp.RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4], [5]])
    stated = {
        name: _number(m.group(1))
        for name, text in _field_comments("StepOptions").items()
        if (m := re.search(r">= (\d+)", text))
    }
    assert stated == {"max_sampled_k": 2}
    for name, lo in stated.items():
        hp.plan_step(batch, 1, 8, **{name: lo})
        with pytest.raises(hp.InvalidArgumentError) as e:
            hp.plan_step(batch, 1, 8, **{name: lo - 1})
        assert e.value.field == name


def test_header_states_the_cpp_limits():
    m = re.search(
        r"// Limits: N <= ([^;]+?) trajectories; S <= ([^;]+?) semantic tokens; V <= ([^;]+?) segments;",
        PROTO,
    )
    assert m, "the header's Limits line"
    assert _number(m.group(1)) == LIMITS["MAX_TRAJECTORIES"] == hp.MAX_TRAJECTORIES
    assert _number(m.group(2)) == LIMITS["MAX_SEMANTIC_TOKENS"] == hp.MAX_SEMANTIC_TOKENS
    assert _number(m.group(3)) == LIMITS["MAX_TREE_SEGMENTS"]
    m = re.search(r"SEARCH_MODE_EXACT = 2;.*above ([\d^ -]+) DP cells", PROTO)
    assert m and _number(m.group(1)) == LIMITS["MAX_EXACT_CELLS"]


@pytest.mark.parametrize("message", ["PlanStepRequest", "PlanCallsRequest"])
def test_request_comments_state_the_call_plan_limits_and_defaults(message):
    comments = _field_comments(message)
    for field, limit, default in (
        ("chunk_size", LIMITS["MAX_CHUNK_SIZE"], call_plan.DEFAULT_CHUNK_SIZE),
        ("conv_width", LIMITS["MAX_CONV_WIDTH"], call_plan.DEFAULT_CONV_WIDTH),
    ):
        m = re.search(r"in \[1, ([\d^ -]+)\].*; 0 means (\d+)", comments[field])
        assert m, f"{message}.{field}: {comments[field]!r}"
        assert _number(m.group(1)) == limit
        assert int(m.group(2)) == default
    assert (
        checks.MAX_CHUNK_SIZE
        == hp.call_plan.MAX_CHUNK_SIZE
        == _native.MAX_CHUNK_SIZE
        == LIMITS["MAX_CHUNK_SIZE"]
    )
    assert checks.MAX_CONV_WIDTH == _native.MAX_CONV_WIDTH == LIMITS["MAX_CONV_WIDTH"]


def test_python_signatures_use_the_stated_defaults():
    for fn in (hp.plan_calls, hp.Planner.plan_calls, hp.Planner.plan_step, hp.plan_step):
        params = inspect.signature(fn).parameters
        assert params["chunk_size"].default == call_plan.DEFAULT_CHUNK_SIZE, fn
        if "conv_width" in params:
            assert params["conv_width"].default == call_plan.DEFAULT_CONV_WIDTH, fn
    assert (
        codec.decode_plan_calls_request(pb.PlanCallsRequest())["chunk_size"] == call_plan.DEFAULT_CHUNK_SIZE
    )
    assert (
        codec.decode_plan_calls_request(pb.PlanCallsRequest())["conv_width"] == call_plan.DEFAULT_CONV_WIDTH
    )


# ---------------------------------------------------------------------------------- Layout / Debug
def test_call_plan_message_groups_layout_then_debug():
    body = _message_body("CallPlan")
    layout_head = "// Layout: what a runtime reads (harts_runtime.layout.CallLayoutArrays)"
    debug_head = "// Debug: Algorithm 1's internal choices (recovery, chains, slot producers)"
    assert body.count(layout_head) == 1 and body.count(debug_head) == 1
    layout_text, debug_text = body.split(debug_head)
    assert layout_head in layout_text

    def names(text):
        return {m.group(1) for m in re.finditer(r"^\s*(?:bytes|int64|bool) (\w+) = \d+;", text, re.M)}

    assert names(layout_text) == set(call_plan.SCALAR_FIELDS) | set(call_plan.LAYOUT_FIELDS)
    assert names(debug_text) == set(call_plan.DEBUG_FIELDS) | {"debug_omitted"}
    for name, dtype in call_plan.ARRAY_FIELDS.items():  # int64 arrays say so in their comment
        comment = _field_comments("CallPlan", above_too=False)[name]
        assert comment.startswith("int64") == (dtype.itemsize == 8), name


def test_request_flags_are_documented():
    assert "omit_debug" in _field_comments("PlanStepRequest")
    assert "debug part" in _field_comments("PlanCallsRequest")["omit_debug"]
    assert "omit_debug" in _field_comments("CallPlan")["debug_omitted"]
