"""Step planner (Section 3.2): exact DP against brute force, the plan guarantees on random batches,
the objective and metrics, determinism, errors, and the Python surface."""

from __future__ import annotations

import itertools
import json
import threading

import numpy as np
import pytest
from greedy_oracle import greedy_candidate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harts_planner
from harts_planner import (
    InfeasibleError,
    InvalidArgumentError,
    RolloutBatch,
    StepPlan,
    _native,
    plan_step,
    synth,
)
from harts_planner.step_plan import imbalance, schedule_metrics, verify_schedule


# ---------------------------------------------------------------------------- strategies
@st.composite
def tree_batches(draw, max_n: int = 14, max_len: int = 10, alphabet: int = 3):
    """Trajectories that share prefixes at random depths, with duplicates."""
    n = draw(st.integers(1, max_n))
    trajs: list[list[int]] = []
    for _ in range(n):
        kind = draw(st.sampled_from(["fresh", "extend", "copy"])) if trajs else "fresh"
        if kind == "copy":
            t = list(draw(st.sampled_from(trajs)))
        else:
            t = []
            if kind == "extend":
                base = draw(st.sampled_from(trajs))
                t = base[: draw(st.integers(0, len(base)))]
            t += draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=max_len))
            t = t[:max_len] or [0]
        trajs.append(t)
    return trajs


def brute_force(batch: RolloutBatch, capacity: int, k: int):
    """Best (total, max) over all contiguous partitions of the lexicographic order into k parts."""
    n = batch.num_trajectories
    best = None
    for cut_set in itertools.combinations(range(1, n), k - 1):
        cuts = (0, *cut_set, n)
        works = [batch.interval_work(a, b) for a, b in itertools.pairwise(cuts)]
        if max(works) > capacity:
            continue
        key = (sum(works), max(works))
        best = key if best is None or key < best else best
    return best


def naive_natural(batch: RolloutBatch, capacity: int) -> list[int]:
    lcp = batch.adjacent_lcp
    cuts = [0]

    def rec(lo, hi):
        if hi - lo == 1 or batch.interval_work(lo, hi) <= capacity:
            cuts.append(hi)
            return
        key = lambda t: (
            int(lcp[t]),
            max(batch.interval_work(lo, t), batch.interval_work(t, hi)),
            abs(batch.interval_work(lo, t) - batch.interval_work(t, hi)),
            t,
        )
        t = min(range(lo + 1, hi), key=key)
        rec(lo, t)
        rec(t, hi)

    rec(0, batch.num_trajectories)
    return cuts


# ---------------------------------------------------------------------------- exact DP
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree_batches(max_n=9), st.integers(0, 12))
def test_exact_dp_equals_brute_force(trajs, slack):
    batch = RolloutBatch.from_token_lists(trajs)
    capacity = int(batch.lengths.max()) + slack
    n = batch.num_trajectories
    results = _native.exact_contiguous_partitions(batch._native, capacity, list(range(1, n + 1)))
    for r in results:
        expect = brute_force(batch, capacity, r["k"])
        assert r["feasible"] == (expect is not None)
        if expect is None:
            continue
        assert (r["total_work"], r["max_work"]) == expect
        cuts = r["cuts"]
        assert cuts[0] == 0 and cuts[-1] == n and len(cuts) == r["k"] + 1
        works = [batch.interval_work(a, b) for a, b in itertools.pairwise(cuts)]
        assert (sum(works), max(works)) == expect


@settings(max_examples=100, deadline=None)
@given(tree_batches(max_n=12), st.integers(0, 15))
def test_natural_partition_matches_reference(trajs, slack):
    batch = RolloutBatch.from_token_lists(trajs)
    capacity = int(batch.lengths.max()) + slack
    assert list(_native.natural_partition(batch._native, capacity)) == naive_natural(batch, capacity)


# ---------------------------------------------------------------------------- guarantees
def with_microbatch_cost(candidate: dict, cost: int, dp_size: int) -> tuple:
    """J of a candidate with every microbatch's work counted ``cost`` tokens more (``step_plan.h``,
    step 5): K microbatches, K / D per replica, one per slot."""
    total, critical, max_replica = candidate["objective"]
    k, slots = candidate["k"], candidate["k"] // dp_size
    return (total + cost * k, critical + cost * slots, max_replica + cost * slots)


