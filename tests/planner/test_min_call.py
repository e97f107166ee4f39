"""Minimum-call planner and compact physical layout (issue 3; Section 3.3, Algorithm 1,
Figure 2, Section 4.2 and Appendix A of the paper)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from min_call_oracle import (
    APPENDIX_A,
    batch_from_trajectories,
    brute_force_calls,
    case_tree,
    check_plan,
    choice_count,
    plan_tree,
    preorder,
    tree_batch,
)

import harts_planner
from harts_planner import CallPlan, InvalidArgumentError, RolloutBatch, plan_calls
from harts_planner.call_plan import MAX_CHUNK_SIZE, plan_segment_forest


def unary(parent) -> list[int]:
    counts = [0] * len(parent)
    for p in parent:
        if p >= 0:
            counts[p] += 1
    return [v for v, c in enumerate(counts) if c == 1]


def plan_of_tree(parent, lengths, b, **kw):
    trajs, _ = tree_batch(parent, lengths, unary(parent))
    batch = batch_from_trajectories(trajs)
    return batch, plan_calls(batch, b, **kw)


def rounds_by_name(plan, names_in_plan_order):
    out = []
    so = plan.round_sequence_offsets
    for r in range(plan.num_calls):
        out.append(
            {
                tuple(names_in_plan_order[v] for v in plan.chain(q)): int(plan.sequence_replay_length[q])
                for q in range(so[r], so[r + 1])
            }
        )
    return out


# ---------------------------------------------------------------------------------- paper cases


@pytest.mark.parametrize("key", ["I", "II", "III"])
def test_appendix_a(key):
    case = APPENDIX_A[key]
    names, parent, lengths, extra = case_tree(case)
    trajs, _ = tree_batch(parent, lengths, extra)
    batch = batch_from_trajectories(trajs)
    plan = plan_calls(batch, chunk_size=64)
    assert plan.num_segments == len(names)
    pre = preorder(parent)
    # The batch's segments are the figure's segments (same positions, preorder numbering).
    starts = [0] * len(parent)
    for v in range(len(parent)):
        starts[v] = 0 if parent[v] < 0 else starts[parent[v]] + lengths[parent[v]]
    assert plan.segment_start.tolist() == [starts[v] for v in pre]
    assert plan.num_calls == case["calls"]
    assert plan.replay_tokens == case["replay"]
    assert rounds_by_name(plan, [names[v] for v in pre]) == case["rounds"]
    check_plan(batch, plan)


def test_appendix_a_per_call_replay():
    expected = {"I": ([5, 13, 1], [26, 340, 7]), "II": ([4, 24], [11, 802]), "III": ([4, 22], [11, 769])}
    for key, (members, replay) in expected.items():
        names, parent, lengths, extra = case_tree(APPENDIX_A[key])
        batch = batch_from_trajectories(tree_batch(parent, lengths, extra)[0])
        d = plan_calls(batch, 64).to_dict(segments=False)
        assert [len(r["sequences"]) for r in d["rounds"]] == members
        assert [r["replay_tokens"] for r in d["rounds"]] == replay


def test_appendix_a_unary_segment_does_not_matter():
    """Case II's F2 has one child (a trajectory ends there); merged into F6 nothing changes."""
    names, parent, lengths, _ = case_tree(APPENDIX_A["II"])
    batch = batch_from_trajectories(tree_batch(parent, lengths, [])[0])
    plan = plan_calls(batch, 64)
    assert plan.num_segments == len(names) - 1
    assert (plan.num_calls, plan.replay_tokens) == (2, 813)
    check_plan(batch, plan)


B = 16


def figure2_tree(b=B):
    # v0 = [0, B-1) forks at p1 = B-1 into v1, v2; v1 = [B-1, B+1) forks at p2 = B+1 into v3, v4.
    parent = [-1, 0, 0, 1, 1]
    lengths = [b - 1, 2, b + 3, 2 * b, 5]
    return parent, lengths


def test_figure2():
    parent, lengths = figure2_tree()
    batch, plan = plan_of_tree(parent, lengths, B)
    check_plan(batch, plan)
    # Preorder of the tree is v0, v1, v3, v4, v2.
    v0, v1, v3, v4, v2 = range(5)
    assert plan.num_calls == 2 and plan.t_pre[v0] == 2
    assert plan.replay_tokens == (B - 1) + 1
    d = plan.to_dict()
    r0, r1 = d["rounds"]
    assert [s["segments"] for s in r0["sequences"]] == [[v0, v1, v3], [v2]]
    assert r0["sequences"][1]["replay"] == [0, B - 1] and r0["sequences"][1]["initial_state"] is None
    assert r0["sequences"][0]["returns"] == [{"slot": 0, "position": B, "chunk": 1}]
    (s4,) = r1["sequences"]
    assert s4["segments"] == [v4] and s4["replay"] == [B, B + 1]
    assert s4["initial_state"] == {"slot": 0, "source_sequence": 0, "position": B}
    json.dumps(d)


