"""Context parallelism in the planner (issue 35 items 1-2): ``plan_step(..., cp_size=C)`` packs
microbatches of up to C x T rows, and ``plan_cp`` splits one between C ranks. Property tests against a
brute-force oracle built from the token lists alone (the microbatch's distinct prefixes in lexicographic
order are its rows in DFS preorder)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import harts_planner as hp
from harts_planner import step_plan
from harts_planner.rpc import codec


# ---------------------------------------------------------------------------------- the oracle
class Trie:
    """Rows of a set of trajectories: every distinct prefix, sorted (= DFS preorder of the trie)."""

    def __init__(self, trajectories):
        prefixes = {tuple(t[: i + 1]) for t in trajectories for i in range(len(t))}
        self.rows = sorted(prefixes)
        index = {p: x for x, p in enumerate(self.rows)}
        self.pos = [len(p) - 1 for p in self.rows]
        self.pred = [index[p[:-1]] if len(p) > 1 else -1 for p in self.rows]

    def ancestor(self, x: int, q: int) -> int:
        """Row at position q on the path of row x (q <= pos(x)); -1 for q < 0."""
        if q < 0:
            return -1
        while self.pos[x] > q:
            x = self.pred[x]
        return x


def row_costs(trie: Trie, linear: int, attention: int) -> list[int]:
    return [linear + attention * (p + 1) for p in trie.pos]


def brute_force_best(trie: Trie, cp_size: int, chunk: int, linear: int, attention: int) -> int | None:
    """The least largest rank cost over every split with interior cuts on the grid (None: too many)."""
    n = len(trie.rows)
    prefix = np.concatenate([[0], np.cumsum(row_costs(trie, linear, attention))])
    points = [0] + [x for x in range(1, n) if trie.pos[x] % chunk == 0] + [n]
    if len(points) ** (cp_size - 1) > 50_000:
        return None
    best = None
    for cuts in itertools.combinations_with_replacement(points, cp_size - 1):
        bounds = [0, *cuts, n]
        worst = max(int(prefix[b] - prefix[a]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


def check_split(split: hp.CpSplit, trie: Trie, cp_size, chunk, conv_width, linear, attention):
    """Every guarantee of harts/cp_split.h against the oracle's rows."""
    n = len(trie.rows)
    w = conv_width - 1
    offsets = split.rank_row_offsets
    assert split.num_rows == n and len(offsets) == cp_size + 1 and offsets[0] == 0 and offsets[-1] == n
    assert (np.diff(offsets) >= 0).all()
    rank = split.rank_of(np.arange(n))
    # every compact row on exactly one rank
    assert np.array_equal(np.bincount(rank, minlength=cp_size), np.diff(offsets))
    # interior cuts on the chunk grid
    for x in offsets[1:-1]:
        assert x == n or trie.pos[x] % chunk == 0, (x, trie.pos[x])
    costs = np.array(row_costs(trie, linear, attention), dtype=np.int64)
    per_rank = np.array([costs[offsets[r] : offsets[r + 1]].sum() for r in range(cp_size)])
    assert np.array_equal(split.rank_cost, per_rank) and split.max_cost == per_rank.max()
    assert split.total_cost == costs.sum()
    # every entering row received once, with the state / replay / conv rows of its path
    entered = np.zeros(n, dtype=np.int64)
    for r in range(cp_size):
        for i in range(split.receive_offsets[r], split.receive_offsets[r + 1]):
            u = int(split.receive_row[i])
            assert split.receive_rank[i] == r and rank[u] < r
            s = trie.pos[u] + 1
            a = s - s % chunk
            assert split.receive_anchor[i] == a
            for x in split.entries(i):
                assert rank[x] == r and trie.pred[x] == u
                entered[x] += 1
            replay = split.replay(i).tolist()
            assert replay == [trie.ancestor(u, p) for p in range(a, s)]
            assert all(rank[x] < r for x in replay)
            conv = split.conv_context(i).tolist()
            assert conv == [trie.ancestor(u, p) for p in range(a - w, a)]
            assert all(rank[x] < r for x in conv if x >= 0)
            k = int(split.receive_state[i])
            if a == 0:
                assert k == -1
            else:  # produced by an earlier rank: the one holding the row at position a - 1
                assert split.state_row[k] == trie.ancestor(u, a - 1)
                assert split.state_position[k] == a and split.state_rank[k] == rank[split.state_row[k]] < r
                assert r in split.state_consumers(k)
    needs = np.array([trie.pred[x] >= 0 and rank[trie.pred[x]] < rank[x] for x in range(n)], dtype=np.int64)
    assert np.array_equal(entered, needs)
    # states: by row, grouped by producing rank, each handed to some rank after it
    assert (np.diff(split.state_row) > 0).all()
    for r in range(cp_size):
        for k in range(split.send_offsets[r], split.send_offsets[r + 1]):
            assert split.state_rank[k] == r
            consumers = split.state_consumers(k)
            assert len(consumers) and (consumers > r).all()
    assert split.send_offsets[-1] == split.num_states


