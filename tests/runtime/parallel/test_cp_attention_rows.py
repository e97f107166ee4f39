"""The host side of attention under the states mode of CP (``harts_runtime.parallel.cp_attention``),
in one process: which rows each rank gathers (against a brute-force oracle that walks every query's
parents), the all-to-all's split sizes, and each rank's re-indexed views, whose compact attention
over its key rows equals the one-process attention of its rows (every backend that runs here)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import forests, seeded

import harts_planner as hp
from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.rows import compact_layout
from harts_runtime.ops.attention import compact_attention
from harts_runtime.parallel.cp_attention import StatesAttentionPlan, needed_rows, rank_attention

TOL_ATTN = 2e-6  # absolute, float32 outputs of unit-scale q / k / v: only the summation order differs
TOL_ATTN_GRAD = (
    4e-6  # absolute, float32 q / k / v gradients (k / v summed over ranks in another order; 9.5e-7 seen)
)


def oracle_needed(parent, cuts) -> list[list[int]]:
    """Per rank, every ancestor below its first row of every one of its rows (walking parents)."""
    out = []
    for r in range(len(cuts) - 1):
        lo, hi = int(cuts[r]), int(cuts[r + 1])
        seen = set()
        for q in range(lo, hi):
            a = int(parent[q])
            while a >= 0:
                if a < lo:
                    seen.add(a)
                a = int(parent[a])
        out.append(sorted(seen))
    return out


def strict_ancestors(parent, x) -> list[int]:
    out, a = [], int(parent[x])
    while a >= 0:
        out.append(a)
        a = int(parent[a])
    return sorted(out)


def random_cuts(rng, n: int, c: int) -> np.ndarray:
    inner = np.sort(rng.integers(0, n + 1, size=c - 1))
    return np.concatenate([[0], inner, [n]]).astype(np.int64)


def tree_rows(trajectories):
    """(batch, call plan, plan over a trivial split) of a forest: parents in the call plan's rows."""
    batch = hp.RolloutBatch.from_token_lists(trajectories)
    calls = hp.plan_calls(batch, 4)
    return batch, calls


@settings(max_examples=60, deadline=None)
@given(forests(max_num=9, max_new=8), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_needed_rows_against_walking_parents_preorder(trajectories, c, seed):
    batch, calls = tree_rows(trajectories)
    r2g = np.asarray(calls.row_to_global, dtype=np.int64)
    gp = np.asarray(batch.row_parent, dtype=np.int64)[r2g]
    parent = np.where(gp < 0, -1, np.searchsorted(r2g, np.maximum(gp, 0)))
    cuts = random_cuts(np.random.default_rng(seed), len(parent), c)
    got = needed_rows(parent, cuts)
    assert [g.tolist() for g in got] == oracle_needed(parent, cuts)
    for r in range(c):  # preorder: exactly the strict ancestors of the rank's first row
        if cuts[r] < cuts[r + 1]:
            assert got[r].tolist() == strict_ancestors(parent, int(cuts[r]))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_needed_rows_against_walking_parents_any_topological_order(n, c, seed):
    """Any numbering with parent[x] < x (not preorder: a rank's needed rows are then a union of paths)."""
    rng = np.random.default_rng(seed)
    parent = np.array([-1 if x == 0 or rng.random() < 0.1 else int(rng.integers(0, x)) for x in range(n)])
    chain = rng.random(n) < 0.5  # runs of consecutive rows, as compact rows have
    parent = np.where(chain & (np.arange(n) > 0), np.arange(n) - 1, parent)
    cuts = random_cuts(rng, n, c)
    assert [g.tolist() for g in needed_rows(parent, cuts)] == oracle_needed(parent, cuts)


def test_split_sizes_and_send_index_agree():
    trajectories = seeded(3, num=10, max_new=9)
    batch, calls = tree_rows(trajectories)
    split = hp.plan_cp(batch, None, 4, 2, linear_cost=1, attention_cost=1)
    plan = StatesAttentionPlan.from_call_plan(batch, calls, split)
    c = plan.cp_size
    for r in range(c):
        assert plan.recv_counts(r) == [len(plan.recv_rows(r, s)) for s in range(c)]
        assert sum(plan.recv_counts(r)) == plan.gathered_rows(r)
        assert all(len(plan.recv_rows(r, s)) == 0 for s in range(r, c))  # only earlier ranks send
        assert np.array_equal(np.concatenate([plan.recv_rows(r, s) for s in range(c)]), plan.need[r])
    for s in range(c):
        counts = plan.send_counts(s)
        assert counts == [plan.recv_counts(r)[s] for r in range(c)]
        assert np.array_equal(
            plan.send_index(s) + plan.cuts[s], np.concatenate([plan.recv_rows(r, s) for r in range(c)])
        )
        index, recv, send = plan.exchange(s)
        assert (
            index.tolist() == plan.send_index(s).tolist() and recv == plan.recv_counts(s) and send == counts
        )
    stats = plan.stats()
    assert stats["gathered_total"] == sum(len(n) for n in plan.need) > 0


def _qkv(n, hq, hkv, dqk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, hq, dqk, generator=g),
        torch.randn(n, hkv, dqk, generator=g),
        torch.randn(n, hkv, dv, generator=g),
    )