@pytest.mark.parametrize("fork,calls", [(B - 1, 1), (B, 2), (B + 1, 2), (1, 1), (2 * B, 2), (3 * B - 1, 2)])
def test_fork_position_cases(fork, calls):
    """Figure 2(b): replay length is fork mod B; the side branch waits a call iff the fork
    crossed a chunk boundary (at exactly B: zero replay, but the state is produced now)."""
    batch, plan = plan_of_tree([-1, 0, 0], [fork, 3, 2 * B], B)
    check_plan(batch, plan)
    assert plan.num_calls == calls
    assert plan.replay_tokens == fork % B
    side = plan.to_dict()["rounds"][-1]["sequences"][-1]
    assert side["replay"] == [fork - fork % B, fork]
    if calls == 2:
        assert side["round"] == 1 and side["initial_state"]["position"] == fork - fork % B
        assert side["initial_state"]["source_sequence"] == 0


def test_nested_forks_inside_one_chunk():
    # Forks at 2, 3 and 5, all inside chunk 0: everything runs in one call.
    parent = [-1, 0, 0, 1, 1, 3, 3]
    lengths = [2, 1, 30, 2, 3, 40, 2]
    batch, plan = plan_of_tree(parent, lengths, 8)
    check_plan(batch, plan)
    assert plan.num_calls == 1 and plan.num_sequences == 4
    assert plan.replay_tokens == 2 + 3 + 5
    # Behind a chunk crossing the same forks cost one more call, side branches in call 2.
    batch, plan = plan_of_tree([-1, 0, 0, 1, 1], [10, 1, 5, 2, 3], 8)
    check_plan(batch, plan)
    assert plan.num_calls == 2


def test_trajectory_ending_where_another_continues():
    trajs = [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 5, 6, 7]]
    batch = RolloutBatch.from_token_lists(trajs)
    for b in range(1, 9):
        plan = plan_calls(batch, b)
        check_plan(batch, plan)
        start, end, parent, children = plan_tree(plan)
        assert [len(c) for c in children].count(1) == 1  # the unary segment [0, 3)
        # Contracting it changes nothing.
        merged = plan_segment_forest([-1, 0, 0], [0, 5, 5], [5, 7, 6], b)
        assert (merged.num_calls, merged.replay_tokens) == (plan.num_calls, plan.replay_tokens)
        assert plan.num_calls == brute_force_calls(start, end, parent, children, b)


def test_identical_trajectories():
    batch = RolloutBatch.from_token_lists([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7]])
    plan = plan_calls(batch, 2)
    check_plan(batch, plan)
    assert (plan.num_calls, plan.replay_tokens, plan.num_sequences, plan.compact_tokens) == (1, 0, 1, 4)
    s2p = plan.semantic_to_physical.reshape(3, 4)
    assert (s2p == s2p[0]).all()
    # Duplicates inside a fork.
    batch = RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4], [1, 2, 3]])
    for b in (1, 2, 3):
        plan = plan_calls(batch, b, microbatch=[2, 1, 0])
        check_plan(batch, plan, [2, 1, 0])


# ---------------------------------------------------------------------------------- optimality


@st.composite
def small_trees(draw):
    n = draw(st.integers(1, 10))
    b = draw(st.integers(1, 6))
    parent = [-1]
    for v in range(1, n):
        parent.append(
            draw(st.one_of(st.integers(0, v - 1), st.just(-1)))
            if draw(st.integers(0, 9)) == 0
            else draw(st.integers(0, v - 1))
        )
    lengths = [draw(st.integers(1, 2 * b + 1)) for _ in range(n)]
    return parent, lengths, b


@pytest.mark.slow
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_trees(), st.integers(1, 5))
def test_optimal_on_random_trees(tree, width):
    parent, lengths, b = tree
    batch, plan = plan_of_tree(parent, lengths, b, conv_width=width)
    assert plan.num_segments == len(parent)
    start, end, par, children = plan_tree(plan)
    assert choice_count(children) <= 20000
    assert plan.num_calls == brute_force_calls(start, end, par, children, b)
    check_plan(batch, plan)


