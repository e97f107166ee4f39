"""RolloutBatch from a compacted segment tree: the same batch and the same plans as the token path,
and malformed trees, token batches and request messages fail only with clear planner errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trees import forests

import harts_planner as hp
from harts_planner import PackedTokens, RolloutBatch, SegmentTree
from harts_planner.rpc import codec
from harts_planner.rpc import planner_pb2 as pb

BATCH_ARRAYS = [
    "lengths",
    "tree_ids",
    "order",
    "rank",
    "adjacent_lcp",
    "compact_map",
    "multiplicity",
    "row_parent",
    "row_depth",
    "row_segment",
    "component",
    "segment_start",
    "segment_end",
    "segment_parent",
    "segment_subtree_end",
    "segment_row_begin",
    "segment_multiplicity",
    "segment_child_offsets",
    "segment_children",
    "segment_end_offsets",
    "segment_ending",
    "segment_roots",
    "offsets",
]

trajectories = st.one_of(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=7), min_size=1, max_size=14),
    forests(max_num=14, vocab=3, max_new=6),  # copied prefixes: deep forks, prefixes, duplicates
)


def assert_same_batch(a: RolloutBatch, b: RolloutBatch) -> None:
    assert (a.num_trajectories, a.semantic_tokens, a.compact_tokens, a.num_segments) == (
        b.num_trajectories,
        b.semantic_tokens,
        b.compact_tokens,
        b.num_segments,
    )
    for name in BATCH_ARRAYS:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


@settings(max_examples=120, deadline=None)
@given(trajectories, st.booleans(), st.integers(1, 3), st.integers(0, 6), st.integers(1, 5))
def test_tree_path_equals_token_path(trajs, with_ids, dp, slack, chunk):
    ids = np.arange(len(trajs)) % 3 if with_ids else None
    a = RolloutBatch.from_token_lists(trajs, tree_ids=ids)
    tree = a.segment_tree()
    b = RolloutBatch.from_segment_tree(tree)
    assert b.tokens is None and not b.has_tokens
    assert_same_batch(a, b)
    # Plans are identical, field by field (step plan, call plans, single microbatch).
    capacity = int(a.lengths.max()) + slack
    planner = hp.Planner()
    try:
        pa = planner.plan_step(a, dp, capacity, chunk, call_plans=True)
    except hp.InfeasibleError as e:
        with pytest.raises(hp.InfeasibleError) as again:
            planner.plan_step(tree, dp, capacity, chunk)
        assert again.value.field == e.field
        return
    pb_ = planner.plan_step(tree, dp, capacity, chunk, call_plans=True)
    assert pa == pb_ and pa.call_plans() == pb_.call_plans()
    mb = pa.microbatches[-1]
    assert planner.plan_calls(a, chunk, mb) == planner.plan_calls(tree, chunk, mb)


def test_tree_batch_has_no_tokens_to_save(tmp_path):
    b = RolloutBatch.from_segment_tree(SegmentTree([-1, 0, 0], [2, 1, 3], [1, 2, 2]))
    assert b.lengths.tolist() == [3, 5, 5] and b.offsets.tolist() == [0, 3, 8, 13]
    assert b.compact_tokens == 6 and b.num_segments == 3
    with pytest.raises(hp.InvalidArgumentError, match="tokens: a batch built from a segment tree"):
        b.save(tmp_path / "x.hrb")
    with pytest.raises(hp.InvalidArgumentError):
        b.trajectory(0)


@pytest.mark.parametrize(
    "parent,length,ends,field,match",
    [
        ([], [], [0], "parent", "at least one segment"),
        ([-1], [1], [], "trajectory_end", "at least one trajectory"),
        ([-1, 7], [1, 1], [1], "parent[1]", r"must be -1 \(a root\) or a segment id in \[0, 2\), got 7"),
        ([-1, 1], [1, 1], [0], "parent[1]", "its own parent"),
        ([-1, 2, 1], [1, 1, 1], [0], "parent[1]", "parent cycle"),
        ([-1, 0], [1, 0], [1], "length[1]", "at least one token"),
        ([-1, 0], [1, 1], [3], "trajectory_end[0]", r"segment id in \[0, 2\), got 3"),
        ([-1, 0, 0], [1, 1, 1], [1], "trajectory_end", "leaf segment 2 ends no trajectory"),
        ([-1, 0], [1, 1, 1], [1], "length", "one entry per segment"),
    ],
)
def test_malformed_trees_name_the_field(parent, length, ends, field, match):
    with pytest.raises(hp.InvalidArgumentError, match=match) as e:
        RolloutBatch.from_segment_tree(SegmentTree(parent, length, ends))
    assert e.value.field == field and str(e.value).startswith(field + ":")


def test_tree_over_the_token_limit_is_a_resource_error():
    big = 2**30
    with pytest.raises(hp.ResourceLimitError, match="over the limit of 2147483647") as e:
        RolloutBatch.from_segment_tree(SegmentTree([-1, 0], [big, big - 2], [1, 1]))
    assert e.value.field == "trajectory_end[1]"


# ---------------------------------------------------------------------------------- fuzzing
int32s = st.integers(-(2**31), 2**31 - 1)
small = st.integers(-3, 12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.one_of(small, int32s), max_size=12),
    st.lists(st.one_of(small, int32s), max_size=12),
    st.lists(st.one_of(small, int32s), max_size=12),
)
def test_fuzz_segment_tree_ingestion(parent, length, ends):
    """Arbitrary arrays: a batch or a planner error naming a field, never anything else."""
    try:
        b = RolloutBatch.from_segment_tree(SegmentTree(parent, length, ends))
    except (hp.InvalidArgumentError, hp.ResourceLimitError) as e:
        assert e.field and str(e).startswith(e.field + ":")
        return
    assert b.num_trajectories == len(ends) and b.semantic_tokens == int(b.lengths.sum())
    assert int(b.multiplicity.sum()) == b.semantic_tokens  # lazy rows are consistent


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(small, int32s), max_size=16),
    st.lists(st.integers(-2, 20), max_size=8),
    st.none() | st.lists(st.integers(-2, 5), max_size=8),
)
def test_fuzz_token_ingestion(tokens, offsets, tree_ids):
    try:
        b = RolloutBatch.from_arrays(
            np.array(tokens, dtype=np.int64), np.array(offsets, dtype=np.int64), tree_ids
        )
    except (hp.InvalidArgumentError, hp.ResourceLimitError) as e:
        assert e.field and str(e).startswith(e.field + ":")
        return
    assert b.semantic_tokens == len(tokens) and b.num_trajectories == len(offsets) - 1


@st.composite
def trajectories_messages(draw):
    msg = pb.Trajectories()
    kind = draw(st.sampled_from(["packed", "tree", "none"]))
    raw = st.binary(max_size=40)
    if kind == "packed":
        msg.packed.tokens = draw(raw)
        msg.packed.offsets = draw(raw)
    elif kind == "tree":
        msg.tree.parent, msg.tree.length, msg.tree.trajectory_end = draw(raw), draw(raw), draw(raw)
    if draw(st.booleans()):
        msg.tree_ids = draw(raw)
    return msg


@settings(max_examples=400, deadline=None)
@given(trajectories_messages())
def test_fuzz_request_trajectory_decoding(msg):
    """Random bytes in every array field: decoding and ingestion end in a batch or an error naming
    a request field (``trajectories...``)."""
    try:
        batch = codec.ingest(codec.decode_trajectories(msg), wire=True)
    except (hp.InvalidArgumentError, hp.ResourceLimitError) as e:
        assert e.field.startswith("trajectories") and str(e).startswith(e.field + ":")
        return
    assert batch.num_trajectories >= 1


@settings(max_examples=200, deadline=None)
@given(
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-5, 9),
    st.binary(max_size=24),
)
def test_fuzz_request_scalar_decoding(dp, cap, chunk, conv, search, microbatch):
    req = pb.PlanStepRequest(dp_size=dp, capacity=cap, chunk_size=chunk, conv_width=conv)
    req.options.search = search
    try:
        args = codec.decode_plan_step_request(req)
    except hp.InvalidArgumentError as e:
        assert e.field in {"dp_size", "capacity", "chunk_size", "conv_width", "options.search"}
    else:
        assert (
            args["dp_size"] >= 1
            and args["capacity"] >= 1
            and 1 <= args["chunk_size"] <= hp.call_plan.MAX_CHUNK_SIZE
        )
    try:
        codec.decode_plan_calls_request(pb.PlanCallsRequest(microbatch=microbatch, chunk_size=chunk))
    except hp.InvalidArgumentError as e:
        assert e.field in {"microbatch", "chunk_size"}


def test_packed_tokens_and_tuples_are_accepted():
    batch = RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4], [5]])
    planner = hp.Planner()
    a = planner.plan_step(batch, 1, 8)
    assert a == planner.plan_step((batch.tokens, batch.offsets), 1, 8)
    assert a == planner.plan_step(PackedTokens(batch.tokens, batch.offsets), 1, 8)
    with pytest.raises(hp.InvalidArgumentError, match="trajectories: must be a RolloutBatch"):
        planner.plan_step([1, 2, 3], 1, 8)


@settings(max_examples=100, deadline=None)
@given(
    trajectories,
    st.booleans(),
    st.booleans(),
    st.none() | st.lists(st.integers(0, 13), min_size=1, max_size=3),
)
def test_fast_request_serialization_equals_protobuf(trajs, as_tree, with_ids, microbatch):
    batch = RolloutBatch.from_token_lists(trajs, tree_ids=np.arange(len(trajs)) if with_ids else None)
    source = (
        batch.segment_tree() if as_tree else PackedTokens(batch.tokens, batch.offsets, batch._input_tree_ids)
    )
    options = {"max_sampled_k": 5, "greedy": False, "search": "heuristic"}
    fast = codec.serialize_plan_step_request(source, 2, 99, 8, options, True, 3)
    assert pb.PlanStepRequest.FromString(fast) == codec.plan_step_request(source, 2, 99, 8, options, True, 3)
    fast = codec.serialize_plan_calls_request(source, microbatch, 16, 2)
    assert pb.PlanCallsRequest.FromString(fast) == codec.plan_calls_request(source, microbatch, 16, 2)
