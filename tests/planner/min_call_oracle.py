"""Pure-Python oracles for the minimum-call planner (slow and obviously correct).

* :func:`brute_force_calls`: the minimum round count over *every* choice of direct
  continuations, each choice scheduled with earliest start (a new sequence runs one round
  after the sequence that outputs the row just before its anchor).
* :func:`check_plan`: an independent validity checker of a :class:`CallPlan` against the
  batch's own compact trie (``compact_map``, ``row_parent``, ``row_depth``); it does not use
  the planner's segment numbering except to cross-check it.
* :func:`tree_batch`: token trajectories realising a given segment tree, so that trees from
  the paper can be fed through :class:`RolloutBatch`.
* ``APPENDIX_A``: the three trees of the paper's Figures 6-8, reconstructed from their
  token counts, call numbers and replay labels.
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np

# ---------------------------------------------------------------------------------- trees


def anchor(p: int, b: int) -> int:
    return b * (p // b)


def parents_first(parent) -> list[int]:
    children = [[] for _ in parent]
    roots = []
    for v, p in enumerate(parent):
        (roots if p < 0 else children[p]).append(v)
    order, queue = [], deque(roots)
    while queue:
        v = queue.popleft()
        order.append(v)
        queue.extend(children[v])
    return order


def earliest_rounds(start, end, parent, direct, b) -> list[int]:
    """1-based round of every segment for fixed direct continuations (``direct[v]`` or -1)."""
    rounds = [0] * len(parent)
    for v in parents_first(parent):
        p = parent[v]
        if p >= 0 and direct[p] == v:
            rounds[v] = rounds[p]
            continue
        a = anchor(start[v], b)
        if a == 0:
            rounds[v] = 1
            continue
        w = p  # the segment outputting position a - 1 on v's path
        while a - 1 < start[w]:
            w = parent[w]
        rounds[v] = rounds[w] + 1
    return rounds


def eq15(end, children, b) -> int:
    """Mandatory replay R of Equation (15)."""
    return sum((len(ch) - 1) * (end[v] % b) for v, ch in enumerate(children) if ch)


def brute_force_calls(start, end, parent, children, b) -> int:
    """Minimum rounds over every direct-continuation choice (exactly one per internal segment);
    also asserts that the replay of every choice equals Equation (15)."""
    internal = [v for v, ch in enumerate(children) if ch]
    r15 = eq15(end, children, b)
    best = None
    for combo in itertools.product(*(children[v] for v in internal)):
        direct = [-1] * len(parent)
        for v, o in zip(internal, combo):
            direct[v] = o
        heads = [v for v in range(len(parent)) if parent[v] < 0 or direct[parent[v]] != v]
        assert sum(start[v] - anchor(start[v], b) for v in heads) == r15
        calls = max(earliest_rounds(start, end, parent, direct, b))
        best = calls if best is None else min(best, calls)
    return best


def choice_count(children) -> int:
    n = 1
    for ch in children:
        n *= max(1, len(ch))
    return n


def plan_tree(plan):
    """(start, end, parent, children) lists of a plan's segment forest."""
    start = plan.segment_start.tolist()
    end = plan.segment_end.tolist()
    parent = plan.segment_parent.tolist()
    children = [plan.children(v).tolist() for v in range(plan.num_segments)]
    return start, end, parent, children


def tree_batch(parent, lengths, extra_ends=()):
    """Token trajectories whose segment forest is the given tree (children in id order).

    Segment v gets ``lengths[v]`` tokens: its sibling rank + 1, then zeros, so siblings differ
    at their first token and sort in id order. One trajectory per leaf (in id order), plus one
    ending at each segment of ``extra_ends`` (needed for unary segments, which only exist
    where a trajectory ends). Returns (trajectories, leaf_of_trajectory)."""
    n = len(parent)
    rank = [0] * n
    count: dict[int, int] = {}
    for v in range(n):
        rank[v] = count.get(parent[v], 0)
        count[parent[v]] = rank[v] + 1
    has_child = [False] * n
    for v in range(n):
        if parent[v] >= 0:
            has_child[parent[v]] = True
    ends = [v for v in range(n) if not has_child[v]] + list(extra_ends)
    trajectories = []
    for v in ends:
        path = []
        while v >= 0:
            path.append(v)
            v = parent[v]
        pieces = []
        for u in reversed(path):
            seg = np.zeros(lengths[u], dtype=np.int32)
            seg[0] = rank[u] + 1
            pieces.append(seg)
        trajectories.append(np.concatenate(pieces))
    return trajectories, ends