def check_plan(batch: RolloutBatch, plan: StepPlan, dp_size: int, capacity: int, cost: int = 0) -> None:
    work = verify_schedule(batch, plan.microbatches, plan.replica, plan.slot, dp_size, capacity)
    assert np.array_equal(work, plan.work)
    m = schedule_metrics(plan.work, plan.replica, plan.slot, dp_size)
    assert plan.objective == (m["total_work"], m["slot_critical_work"], m["max_replica_work"])
    assert plan.num_microbatches % dp_size == 0 and plan.num_slots == plan.num_microbatches // dp_size
    assert plan.total_work >= plan.compact_tokens == batch.compact_tokens
    # Microbatches ordered by (slot, replica), members in lexicographic order.
    keys = list(zip(plan.slot.tolist(), plan.replica.tolist()))
    assert keys == sorted(keys)
    for mb in plan.microbatches:
        assert np.all(np.diff(batch.rank[mb]) > 0)
    # The winner is the lexicographic minimum of the candidates' J (with the microbatch cost, when
    # there is one); ties to the fewer microbatches, then to the earlier candidate.
    cands = plan.candidates
    assert cands[plan.selected]["objective"] == plan.objective
    if cost == 0:
        assert min(c["objective"] for c in cands) == plan.objective
    key = lambda i: (with_microbatch_cost(cands[i], cost, dp_size), cands[i]["k"], i)  # noqa: E731
    assert plan.selected == min(range(len(cands)), key=key)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tree_batches(max_n=24, max_len=12),
    st.integers(1, 5),
    st.sampled_from([0, 0, 1, 3, 20]),
    st.sampled_from([512, 0]),
)
def test_every_plan_satisfies_the_guarantees(trajs, dp_size, slack, exact_threshold):
    """D need not divide N; T is barely above (or equal to) the longest trajectory; duplicates occur;
    both the exact (N <= N0) and the heuristic search (N0 = 0) run."""
    batch = RolloutBatch.from_token_lists(trajs)
    capacity = int(batch.lengths.max()) + slack
    try:
        plan = plan_step(batch, dp_size, capacity, exact_threshold=exact_threshold, max_sampled_k=3)
    except InfeasibleError as e:
        # Only provable or search-exhausted infeasibility, with a reason.
        assert e.field in ("dp_size", "capacity") and len(str(e)) > 40
        if e.field == "dp_size":
            assert batch.num_trajectories < dp_size
        return
    check_plan(batch, plan, dp_size, capacity)
    assert plan.search_mode == ("exact" if batch.num_trajectories <= exact_threshold else "heuristic")
    again = plan_step(batch, dp_size, capacity, exact_threshold=exact_threshold, max_sampled_k=3)
    assert again.to_dict()["microbatches"] == plan.to_dict()["microbatches"]
    assert np.array_equal(again.replica, plan.replica) and np.array_equal(again.slot, plan.slot)


@settings(max_examples=80, deadline=None)
@given(tree_batches(max_n=20), st.integers(1, 3), st.integers(0, 10), st.sampled_from([512, 0]))
def test_component_greedy_extension_never_worsens_j(trajs, dp_size, slack, exact_threshold):
    batch = RolloutBatch.from_token_lists(trajs)
    capacity = int(batch.lengths.max()) + slack
    try:
        paper = plan_step(batch, dp_size, capacity, component_greedy=False, exact_threshold=exact_threshold)
    except InfeasibleError:
        return
    plan = plan_step(batch, dp_size, capacity, exact_threshold=exact_threshold)
    check_plan(batch, plan, dp_size, capacity)
    assert plan.objective <= paper.objective
    assert not any(c["source"].startswith("greedy:component") for c in paper.candidates)


