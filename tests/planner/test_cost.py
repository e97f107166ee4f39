"""Cost before work (``harts/plan_cost.h``, :func:`harts_planner.estimate_cost`): the sizes a request
will need, from the request alone, compared with the real plans and their encoded responses; the
C++ backstop (``max_plan_bytes``) refusing what it cannot afford in a small address space; call
planning in O(microbatch); and the index and argument checks of the objects around them.

Byte bounds on the planner's own allocations are checked exactly in C++ (``plan_cost_test``, a
counting allocator); here the response bounds are checked against the encoded protobuf messages and
the retained bytes against glibc's malloc counters on a ``swe-like`` step.
"""

from __future__ import annotations

import ctypes
import json
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trees import forests, seeded

import harts_planner as hp
from harts_planner import _native, synth
from harts_planner.call_plan import ARRAY_FIELDS, ARRAY_LENGTHS, LAYOUT_FIELDS, plan_segment_forest
from harts_planner.rpc import codec
from harts_planner.rpc import planner_pb2 as pb
from harts_planner.step_plan import plan_step_with_calls

GIB = 2**30

# Arrays whose length an exact shape bounds rather than gives: those of the rounds (K <= height),
# of the state slots (P <= Q - roots), and the children (V - roots <= V).
BOUNDED = {
    "round_sequence_offsets",
    "packed_offsets",
    "cu_offsets",
    "cu_seqlens",
    "round_physical_offsets",
    "request_sequence",
    "request_chunk",
    "request_slot",
    "request_position",
    "slot_producer",
    "slot_position",
    "slot_segment",
    "segment_children",
}


def _calls_response(plan: hp.CallPlan, batch, debug: bool) -> int:
    stats = codec.stats_message(
        batch, decode_seconds=1.0, ingest_seconds=1.0, plan_seconds=1.0, encode_seconds=1.0
    )
    return pb.PlanCallsResponse(plan=codec.encode_call_plan(plan, debug=debug), stats=stats).ByteSize()


def _check_lengths(plan: hp.CallPlan, shape, conv_width: int) -> None:
    for name in ARRAY_FIELDS:
        linear, constant = ARRAY_LENGTHS[name]
        bound = linear(shape, conv_width - 1) + constant
        actual = len(getattr(plan._native, name))
        if shape.exact and name not in BOUNDED:
            assert actual == bound, name
        else:
            assert actual <= bound, name


def test_array_lengths_cover_every_field():
    assert set(ARRAY_LENGTHS) == set(ARRAY_FIELDS)


def _check_request(trajs, microbatch, chunk: int, conv: int) -> None:
    batch = hp.RolloutBatch.from_token_lists(trajs)
    tree = batch.segment_tree()
    packed = hp.PackedTokens(batch.tokens, batch.offsets)
    plan = hp.plan_calls(batch, chunk, microbatch=microbatch, conv_width=conv)
    for source in (tree, batch):
        cost = hp.estimate_cost(source, microbatch=microbatch, chunk_size=chunk, conv_width=conv)
        assert cost.exact and cost.call_plans == 1
        assert cost.call_rows == plan.compact_tokens and cost.replay_rows == plan.replay_tokens
        assert (cost.trajectories, cost.semantic_tokens) == (batch.num_trajectories, batch.semantic_tokens)
        assert (cost.compact_tokens, cost.segments) == (batch.compact_tokens, batch.num_segments)
        assert cost.field == ("trajectories" if microbatch is None else "microbatch")
        for debug in (True, False):
            response = hp.estimate_cost(
                source, microbatch=microbatch, chunk_size=chunk, conv_width=conv, debug=debug
            )
            assert _calls_response(plan, batch, debug) <= response.response_bytes
    ids = None if microbatch is None else np.asarray(microbatch, dtype=np.int32)
    shape = _native.batch_call_shape(batch._native, ids, chunk, conv)
    _check_lengths(plan, shape, conv)
    bound = hp.estimate_cost(packed, microbatch=microbatch, chunk_size=chunk, conv_width=conv)
    assert not bound.exact
    assert bound.call_rows >= plan.compact_tokens and bound.replay_rows >= plan.replay_tokens
    assert bound.response_bytes >= _calls_response(plan, batch, True)
    _check_lengths(plan, _native.token_call_shape(len(batch.tokens), batch.offsets, ids, chunk, conv), conv)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forests(max_num=12, max_new=8), st.data())
