"""Seeded generator of synthetic agentic rollout forests.

A *rollout tree* is what one agentic task produces when several explorations share a prompt and an
early interaction history before diverging (paper Section 2.1). Every node of a tree is a *segment*
of one or more tokens; every root-to-leaf path is one training *trajectory*. :func:`generate` draws a
forest of such trees and returns all trajectories expanded and concatenated, as a trajectory-wise
trainer would receive them.

Generative model (one tree)
---------------------------
* The root segment is the prompt (length log-uniform in ``prompt_len``).
* A *chain* extends a node by a number of turns. Each turn is one segment: a tool output (probability
  ``tool_prob``, length log-uniform in ``tool_len``) or an agent turn (length log-uniform in
  ``turn_len``). The root starts the main chain with ``main_turns`` turns.
* Before each turn, a chain end at depth ``fork_min_depth`` or deeper forks with probability
  ``fork_prob``: ``k`` side branches (``P(k = i + 1) = fanout[i]``) start next to the chain's own
  continuation. A side branch opens with a short retry segment (probability ``retry_prob``, length
  uniform in ``retry_len``) that ends there with probability ``retry_leaf_prob``, or else with an
  ordinary turn; it then runs its own chain of ``side_turns`` turns, which may fork again.
* No root-to-leaf path has more than ``max_depth`` segments.

Segment lengths are never aligned to any chunk grid, so forks land anywhere inside a 64-token chunk.

Trie exactness
--------------
Segment tokens are uniform in ``[0, vocab_size)`` except that siblings get pairwise different first
tokens and distinct trees get pairwise different first tokens (after the optional
``shared_prefix_tokens`` common to every tree). Hence the token trie of the batch has exactly the
generated structure and the number of distinct token prefixes is
``shared_prefix_tokens + sum(segment lengths)``, reported as ``compact_tokens_expected``.

Emission order
--------------
Trees are emitted one after another; within a tree, trajectories follow a depth-first walk whose
child order is shuffled, so the batch is deterministic but not lexicographically sorted. Each
internal node also ends a trajectory with probability ``prefix_prob`` (a strict prefix of another
trajectory), and each leaf trajectory is repeated with probability ``duplicate_prob`` at a random
position inside its tree's block.

Presets
-------
``"tiny"`` (a few trees of tens of tokens, vocabulary 16, for unit tests), ``"small"`` (about 100
trajectories, 0.1-0.5M tokens), ``"medium"`` (about 500 trajectories, a few million tokens) and
``"swe-like"``, calibrated to the per-step scale of the paper's Table 2: 1.3k-2.3k trajectories,
about 40-60M tokens, S / C about 5-6 and about 26k tokens per trajectory, with trees of mostly
under 65,536 compact tokens (roughly one in ten is larger).

Two more step-sized presets cover tree shapes that ``swe-like`` does not: ``"bushy"`` (about 2k
trajectories in trees of 100-400, forking from the second segment on into up to 8 branches that
fork again, up to 64 segments deep, S / C about 20: most trees hold several T-sized microbatches of
interleaved branches) and ``"deep"`` (about 2k trajectories in trees of 20-200 whose paths run up to
600 short segments, forking rarely but all along them). Both keep every trajectory under 65,536
tokens and average 15-18k tokens per trajectory, so 100k trajectories of either stay under 2^31
tokens. Each tree stops forking once it has ``tree_trajectories`` chains.

Segment trees without tokens
----------------------------
:func:`generate_tree` grows the same forest (the same draws, so the same shape as :func:`generate`
for the same preset, seed and overrides) and returns it as a :class:`~harts_planner.SegmentTree`
(parent, length and trajectory end of every segment) without drawing a token: a 100k-trajectory
step of 2G tokens is a few MB. Siblings are ordered by segment id (creation order), which the
segment tree takes for their lexicographic order; :func:`generate` orders them by their random first
tokens instead, so the two batches rank trajectories differently.

Determinism: the same preset, seed and overrides give byte-identical arrays (one
``numpy.random.Generator(PCG64(seed))`` drives every draw).

Small random forests for tests
------------------------------
:func:`random_trajectories` is the one random-tree generator of the test suites (planner, sidecar,
runtime): each trajectory copies a random prefix of an earlier one and extends it, so forks inside
segments, prefix trajectories and exact duplicates all occur. It draws through three methods of
``rng`` only (``integers``, ``random``, ``shuffle``), so a ``numpy.random.Generator`` drives it in
seeded tests and hypothesis drives it, with shrinking, through an adapter (``tests/trees.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from harts_planner.batch import SegmentTree

__all__ = ["PRESETS", "SynthBatch", "SynthConfig", "generate", "generate_tree", "random_trajectories"]

IntRange = tuple[int, int]
ProgressFn = Callable[[int, int], None]

_MAX_VOCAB = 2**31 - 1  # token ids are stored as int32
_MAX_DEPTH = 100_000


@dataclass(frozen=True)
class SynthConfig:
    """Parameters of the rollout-forest model; ranges are inclusive ``(lo, hi)`` pairs of ints."""

    trees: IntRange
    """Number of trees. Drawn uniformly when ``trajectories`` is None, otherwise lower and upper
    bounds on the tree count reached while generating towards the trajectory target."""

    trajectories: IntRange | None
    """Target trajectory count, drawn uniformly; trees are added until the batch holds at least this
    many trajectories (the last tree may overshoot). None draws the tree count from ``trees``."""

    prompt_len: IntRange
    """Root (prompt) segment length, log-uniform."""

    main_turns: IntRange
    """Turns on the main chain that starts at the root, uniform."""

    side_turns: IntRange
    """Turns on the chain of a side branch after its first segment, uniform."""

    max_depth: int
    """Maximum number of segments on any root-to-leaf path (the root counts as one)."""

    fork_min_depth: int
    """Depth (segments from the root, the root being depth 1) below which no node forks, so every
    trajectory of a tree shares at least its first ``fork_min_depth`` segments."""

    fork_prob: float
    """Probability that a chain end at depth ``>= fork_min_depth`` forks before its next turn."""

    fanout: tuple[float, ...]
    """Weights of the side-branch count at a fork: ``fanout[i]`` for ``i + 1`` side branches
    (normalised to sum to one). A fork node has ``1 + k`` children: its continuation and ``k``
    side branches."""

    retry_prob: float
    """Probability that a side branch opens with a short retry segment."""

    retry_len: IntRange
    """Retry segment length, uniform (short: a handful of tokens)."""

    retry_leaf_prob: float
    """Probability that a retry segment is a leaf (otherwise its branch continues)."""

    tool_prob: float
    """Probability that a turn is a long tool output rather than a medium agent turn."""

    tool_len: IntRange
    """Tool-output segment length, log-uniform (thousands of tokens)."""

    turn_len: IntRange
    """Agent-turn segment length, log-uniform (tens to hundreds of tokens)."""

    prefix_prob: float
    """Probability that an internal node also ends a trajectory (a strict prefix of another one)."""

    duplicate_prob: float
    """Probability that a leaf trajectory is emitted a second time."""

    vocab_size: int = 157_184
    """Token ids are drawn from ``[0, vocab_size)``."""

    shared_prefix_tokens: int = 0
    """Length of a token prefix identical across all trees (for example a common system prompt)."""

    max_trajectory_tokens: int | None = None
    """Upper bound on every trajectory's length (shared prefix included); segments that would cross
    it are shortened and chains stop there. None: unbounded. A step planner with microbatch capacity
    T needs every trajectory to fit, so presets used at T = 65,536 set 65,536."""

    tree_trajectories: IntRange | None = None
    """Per-tree cap on forking, drawn uniformly per tree: a chain end forks only while its tree has
    fewer chains than the cap (every chain ends in a leaf, so the cap bounds a tree's leaves up to
    the last fork's branches). None: no cap (forks are bounded by ``max_depth`` and
    ``max_trajectory_tokens`` alone) and no draw, so presets without it are unchanged."""

    def __post_init__(self) -> None:
        for name in ("trees", "prompt_len", "main_turns", "side_turns", "retry_len", "tool_len", "turn_len"):
            _set(self, name, _int_range(self, name))
        for name in ("trajectories", "tree_trajectories"):
            if getattr(self, name) is not None:
                _set(self, name, _int_range(self, name))
        _set(self, "fanout", _weights(self.fanout))
        self._validate()

    def _validate(self) -> None:
        """Check every field against its limit.

        Raises
        ------
        ValueError
            Naming the first offending field and the limit it breaks.
        """
        _check(self.vocab_size, "vocab_size", 2, _MAX_VOCAB)
        _check_range(self.trees, "trees", 1, self.vocab_size)
        if self.trajectories is not None:
            _check_range(self.trajectories, "trajectories", 1, None)
        for name in ("prompt_len", "retry_len", "tool_len", "turn_len"):
            _check_range(getattr(self, name), name, 1, None)
        _check_range(self.main_turns, "main_turns", 0, None)
        _check_range(self.side_turns, "side_turns", 0, None)
        _check(self.max_depth, "max_depth", 1, _MAX_DEPTH)
        _check(self.fork_min_depth, "fork_min_depth", 1, self.max_depth)
        if len(self.fanout) + 1 > self.vocab_size:
            raise ValueError(
                f"fanout: {len(self.fanout) + 1} children at a fork exceed "
                f"vocab_size={self.vocab_size} distinct first tokens"
            )
        for name in (
            "fork_prob",
            "retry_prob",
            "retry_leaf_prob",
            "tool_prob",
            "prefix_prob",
            "duplicate_prob",
        ):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: must lie in [0, 1], got {value!r}")
        _check(self.shared_prefix_tokens, "shared_prefix_tokens", 0, None)
        if self.max_trajectory_tokens is not None:
            _check(self.max_trajectory_tokens, "max_trajectory_tokens", self.shared_prefix_tokens + 1, None)
        if self.tree_trajectories is not None:
            _check_range(self.tree_trajectories, "tree_trajectories", 1, None)


def _set(config: SynthConfig, name: str, value: object) -> None:
    """Normalise a field of a frozen config during ``__post_init__``."""
    object.__setattr__(config, name, value)


def _int_range(config: SynthConfig, name: str) -> IntRange:
    """Return field ``name`` as an ``(lo, hi)`` tuple of ints, or raise ValueError naming it."""
    value = getattr(config, name)
    try:
        lo, hi = value
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected an (lo, hi) pair, got {value!r}") from None
    return _as_int(lo, name), _as_int(hi, name)


def _as_int(value: object, name: str) -> int:
    """Return ``value`` as int, rejecting bools, floats and other non-integers."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    return int(value)