@settings(max_examples=80, deadline=None)
@given(tree_batches(max_n=10), st.integers(1, 3), st.integers(0, 10))
def test_exact_mode_beats_every_contiguous_partition(trajs, dp_size, slack):
    batch = RolloutBatch.from_token_lists(trajs)
    capacity = int(batch.lengths.max()) + slack
    try:
        plan = plan_step(batch, dp_size, capacity)
    except InfeasibleError:
        return
    k_min, k_max = plan.k_range
    for k in range(k_min, k_max + 1, dp_size):
        expect = brute_force(batch, capacity, k)
        if expect is not None:
            assert plan.total_work <= expect[0]
            assert any(
                c["source"] == "exact" and c["k"] == k and c["objective"][0] == expect[0]
                for c in plan.candidates
            )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tree_batches(max_n=40, max_len=12),
    st.integers(1, 4),
    st.sampled_from([0, 1, 3, 20, 60]),
    st.sampled_from([2, 3, 32]),
    st.booleans(),
)
def test_heuristic_search_never_exceeds_the_contiguous_optimum(trajs, dp_size, slack, samples, shared_prefix):
    """Heuristic search (N0 = 0, few sampled K) never plans more compact work than the best exact
    contiguous partition over its K range (computed here by the exact DP of Eq. 9 for every K)."""
    if shared_prefix:
        trajs = [[9, 9, *t] for t in trajs]  # a common system prompt: one component
    batch = RolloutBatch.from_token_lists(trajs)
    capacity = int(batch.lengths.max()) + slack
    try:
        plan = plan_step(batch, dp_size, capacity, exact_threshold=0, max_sampled_k=samples)
    except InfeasibleError:
        return
    check_plan(batch, plan, dp_size, capacity)
    k_min, k_max = plan.k_range
    exact = _native.exact_contiguous_partitions(
        batch._native, capacity, list(range(k_min, k_max + 1, dp_size))
    )
    feasible = [r["total_work"] for r in exact if r["feasible"]]
    if feasible:
        assert plan.total_work <= min(feasible)
        assert any(
            c["source"].startswith("contiguous-optimum") and c["objective"][0] == min(feasible)
            for c in plan.candidates
        )


@settings(max_examples=60, deadline=None)
@given(tree_batches(max_n=30, max_len=12), st.integers(1, 3), st.integers(0, 10), st.sampled_from([2, 32]))
def test_contiguous_optimum_extension_never_worsens_j(trajs, dp_size, slack, samples):
    """contiguous_optimum=False drops exactly the extension's candidates; the extension only lowers J."""
    batch = RolloutBatch.from_token_lists(trajs)
    capacity = int(batch.lengths.max()) + slack
    opts = {"exact_threshold": 0, "max_sampled_k": samples}
    try:
        without = plan_step(batch, dp_size, capacity, contiguous_optimum=False, **opts)
    except InfeasibleError:
        return
    plan = plan_step(batch, dp_size, capacity, **opts)
    check_plan(batch, without, dp_size, capacity)
    assert plan.objective <= without.objective
    assert not any(c["source"].startswith("contiguous-optimum") for c in without.candidates)
    assert [
        c for c in plan.candidates if not c["source"].startswith("contiguous-optimum")
    ] == without.candidates
    assert "contiguous_optimum" in plan.phase_seconds


# Small bushy and deep rollout trees (synth's "bushy" / "deep" presets, scaled down): many forks per
# tree, nested at every depth, the shape whose greedy placement the chain index and step budget serve.
SMALL_SHAPES = {
    "bushy": {"main_turns": (4, 12), "side_turns": (1, 4), "max_depth": 16, "tree_trajectories": (4, 24)},
    "deep": {"main_turns": (20, 60), "side_turns": (4, 24), "max_depth": 80, "tree_trajectories": (3, 12)},
}