@st.composite
def microbatches(draw):
    n = draw(st.integers(1, 5))
    trajectories = []
    for _ in range(n):
        if trajectories and draw(st.booleans()):  # fork from an earlier trajectory
            base = draw(st.sampled_from(trajectories))
            head = base[: draw(st.integers(0, len(base)))]
        else:
            head = []
        tail = draw(st.lists(st.integers(0, 2), min_size=1 if not head else 0, max_size=9))
        trajectories.append(head + tail if head + tail else [0])
    cp_size = draw(st.integers(1, 4))
    chunk = draw(st.integers(1, 5))
    conv_width = draw(st.integers(1, 4))
    linear = draw(st.integers(0, 20))
    attention = draw(st.integers(0, 3))
    if linear == attention == 0:
        linear = 1
    return trajectories, cp_size, chunk, conv_width, linear, attention


# ---------------------------------------------------------------------------------- the split
@settings(max_examples=150, deadline=None)
@given(microbatches())
def test_split_against_the_brute_force_oracle(case):
    trajectories, cp_size, chunk, conv_width, linear, attention = case
    batch = hp.RolloutBatch.from_token_lists(trajectories)
    split = hp.plan_cp(
        batch, None, cp_size, chunk, conv_width=conv_width, linear_cost=linear, attention_cost=attention
    )
    trie = Trie(trajectories)
    check_split(split, trie, cp_size, chunk, conv_width, linear, attention)
    # balance: exactly the best largest rank cost of any legal split (the stated bound is 0)
    best = brute_force_best(trie, cp_size, chunk, linear, attention)
    if best is not None:
        assert split.max_cost == best
    # same input, same split
    again = hp.plan_cp(
        batch, None, cp_size, chunk, conv_width=conv_width, linear_cost=linear, attention_cost=attention
    )
    assert again == split and again.to_dict() == split.to_dict()