def _weights(value: Any) -> tuple[float, ...]:
    """Normalise the ``fanout`` weights to probabilities, or raise ValueError naming the field
    (``value`` may be anything: a non-iterable's TypeError becomes that ValueError)."""
    try:
        weights = tuple(float(w) for w in value)
    except (TypeError, ValueError):
        raise ValueError(f"fanout: expected a sequence of weights, got {value!r}") from None
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"fanout: weights must be finite, non-negative and not all zero, got {value!r}")
    total = sum(weights)
    return tuple(w / total for w in weights)


def _check(value: object, name: str, lo: int, hi: int | None) -> None:
    """Raise ValueError unless ``value`` is an int in ``[lo, hi]`` (``hi`` None: unbounded)."""
    number = _as_int(value, name)
    if number < lo or (hi is not None and number > hi):
        limit = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}: must be {limit}, got {number}")


def _check_range(value: IntRange, name: str, lo: int, hi: int | None) -> None:
    """Raise ValueError unless ``lo <= value[0] <= value[1] <= hi``."""
    _check(value[0], name, lo, hi)
    _check(value[1], name, lo, hi)
    if value[0] > value[1]:
        raise ValueError(f"{name}: lower bound {value[0]} exceeds upper bound {value[1]}")


PRESETS: dict[str, SynthConfig] = {
    "tiny": SynthConfig(
        trees=(2, 4),
        trajectories=None,
        prompt_len=(1, 6),
        main_turns=(1, 4),
        side_turns=(0, 1),
        max_depth=6,
        fork_min_depth=1,
        fork_prob=0.3,
        fanout=(0.6, 0.3, 0.1),
        retry_prob=0.4,
        retry_len=(1, 3),
        retry_leaf_prob=0.6,
        tool_prob=0.2,
        tool_len=(5, 12),
        turn_len=(1, 4),
        prefix_prob=0.2,
        duplicate_prob=0.2,
        vocab_size=16,
    ),
    "small": SynthConfig(
        trees=(4, 100),
        trajectories=(80, 120),
        prompt_len=(300, 1500),
        main_turns=(6, 14),
        side_turns=(0, 1),
        max_depth=24,
        fork_min_depth=5,
        fork_prob=0.32,
        fanout=(0.55, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01),
        retry_prob=0.55,
        retry_len=(1, 20),
        retry_leaf_prob=0.8,
        tool_prob=0.15,
        tool_len=(100, 3000),
        turn_len=(5, 100),
        prefix_prob=0.03,
        duplicate_prob=0.03,
    ),
    "medium": SynthConfig(
        trees=(10, 400),
        trajectories=(450, 550),
        prompt_len=(1000, 4000),
        main_turns=(8, 18),
        side_turns=(0, 1),
        max_depth=32,
        fork_min_depth=7,
        fork_prob=0.32,
        fanout=(0.55, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01),
        retry_prob=0.55,
        retry_len=(1, 20),
        retry_leaf_prob=0.8,
        tool_prob=0.13,
        tool_len=(300, 8000),
        turn_len=(10, 300),
        prefix_prob=0.01,
        duplicate_prob=0.01,
    ),
    "swe-like": SynthConfig(
        trees=(50, 1000),
        trajectories=(1280, 2250),
        prompt_len=(4000, 16_000),
        main_turns=(10, 22),
        side_turns=(0, 1),
        max_depth=48,
        fork_min_depth=9,
        fork_prob=0.32,
        fanout=(0.55, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01),
        retry_prob=0.55,
        retry_len=(1, 20),
        retry_leaf_prob=0.8,
        tool_prob=0.13,
        tool_len=(1000, 30_000),
        turn_len=(20, 800),
        prefix_prob=0.005,
        duplicate_prob=0.005,
        max_trajectory_tokens=65_536,
    ),
    "bushy": SynthConfig(
        trees=(4, 1000),
        trajectories=(1800, 2200),
        prompt_len=(1000, 6000),
        main_turns=(24, 48),
        side_turns=(2, 10),
        max_depth=64,
        fork_min_depth=2,
        fork_prob=0.4,
        fanout=(0.3, 0.25, 0.15, 0.1, 0.08, 0.06, 0.04, 0.02),
        retry_prob=0.3,
        retry_len=(1, 20),
        retry_leaf_prob=0.5,
        tool_prob=0.12,
        tool_len=(200, 4000),
        turn_len=(20, 300),
        prefix_prob=0.005,
        duplicate_prob=0.005,
        max_trajectory_tokens=65_536,
        tree_trajectories=(100, 400),
    ),
    "deep": SynthConfig(
        trees=(10, 1000),
        trajectories=(1800, 2200),
        prompt_len=(500, 4000),
        main_turns=(200, 500),
        side_turns=(20, 200),
        max_depth=600,
        fork_min_depth=3,
        fork_prob=0.05,
        fanout=(0.7, 0.2, 0.1),
        retry_prob=0.3,
        retry_len=(1, 20),
        retry_leaf_prob=0.5,
        tool_prob=0.05,
        tool_len=(50, 1000),
        turn_len=(5, 40),
        prefix_prob=0.005,
        duplicate_prob=0.005,
        max_trajectory_tokens=65_536,
        tree_trajectories=(20, 200),
    ),
}