def small_shape_tree(shape: str, seed: int, trees: int):
    return synth.generate_tree(
        shape,
        seed,
        trees=(trees, trees),
        trajectories=None,
        prompt_len=(1, 8),
        tool_len=(2, 12),
        turn_len=(1, 5),
        retry_len=(1, 3),
        max_trajectory_tokens=None,
        **SMALL_SHAPES[shape],
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(sorted(SMALL_SHAPES)),
    st.integers(0, 2**20),
    st.integers(1, 3),
    st.integers(1, 4),
    st.sampled_from([1.0, 1.5, 3.0]),
    st.booleans(),
)
def test_greedy_candidate_on_bushy_and_deep_trees_matches_the_brute_force_greedy(
    shape, seed, trees, dp_size, slack, shared_prompt
):
    """On bushy / deep trees the greedy candidate (placement index, elimination, alignment, step
    budget) is exactly what probing every microbatch gives, tie rules included; the plan keeps its
    guarantees, is deterministic and plans the same from the tree and from its tokens."""
    tree = small_shape_tree(shape, seed, trees)
    if shared_prompt:  # one system prompt above every tree: a single component
        parent = np.concatenate(([-1], np.where(tree.parent < 0, 0, tree.parent + 1)))
        tree = harts_planner.SegmentTree(parent, np.concatenate(([3], tree.length)), tree.trajectory_end + 1)
    batch = RolloutBatch.from_segment_tree(tree)
    capacity = int(int(batch.lengths.max()) * slack)
    try:
        plan = plan_step(batch, dp_size, capacity, exact_threshold=0, max_sampled_k=4)
    except InfeasibleError:
        assert greedy_candidate(batch, dp_size, capacity) is None
        return
    check_plan(batch, plan, dp_size, capacity)
    expect = greedy_candidate(batch, dp_size, capacity)
    got = [c for c in plan.candidates if c["source"].startswith("greedy:") and c["source"].count(":") == 1]
    got = [c for c in got if c["source"] != "greedy:component" and "+" not in c["source"]]
    if expect is None:
        assert not got
    else:
        (c,) = got
        assert (c["source"], c["k"], c["objective"][0]) == ("greedy:" + expect[0], expect[1], expect[2])
    again = plan_step(batch, dp_size, capacity, exact_threshold=0, max_sampled_k=4)
    assert again.to_dict()["microbatches"] == plan.to_dict()["microbatches"]
    tokens = batch.segment_tree()  # the same batch compacted again: same plan
    same = plan_step(
        RolloutBatch.from_segment_tree(tokens), dp_size, capacity, exact_threshold=0, max_sampled_k=4
    )
    assert same.to_dict()["microbatches"] == plan.to_dict()["microbatches"]


@pytest.mark.parametrize(("shape", "seed"), [("bushy", 3), ("deep", 1)])
def test_greedy_candidate_with_index_nodes_matches_the_brute_force_greedy(shape, seed):
    """Trees of a few hundred trajectories, so that the placement index has nodes (parts of at least
    128 ranks) nested along chains, as on full-size steps."""
    tree = synth.generate_tree(
        shape,
        seed,
        trees=(2, 2),
        trajectories=None,
        prompt_len=(1, 8),
        tool_len=(2, 12),
        turn_len=(1, 5),
        retry_len=(1, 3),
        max_trajectory_tokens=None,
        tree_trajectories=(150, 250),
    )
    batch = RolloutBatch.from_segment_tree(tree)
    assert batch.num_trajectories >= 256
    for dp_size, slack in ((2, 2.0), (3, 6.0)):
        capacity = int(int(batch.lengths.max()) * slack)
        plan = plan_step(batch, dp_size, capacity)
        check_plan(batch, plan, dp_size, capacity)
        name, k, total = greedy_candidate(batch, dp_size, capacity)
        (c,) = [c for c in plan.candidates if c["source"] == "greedy:" + name]
        assert (c["k"], c["objective"][0]) == (k, total)


def test_plans_from_a_segment_tree_match_the_token_batch():
    """A larger heuristic step (several swe-like-shaped trees behind a common prefix): the batch
    built from its segment tree plans byte for byte like the token batch."""
    rng = np.random.default_rng(7)
    trajs = [
        [1, 1, 1, int(t), *rng.integers(0, 3, size=rng.integers(1, 30)).tolist()]
        for t in rng.integers(0, 40, 900)
    ]
    batch = RolloutBatch.from_token_lists(trajs)
    tree_batch = RolloutBatch.from_segment_tree(batch.segment_tree())
    for dp in (1, 3):
        a, b = plan_step(batch, dp, 200), plan_step(tree_batch, dp, 200)
        check_plan(batch, a, dp, 200)
        assert a.to_dict()["microbatches"] == b.to_dict()["microbatches"]
        assert a.objective == b.objective and a.source == b.source


def test_identical_trajectories_share_everything():
    batch = RolloutBatch.from_token_lists([[5, 6, 7, 8]] * 6)
    plan = plan_step(batch, 3, 4)
    check_plan(batch, plan, 3, 4)
    assert plan.num_microbatches == 3 and plan.total_work == 12
    assert plan.metrics["step_imbalance"] == 0.0