@settings(max_examples=40, deadline=None)
@given(microbatches(), st.data())
def test_split_of_a_step_plans_microbatch(case, data):
    """A microbatch of a CP step plan: its rows are the call plan's rows (row_to_global)."""
    trajectories, cp_size, chunk, conv_width, *_ = case
    batch = hp.RolloutBatch.from_token_lists(trajectories)
    cap = data.draw(st.integers(max(len(t) for t in trajectories), 40))
    t = -(-cap // cp_size)  # ceil: C x T >= the longest trajectory
    plan = hp.plan_step(batch, 1, t, chunk, cp_size=cp_size, conv_width=conv_width)
    assert (plan.work <= cp_size * t).all() and plan.cp_size == cp_size and plan.capacity == t
    for m, members in enumerate(plan.microbatches):
        split = plan.cp_split(m)
        trie = Trie([trajectories[i] for i in members])
        check_split(split, trie, cp_size, chunk, conv_width, 8192, 1)
        calls = hp.plan_calls(batch, chunk, members, conv_width=conv_width)
        assert split.num_rows == calls.compact_tokens
        assert split == hp.plan_cp(batch, members[::-1], cp_size, chunk, conv_width=conv_width)


def test_a_fork_on_an_earlier_rank():
    """A 6-row prompt and two 3-row children, B = 4, unit costs: rows 0-7 | 8-11. Rank 1 continues the
    first child from S_8 (a grid cut) and starts the second from the prompt's S_4 on rank 0, replaying
    prompt rows 4 and 5."""
    batch = hp.RolloutBatch.from_token_lists([[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 10, 11, 12]])
    split = hp.plan_cp(batch, None, 2, 4, conv_width=2, linear_cost=1, attention_cost=0)
    assert split.rank_row_offsets.tolist() == [0, 8, 12]
    rank1 = split.rank(1)
    assert rank1["rows"] == [8, 12] and rank1["cost"] == 4
    assert rank1["receives"] == [
        {"row": 5, "anchor": 4, "state": 0, "from_rank": 0, "replay_rows": [4, 5], "conv_context": [3],
         "entry_rows": [9]},
        {"row": 7, "anchor": 8, "state": 1, "from_rank": 0, "replay_rows": [], "conv_context": [7],
         "entry_rows": [8]},
    ]  # fmt: skip
    assert split.rank(0)["sends"] == [
        {"state": 0, "row": 3, "position": 4, "to_ranks": [1]},
        {"state": 1, "row": 7, "position": 8, "to_ranks": [1]},
    ]


def test_long_agentic_trajectory_splits_over_ranks():
    """The issue's example: 100,000 tokens at T = 65,536 is refused at C = 1 and planned at C = 2, the
    path cut on the 64-row grid, near the attention-weighted balance point."""
    batch = hp.RolloutBatch.from_token_lists([list(range(1, 100_001))])
    with pytest.raises(hp.InvalidArgumentError, match="capacity T = 65536;"):
        hp.plan_step(batch, 1, 65536)
    plan = hp.plan_step(batch, 1, 65536, cp_size=2)
    split = plan.cp_split(0)
    cut = int(split.rank_row_offsets[1])
    assert cut % 64 == 0 and 50_000 < cut < 100_000  # attention pushes the cut past the middle
    assert split.state_rank.tolist() == [0] and split.state_position.tolist() == [cut]
    assert split.max_cost - split.rank_cost.min() <= 64 * (8192 + 100_000)  # within one chunk's cost


# ---------------------------------------------------------------------------------- cp_size in plan_step
@settings(max_examples=40, deadline=None)
@given(microbatches(), st.integers(1, 3))
def test_cp_step_plans_pack_c_times_t(case, dp_size):
    """cp_size = 1 is the plan without the option, field for field; cp_size = C is the plan of capacity
    C x T with capacity reported as T."""
    trajectories, cp_size, *_ = case
    batch = hp.RolloutBatch.from_token_lists(trajectories)
    t = max(len(x) for x in trajectories) + 2
    try:
        plain = hp.plan_step(batch, dp_size, t)
    except hp.InfeasibleError:
        return
    one = hp.plan_step(batch, dp_size, t, cp_size=1)
    assert one == plain and one.to_dict().keys() == plain.to_dict().keys()
    for f in step_plan.SCALAR_FIELDS:
        assert getattr(one._native, f) == getattr(plain._native, f), f
    for f in step_plan.ARRAY_FIELDS:
        assert getattr(one._native, f).tobytes() == getattr(plain._native, f).tobytes(), f
    wide = hp.plan_step(batch, dp_size, cp_size * t)
    cp = hp.plan_step(batch, dp_size, t, cp_size=cp_size)
    assert cp.capacity == t and cp.cp_size == cp_size and cp.microbatch_capacity == cp_size * t
    for f in step_plan.ARRAY_FIELDS:
        assert getattr(cp._native, f).tobytes() == getattr(wide._native, f).tobytes(), f
    assert cp.objective == wide.objective and cp.candidates == wide.candidates and cp.source == wide.source


def test_planner_client_and_codec_carry_cp_size():
    batch = hp.RolloutBatch.from_token_lists([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7], [8, 9]])
    local = hp.Planner().plan_step(batch, 1, 4, 2, cp_size=2)
    assert local == hp.plan_step(batch, 1, 4, 2, cp_size=2) and local.cp_size == 2
    # the request carries StepOptions.cp_size only when it is not 1 (a C = 1 request is as before)
    request = codec.plan_step_request(batch.segment_tree(), 1, 4, 2, {"cp_size": 2}, False, 4)
    assert request.options.cp_size == 2 and codec.decode_plan_step_request(request)["options"] == {
        "cp_size": 2
    }
    assert not codec.plan_step_request(batch.segment_tree(), 1, 4, 2, {}, False, 4).options.HasField(
        "cp_size"
    )
    # a plan survives the wire with its cp_size
    decoded = codec.decode_step_plan(codec.encode_step_plan(local), None, 0.0)
    assert decoded == local and decoded.cp_size == 2