def batch_from_trajectories(trajectories):
    from harts_planner import RolloutBatch

    lengths = np.array([len(t) for t in trajectories], dtype=np.int64)
    offsets = np.zeros(len(trajectories) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return RolloutBatch.from_arrays(np.concatenate(trajectories).astype(np.int32), offsets)


# ---------------------------------------------------------------------------------- checker


def _ancestor(row_parent, row_depth, row: int, depth: int) -> int:
    while row_depth[row] > depth:
        row = row_parent[row]
    return row


def check_plan(batch, plan, trajectories=None) -> None:
    """Assert that ``plan`` is a valid execution plan of the microbatch (see module doc)."""
    b = plan.chunk_size
    ids = list(range(batch.num_trajectories)) if trajectories is None else [int(i) for i in trajectories]
    cmap = batch.compact_map
    offsets = batch.offsets
    row_parent = batch.row_parent.tolist()
    row_depth = batch.row_depth.tolist()

    # Rows of the microbatch = distinct prefixes of its trajectories.
    glob = set()
    for i in ids:
        glob.update(cmap[offsets[i] : offsets[i + 1]].tolist())
    c = plan.compact_tokens
    assert c == len(glob) == batch.subset_work(ids)
    r2g = plan.row_to_global
    assert sorted(r2g.tolist()) == sorted(glob)
    p2r = plan.physical_to_row
    assert sorted(p2r.tolist()) == list(range(c))
    assert (plan.row_to_physical[p2r] == np.arange(c)).all()
    p2g = plan.physical_to_global
    assert (p2g == r2g[p2r]).all()
    depth = np.asarray(row_depth)[p2g] if c else np.zeros(0)
    assert (plan.position_ids == depth).all()

    # Semantic positions map to their compact rows.
    assert plan.trajectories.tolist() == ids
    so = plan.semantic_offsets
    for j, i in enumerate(ids):
        rows = p2g[plan.semantic_to_physical[so[j] : so[j + 1]]]
        assert (rows == cmap[offsets[i] : offsets[i + 1]]).all()

    # Sequences, rounds, rows output exactly once.
    q_count = plan.num_sequences
    k = plan.num_calls
    seq_round = plan.sequence_round.tolist()
    assert seq_round == sorted(seq_round)
    assert set(seq_round) == set(range(k))  # every round non-empty, rounds 0..K-1
    rso = plan.round_sequence_offsets.tolist()
    assert rso[0] == 0 and rso[-1] == q_count
    for r in range(k):
        assert all(seq_round[q] == r for q in range(rso[r], rso[r + 1]))
    spo = plan.sequence_physical_offsets.tolist()
    assert spo[0] == 0 and spo[-1] == c and all(x < y for x, y in zip(spo, spo[1:]))
    assert plan.round_physical_offsets.tolist() == [spo[x] for x in rso]
    written = np.zeros(c, dtype=np.int64)
    first_own = []
    anchor_of = []
    replay_total = 0
    for r in range(k):
        cu = plan.round_cu_seqlens(r).tolist()
        gather = plan.round_gather_index(r).tolist()
        outrow = plan.round_output_row(r).tolist()
        assert cu[0] == 0 and cu[-1] == len(gather) == len(outrow)
        assert len(cu) == rso[r + 1] - rso[r] + 1
        for i, q in enumerate(range(rso[r], rso[r + 1])):
            own = list(range(spo[q], spo[q + 1]))
            g_own = p2g[own].tolist()
            for x, y in zip(g_own, g_own[1:]):  # a path, in position order
                assert row_parent[y] == x
            s = row_depth[g_own[0]]
            a = anchor(s, b)
            first_own.append(g_own[0])
            anchor_of.append(a)
            assert plan.sequence_start[q] == s and plan.sequence_anchor[q] == a
            assert plan.sequence_replay_length[q] == s - a == s % b
            replay_total += s - a
            packed = gather[cu[i] : cu[i + 1]]
            outs = outrow[cu[i] : cu[i + 1]]
            assert len(packed) == (s - a) + len(own)
            for t in range(s - a):  # replay rows: the true ancestors at positions a..s-1
                assert outs[t] == -1
                assert p2g[packed[t]] == _ancestor(row_parent, row_depth, row_parent[g_own[0]], a + t)
            assert packed[s - a :] == own and outs[s - a :] == own
            written[own] += 1
            # Chain of segments: direct continuations whose rows are the sequence's rows.
            chain = plan.chain(q).tolist()
            seg_rows = []
            for x, y in zip(chain, chain[1:]):
                assert plan.segment_parent[y] == x and plan.direct_child[x] == y
            assert plan.direct_child[chain[-1]] == -1 and len(plan.children(chain[-1])) == 0
            for v in chain:
                pb = plan.segment_physical_begin[v]
                seg_rows.extend(range(pb, pb + plan.segment_end[v] - plan.segment_start[v]))
            assert seg_rows == own
            # Causal-conv contexts: true ancestors, never a neighbouring packed sequence.
            w1 = plan.conv_width - 1
            for t in range(w1):
                packed_ctx = (a - w1 + t, plan.conv_context[q, t])
                own_ctx = (s - w1 + t, plan.own_conv_context[q, t])
                for pos, got in (packed_ctx, own_ctx):
                    if pos < 0:
                        assert got == -1
                    else:
                        assert p2g[got] == _ancestor(row_parent, row_depth, row_parent[g_own[0]], pos)
    assert (written == 1).all()

    # Initial states: zero at anchor 0; otherwise a slot holding S_anchor, returned by a
    # sequence of an earlier round whose own rows hold the ancestor at anchor - 1 and whose
    # scan crosses the anchor (its own anchor is smaller), and listed in its requests.
    req = {}
    for i in range(len(plan.request_slot)):
        req[int(plan.request_slot[i])] = (
            int(plan.request_sequence[i]),
            int(plan.request_position[i]),
            int(plan.request_chunk[i]),
        )
    assert len(req) == plan.num_state_slots == len(plan.request_slot)
    consumed = set()
    for q in range(q_count):
        a = anchor_of[q]
        slot = int(plan.sequence_state_slot[q])
        if a == 0:
            assert slot == -1
            continue
        assert 0 <= slot < plan.num_state_slots
        consumed.add(slot)
        prod, pos, chunk = req[slot]
        assert pos == a and plan.slot_position[slot] == a and plan.slot_producer[slot] == prod
        assert seq_round[prod] < seq_round[q]
        assert anchor_of[prod] < a and chunk == (a - anchor_of[prod]) // b and (a - anchor_of[prod]) % b == 0
        last = _ancestor(row_parent, row_depth, row_parent[first_own[q]], a - 1)
        assert last in set(p2g[spo[prod] : spo[prod + 1]].tolist())
    assert consumed == set(range(plan.num_state_slots))  # no state is returned for nothing

    # Replay: R = sum of replays = Equation (15), on the plan's forest and on the batch trie.
    assert replay_total == plan.replay_tokens
    start, end, parent, children = plan_tree(plan)
    assert plan.replay_tokens == eq15(end, children, b)
    child_count: dict[int, int] = {}
    for row in glob:
        if row_parent[row] >= 0:
            child_count[row_parent[row]] = child_count.get(row_parent[row], 0) + 1
    assert plan.replay_tokens == sum((n - 1) * ((row_depth[row] + 1) % b) for row, n in child_count.items())
    # The DP's call count is the rounds used.
    assert k == max(int(plan.t_pre[v]) for v in plan.segment_roots.tolist())


# ---------------------------------------------------------------------------------- appendix A
# Each tree: (name, parent name or None, tokens), children listed in their figure numbering
# (a node's children are numbered when the node is visited in DFS), which is also the child
# order Algorithm 1 scans. extra_ends: segments where a trajectory ends although the tree
# continues (a unary segment).

CASE_I = dict(
    calls=3,
    replay=373,
    segments=[
        ("R1", None, 3),
        ("A1", "R1", 2),
        ("B1", "R1", 632),
        ("C1", "R1", 255),
        ("A2", "A1", 403),
        ("A3", "A1", 10),
        ("A4", "A3", 7753),
        ("A5", "A3", 21119),
        ("A6", "A4", 1355),
        ("A7", "A4", 2),
        ("A8", "A7", 1),
        ("A9", "A7", 3588),
        ("A10", "A8", 29628),
        ("A11", "A8", 3604),
        ("B2", "B1", 1),
        ("B3", "B1", 15),
        ("B4", "B2", 10),
        ("B5", "B2", 14),
        ("B6", "B4", 13),
        ("B7", "B4", 6),
        ("B8", "B7", 13),
        ("B9", "B7", 11),
        ("C2", "C1", 1),
        ("C3", "C1", 45),
        ("C4", "C2", 10),
        ("C5", "C2", 27),
        ("C6", "C4", 110),
        ("C7", "C4", 6),
        ("C8", "C6", 630),
        ("C9", "C6", 630),
        ("C10", "C7", 116),
        ("C11", "C7", 553),
        ("C12", "C10", 435),
        ("C13", "C10", 427),
        ("C14", "C5", 189),
        ("C15", "C5", 187),
    ],
    extra_ends=[],
    # Figure 6 caption: per call, member chains with their replay.
    rounds=[
        {
            ("R1", "A1", "A2"): 0,
            ("A3", "A4", "A6"): 5,
            ("A5",): 15,
            ("B1", "B2", "B4", "B6"): 3,
            ("C1", "C2", "C4", "C6", "C8"): 3,
        },
        {
            ("A7", "A8", "A10"): 24,
            ("A11",): 27,
            ("A9",): 26,
            ("B7", "B8"): 6,
            ("B9",): 12,
            ("B5",): 60,
            ("B3",): 59,
            ("C9",): 59,
            ("C7", "C10", "C12"): 13,
            ("C11",): 19,
            ("C5", "C14"): 3,
            ("C15",): 30,
            ("C3",): 2,
        },
        {("C13",): 7},
    ],
)

CASE_II = dict(
    calls=2,
    replay=813,
    segments=[
        ("R2", None, 3),
        ("D1", "R2", 2),
        ("E1", "R2", 633),
        ("F1", "R2", 256),
        ("D2", "D1", 399),
        ("D3", "D1", 16884),
        ("D4", "D3", 59),
        ("D5", "D3", 10346),
        ("D6", "D5", 133),
        ("D7", "D5", 6555),
        ("D8", "D7", 1902),
        ("D9", "D7", 70),
        ("E2", "E1", 1),
        ("E3", "E1", 1),
        ("E4", "E1", 15),
        ("E5", "E1", 15),
        ("E6", "E2", 2),
        ("E7", "E2", 15),
        ("E8", "E6", 13),
        ("E9", "E6", 14),
        ("E10", "E3", 15),
        ("E11", "E3", 15),
        ("E12", "E3", 16),
        ("E13", "E3", 15),
        ("E14", "E3", 15),
        ("E15", "E3", 14),
        ("F2", "F1", 1),
        ("F3", "F1", 1),
        ("F4", "F1", 170),
        ("F5", "F1", 445),
        ("F6", "F2", 2),
        ("F7", "F6", 220),
        ("F8", "F6", 212),
        ("F9", "F3", 155),
        ("F10", "F3", 346),
        ("F11", "F3", 1469),
        ("F12", "F3", 390),
        ("F13", "F3", 168),
        ("F14", "F3", 335),
        ("F15", "F3", 226),
        ("F16", "F5", 10),
        ("F17", "F5", 5),
    ],
    # F2 has the single child F6 in the figure: a unary segment, so a trajectory ends at F2.
    extra_ends=["F2"],
    rounds=[
        {
            ("R2", "D1", "D2"): 0,
            ("D3", "D5", "D7", "D8"): 5,
            ("E1", "E2", "E6", "E8"): 3,
            ("F1", "F5", "F16"): 3,
        },
        {
            ("D4",): 57,
            ("D6",): 35,
            ("D9",): 62,
            ("E9",): 63,
            ("E7",): 61,
            ("E3", "E10"): 60,
            ("E11",): 61,
            ("E12",): 61,
            ("E13",): 61,
            ("E14",): 61,
            ("E15",): 61,
            ("E4",): 60,
            ("E5",): 60,
            ("F2", "F6", "F7"): 3,
            ("F8",): 6,
            ("F3", "F9"): 3,
            ("F10",): 4,
            ("F11",): 4,
            ("F12",): 4,
            ("F13",): 4,
            ("F14",): 4,
            ("F15",): 4,
            ("F4",): 3,
            ("F17",): 0,
        },
    ],
)

_G_CHAIN = [
    ("G3", 13257),
    ("G4", 585),
    ("G6", 480),
    ("G8", 644),
    ("G10", 999),
    ("G12", 772),
    ("G14", 1527),
    ("G16", 116),
    ("G18", 39239),
    ("G20", 477),
    ("G22", 3247),
    ("G24", 838),
    ("G26", 909),
    ("G28", 2111),
    ("G30", 874),
    ("G32", 1773),
    ("G34", 1592),
]
_G_SIDE = [
    ("G5", 251),
    ("G7", 225),
    ("G9", 319),
    ("G11", 49),
    ("G13", 485),
    ("G15", 38),
    ("G17", 63),
    ("G19", 76),
    ("G21", 222),
    ("G23", 765),
    ("G25", 550),
    ("G27", 799),
    ("G29", 867),
    ("G31", 395),
    ("G33", 962),
    ("G35", 583),
]


def _case_iii_segments():
    segs = [
        ("R3", None, 3),
        ("G1", "R3", 2),
        ("H1", "R3", 633),
        ("I1", "R3", 256),
        ("G2", "G1", 397),
        ("G3", "G1", 13257),
    ]
    # G_{2i+1} has children G_{2i+2} (the chain) and G_{2i+3} (a side leaf).
    for (name, _), (nxt, nxt_len), (side, side_len) in zip(_G_CHAIN, _G_CHAIN[1:], _G_SIDE):
        segs += [(nxt, name, nxt_len), (side, name, side_len)]
    segs += [
        ("H2", "H1", 1),
        ("H3", "H1", 15),
        ("H4", "H1", 15),
        ("H5", "H2", 14),
        ("H6", "H2", 15),
        ("I2", "I1", 1),
        ("I3", "I1", 943),
        ("I4", "I1", 282),
        ("I5", "I2", 1243),
        ("I6", "I2", 410),
    ]
    return segs


CASE_III = dict(
    calls=2,
    replay=780,
    segments=_case_iii_segments(),
    extra_ends=[],
    rounds=[
        {
            ("R3", "G1", "G2"): 0,
            tuple(n for n, _ in _G_CHAIN): 5,
            ("H1", "H2", "H5"): 3,
            ("I1", "I2", "I5"): 3,
        },
        {
            ("G35",): 13,
            ("G33",): 32,
            ("G31",): 54,
            ("G29",): 55,
            ("G27",): 42,
            ("G25",): 36,
            ("G23",): 53,
            ("G21",): 24,
            ("G19",): 17,
            ("G17",): 29,
            ("G15",): 38,
            ("G13",): 34,
            ("G11",): 59,
            ("G9",): 55,
            ("G7",): 23,
            ("G5",): 14,
            ("H6",): 61,
            ("H3",): 60,
            ("H4",): 60,
            ("I6",): 4,
            ("I3",): 3,
            ("I4",): 3,
        },
    ],
)

APPENDIX_A = {"I": CASE_I, "II": CASE_II, "III": CASE_III}


def preorder(parent) -> list[int]:
    """Ids in DFS preorder, children in id order (the numbering RolloutBatch gives segments)."""
    children = [[] for _ in parent]
    roots = []
    for v, p in enumerate(parent):
        (roots if p < 0 else children[p]).append(v)
    out, stack = [], list(reversed(roots))
    while stack:
        v = stack.pop()
        out.append(v)
        stack.extend(reversed(children[v]))
    return out


def case_tree(case):
    """(names, parent ids, lengths, extra end ids) with ids in listing order."""
    names = [n for n, _, _ in case["segments"]]
    index = {n: i for i, n in enumerate(names)}
    assert len(index) == len(names)
    parent = [-1 if p is None else index[p] for _, p, _ in case["segments"]]
    assert all(p < v for v, p in enumerate(parent))
    lengths = [t for _, _, t in case["segments"]]
    return names, parent, lengths, [index[n] for n in case["extra_ends"]]