def test_tight_capacity_forces_singletons():
    trajs = [[i, 1, 2, 3] for i in range(8)]
    batch = RolloutBatch.from_token_lists(trajs)
    plan = plan_step(batch, 4, 4)  # every trajectory fills a microbatch
    check_plan(batch, plan, 4, 4)
    assert plan.num_microbatches == 8 and plan.num_slots == 2


def test_shared_prefix_kept_together():
    # Two trees of 4 trajectories; each tree fits T exactly, so the best plan never splits a tree.
    trajs = [[t, 9, 9, 9, 9, b] for t in (0, 1) for b in range(4)]
    batch = RolloutBatch.from_token_lists(trajs)
    plan = plan_step(batch, 2, 9)
    check_plan(batch, plan, 2, 9)
    assert plan.total_work == batch.compact_tokens == 18
    assert sorted(sorted(batch.tree_ids[mb].tolist()) for mb in plan.microbatches) == [[0] * 4, [1] * 4]


# ---------------------------------------------------------------------------- errors
def test_trajectory_longer_than_capacity_is_named():
    batch = RolloutBatch.from_token_lists([[1, 2], [1, 2, 3, 4, 5], [3]])
    with pytest.raises(InvalidArgumentError) as e:
        plan_step(batch, 1, 4)
    assert e.value.field == "trajectories[1]"
    assert "5 tokens" in str(e.value) and "T = 4" in str(e.value)


def test_fewer_trajectories_than_replicas_is_infeasible():
    batch = RolloutBatch.from_token_lists([[1, 2], [1, 3], [4]])
    with pytest.raises(InfeasibleError) as e:
        plan_step(batch, 4, 100)
    assert e.value.field == "dp_size" and "N >= D" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_too_many_microbatches_is_infeasible():
    # Three disjoint 5-token trajectories at T = 5 need K = 3 microbatches; D = 2 needs K = 4 > N.
    batch = RolloutBatch.from_token_lists([[1] * 5, [2] * 5, [3] * 5])
    with pytest.raises(InfeasibleError) as e:
        plan_step(batch, 2, 5)
    assert e.value.field == "capacity"
    plan = plan_step(batch, 2, 10)
    check_plan(batch, plan, 2, 10)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"dp_size": 0}, "dp_size"),
        ({"capacity": 0}, "capacity"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"dp_size": 1.5}, "dp_size"),
        ({"search": "fast"}, "search"),
        ({"max_sampled_k": 1}, "max_sampled_k"),
        ({"repair_window": -1}, "repair_window"),
        ({"greedy": 1}, "greedy"),
        ({"no_such_option": 3}, "no_such_option"),
    ],
)
def test_bad_arguments(kwargs, field):
    batch = RolloutBatch.from_token_lists([[1, 2], [1, 3]])
    args = {"dp_size": 1, "capacity": 10}
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError) as e:
        plan_step(batch, **args)
    assert e.value.field == field


def test_batch_type_is_checked():
    with pytest.raises(InvalidArgumentError) as e:
        plan_step([[1, 2]], 1, 10)
    assert e.value.field == "batch"


# ---------------------------------------------------------------------------- surface
def test_metrics_and_to_dict():
    rng = np.random.default_rng(0)
    trajs = [[int(t), *rng.integers(0, 4, size=rng.integers(1, 30)).tolist()] for t in rng.integers(0, 5, 60)]
    batch = RolloutBatch.from_token_lists(trajs)
    plan = plan_step(batch, 4, 64)
    check_plan(batch, plan, 4, 64)
    d = plan.to_dict()
    json.dumps(d)
    assert d["num_microbatches"] == plan.num_microbatches and len(d["imbalance"]["slot"]) == plan.num_slots
    assert d["objective"]["total_work"] == plan.total_work
    grid = np.zeros((plan.num_slots, 4))
    grid[plan.slot, plan.replica] = plan.work
    slot_imb = [imbalance(row) for row in grid]
    assert d["imbalance"]["slot_p50"] == pytest.approx(np.percentile(slot_imb, 50))
    assert d["imbalance"]["step_total"] == pytest.approx(imbalance(grid.sum(axis=0)))
    assert plan.planning_seconds > 0 and set(plan.phase_seconds) >= {"natural_partition", "greedy"}
    for s in range(plan.num_slots):
        for r in range(4):
            mb = plan.microbatch_at(r, s)
            assert batch.subset_work(mb) == plan.work[s * 4 + r]
    assert "StepPlan(" in repr(plan)