def test_exact_estimates_equal_real_plans(trajs, data):
    n = len(trajs)
    ids = data.draw(
        st.one_of(st.none(), st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    )
    chunk = data.draw(st.sampled_from([1, 2, 3, 4, 8, 64]))
    conv = data.draw(st.integers(1, 6))
    _check_request(trajs, ids, chunk, conv)


@pytest.mark.parametrize("seed", range(12))
def test_estimates_on_larger_random_batches(seed):
    rng = random.Random(seed)
    trajs = seeded(seed, num=rng.randint(20, 120), max_new=rng.choice([5, 40, 300]), vocab=3)
    ids = rng.sample(range(len(trajs)), rng.randint(1, len(trajs))) if seed % 3 else None
    _check_request(trajs, ids, rng.choice([1, 7, 16, 64, 256]), rng.choice([1, 4, 9]))


def _encoded_step(plan: hp.StepPlan, batch, debug: bool) -> int:
    response = pb.PlanStepResponse(plan=codec.encode_step_plan(plan))
    response.call_plans.extend(codec.encode_call_plan(c, debug=debug) for c in plan.call_plans())
    response.stats.CopyFrom(codec.stats_message(batch, decode_seconds=1.0, plan_seconds=1.0))
    return response.ByteSize()


@pytest.mark.parametrize("seed", range(10))
def test_step_estimates_bound_real_steps(seed):
    rng = random.Random(seed)
    trajs = seeded(100 + seed, num=rng.randint(2, 80), max_new=rng.choice([4, 30]), vocab=3)
    batch = hp.RolloutBatch.from_token_lists(trajs)
    capacity = max(len(t) for t in trajs) * rng.randint(1, 4)
    chunk, conv, debug = rng.choice([1, 4, 64]), rng.choice([1, 4]), rng.random() < 0.5
    dp = rng.randint(1, min(2, len(trajs)))
    try:
        plan = plan_step_with_calls(batch, dp, capacity, chunk, {}, True, conv, debug=debug)
    except hp.InfeasibleError:
        return
    rows = sum(c.compact_tokens for c in plan.call_plans())
    replay = sum(c.replay_tokens for c in plan.call_plans())
    encoded = _encoded_step(plan, batch, debug)
    for source in (batch.segment_tree(), batch, hp.PackedTokens(batch.tokens, batch.offsets)):
        cost = hp.estimate_cost(
            source, request="step", call_plans=True, chunk_size=chunk, conv_width=conv, debug=debug
        )
        assert not cost.exact and cost.field == "call_plans"
        assert cost.call_rows >= rows and cost.replay_rows >= replay
        assert cost.response_bytes >= encoded
        without = hp.estimate_cost(source, request="step", chunk_size=chunk)
        assert without.call_rows == 0 and without.field == "trajectories"
        assert without.response_bytes >= pb.PlanStepResponse(plan=codec.encode_step_plan(plan)).ByteSize()
    exact = hp.estimate_call_plans(batch, plan.microbatches, chunk, conv, debug)
    assert exact.exact and (exact.call_rows, exact.replay_rows) == (rows, replay)
    assert exact.call_plans == plan.num_microbatches
    encoded_calls = sum(codec.encode_call_plan(c, debug=debug).ByteSize() for c in plan.call_plans())
    assert encoded_calls <= exact.response_bytes


def test_plan_step_with_calls_refuses_before_the_call_plans():
    batch = hp.RolloutBatch.from_token_lists(seeded(3, num=30, max_new=20))
    capacity = int(batch.lengths.max()) * 2
    plan = plan_step_with_calls(batch, 1, capacity, 64, {}, True, 4, limits=hp.CostLimits())
    rows = sum(c.compact_tokens + c.replay_tokens for c in plan.call_plans())
    plan_step_with_calls(batch, 1, capacity, 64, {}, True, 4, limits=hp.CostLimits(max_packed_rows=rows))
    with pytest.raises(hp.ResourceLimitError) as info:
        plan_step_with_calls(
            batch, 1, capacity, 64, {}, True, 4, limits=hp.CostLimits(max_packed_rows=rows - 1)
        )
    assert info.value.field == "call_plans" and info.value.limit == "max_packed_rows"
    assert (info.value.needed, info.value.maximum) == (rows, rows - 1)


def test_check_names_the_field_and_the_limit():
    batch = hp.RolloutBatch.from_token_lists([[1, 2, 3, 4], [1, 2, 5], [7]])
    cost = hp.estimate_cost(batch, microbatch=[0, 1], chunk_size=2)
    assert cost.packed_rows == cost.call_rows + cost.replay_rows == 5 + 0
    assert cost.peak_bytes == cost.ingest_bytes + cost.plan_bytes
    cost.check()
    cost.check(
        hp.CostLimits(
            max_packed_rows=5, max_peak_bytes=cost.peak_bytes, max_response_bytes=cost.response_bytes
        )
    )
    for limits, name in (
        (hp.CostLimits(max_packed_rows=4), "max_packed_rows"),
        (hp.CostLimits(max_peak_bytes=cost.peak_bytes - 1), "max_peak_bytes"),
        (hp.CostLimits(max_response_bytes=100), "max_response_bytes"),
    ):
        with pytest.raises(hp.ResourceLimitError) as info:
            cost.check(limits)
        assert info.value.field == "microbatch" and info.value.limit == name
        assert name in str(info.value) and str(info.value).startswith("microbatch: ")
        assert isinstance(info.value, ValueError)
    with pytest.raises(hp.ResourceLimitError) as info:
        hp.estimate_cost(batch).check(hp.CostLimits(max_packed_rows=1))
    assert info.value.field == "trajectories"
    for bad in (-1, 2**63, "x", 1.5, True):
        with pytest.raises(hp.InvalidArgumentError) as info:
            hp.CostLimits(max_peak_bytes=bad)
        assert info.value.field == "max_peak_bytes"


def test_the_measured_attacks_are_refused_from_the_request():
    # A 26-byte PlanCalls request: one segment of 2^31 - 1 tokens (a ~64 GiB response).
    huge = hp.SegmentTree(np.array([-1]), np.array([2**31 - 1]), np.array([0]))
    cost = hp.estimate_cost(huge)
    assert cost.call_rows == 2**31 - 1 and cost.exact
    with pytest.raises(hp.ResourceLimitError) as info:
        cost.check()
    assert info.value.field == "trajectories" and info.value.limit == "max_response_bytes"
    # One segment of 2^26 tokens: the response is over 2 GiB, refused before planning.
    with pytest.raises(hp.ResourceLimitError):
        hp.estimate_cost(hp.SegmentTree(np.array([-1]), np.array([2**26]), np.array([0]))).check()
    assert hp.estimate_cost(huge).plan_bytes > hp.max_plan_bytes()  # the backstop would refuse it too


@pytest.fixture(scope="module")
def swe_like():
    syn = synth.generate("swe-like", seed=0)
    batch = hp.RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids)
    return batch, batch.segment_tree()


