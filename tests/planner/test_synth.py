"""Tests for harts_planner.synth: determinism, scale, trie exactness and input validation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_planner import synth

SMALL_PRESETS = ["tiny", "small", "medium"]


def trajectories(batch: synth.SynthBatch) -> list[np.ndarray]:
    """Every trajectory of ``batch`` as a view of its tokens."""
    return [batch.tokens[batch.offsets[i] : batch.offsets[i + 1]] for i in range(len(batch.offsets) - 1)]


def distinct_prefixes_by_set(batch: synth.SynthBatch) -> int:
    """Naive oracle: the number of distinct non-empty token prefixes, from a set of tuples."""
    prefixes = set()
    for trajectory in trajectories(batch):
        values = tuple(trajectory.tolist())
        prefixes.update(values[:end] for end in range(1, len(values) + 1))
    return len(prefixes)


def distinct_prefixes_by_trie(batch: synth.SynthBatch) -> int:
    """Naive oracle: the number of nodes of a dict-of-dicts token trie."""
    root: dict[int, dict] = {}
    nodes = 0
    for trajectory in trajectories(batch):
        node = root
        for token in trajectory.tolist():
            if token not in node:
                node[token] = {}
                nodes += 1
            node = node[token]
    return nodes


def distinct_prefixes_by_lcp(batch: synth.SynthBatch) -> int:
    """Sorted-LCP oracle: sum of lengths minus the LCP of lexicographic neighbours."""
    seqs = trajectories(batch)
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].astype(">u4").tobytes())
    total, previous = 0, seqs[order[0]][:0]
    for index in order:
        current = seqs[index]
        common = min(len(current), len(previous))
        mismatch = np.flatnonzero(current[:common] != previous[:common])
        total += len(current) - (int(mismatch[0]) if mismatch.size else common)
        previous = current
    return total


def assert_well_formed(batch: synth.SynthBatch, vocab_size: int) -> None:
    """Dtypes, shapes, offsets, token range and consecutive tree ids."""
    assert batch.tokens.dtype == np.int32 and batch.tokens.ndim == 1
    assert batch.offsets.dtype == np.int64 and batch.tree_ids.dtype == np.int64
    n = len(batch.tree_ids)
    assert batch.offsets.shape == (n + 1,) and batch.offsets[0] == 0
    assert batch.offsets[-1] == len(batch.tokens) == batch.semantic_tokens
    assert np.all(np.diff(batch.offsets) > 0)
    assert batch.tokens.min() >= 0 and batch.tokens.max() < vocab_size
    assert batch.tree_ids[0] == 0 and np.all(np.diff(batch.tree_ids) >= 0)
    assert np.array_equal(np.unique(batch.tree_ids), np.arange(batch.tree_ids[-1] + 1))


@pytest.mark.parametrize("preset", SMALL_PRESETS)
def test_same_seed_gives_identical_bytes(preset: str) -> None:
    first, second = synth.generate(preset, 7), synth.generate(preset, 7)
    assert first.tokens.tobytes() == second.tokens.tobytes()
    assert first.offsets.tobytes() == second.offsets.tobytes()
    assert first.tree_ids.tobytes() == second.tree_ids.tobytes()
    assert first.compact_tokens_expected == second.compact_tokens_expected
    assert (first.preset, first.seed) == (preset, 7)


def test_different_seeds_differ() -> None:
    assert synth.generate("small", 0).tokens.tobytes() != synth.generate("small", 1).tokens.tobytes()


def test_overrides_are_part_of_the_determinism_key() -> None:
    base = synth.generate("tiny", 3)
    again = synth.generate("tiny", 3, vocab_size=16)
    other = synth.generate("tiny", 3, vocab_size=17)
    assert base.tokens.tobytes() == again.tokens.tobytes()
    assert base.tokens.tobytes() != other.tokens.tobytes()


@pytest.mark.parametrize(
    ("preset", "trees", "n_range", "s_range"),
    [
        ("tiny", (2, 4), (1, 200), (2, 2_000)),
        ("small", (1, 100), (80, 200), (100_000, 500_000)),
        ("medium", (1, 400), (450, 700), (1_500_000, 8_000_000)),
    ],
)
@pytest.mark.parametrize("seed", range(3))
def test_preset_scale(
    preset: str, trees: tuple[int, int], n_range: tuple[int, int], s_range: tuple[int, int], seed: int
) -> None:
    batch = synth.generate(preset, seed)
    assert_well_formed(batch, synth.PRESETS[preset].vocab_size)
    assert trees[0] <= batch.tree_ids[-1] + 1 <= trees[1]
    assert n_range[0] <= len(batch.tree_ids) <= n_range[1]
    assert s_range[0] <= batch.semantic_tokens <= s_range[1]
    assert batch.compact_tokens_expected < batch.semantic_tokens


@pytest.mark.parametrize("seed", [0, 1])
def test_swe_like_matches_table_2_scale(seed: int) -> None:
    # (its generation time is reported, not asserted: harts-planner demo --json, generate_seconds)
    batch = synth.generate("swe-like", seed)
    n, s, c = len(batch.tree_ids), batch.semantic_tokens, batch.compact_tokens_expected
    assert 1_250 <= n <= 2_450
    assert 32_000_000 <= s <= 62_000_000
    assert 4.5 <= s / c <= 6.5
    assert 22_000 <= s / n <= 32_000
    assert_well_formed(batch, 157_184)


@pytest.mark.parametrize("seed", range(10))
def test_tiny_compact_count_matches_naive_oracles(seed: int) -> None:
    batch = synth.generate("tiny", seed)
    assert distinct_prefixes_by_set(batch) == batch.compact_tokens_expected
    assert distinct_prefixes_by_trie(batch) == batch.compact_tokens_expected


@pytest.mark.parametrize(("preset", "seed"), [("small", 0), ("small", 1), ("small", 2), ("medium", 0)])
def test_compact_count_matches_sorted_lcp(preset: str, seed: int) -> None:
    batch = synth.generate(preset, seed)
    assert distinct_prefixes_by_lcp(batch) == batch.compact_tokens_expected


@pytest.mark.parametrize("shared", [1, 5, 40])
def test_shared_prefix_is_common_then_trees_differ(shared: int) -> None:
    batch = synth.generate("small", 4, shared_prefix_tokens=shared)
    seqs = trajectories(batch)
    assert all(np.array_equal(seq[:shared], seqs[0][:shared]) for seq in seqs)
    firsts = np.unique(batch.tree_ids, return_index=True)[1]
    next_tokens = [int(seqs[i][shared]) for i in firsts]
    assert len(set(next_tokens)) == len(next_tokens)
    assert distinct_prefixes_by_lcp(batch) == batch.compact_tokens_expected


@pytest.mark.parametrize("preset", SMALL_PRESETS)
def test_trees_start_with_distinct_tokens(preset: str) -> None:
    batch = synth.generate(preset, 5)
    first_tokens = batch.tokens[batch.offsets[:-1]]
    per_tree = {}
    for tree, token in zip(batch.tree_ids.tolist(), first_tokens.tolist(), strict=True):
        assert per_tree.setdefault(tree, token) == token
    assert len(set(per_tree.values())) == len(per_tree)


@pytest.mark.parametrize(("preset", "seed"), [("tiny", s) for s in range(5)] + [("small", 0)])
def test_siblings_start_with_distinct_tokens(preset: str, seed: int) -> None:
    cfg = synth.PRESETS[preset]
    rng = np.random.Generator(np.random.PCG64(seed))
    forest, roots, _ = synth._grow_forest(rng, cfg)
    pool, starts = synth._draw_segment_tokens(rng, cfg, forest, roots)
    for children in forest.children:
        first_tokens = pool[starts[children]].tolist()
        assert len(set(first_tokens)) == len(first_tokens)


def test_prefix_and_duplicate_trajectories_appear() -> None:
    prefixes = duplicates = 0
    for seed in range(10):
        seqs = [tuple(seq.tolist()) for seq in trajectories(synth.generate("tiny", seed))]
        duplicates += len(seqs) - len(set(seqs))
        unique = set(seqs)
        prefixes += sum(
            any(other[: len(seq)] == seq and len(other) > len(seq) for other in unique) for seq in unique
        )
    assert prefixes > 0 and duplicates > 0


def test_no_prefix_or_duplicate_trajectories_when_disabled() -> None:
    batch = synth.generate("tiny", 2, prefix_prob=0.0, duplicate_prob=0.0, trees=(4, 4))
    seqs = {tuple(seq.tolist()) for seq in trajectories(batch)}
    assert len(seqs) == len(batch.tree_ids)
    assert not any(a != b and b[: len(a)] == a for a in seqs for b in seqs)


def test_order_within_trees_is_not_lexicographic() -> None:
    batch = synth.generate("small", 0)
    keys = [seq.astype(">u4").tobytes() for seq in trajectories(batch)]
    assert keys != sorted(keys)


def test_fork_positions_are_not_chunk_aligned() -> None:
    batch = synth.generate("medium", 0)
    seqs = trajectories(batch)
    forks = []
    for a, b in itertools.pairwise(seqs):
        common = min(len(a), len(b))
        mismatch = np.flatnonzero(a[:common] != b[:common])
        if mismatch.size:
            forks.append(int(mismatch[0]))
    residues = {fork % 64 for fork in forks}
    assert len(residues) > 32


def test_progress_is_reported_per_tree() -> None:
    calls: list[tuple[int, int]] = []
    batch = synth.generate("small", 1, progress=lambda done, total: calls.append((done, total)))
    trees = int(batch.tree_ids[-1]) + 1
    assert calls == [(done, trees) for done in range(1, trees + 1)]


@st.composite
def tiny_overrides(draw: st.DrawFn) -> dict[str, object]:
    """Random small configurations whose batches the set oracle can check."""
    max_depth = draw(st.integers(1, 6))
    fanout = draw(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4).filter(lambda w: sum(w) > 0))
    trees_hi = draw(st.integers(1, 4))
    return {
        "trees": (draw(st.integers(1, trees_hi)), trees_hi),
        "prompt_len": (1, draw(st.integers(1, 5))),
        "main_turns": (0, draw(st.integers(0, 5))),
        "side_turns": (0, draw(st.integers(0, 3))),
        "max_depth": max_depth,
        "fork_min_depth": draw(st.integers(1, max_depth)),
        "fork_prob": draw(st.floats(0.0, 1.0)),
        "fanout": tuple(fanout),
        "retry_prob": draw(st.floats(0.0, 1.0)),
        "retry_leaf_prob": draw(st.floats(0.0, 1.0)),
        "tool_prob": draw(st.floats(0.0, 1.0)),
        "prefix_prob": draw(st.floats(0.0, 1.0)),
        "duplicate_prob": draw(st.floats(0.0, 1.0)),
        "vocab_size": draw(st.integers(max(2, trees_hi, len(fanout) + 1), 8)),
        "shared_prefix_tokens": draw(st.integers(0, 3)),
    }


@settings(max_examples=150, deadline=None)
@given(overrides=tiny_overrides(), seed=st.integers(0, 2**32))
def test_compact_count_matches_oracle_for_random_configs(overrides: dict[str, object], seed: int) -> None:
    batch = synth.generate("tiny", seed, **overrides)
    assert_well_formed(batch, int(overrides["vocab_size"]))
    assert distinct_prefixes_by_set(batch) == batch.compact_tokens_expected


def test_unknown_override_names_the_field() -> None:
    with pytest.raises(ValueError, match="fork_probability"):
        synth.generate("tiny", 0, fork_probability=0.5)


def test_unknown_preset_is_rejected() -> None:
    with pytest.raises(ValueError, match="preset"):
        synth.generate("huge", 0)


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("vocab_size", 1, r"\[2, 2147483647\]"),
        ("vocab_size", 2**31, r"\[2, 2147483647\]"),
        ("trees", (0, 3), r"\[1, 16\]"),
        ("trees", (2, 17), r"\[1, 16\]"),
        ("trees", (3, 2), "exceeds upper bound"),
        ("trajectories", (0, 5), ">= 1"),
        ("prompt_len", (0, 5), ">= 1"),
        ("retry_len", (5, 2), "exceeds upper bound"),
        ("main_turns", (-1, 2), ">= 0"),
        ("max_depth", 0, r"\[1, 100000\]"),
        ("fork_min_depth", 7, r"\[1, 6\]"),
        ("fork_prob", 1.5, r"\[0, 1\]"),
        ("duplicate_prob", -0.1, r"\[0, 1\]"),
        ("fanout", (), "not all zero"),
        ("fanout", (1.0,) * 16, "vocab_size=16"),
        ("shared_prefix_tokens", -1, ">= 0"),
        ("tree_trajectories", (0, 4), ">= 1"),
        ("tree_trajectories", (5, 2), "exceeds upper bound"),
        ("tool_len", 5, r"\(lo, hi\) pair"),
        ("turn_len", (1.5, 3), "integer"),
    ],
)
def test_out_of_range_override_names_field_and_limit(field: str, value: object, limit: str) -> None:
    with pytest.raises(ValueError, match=field) as error:
        synth.generate("tiny", 0, **{field: value})
    assert error.match(limit)


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_bad_seed_is_rejected(seed: object) -> None:
    with pytest.raises(ValueError, match="seed"):
        synth.generate("tiny", seed)  # type: ignore[arg-type]


def test_presets_are_valid_configs() -> None:
    assert set(synth.PRESETS) == {"tiny", "small", "medium", "swe-like", "bushy", "deep"}
    for cfg in synth.PRESETS.values():
        assert abs(sum(cfg.fanout) - 1.0) < 1e-12


# ---------------------------------------------------------------------------- segment trees without tokens
def tree_paths(tree) -> list[list[int]]:
    """Every trajectory of a segment tree as its root-to-end list of segments."""
    paths = []
    for end in tree.trajectory_end.tolist():
        path = []
        while end >= 0:
            path.append(end)
            end = int(tree.parent[end])
        paths.append(path[::-1])
    return paths


@pytest.mark.parametrize(
    ("preset", "seed", "overrides"),
    [("tiny", s, {}) for s in range(6)]
    + [
        ("tiny", 2, {"shared_prefix_tokens": 3}),
        ("small", 0, {}),
        ("medium", 1, {"shared_prefix_tokens": 40}),
    ],
)
def test_generate_tree_is_the_forest_generate_expands(preset: str, seed: int, overrides: dict) -> None:
    """Same draws, same forest: trajectory i of the tree has trajectory i's length, the two share the
    same prefix with every other trajectory (LCPs from the tokens vs. from the tree's paths), the
    segments hold compact_tokens_expected tokens, and the tree ids agree."""
    batch = synth.generate(preset, seed, **overrides)
    tree = synth.generate_tree(preset, seed, **overrides)
    paths = tree_paths(tree)
    lengths = [int(tree.length[p].sum()) for p in paths]
    assert lengths == np.diff(batch.offsets).tolist()
    assert int(tree.length.sum()) == batch.compact_tokens_expected
    assert np.array_equal(tree.tree_ids, batch.tree_ids)
    seqs = trajectories(batch)
    for i, j in itertools.combinations(range(min(len(seqs), 40)), 2):
        a, b = seqs[i], seqs[j]
        common = min(len(a), len(b))
        mismatch = np.flatnonzero(a[:common] != b[:common])
        token_lcp = int(mismatch[0]) if mismatch.size else common
        shared = 0
        for u, v in zip(paths[i], paths[j], strict=False):
            if u != v:
                break
            shared += int(tree.length[u])
        assert token_lcp == shared, (i, j)


@pytest.mark.parametrize("preset", ["bushy", "deep"])
def test_generate_tree_is_deterministic(preset: str) -> None:
    a, b = synth.generate_tree(preset, 4), synth.generate_tree(preset, 4)
    for name in ("parent", "length", "trajectory_end", "tree_ids"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes()
    assert synth.generate_tree(preset, 5).length.tobytes() != a.length.tobytes()


@pytest.mark.parametrize("seed", range(3))
def test_bushy_and_deep_step_scale(seed: int) -> None:
    """Step-sized (about 2k trajectories, every one under 65,536 tokens and about 15-18k on average, so
    100k fit under 2^31 tokens); bushy trees hold 100-400 trajectories forking at every depth, deep
    trees run hundreds of segments deep."""
    from harts_planner import RolloutBatch

    for preset in ("bushy", "deep"):
        tree = synth.generate_tree(preset, seed)
        batch = RolloutBatch.from_segment_tree(tree)
        n, s = batch.num_trajectories, batch.semantic_tokens
        assert 1_800 <= n <= 2_800
        assert int(batch.lengths.max()) <= 65_536
        assert 12_000 <= s / n <= 20_000
        per_tree = np.bincount(tree.tree_ids)
        depth = np.array([len(p) for p in tree_paths(tree)])
        if preset == "bushy":
            assert np.median(per_tree) >= 150 and depth.max() <= 64 and s / batch.compact_tokens >= 15
        else:
            assert np.median(per_tree) >= 60 and depth.max() >= 400


def test_tree_trajectories_caps_each_tree() -> None:
    cfg = synth.PRESETS["bushy"]
    tree = synth.generate_tree("bushy", 0, tree_trajectories=(5, 5), prefix_prob=0.0, duplicate_prob=0.0)
    # Each tree forks only while it has fewer than 5 chains; the last fork adds at most len(fanout).
    assert np.bincount(tree.tree_ids).max() <= 5 - 1 + len(cfg.fanout)
    assert len(tree.tree_ids) >= cfg.trajectories[0]