def test_imbalance_definition():
    assert imbalance([10, 10]) == 0.0
    assert imbalance([30, 10]) == pytest.approx(0.5)  # max / mean - 1 = 30 / 20 - 1
    assert imbalance([0, 0]) == 0.0


def test_call_plans_use_plan_calls(monkeypatch):
    batch = RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4], [5, 6]])
    plan = plan_step(batch, 1, 4, chunk_size=2)
    calls = []

    def fake_plan_calls(b, chunk_size, microbatch, conv_width, cancel, debug):
        assert (conv_width, cancel, debug) == (4, None, True)  # plan_step's defaults
        calls.append((b, chunk_size, list(microbatch)))
        return len(microbatch)

    monkeypatch.setattr(harts_planner.step_plan, "plan_calls", fake_plan_calls)
    out = plan.call_plans()
    assert out == [len(mb) for mb in plan.microbatches]
    assert [c[2] for c in calls] == [mb.tolist() for mb in plan.microbatches]
    assert all(c[0] is batch and c[1] == 2 for c in calls)
    assert plan.call_plans() is out  # cached


def test_concurrent_planning_is_deterministic():
    rng = np.random.default_rng(1)
    trajs = [
        [int(t), *rng.integers(0, 3, size=rng.integers(1, 40)).tolist()] for t in rng.integers(0, 8, 700)
    ]
    batch = RolloutBatch.from_token_lists(trajs)  # N > N0: heuristic search
    results = [None] * 4

    def run(i):
        results[i] = plan_step(batch, 2, 128).to_dict()["microbatches"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == results[0] for r in results)


def test_swe_like_step_plans():
    # (planning time is measured by benchmarks/planner_quality.py, not asserted here)
    from harts_planner import synth

    syn = synth.generate("swe-like", seed=0)
    batch = RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids)
    for dp in (2, 4):
        plan = plan_step(batch, dp, 65536)
        check_plan(batch, plan, dp, 65536)
        assert plan.search_mode == "heuristic"


# ---------------------------------------------------------------------------- benchmark baselines
def _baselines():
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import baselines.dta_balancer
    import baselines.prefix_unaware

    return baselines


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_baselines_satisfy_the_guarantees(seed, dp_size):
    from harts_planner import synth

    syn = synth.generate("small", seed=seed)
    batch = RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids)
    capacity = max(8192, int(batch.lengths.max()))
    baselines = _baselines()
    plans = [
        baselines.dta_balancer.plan(batch, dp_size, capacity),
        baselines.prefix_unaware.plan(batch, dp_size, capacity),
    ]
    try:
        from ortools.sat.python import cp_model  # noqa: F401
    except ImportError:
        pass
    else:
        import baselines.ortools_baseline as ob

        if len(np.unique(batch.tree_ids)) >= dp_size:
            plans += [
                ob.plan(batch, dp_size, capacity, time_limit_s=2.0),
                ob.plan(batch, dp_size, capacity, time_limit_s=2.0, per_tree=True),
            ]
    harts = plan_step(batch, dp_size, capacity)
    for p in plans:
        work = verify_schedule(batch, p.microbatches, p.replica, p.slot, dp_size, capacity)
        assert work.sum() >= batch.compact_tokens
    # HARTS never needs more compact tokens than the contiguous DTA cuts of the same order.
    dta = plans[0]
    assert harts.total_work <= sum(batch.subset_work(mb) for mb in dta.microbatches)


def test_ortools_baseline_model_is_exact():
    pytest.importorskip("ortools")
    _baselines()
    import baselines.ortools_baseline as ob

    # One tree of 4 trajectories (compact 9) at T = 7: CP-SAT must split it optimally.
    batch = RolloutBatch.from_token_lists(
        [[1, 2, 3, 4], [1, 2, 3, 5], [1, 6, 7], [1, 6, 8]], tree_ids=[0] * 4
    )
    end_seg, parent = ob._segment_paths(batch)
    bins, diag = ob.cpsat_partition(batch, [np.arange(4, dtype=np.int32)], 7, end_seg, parent, 5.0)
    assert diag["status"] == "OPTIMAL"
    assert sorted(sorted(b.tolist()) for b in bins) == [[0, 1], [2, 3]]
    assert diag["objective"] == sum(batch.subset_work(b) for b in bins) == 5 + 4