@pytest.mark.slow
def test_swe_like_whole_batch_plan_calls_is_refused_with_a_response_limit(swe_like):
    # PlanCalls without a microbatch on a swe-like tree: a 49 KB request for a ~0.5 GB response.
    batch, tree = swe_like
    cost = hp.estimate_cost(tree)
    assert cost.call_rows == batch.compact_tokens and cost.exact
    assert cost.response_bytes > 400 * 2**20
    with pytest.raises(hp.ResourceLimitError) as info:
        cost.check(hp.CostLimits(max_response_bytes=256 * 2**20))
    assert info.value.field == "trajectories"
    step = hp.estimate_cost(tree, request="step", call_plans=False)
    step.check(hp.CostLimits(max_response_bytes=256 * 2**20, max_peak_bytes=GIB))


def _malloc_in_use() -> int | None:
    try:
        libc = ctypes.CDLL(None)
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


@pytest.mark.slow
def test_swe_like_microbatches_exact_sizes_and_retained_bytes(swe_like):
    batch, tree = swe_like
    if _malloc_in_use() is None:
        pytest.skip("needs glibc's mallinfo2")
    from_tree = hp.RolloutBatch.from_segment_tree(tree)
    rng = np.random.default_rng(0)
    for k in (1, 8, 64, 400):
        ids = rng.choice(batch.num_trajectories, size=k, replace=False).astype(np.int32)
        cost = hp.estimate_cost(tree, microbatch=ids, debug=False)
        before = _malloc_in_use()
        plan = hp.plan_calls(from_tree, 64, microbatch=ids)
        retained = _malloc_in_use() - before
        assert (cost.call_rows, cost.replay_rows) == (plan.compact_tokens, plan.replay_tokens)
        assert 0 < retained <= cost.plan_bytes
        assert _calls_response(plan, from_tree, False) <= cost.response_bytes
        assert hp.estimate_cost(batch, microbatch=ids, debug=False) == cost.__class__(
            **{**cost.__dict__, "ingest_bytes": 0}
        )
        del plan
    assert not _native.rows_built(from_tree._native)  # no microbatch plan built the batch's rows