@dataclass(frozen=True, eq=False)
class SynthBatch:
    """A generated batch of trajectories, concatenated.

    Attributes
    ----------
    tokens : np.ndarray, int32, shape [S]
        All trajectories back to back.
    offsets : np.ndarray, int64, shape [N + 1]
        Trajectory ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``; ``offsets[0] == 0`` and
        ``offsets[-1] == S``.
    tree_ids : np.ndarray, int64, shape [N]
        Index of the tree each trajectory belongs to; trajectories of one tree are consecutive.
    preset : str
        Preset name the batch was generated from.
    seed : int
        Seed of the generator.
    compact_tokens_expected : int
        Number of distinct token prefixes (unique trie nodes) of the batch, C.
    """

    tokens: np.ndarray
    offsets: np.ndarray
    tree_ids: np.ndarray
    preset: str
    seed: int
    compact_tokens_expected: int

    @property
    def semantic_tokens(self) -> int:
        """Total number of trajectory tokens S (semantic positions), ``offsets[-1]``."""
        return int(self.offsets[-1])


class _Forest:
    """Growing node table of all trees: parent, segment length and children of every node.

    INVARIANT: a node's id is larger than its parent's id, and the nodes of one tree are contiguous.
    """

    def __init__(self, max_path_len: int | None = None) -> None:
        self.max_path_len = max_path_len
        self.parent: list[int] = []
        self.length: list[int] = []
        self.path_len: list[int] = []  # tokens from the tree root through the node
        self.children: list[list[int]] = []

    def add(self, parent: int, length: int) -> int:
        """Append a segment of ``length`` tokens under ``parent`` (-1 for a root); return its id.

        The segment is shortened so that its path stays within ``max_path_len``; returns -1 (and
        adds nothing) when the parent's path is already that long."""
        if self.max_path_len is not None:
            length = min(length, self.max_path_len - (self.path_len[parent] if parent >= 0 else 0))
            if length <= 0:
                return -1
        node = len(self.parent)
        self.parent.append(parent)
        self.length.append(length)
        self.path_len.append(length + (self.path_len[parent] if parent >= 0 else 0))
        self.children.append([])
        if parent >= 0:
            self.children[parent].append(node)
        return node

    def path(self, node: int) -> list[int]:
        """Node ids from the tree root down to ``node``."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parent[node]
        return nodes[::-1]


def _uniform(rng: np.random.Generator, bounds: IntRange) -> int:
    """Integer uniform in ``[lo, hi]``."""
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _log_uniform(rng: np.random.Generator, bounds: IntRange) -> int:
    """Integer whose logarithm is uniform over ``[lo, hi + 1)``, clipped to ``[lo, hi]``."""
    value = math.exp(rng.uniform(math.log(bounds[0]), math.log(bounds[1] + 1)))
    return min(bounds[1], max(bounds[0], int(value)))


def _turn_length(rng: np.random.Generator, cfg: SynthConfig) -> int:
    """Length of one chain turn: a tool output or an agent turn."""
    if rng.random() < cfg.tool_prob:
        return _log_uniform(rng, cfg.tool_len)
    return _log_uniform(rng, cfg.turn_len)


def _start_side_branch(
    rng: np.random.Generator, cfg: SynthConfig, forest: _Forest, parent: int, depth: int
) -> tuple[int, int, int] | None:
    """Add the first segment of a side branch under ``parent`` (at ``depth``).

    Returns
    -------
    tuple[int, int, int]
        ``(node, depth, turns)``: the new chain end, its depth and the turns its chain still takes;
        None when the parent's path has reached ``max_trajectory_tokens``.
    """
    if rng.random() < cfg.retry_prob:
        node = forest.add(parent, _uniform(rng, cfg.retry_len))
        turns = 0 if rng.random() < cfg.retry_leaf_prob else _uniform(rng, cfg.side_turns)
    else:
        node = forest.add(parent, _turn_length(rng, cfg))
        turns = _uniform(rng, cfg.side_turns)
    return None if node < 0 else (node, depth + 1, turns)


def _grow_tree(rng: np.random.Generator, cfg: SynthConfig, forest: _Forest) -> int:
    """Add one rollout tree to ``forest``; return its root id."""
    root = forest.add(-1, _log_uniform(rng, cfg.prompt_len))
    chains = [(root, 1, _uniform(rng, cfg.main_turns))]
    cap = None if cfg.tree_trajectories is None else _uniform(rng, cfg.tree_trajectories)
    made = 1  # chains started in this tree
    while chains:
        node, depth, turns = chains.pop()
        for _ in range(turns):
            if depth >= cfg.max_depth:
                break
            if depth >= cfg.fork_min_depth and (cap is None or made < cap) and rng.random() < cfg.fork_prob:
                sides = 1 + int(rng.choice(len(cfg.fanout), p=cfg.fanout))
                branches = [_start_side_branch(rng, cfg, forest, node, depth) for _ in range(sides)]
                branches = [b for b in branches if b is not None]
                chains.extend(branches)
                made += len(branches)
            child = forest.add(node, _turn_length(rng, cfg))
            if child < 0:
                break
            node, depth = child, depth + 1
    return root


def _emission_order(rng: np.random.Generator, cfg: SynthConfig, forest: _Forest, root: int) -> list[int]:
    """End nodes of the tree's trajectories in emission order.

    A depth-first walk with shuffled children emits every leaf, and every internal node with
    probability ``prefix_prob``; each leaf is then repeated with probability ``duplicate_prob`` at a
    random position of the tree's block.
    """
    order: list[int] = []
    stack = [root]
    while stack:
        node = stack.pop()
        children = forest.children[node]
        if not children:
            order.append(node)
            continue
        if rng.random() < cfg.prefix_prob:
            order.append(node)
        stack.extend(children[i] for i in rng.permutation(len(children)))
    leaves = [node for node in order if not forest.children[node]]
    for node in leaves:
        if rng.random() < cfg.duplicate_prob:
            order.insert(int(rng.integers(0, len(order) + 1)), node)
    return order


def _grow_forest(rng: np.random.Generator, cfg: SynthConfig) -> tuple[_Forest, list[int], list[list[int]]]:
    """Grow all trees and fix each tree's trajectory order.

    Returns
    -------
    tuple
        ``(forest, roots, orders)``: the node table, the root id of every tree and, per tree, the end
        node of each trajectory in emission order.
    """
    if cfg.trajectories is None:
        min_trees = max_trees = _uniform(rng, cfg.trees)
        target = 0
    else:
        (min_trees, max_trees), target = cfg.trees, _uniform(rng, cfg.trajectories)
    cap = None if cfg.max_trajectory_tokens is None else cfg.max_trajectory_tokens - cfg.shared_prefix_tokens
    forest, roots, orders = _Forest(cap), [], []
    emitted = 0
    while len(roots) < max_trees and (len(roots) < min_trees or emitted < target):
        roots.append(_grow_tree(rng, cfg, forest))
        orders.append(_emission_order(rng, cfg, forest, roots[-1]))
        emitted += len(orders[-1])
    return forest, roots, orders


def _draw_segment_tokens(
    rng: np.random.Generator, cfg: SynthConfig, forest: _Forest, roots: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Draw the tokens of the shared prefix and of every segment.

    Returns
    -------
    pool : np.ndarray, int32, shape [C]
        The shared prefix followed by every segment's tokens in node order.
    starts : np.ndarray, int64, shape [num_nodes]
        Offset of each node's segment in ``pool``.
    """
    lengths = np.asarray(forest.length, dtype=np.int64)
    starts = cfg.shared_prefix_tokens + np.concatenate(([0], np.cumsum(lengths)[:-1]))
    total = cfg.shared_prefix_tokens + int(lengths.sum())
    pool = rng.integers(0, cfg.vocab_size, size=total, dtype=np.int32)
    pool[starts[roots]] = rng.choice(cfg.vocab_size, size=len(roots), replace=False)
    for children in forest.children:
        if len(children) > 1:
            pool[starts[children]] = rng.choice(cfg.vocab_size, size=len(children), replace=False)
    return pool, starts