def test_optimal_on_thousands_of_seeded_trees():
    rng = random.Random(20240601)
    checked = 0
    for _ in range(3000):
        b = rng.randint(1, 8)
        n = rng.randint(1, 12)
        parent = [-1] + [rng.randrange(v) if rng.random() > 0.05 else -1 for v in range(1, n)]
        lengths = [rng.randint(1, 2 * b + 2) for _ in range(n)]
        children = [[] for _ in range(n)]
        for v, p in enumerate(parent):
            if p >= 0:
                children[p].append(v)
        if choice_count(children) > 3000:
            continue
        batch, plan = plan_of_tree(parent, lengths, b)
        start, end, par, ch = plan_tree(plan)
        assert plan.num_calls == brute_force_calls(start, end, par, ch, b)
        check_plan(batch, plan)
        checked += 1
    assert checked > 2500


@st.composite
def token_batches(draw):
    alphabet = draw(st.integers(1, 3))
    tokens = st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=16)
    trajs = draw(st.lists(tokens, min_size=1, max_size=8))
    if draw(st.booleans()):
        trajs.append(list(trajs[0]))
    ids = draw(st.permutations(range(len(trajs))))
    k = draw(st.integers(1, len(trajs)))
    return trajs, list(ids[:k])


@pytest.mark.slow
@settings(max_examples=600, deadline=None)
@given(token_batches(), st.integers(1, 7), st.integers(1, 4))
def test_random_token_batches_and_subsets(data, b, width):
    trajs, ids = data
    batch = RolloutBatch.from_token_lists(trajs)
    plan = plan_calls(batch, b, microbatch=ids, conv_width=width)
    check_plan(batch, plan, ids)
    start, end, parent, children = plan_tree(plan)
    if choice_count(children) <= 5000:
        assert plan.num_calls == brute_force_calls(start, end, parent, children, b)


# ---------------------------------------------------------------------------------- API


def small_batch():
    return RolloutBatch.from_token_lists([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 7], [8, 9]])


def test_exports_and_types():
    assert harts_planner.plan_calls is plan_calls and harts_planner.CallPlan is CallPlan
    plan = plan_calls(small_batch())
    assert plan.chunk_size == 64 and plan.conv_width == 4
    assert plan.conv_context.shape == (plan.num_sequences, 3)
    assert plan.gather_index.dtype == np.int32 and plan.packed_offsets.dtype == np.int64
    with pytest.raises(ValueError):
        plan.position_ids[0] = 5  # read-only views
    assert "CallPlan(" in repr(plan)


def test_whole_batch_rows_are_batch_rows():
    batch = small_batch()
    plan = plan_calls(batch, 2)
    assert (plan.row_to_global == np.arange(batch.compact_tokens)).all()
    assert plan.compact_tokens == batch.compact_tokens
    check_plan(batch, plan)


def test_subset_and_caller_order():
    batch = small_batch()
    plan = plan_calls(batch, 2, microbatch=np.array([3, 1], dtype=np.int64))
    assert plan.trajectories.tolist() == [3, 1]
    assert plan.compact_tokens == batch.subset_work([1, 3]) == 7
    assert len(plan.segment_roots) == 2  # two trees merged by round
    check_plan(batch, plan, [3, 1])


def test_deterministic():
    names, parent, lengths, extra = case_tree(APPENDIX_A["I"])
    batch = batch_from_trajectories(tree_batch(parent, lengths, extra)[0])
    a, b = plan_calls(batch, 64), plan_calls(batch, 64)
    assert a.to_dict() == b.to_dict()
    for name in (
        "gather_index",
        "cu_seqlens",
        "physical_to_row",
        "conv_context",
        "request_slot",
        "semantic_to_physical",
    ):
        assert np.array_equal(getattr(a, name), getattr(b, name))


def test_segment_forest_entry_point_matches_batch():
    parent, lengths = figure2_tree()
    batch, plan = plan_of_tree(parent, lengths, B)
    start, end, par, _ = plan_tree(plan)
    bare = plan_segment_forest(par, start, end, B)
    assert bare.to_dict() == plan.to_dict()
    assert np.array_equal(bare.gather_index, plan.gather_index)
    assert len(bare.row_to_global) == 0 and len(bare.semantic_to_physical) == 0