# ---------------------------------------------------------------------------------- the backstop
_PRELUDE = """
import json, resource
import numpy as np
import harts_planner as hp

def cap_address_space(extra_bytes):
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra_bytes, vm + extra_bytes))

def outcome(call):
    try:
        call()
        return "planned"
    except hp.ResourceLimitError as e:
        return "ResourceLimitError " + e.field
    except MemoryError:
        return "MemoryError"
"""


def _run(script: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_backstop_refuses_before_allocating_in_a_small_address_space():
    out = _run(
        f"""
        huge = hp.SegmentTree(np.array([-1]), np.array([2**31 - 1]), np.array([0]))
        big = hp.SegmentTree(np.array([-1]), np.array([2**26]), np.array([0]))
        batch, big_batch = hp.RolloutBatch.from_segment_tree(huge), hp.RolloutBatch.from_segment_tree(big)
        cap_address_space({GIB})
        out = {{"default": outcome(lambda: hp.plan_calls(batch, 64))}}
        out["forest"] = outcome(lambda: hp.call_plan.plan_segment_forest([-1], [0], [2**31 - 1], 64))
        out["rows"] = outcome(lambda: batch.compact_map)
        previous = hp.set_max_plan_bytes({GIB} // 2)
        out["lowered"] = outcome(lambda: hp.plan_calls(big_batch, 64))
        out["previous"] = previous
        print(json.dumps(out))
        """
    )
    assert out == {
        "default": "ResourceLimitError trajectories",
        "forest": "ResourceLimitError end",
        "rows": "ResourceLimitError length",
        "lowered": "ResourceLimitError trajectories",
        "previous": _native.DEFAULT_MAX_PLAN_BYTES,
    }


def test_max_plan_bytes_is_configurable():
    previous = hp.set_max_plan_bytes(10_000)
    try:
        assert hp.max_plan_bytes() == 10_000
        batch = hp.RolloutBatch.from_token_lists([[1] * 50, [1] * 40 + [2] * 30])
        with pytest.raises(hp.ResourceLimitError) as info:
            hp.plan_calls(batch, 64)
        assert info.value.field == "trajectories" and "max_plan_bytes" in str(info.value)
    finally:
        assert hp.set_max_plan_bytes(previous) == 10_000
    assert hp.plan_calls(batch, 64).compact_tokens == 80
    for bad in (0, -5, 2**63, "1", 2.0):
        with pytest.raises(hp.InvalidArgumentError) as info:
            hp.set_max_plan_bytes(bad)
        assert info.value.field == "max_plan_bytes"
    assert hp.max_plan_bytes() == previous


# ---------------------------------------------------------------------------------- O(microbatch)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forests(max_num=14, max_new=6), st.data())
def test_call_plans_of_a_tree_batch_equal_the_token_batch_without_its_rows(trajs, data):
    batch = hp.RolloutBatch.from_token_lists(trajs)
    from_tree = hp.RolloutBatch.from_segment_tree(batch.segment_tree())
    n = len(trajs)
    ids = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    chunk = data.draw(st.sampled_from([1, 2, 5, 64]))
    assert hp.plan_calls(from_tree, chunk, microbatch=ids) == hp.plan_calls(batch, chunk, microbatch=ids)
    assert not _native.rows_built(from_tree._native)
    assert np.array_equal(from_tree.compact_map, batch.compact_map)  # built now, on first use
    assert _native.rows_built(from_tree._native)


# ---------------------------------------------------------------------------------- estimate errors
def test_estimate_cost_errors_name_the_field():
    batch = hp.RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4], [5]])
    tree = batch.segment_tree()
    packed = hp.PackedTokens(batch.tokens, batch.offsets)
    cases = [
        (lambda: hp.estimate_cost([1, 2]), "source"),
        (lambda: hp.estimate_cost(tree, request="plan"), "request"),
        (lambda: hp.estimate_cost(tree, request="step", microbatch=[0]), "microbatch"),
        (lambda: hp.estimate_cost(tree, microbatch=[0, 3]), "microbatch[1]"),
        (lambda: hp.estimate_cost(batch, microbatch=[-1]), "microbatch[0]"),
        (lambda: hp.estimate_cost(packed, microbatch=[0, 7]), "microbatch[1]"),
        (lambda: hp.estimate_cost(tree, microbatch=[1, 1]), "microbatch"),
        (lambda: hp.estimate_cost(tree, microbatch=[]), "microbatch"),
        (lambda: hp.estimate_cost(tree, chunk_size=0), "chunk_size"),
        (lambda: hp.estimate_cost(tree, conv_width=2**63), "conv_width"),
        (lambda: hp.estimate_cost(tree, options={"max_sampled_k": 2**63}), "max_sampled_k"),
        (lambda: hp.estimate_cost(tree, options={"colour": 1}), "colour"),
        (lambda: hp.estimate_cost(hp.SegmentTree([1, 0], [1, 1], [0]), microbatch=[0]), "parent[0]"),
        (lambda: hp.estimate_cost(hp.SegmentTree([-1], [0], [0])), "length[0]"),
        (lambda: hp.estimate_cost(hp.PackedTokens([1, 2], [0, 2, 2])), "offsets[2]"),
    ]
    for call, field in cases:
        with pytest.raises(hp.InvalidArgumentError) as info:
            call()
        assert info.value.field == field, (field, info.value)