def _assemble(
    cfg: SynthConfig,
    forest: _Forest,
    orders: list[list[int]],
    pool: np.ndarray,
    starts: np.ndarray,
    progress: ProgressFn | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Expand every trajectory into a preallocated token array.

    Returns
    -------
    tokens : np.ndarray, int32, shape [S]
    offsets : np.ndarray, int64, shape [N + 1]
    tree_ids : np.ndarray, int64, shape [N]
    """
    ends = [node for order in orders for node in order]
    tree_ids = np.repeat(np.arange(len(orders), dtype=np.int64), [len(o) for o in orders])
    lengths = cfg.shared_prefix_tokens + np.asarray([forest.path_len[n] for n in ends], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    tokens = np.empty(int(offsets[-1]), dtype=np.int32)
    shared = cfg.shared_prefix_tokens
    index = 0
    for tree, order in enumerate(orders):
        for node in order:
            pos = int(offsets[index])
            tokens[pos : pos + shared] = pool[:shared]
            pos += shared
            for segment in forest.path(node):
                start, length = int(starts[segment]), forest.length[segment]
                tokens[pos : pos + length] = pool[start : start + length]
                pos += length
            index += 1
        if progress is not None:
            progress(tree + 1, len(orders))
    return tokens, offsets, tree_ids


def _config(preset: str, seed: int, overrides: dict[str, object]) -> SynthConfig:
    """The preset's config with ``overrides`` applied, after checking the preset, seed and names."""
    if preset not in PRESETS:
        raise ValueError(f"preset: unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    _check(seed, "seed", 0, None)
    fields = {f.name for f in dataclasses.fields(SynthConfig)}
    for name in overrides:
        if name not in fields:
            raise ValueError(f"{name}: not a SynthConfig field; known fields: {sorted(fields)}")
    return dataclasses.replace(PRESETS[preset], **overrides)


def generate(
    preset: str = "swe-like", seed: int = 0, *, progress: ProgressFn | None = None, **overrides: object
) -> SynthBatch:
    """Generate a seeded batch of root-to-leaf trajectories from a synthetic rollout forest.

    Parameters
    ----------
    preset : str
        Key of :data:`PRESETS`: ``"tiny"``, ``"small"``, ``"medium"`` or ``"swe-like"``.
    seed : int
        Non-negative seed of ``numpy.random.Generator(PCG64(seed))``.
    progress : callable(done: int, total: int), optional
        Called after each tree's trajectories are written, with the trees done and the tree count.
    **overrides
        Replacement values for :class:`SynthConfig` fields.

    Returns
    -------
    SynthBatch
        ``tokens`` int32 [S], ``offsets`` int64 [N + 1], ``tree_ids`` int64 [N] and the exact
        number of distinct token prefixes ``compact_tokens_expected``.

    Raises
    ------
    ValueError
        For an unknown preset, a negative or non-integer seed, an unknown override name, or an
        override value outside its limit; the message names the preset, ``seed`` or the field.
    """
    cfg = _config(preset, seed, overrides)
    rng = np.random.Generator(np.random.PCG64(seed))
    forest, roots, orders = _grow_forest(rng, cfg)
    pool, starts = _draw_segment_tokens(rng, cfg, forest, roots)
    tokens, offsets, tree_ids = _assemble(cfg, forest, orders, pool, starts, progress)
    return SynthBatch(
        tokens=tokens,
        offsets=offsets,
        tree_ids=tree_ids,
        preset=preset,
        seed=seed,
        compact_tokens_expected=len(pool),
    )


def generate_tree(preset: str = "swe-like", seed: int = 0, **overrides: object) -> SegmentTree:
    """Generate the seeded rollout forest of :func:`generate` as a segment tree, drawing no tokens.

    Parameters
    ----------
    preset, seed, **overrides
        As for :func:`generate`; the forest's shape is the one :func:`generate` expands.

    Returns
    -------
    harts_planner.SegmentTree
        ``parent`` / ``length`` int32 [V] (a root segment of ``shared_prefix_tokens`` tokens above
        every tree when that is positive), ``trajectory_end`` int32 [N] in :func:`generate`'s
        trajectory order and ``tree_ids`` int64 [N]. Siblings are ordered by id. Trajectory ``i`` has
        the tokens of :func:`generate`'s trajectory ``i``; the tree's ``length.sum()`` is its
        ``compact_tokens_expected``.

    Raises
    ------
    ValueError
        As :func:`generate`, naming the preset, ``seed`` or the field.
    """
    cfg = _config(preset, seed, overrides)
    rng = np.random.Generator(np.random.PCG64(seed))
    forest, _, orders = _grow_forest(rng, cfg)
    parent = np.asarray(forest.parent, dtype=np.int64)
    length = np.asarray(forest.length, dtype=np.int64)
    ends = np.fromiter((node for order in orders for node in order), dtype=np.int64)
    if cfg.shared_prefix_tokens > 0:
        parent = np.concatenate(([-1], np.where(parent < 0, 0, parent + 1)))
        length = np.concatenate(([cfg.shared_prefix_tokens], length))
        ends = ends + 1
    tree_ids = np.repeat(np.arange(len(orders), dtype=np.int64), [len(o) for o in orders])
    return SegmentTree(parent, length, ends, tree_ids)


def random_trajectories(
    rng,
    num: int = 8,
    vocab: int = 5,
    max_new: int = 6,
    new_tree_prob: float = 0.15,
    *,
    min_new: int = 0,
    first_len: tuple[int, int] | None = None,
    tokens: Callable[[int], list[int]] | None = None,
) -> list[list[int]]:
    """Trajectories of a small random forest, for property tests and fuzzing.

    The first trajectory has ``first_len`` tokens (uniform in ``[lo, hi]``; default
    ``[2, max_new + 1]``). Each further one starts a new tree with probability ``new_tree_prob``
    (``1 .. max_new + 1`` tokens), or copies a prefix of ``1 .. len`` tokens of a uniformly chosen
    earlier trajectory and appends ``min_new .. max_new`` tokens. The list is shuffled at the end.

    Parameters
    ----------
    rng : numpy.random.Generator, or any object with ``integers(lo, hi[, size])`` (``hi``
        exclusive), ``random()`` and ``shuffle(list)``
    num : int
        Number of trajectories (>= 1).
    vocab : int
        New tokens are uniform in ``[0, vocab)``; a small vocabulary adds accidental sharing.
    tokens : callable, optional
        ``tokens(n)`` returns the ``n`` new tokens instead (e.g. ids never used before, so that the
        only sharing is the copied prefixes).

    Returns
    -------
    list of list of int
        ``num`` non-empty trajectories.
    """
    if num < 1:
        raise ValueError(f"num: must be >= 1, got {num}")
    draw_tokens = tokens or (lambda n: [int(x) for x in rng.integers(0, vocab, n)])
    lo, hi = first_len if first_len is not None else (2, max_new + 1)
    trajs = [draw_tokens(int(rng.integers(lo, hi + 1)))]
    while len(trajs) < num:
        if rng.random() < new_tree_prob:
            trajs.append(draw_tokens(int(rng.integers(1, 2 + max_new))))
            continue
        base = trajs[int(rng.integers(0, len(trajs)))]
        cut = int(rng.integers(1, len(base) + 1))
        trajs.append(base[:cut] + draw_tokens(int(rng.integers(min_new, max_new + 1))))
    rng.shuffle(trajs)
    return trajs