# ---------------------------------------------------------------------------------- bad configurations
@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"cp_size": 0}, "cp_size", "must be in [1, 1024], got 0"),
        ({"cp_size": 1025}, "cp_size", "must be in [1, 1024], got 1025"),
        ({"cp_size": True}, "cp_size", ""),
        ({"cp_size": 2.0}, "cp_size", ""),
        ({"cp_size": 4, "capacity": 2**61}, "cp_size", "capacity x cp_size = 2305843009213693952 x 4"),
        (
            {"cp_size": 2, "capacity": 4},
            "trajectories[0]",
            "more than the microbatch capacity C x T = 2 x 4 = 8",
        ),
        ({"capacity": 4}, "trajectories[0]", "more than the microbatch capacity T = 4;"),
    ],
)
def test_bad_step_configurations_are_one_line(kwargs, field, fragment):
    batch = hp.RolloutBatch.from_token_lists([list(range(1, 10)), [1, 2]])
    args = {"dp_size": 1, "capacity": 8, **kwargs}
    with pytest.raises(hp.InvalidArgumentError) as e:
        hp.plan_step(batch, **args)
    assert e.value.field == field and fragment in str(e.value) and "\n" not in str(e.value)
    # the sidecar's admission check says exactly the same before planning
    options = {k: v for k, v in kwargs.items() if k == "cp_size"}
    if all(type(v) is int for v in options.values()):
        with pytest.raises(hp.InvalidArgumentError) as admitted:
            codec.check_step(batch.lengths, args["dp_size"], args["capacity"], options)
        assert (admitted.value.field, str(admitted.value)) == (e.value.field, str(e.value))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"cp_size": 0}, "cp_size"),
        ({"cp_size": 2000}, "cp_size"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"conv_width": 0}, "conv_width"),
        ({"linear_cost": -1}, "linear_cost"),
        ({"attention_cost": 2**21}, "attention_cost"),
        ({"linear_cost": 0, "attention_cost": 0}, "linear_cost"),
        ({"microbatch": [0, 7]}, "microbatch[1]"),
        ({"microbatch": [1, 1]}, "microbatch"),
        ({"microbatch": []}, "microbatch"),
        ({"batch": "tokens"}, "batch"),
    ],
)
def test_bad_split_configurations_are_one_line(kwargs, field):
    batch = hp.RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4]])
    args = {"batch": batch, "microbatch": None, "cp_size": 2, **kwargs}
    with pytest.raises(hp.InvalidArgumentError) as e:
        hp.plan_cp(**args)
    assert e.value.field == field and "\n" not in str(e.value)


def test_a_plan_from_a_sidecar_needs_the_batch_for_its_split():
    batch = hp.RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4]])
    plan = hp.plan_step(batch, 1, 4, cp_size=2)
    remote_like = codec.decode_step_plan(codec.encode_step_plan(plan), None, 0.0)
    with pytest.raises(hp.InvalidArgumentError) as e:
        remote_like.cp_split(0)
    assert e.value.field == "batch"
    with pytest.raises(hp.InvalidArgumentError) as e:
        plan.cp_split(1)
    assert e.value.field == "m"