# ---------------------------------------------------------------------------------- index hygiene
def test_out_of_range_and_negative_indices_raise():
    batch = hp.RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4], [5]])
    plan = hp.plan_step(batch, 1, 8)
    calls = hp.plan_calls(batch, 2)
    cases = [
        (lambda: batch.trajectory(3), "i"),
        (lambda: batch.trajectory(-1), "i"),
        (lambda: batch.children(99), "v"),
        (lambda: batch.children(-1), "v"),
        (lambda: batch.ending(-1), "v"),
        (lambda: batch.lcp(-1, 0), "i"),
        (lambda: batch.lcp(0, 2**63), "j"),
        (lambda: batch.interval_work(0, 2**63), "hi"),
        (lambda: batch.interval_work(2, 1), "lo, hi"),
        (lambda: plan.microbatch_at(-1, 0), "replica"),
        (lambda: plan.microbatch_at(1, 0), "replica"),
        (lambda: plan.microbatch_at(0, -1), "slot"),
        (lambda: plan.microbatch_at(0, plan.num_slots), "slot"),
        (lambda: calls.children(-1), "v"),
        (lambda: calls.children(calls.num_segments), "v"),
        (lambda: calls.debug.chain(-1), "q"),
        (lambda: calls.sequence_dict(calls.num_sequences), "q"),
        (lambda: calls.round_cu_seqlens(-1), "round"),
    ]
    for call, field in cases:
        with pytest.raises(hp.InvalidArgumentError) as info:
            call()
        assert info.value.field == field, (field, info.value)
    assert (
        batch.trajectory(2).tolist() == [5]
        and plan.microbatch_at(0, 0).tolist() == plan.microbatches[0].tolist()
    )
    assert list(batch.children(0)) == list(batch.segment_children[: batch.segment_child_offsets[1]])


@pytest.mark.parametrize(
    "trajectories, field",
    [
        ([None], "trajectories[0]"),
        ([1, 2, 3], "trajectories[0]"),
        ([[1], "ab"], "trajectories[1]"),
        ([[1], [2, [3]]], "trajectories[1]"),
        ([[1], []], "trajectories[1]"),
        ([[1], [2**31]], "trajectories[1]"),
        ([[0, -1]], "trajectories[0]"),
        ([[1.5]], "trajectories[0]"),
        (None, "trajectories"),
        (7, "trajectories"),
        ("abc", "trajectories"),
        ([], "trajectories"),
    ],
)
def test_bad_token_lists_name_the_trajectory(trajectories, field):
    with pytest.raises(hp.InvalidArgumentError) as info:
        hp.RolloutBatch.from_token_lists(trajectories)
    assert info.value.field == field


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"chunk_size": 2**63}, "chunk_size"),
        ({"chunk_size": 2**20 + 1}, "chunk_size"),
        ({"capacity": 2**63}, "capacity"),
        ({"dp_size": 2**64}, "dp_size"),
        ({"max_sampled_k": 2**63}, "max_sampled_k"),
        ({"refine_window": -(2**63) - 1}, "refine_window"),
    ],
)
def test_huge_arguments_are_refused_up_front(kwargs, field):
    batch = hp.RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4]])
    args = {"dp_size": 1, "capacity": 8, **kwargs}
    with pytest.raises(hp.InvalidArgumentError) as info:
        hp.plan_step(batch, **args)
    assert info.value.field == field


def test_plan_segment_forest_with_cancel_and_limits():
    calls = plan_segment_forest([-1, 0, 0], [0, 3, 3], [3, 5, 9], 4)
    assert calls == plan_segment_forest(
        np.array([-1, 0, 0]), [0, 3, 3], [3, 5, 9], 4, cancel=hp.CancelToken()
    )
    assert set(LAYOUT_FIELDS) <= set(ARRAY_FIELDS)