@pytest.mark.parametrize("backend", ["reference", "sdpa", "dense_tree"])
@pytest.mark.parametrize("with_end", [True, False])
def test_rank_views_give_the_one_process_rows(backend, with_end):
    """Each rank's compact attention over its key rows (gathered ancestors + own rows, here indexed
    from the full tensors) equals one process's attention on its rows, at C = 1 .. 5 on trees whose
    paths cross the cuts and fork on both sides of them."""
    trajectories = seeded(7, num=12, max_new=10, new_tree_prob=0.2)
    batch, calls = tree_rows(trajectories)
    layout = compact_layout(batch, calls)
    r2p = torch.from_numpy(np.asarray(calls.row_to_physical, dtype=np.int64))
    n = layout.num_rows
    q, k, v = _qkv(n, 4, 2, 8, 6, 0)  # row numbering
    inv = torch.empty_like(r2p)
    inv[r2p] = torch.arange(n)
    ref = compact_attention(q[inv], k[inv], v[inv], layout.views, backend="reference")[r2p]
    crossed = 0
    for c in range(1, 6):
        split = hp.plan_cp(batch, None, c, 2, linear_cost=1, attention_cost=1)
        plan = StatesAttentionPlan.from_call_plan(batch, calls, split)
        if not with_end:
            plan = StatesAttentionPlan.build(plan.parent, plan.cuts, positions=plan.positions)
        for r in range(c):
            lo, hi = plan.rank_rows(r)
            keys = torch.from_numpy(plan.key_rows(r))
            m = plan.gathered_rows(r)
            crossed += m > 0
            q_pad = torch.cat([q.new_zeros(m, 4, 8), q[lo:hi]])
            out = compact_attention(q_pad, k[keys], v[keys], plan.rank_views(r), backend=backend)
            torch.testing.assert_close(out[m:], ref[lo:hi], atol=TOL_ATTN, rtol=0)
            assert torch.equal(plan.key_positions(r), torch.from_numpy(plan.positions[keys.numpy()]))
    assert crossed >= 4  # the cuts do cut paths