@pytest.mark.parametrize("chunk_size", [0, -1, MAX_CHUNK_SIZE + 1, 2**40, 1.5, True, "64", None])
def test_bad_chunk_size(chunk_size):
    with pytest.raises(InvalidArgumentError) as e:
        plan_calls(small_batch(), chunk_size)
    assert e.value.field == "chunk_size"


def test_extreme_chunk_sizes_ok():
    batch = small_batch()
    assert plan_calls(batch, MAX_CHUNK_SIZE).num_calls == 1
    plan = plan_calls(batch, 1)  # every position is a chunk boundary: no replay
    assert plan.replay_tokens == 0
    check_plan(batch, plan)


@pytest.mark.parametrize(
    "ids,field",
    [
        ([], "microbatch"),
        ([4], "microbatch[0]"),
        ([0, -1], "microbatch[1]"),
        ([1, 0, 1], "microbatch"),
        ([[0, 1]], "microbatch"),
        ([0.5], "microbatch"),
        ([2**40], "microbatch[0]"),
    ],
)
def test_bad_microbatch(ids, field):
    with pytest.raises(InvalidArgumentError) as e:
        plan_calls(small_batch(), 64, microbatch=ids)
    assert e.value.field == field and str(e.value).startswith(field)


def test_trajectories_is_a_deprecated_spelling_of_microbatch():
    batch = small_batch()
    with pytest.warns(DeprecationWarning, match="microbatch"):
        old = plan_calls(batch, 64, trajectories=[2, 0])
    assert old == plan_calls(batch, 64, microbatch=[2, 0])
    with pytest.raises(InvalidArgumentError) as e:
        plan_calls(batch, 64, microbatch=[0], trajectories=[1])
    assert e.value.field == "trajectories"


def test_module_level_calls_take_debug_and_call_plans_like_the_planner():
    """``plan_calls(..., debug=False)`` and ``plan_step(..., call_plans=True, debug=False)`` return
    what ``Planner()`` returns for the same arguments (the README shows both spellings)."""
    from harts_planner import Planner, plan_step

    batch = small_batch()
    lean = plan_calls(batch, 2, [1, 2], debug=False)
    assert not lean.has_debug and lean == Planner().plan_calls(batch, 2, [1, 2], debug=False)
    assert lean == plan_calls(batch, 2, [1, 2]).without_debug()
    step = plan_step(batch, 1, 64, 2, call_plans=True, debug=False)
    assert step.has_call_plans and not any(c.has_debug for c in step.call_plans())
    assert step == Planner().plan_step(batch, 1, 64, 2, call_plans=True, debug=False)
    lazy = plan_step(batch, 1, 64, 2, conv_width=2)  # call plans on first use, with these arguments
    assert (
        not lazy.has_call_plans and [c.conv_width for c in lazy.call_plans()] == [2] * lazy.num_microbatches
    )
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidArgumentError) as e:
            plan_step(batch, 1, 64, call_plans=bad)
        assert e.value.field == "call_plans"
        with pytest.raises(InvalidArgumentError) as e:
            plan_calls(batch, 2, debug=bad)
        assert e.value.field == "debug"


def test_bad_batch():
    with pytest.raises(InvalidArgumentError) as e:
        plan_calls([[1, 2, 3]], 64)
    assert e.value.field == "batch"


def test_bad_conv_width_and_round():
    with pytest.raises(InvalidArgumentError) as e:
        plan_calls(small_batch(), 64, conv_width=0)
    assert e.value.field == "conv_width"
    plan = plan_calls(small_batch(), 64, conv_width=1)
    assert plan.conv_context.shape == (plan.num_sequences, 0)
    with pytest.raises(InvalidArgumentError) as e:
        plan.round_cu_seqlens(plan.num_calls)
    assert e.value.field == "round"


@pytest.mark.parametrize(
    "parent,start,end,field",
    [
        ([-1, 3], [0, 2], [2, 3], "parent[1]"),
        ([-1, 0], [0, 3], [2, 4], "start[1]"),
        ([-1, 0], [1, 2], [2, 4], "start[0]"),
        ([-1, 0], [0, 2], [2, 2], "end[1]"),
        ([1, 0], [0, 2], [2, 4], "start[0]"),  # a parent cycle
        ([], [], [], "parent"),
        ([-1], [0, 1], [1], "start"),
    ],
)
def test_bad_segment_forest(parent, start, end, field):
    with pytest.raises(InvalidArgumentError) as e:
        plan_segment_forest(parent, start, end, 4)
    assert e.value.field == field