def test_call_plans_with_the_min_call_planner():
    if not hasattr(harts_planner, "plan_calls"):
        pytest.skip("no minimum-call planner in this build")
    from harts_planner import synth

    syn = synth.generate("small", seed=3)
    batch = RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids)
    plan = plan_step(batch, 2, max(8192, int(batch.lengths.max())), chunk_size=64)
    calls = plan.call_plans()
    assert len(calls) == plan.num_microbatches
    for cp, w in zip(calls, plan.work, strict=True):
        assert cp.compact_tokens == w and cp.chunk_size == 64 and cp.num_calls >= 1


def test_equal_work_prefers_fewer_microbatches():
    """Four unshared trajectories of 4, 4, 2, 2 tokens at T = 6: the contiguous candidates (trie
    order) need K = 3, the greedy ones pack K = 2, all with J = (12, 12, 12). Each microbatch costs a
    fixed time (about 0.3 s of a 2 s microbatch on the H200), so the tie goes to K = 2."""
    batch = RolloutBatch.from_token_lists([[1, 5, 5, 5], [2, 5, 5, 5], [3, 5], [4, 5]])
    plan = plan_step(batch, 1, 6)
    ks = {c["k"] for c in plan.candidates if c["objective"] == plan.objective}
    assert {2, 3} <= ks, plan.candidates
    assert plan.num_microbatches == 2 and plan.objective == (12, 12, 12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree_batches(max_n=24, max_len=12), st.integers(1, 3), st.integers(0, 6), st.integers(0, 40))
def test_microbatch_cost_selects_by_j_with_the_cost(trajs, dp_size, slack, cost_percent):
    """``microbatch_cost`` changes only the selection: the same candidates, the winner the least J
    with the cost added to every microbatch, the reported objective the paper's J; 0 is the default."""
    batch = RolloutBatch.from_token_lists(trajs)
    capacity = int(batch.lengths.max()) + slack
    cost = capacity * cost_percent // 100
    try:
        base = plan_step(batch, dp_size, capacity, max_sampled_k=3)
    except InfeasibleError:
        return
    plan = plan_step(batch, dp_size, capacity, max_sampled_k=3, microbatch_cost=cost)
    check_plan(batch, plan, dp_size, capacity, cost)
    assert plan.candidates == base.candidates
    chosen = with_microbatch_cost(plan.candidates[plan.selected], cost, dp_size)
    assert chosen <= with_microbatch_cost(base.candidates[base.selected], cost, dp_size)
    if cost == 0:
        assert (
            plan.selected == base.selected
            and plan.to_dict()["microbatches"] == base.to_dict()["microbatches"]
        )


def test_microbatch_cost_trades_work_for_fewer_microbatches():
    """A bushy step at T = 65,536 (synthetic, seed 0): the least-work plan has K = 35; with each
    microbatch costing 8,400 tokens (0.31 s on the H200 over the 24-layer ling-tiny's variable seconds
    per compact row, benchmarks/results/issue26_gpu) a plan of 4 fewer microbatches and 0.18% more
    work wins."""
    from harts_planner import synth

    sb = synth.generate("bushy", 0)
    batch = RolloutBatch.from_arrays(sb.tokens, sb.offsets, sb.tree_ids)
    base = plan_step(batch, 1, 65_536)
    costed = plan_step(batch, 1, 65_536, microbatch_cost=8_400)
    assert costed.num_microbatches < base.num_microbatches
    assert base.total_work < costed.total_work < base.total_work * 1.01
    assert (
        costed.total_work + 6_750 * costed.num_microbatches < base.total_work + 6_750 * base.num_microbatches
    )
    with pytest.raises(InvalidArgumentError, match="microbatch_cost: must be <= capacity T = 65536"):
        plan_step(batch, 1, 65_536, microbatch_cost=65_537)
    with pytest.raises(InvalidArgumentError, match="microbatch_cost: must be >= 0"):
        plan_step(batch, 1, 65_536, microbatch_cost=-1)
