"""Rollout-batch ingestion against a brute-force trie (hypothesis), plus error handling."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import forests
from trie_oracle import naive_ingest, subset_work

import harts_planner as hp

# Small alphabets make shared prefixes, identical trajectories and prefixes-of-others common.
token = st.integers(min_value=0, max_value=2)
trajectory = st.lists(token, min_size=1, max_size=7)
batches = st.lists(trajectory, min_size=1, max_size=9)


# Forests (copied prefixes, forks, duplicates) from the suites' one generator, tokens 0..2 as above.
any_batch = st.one_of(batches, forests(max_num=9, vocab=3, max_new=5))


@settings(max_examples=300, deadline=None)
@given(any_batch)
def test_order_and_lcp(trajs):
    b = hp.RolloutBatch.from_token_lists(trajs)
    ref = naive_ingest(trajs)
    assert b.order.tolist() == ref.order
    assert b.adjacent_lcp.tolist() == ref.adjacent_lcp
    assert b.rank[b.order].tolist() == list(range(len(trajs)))
    for i in range(len(trajs)):
        for j in range(len(trajs)):
            expect = len(trajs[i]) if i == j else sum(1 for _ in iter_common(trajs[i], trajs[j]))
            assert b.lcp(i, j) == expect


def iter_common(a, b):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


@settings(max_examples=300, deadline=None)
@given(any_batch)
def test_compact_map_and_multiplicity(trajs):
    b = hp.RolloutBatch.from_token_lists(trajs)
    ref = naive_ingest(trajs)
    assert b.semantic_tokens == sum(map(len, trajs))
    assert b.compact_tokens == ref.compact_tokens
    m = b.compact_map
    row_of = {}
    for i, t in enumerate(trajs):
        for p in range(len(t)):
            row = int(m[b.offsets[i] + p])
            pre = tuple(t[: p + 1])
            assert row_of.setdefault(pre, row) == row, "same prefix must share one row"
            assert b.row_depth[row] == p
            assert b.row_parent[row] == (-1 if p == 0 else m[b.offsets[i] + p - 1])
    assert len(set(row_of.values())) == len(row_of), "different prefixes must use different rows"
    for pre, row in row_of.items():
        assert b.multiplicity[row] == ref.prefix_count[pre]
    assert int(b.multiplicity.sum()) == b.semantic_tokens


@settings(max_examples=300, deadline=None)
@given(any_batch, st.data())
def test_interval_and_subset_work(trajs, data):
    b = hp.RolloutBatch.from_token_lists(trajs)
    n = len(trajs)
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            assert b.interval_work(lo, hi) == subset_work(trajs, b.order[lo:hi].tolist())
    subset = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    assert b.subset_work(subset) == subset_work(trajs, subset)
    assert b.subset_work(np.arange(n)) == b.compact_tokens


@settings(max_examples=300, deadline=None)
@given(any_batch)
def test_segment_forest(trajs):
    b = hp.RolloutBatch.from_token_lists(trajs)
    ref = naive_ingest(trajs)
    start, end, parent = b.segment_start, b.segment_end, b.segment_parent
    assert b.num_segments == len(ref.segment_ends)
    # Each segment = contiguous rows; its end prefix is a naive segment end; nothing inside is.
    covered = np.zeros(b.compact_tokens, dtype=int)
    for v in range(b.num_segments):
        assert start[v] < end[v]
        rows = np.arange(b.segment_row_begin[v], b.segment_row_begin[v] + end[v] - start[v])
        covered[rows] += 1
        assert (b.row_segment[rows] == v).all()
        assert (b.row_depth[rows] == np.arange(start[v], end[v])).all()
        if parent[v] < 0:
            assert start[v] == 0
        else:
            assert end[parent[v]] == start[v] and parent[v] < v
            assert (
                b.row_parent[rows[0]]
                == b.segment_row_begin[parent[v]] + end[parent[v]] - start[parent[v]] - 1
            )
        assert (b.multiplicity[rows] == b.segment_multiplicity[v]).all()
        for t in b.ending(v):
            assert len(trajs[t]) == end[v]
            assert b.row_segment[b.compact_map[b.offsets[t + 1] - 1]] == v
        kids = b.children(v)
        assert (parent[kids] == v).all() and (np.diff(kids) > 0).all()
    assert (covered == 1).all()
    assert sorted(b.segment_ending.tolist()) == list(range(len(trajs)))
    # Subtree ranges are consistent with parents (preorder numbering).
    for v in range(b.num_segments):
        inside = np.arange(v + 1, b.segment_subtree_end[v])
        for u in inside:
            w = u
            while w > v:
                w = parent[w]
            assert w == v
    # One root per connected component; tree ids default to the component.
    assert (b.tree_ids == b.component).all()
    firsts = {t[0] for t in trajs}
    assert len(b.segment_roots) == len(firsts)


def test_examples_from_the_paper_figure_1():
    # T1 = A B D, T2 = A B E, T3 = A C (each letter one token).
    A, B, C, D, E = 1, 2, 3, 4, 5
    b = hp.RolloutBatch.from_token_lists([[A, B, D], [A, B, E], [A, C]])
    assert (b.semantic_tokens, b.compact_tokens) == (8, 5)
    row_b = b.compact_map[1]
    assert b.compact_map[4] == row_b and b.multiplicity[row_b] == 2
    assert b.num_segments == 5  # A | B | C | D | E
    assert b.subset_work([0, 1]) == 4


def test_edge_cases_identical_prefix_single_token_many_trees():
    trajs = [[7], [7], [7, 1], [7, 1, 2], [9, 9], [8]]
    b = hp.RolloutBatch.from_token_lists(trajs, tree_ids=[0, 0, 0, 0, 1, 2])
    assert b.compact_tokens == 6
    assert b.tree_ids.tolist() == [0, 0, 0, 0, 1, 2]
    assert len(b.segment_roots) == 3
    seg7 = b.row_segment[b.compact_map[0]]
    assert sorted(b.ending(seg7).tolist()) == [0, 1]


def test_views_of_the_batch():
    tokens = np.array([1, 2, 3, 1, 2, 4], dtype=np.int32)
    offsets = np.array([0, 3, 6], dtype=np.int64)
    b = hp.RolloutBatch.from_arrays(tokens, offsets)
    assert not b.compact_map.flags.writeable and not b.tokens.flags.writeable
    assert np.shares_memory(
        b.trajectory(1), b.tokens
    )  # what it holds (tests/planner/test_ingest_ownership.py)


@pytest.mark.parametrize(
    "tokens, offsets, tree_ids, field",
    [
        ([1, 2, 3], [0, 1, 1, 3], None, "offsets[2]"),  # empty trajectory
        ([1, 2, 3], [0, 2, 1, 3], None, "offsets[2]"),  # decreasing
        ([1, 2, 3], [1, 3], None, "offsets[0]"),
        ([1, 2, 3], [0, 1, 2], None, "offsets[2]"),  # does not match the buffer
        ([1, 2, 3], [0], None, "offsets"),  # no trajectory
        ([1, -2, 3], [0, 1, 3], None, "tokens[1]"),  # negative token id
        ([1, 2, 3], [0, 1, 3], [0], "tree_ids"),  # wrong length
        ([1, 2, 3], [0, 1, 3], [0, -1], "tree_ids[1]"),
        ([1.5, 2, 3], [0, 1, 3], None, "tokens"),  # not integers
        ([1, 2, 2**31], [0, 1, 3], None, "tokens"),  # does not fit int32
        ([[1, 2, 3]], [0, 3], None, "tokens"),  # not 1-D
    ],
)
def test_bad_inputs_name_the_field(tokens, offsets, tree_ids, field):
    with pytest.raises(hp.InvalidArgumentError) as info:
        hp.RolloutBatch.from_arrays(np.array(tokens), np.array(offsets), tree_ids)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)
    assert field in str(info.value)


def test_bad_token_lists_and_queries():
    with pytest.raises(hp.InvalidArgumentError, match="trajectories"):
        hp.RolloutBatch.from_token_lists([])
    with pytest.raises(hp.InvalidArgumentError, match=r"trajectories\[1\]"):
        hp.RolloutBatch.from_token_lists([[1], []])
    b = hp.RolloutBatch.from_token_lists([[1, 2], [1, 3]])
    with pytest.raises(hp.InvalidArgumentError, match="appears more than once"):
        b.subset_work([0, 0])
    with pytest.raises(hp.InvalidArgumentError, match="out of range"):
        b.subset_work([2])
    with pytest.raises(hp.InvalidArgumentError, match="out of range"):
        b.lcp(0, 5)
    with pytest.raises(hp.InvalidArgumentError, match="lo < hi"):
        b.interval_work(1, 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 3), max_size=12), st.lists(st.integers(-2, 14), max_size=6))
def test_fuzz_malformed_arrays_never_crash(tokens, offsets):
    try:
        b = hp.RolloutBatch.from_arrays(np.array(tokens, dtype=np.int64), np.array(offsets, dtype=np.int64))
    except hp.InvalidArgumentError as e:
        assert e.field
    else:
        assert b.semantic_tokens == len(tokens) and b.num_trajectories == len(offsets) - 1