@pytest.mark.parametrize("backend", ["reference", "sdpa", "dense_tree", "auto"])
def test_rank_attention_gives_the_one_process_rows_forward_and_backward(backend):
    """rank_attention (local queries only for view backends, zero-padded for tree backends) on each
    rank's key rows equals one process's attention, and the q / k / v gradients summed over the
    ranks (k / v rows used by several ranks) equal one process's."""
    batch, calls = tree_rows(seeded(5, num=10, max_new=9))
    layout = compact_layout(batch, calls)
    r2p = torch.from_numpy(np.asarray(calls.row_to_physical, dtype=np.int64))
    n = layout.num_rows
    inv = torch.empty_like(r2p)
    inv[r2p] = torch.arange(n)
    q0, k0, v0 = _qkv(n, 4, 2, 8, 6, 3)
    dy = torch.randn(n, 4, 6, generator=torch.Generator().manual_seed(4))
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    ref = compact_attention(q[inv], k[inv], v[inv], layout.views, backend="reference")[r2p]
    (ref * dy).sum().backward()
    grads_ref = [t.grad for t in (q, k, v)]
    split = hp.plan_cp(batch, None, 4, 2, linear_cost=1, attention_cost=1)
    plan = StatesAttentionPlan.from_call_plan(batch, calls, split)
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    for r in range(4):
        lo, hi = plan.rank_rows(r)
        keys = torch.from_numpy(plan.key_rows(r))
        out = rank_attention(q[lo:hi], k[keys], v[keys], plan, r, backend=backend)
        torch.testing.assert_close(out, ref[lo:hi].detach(), atol=TOL_ATTN, rtol=0)
        (out * dy[lo:hi]).sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), grads_ref):
        torch.testing.assert_close(got, want, atol=TOL_ATTN_GRAD, rtol=0)
    with pytest.raises(InvalidInputError) as e:  # key rows of another rank
        r = max(range(4), key=plan.gathered_rows)
        lo, hi = plan.rank_rows(r)
        rank_attention(q[lo:hi], k[lo:hi], v[lo:hi], plan, r)
    assert e.value.field == "k/v"


def test_positions_are_the_call_plans():
    """from_call_plan's positions are the rows' depths (RoPE positions), its end the subtree ends."""
    batch, calls = tree_rows(seeded(11, num=8, max_new=7))
    split = hp.plan_cp(batch, None, 3, 2)
    plan = StatesAttentionPlan.from_call_plan(batch, calls, split)
    depth = np.array([len(strict_ancestors(plan.parent, x)) for x in range(plan.num_rows)])
    assert np.array_equal(plan.positions, depth)
    for x in range(plan.num_rows):  # end[x]: first later row that is not a descendant
        below = [y for y in range(x + 1, plan.num_rows) if x not in strict_ancestors(plan.parent, y)]
        assert plan.end[x] == (below[0] if below else plan.num_rows)


def test_bad_inputs_name_the_field():
    cases = [
        (lambda: needed_rows([-1, 1], [0, 2]), "parent"),
        (lambda: needed_rows([-1, -2], [0, 2]), "parent"),
        (lambda: needed_rows([-1, 0], [0, 1]), "cuts"),
        (lambda: needed_rows([-1, 0], [0, 2, 1, 2]), "cuts"),
        (lambda: needed_rows([-1, 0], [2]), "cuts"),
        (lambda: StatesAttentionPlan.build([-1, 0], [0, 2], positions=[0]), "positions"),
        (lambda: StatesAttentionPlan.build([-1, 0], [0, 2], end=[2, 2, 2]), "end"),
        (lambda: StatesAttentionPlan.build([-1, 0], [0, 1, 2]).key_positions(1), "positions"),
        # a hand-made plan whose needed rows miss an ancestor: refused, not a cycle in the views
        (
            lambda: StatesAttentionPlan(
                np.array([-1, 0, 1]), np.array([0, 2, 3]), ((), np.array([1]))
            ).rank_views(1),
            "need",
        ),
    ]
    for fn, field in cases:
        with pytest.raises(InvalidInputError) as e:
            fn()
        assert e.value.field == field and "\n" not in str(e.value)
    batch, calls = tree_rows([[1, 2, 3], [1, 2, 4]])
    other = hp.plan_cp(hp.RolloutBatch.from_token_lists([[1, 2]]), None, 2, 1)
    with pytest.raises(InvalidInputError) as e:
        StatesAttentionPlan.from_call_plan(batch, calls, other)
    assert e.value.field == "split"
