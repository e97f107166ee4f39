"""Attention under the states mode of context parallelism (gloo, 2 and 4 processes) against one
process: each rank holds its ``plan_cp`` row range, gathers the K / V (MLA: latent) rows its
queries see from the ranks holding them (``harts_runtime.parallel.cp_attention``), and its output
rows, its input rows' gradients and the weight gradients summed over the ranks equal the
one-process layer's on the whole microbatch (``compact_layout`` of the same call plan).

Layers: GQA (4 query / 2 KV heads), Qwen3.5's gated attention (q / k norms, partial RoPE, output
gate) and MLA (query latent, interleaved RoPE, Ling's output gate), float32, backends ``reference``
and ``sdpa``. Trees: a forest whose paths cross the cuts, fork on both sides of them and (at C = 4)
read rows from two ranks back; at C = 4 also hand-made cuts with a rank holding no rows.
"""

import numpy as np
import pytest
import torch

from harts_runtime.parallel import run_distributed

# float32, relative to each tensor's largest reference value (at least 1); only the summation order
# differs (measured under this test: 3.1e-7 rows, 9.3e-7 weight gradients summed over 4 ranks)
TOL_REL_ROWS = 1e-6  # the rank's output rows and its input rows' gradients
TOL_REL_WEIGHTS = 4e-6  # weight gradients summed over the ranks
BACKENDS = ("reference", "sdpa")


def _trajectories(seed: int) -> list[list[int]]:
    """Two trees (a 14-token prompt, 3 turns of 4-9 tokens, forks in 2 or 3) and a lone path."""
    rng = np.random.default_rng(seed)
    out = []
    for root in (1, 2):
        frontier = [[root] + rng.integers(3, 50, 13).tolist()]
        for _ in range(3):
            nxt = []
            for path in frontier:
                for _ in range(int(rng.integers(1, 4))):
                    nxt.append(path + rng.integers(3, 50, int(rng.integers(4, 10))).tolist())
            frontier = nxt
        out += frontier
    out.append([0] + rng.integers(3, 50, 30).tolist())
    return out


def _layers():
    from harts_runtime.layers.attention import AttentionConfig, CompactAttention
    from harts_runtime.layers.gated_attention import CompactGatedAttention, GatedAttentionConfig
    from harts_runtime.layers.mla import CompactMLA, MLAConfig

    torch.manual_seed(0)
    layers = {
        "gqa": CompactAttention(AttentionConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8)),
        "gated": CompactGatedAttention(
            GatedAttentionConfig(
                hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, partial_rotary_factor=0.5
            )
        ),
        "mla": CompactMLA(
            MLAConfig(
                hidden_size=32,
                num_heads=4,
                kv_lora_rank=12,
                qk_nope_head_dim=8,
                qk_rope_head_dim=4,
                v_head_dim=6,
                q_lora_rank=10,
                rope_interleave=True,
                output_gate=True,
            )
        ),  # fmt: skip
    }
    with torch.no_grad():
        for layer in layers.values():
            for p in layer.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return layers


def _setup(cp: int):
    import harts_planner as hp
    from harts_runtime.layout.rows import compact_layout
    from harts_runtime.parallel.cp_attention import StatesAttentionPlan

    batch = hp.RolloutBatch.from_token_lists(_trajectories(5))
    calls = hp.plan_calls(batch, 4)
    split = hp.plan_cp(batch, None, cp, 4, linear_cost=16, attention_cost=1)
    plan = StatesAttentionPlan.from_call_plan(batch, calls, split)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(plan.num_rows, 32, generator=g)
    dy = torch.randn(plan.num_rows, 32, generator=g)
    r2p = torch.from_numpy(np.asarray(calls.row_to_physical, dtype=np.int64))
    return plan, compact_layout(batch, calls), r2p, x, dy


def _one_process(layer, layout, r2p, x, dy, backend):
    """The one-process layer on the physical rows, in row numbering: output, input grad, weight grads."""
    inv = torch.empty_like(r2p)
    inv[r2p] = torch.arange(len(r2p))
    xp = x[inv].clone().requires_grad_()
    y = layer(xp, layout, backend=backend)[r2p]
    layer.zero_grad()
    (y * dy).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return y.detach(), xp.grad[r2p], grads


def _states(layer, plan, x, dy, backend, group):
    import torch.distributed as dist

    from harts_runtime.parallel.cp_attention import states_attention

    rank = dist.get_rank(group)
    lo, hi = plan.rank_rows(rank)
    xl = x[lo:hi].clone().requires_grad_()
    y = states_attention(layer, xl, plan, group, backend=backend)
    layer.zero_grad()
    (y * dy[lo:hi]).sum().backward()
    grads = {}
    for n, p in layer.named_parameters():
        gsum = torch.zeros_like(p) if p.grad is None else p.grad.clone()  # None: a rank holding no rows
        dist.all_reduce(gsum, group=group)
        grads[n] = gsum
    return y.detach(), xl.grad, grads


def _errors(got, ref, lo, hi):
    """Per tensor, (max absolute error, max absolute reference value) over this rank's rows (its
    outputs and input gradients) or the whole tensor (weight gradients, summed over the ranks)."""
    y, dx, grads = got
    y_ref, dx_ref, grads_ref = ref
    pairs = {"out": (y, y_ref[lo:hi]), "d_input": (dx, dx_ref[lo:hi])}
    pairs.update({f"d_{n}": (grads[n], grads_ref[n]) for n in grads_ref})
    return {
        k: ((a - b).abs().max().item(), b.abs().max().item()) if b.numel() else (0.0, 0.0)
        for k, (a, b) in pairs.items()
    }


def _worker(rank, world):
    import torch.distributed as dist

    from harts_runtime.parallel.cp_attention import StatesAttentionPlan

    group = dist.group.WORLD
    plan, layout, r2p, x, dy = _setup(world)
    plans = {"plan_cp": plan}
    if world == 4:  # hand-made cuts: rank 1 holds no rows, ranks 2 and 3 read from rank 0 only
        n = plan.num_rows
        cuts = [0, n // 2, n // 2, 3 * n // 4, n]
        plans["empty_rank"] = StatesAttentionPlan.build(
            plan.parent, cuts, positions=plan.positions, end=plan.end
        )
    errors = {}
    for layer_name, layer in _layers().items():
        for backend in BACKENDS:
            ref = _one_process(layer, layout, r2p, x, dy, backend="reference")
            for plan_name, p in plans.items():
                lo, hi = p.rank_rows(rank)
                got = _states(layer, p, x, dy, backend, group)
                errors[(layer_name, backend, plan_name)] = _errors(got, ref, lo, hi)
    return {"errors": errors, "stats": plan.stats(), "recv": [plan.recv_counts(r) for r in range(world)]}


def _check_tree_shape(plan):
    """The split cuts paths (some rank gathers rows), some rank holds a fork whose parent lives on an
    earlier rank, and (C >= 3) some rank reads rows of two earlier ranks."""
    gathered = [plan.gathered_rows(r) for r in range(plan.cp_size)]
    assert sum(g > 0 for g in gathered) >= plan.cp_size - 1, gathered
    forks_across = 0
    for r in range(1, plan.cp_size):
        lo, hi = plan.rank_rows(r)
        p = plan.parent[lo:hi]
        forks_across += int(((p >= 0) & (p < lo - 1)).sum())
    assert forks_across > 0
    if plan.cp_size >= 3:
        assert any(sum(c > 0 for c in plan.recv_counts(r)) >= 2 for r in range(plan.cp_size))


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_states_attention_matches_one_process(cp):
    plan = _setup(cp)[0]
    _check_tree_shape(plan)
    results = run_distributed(_worker, cp, timeout=240)
    worst = {}
    for r, res in enumerate(results):
        for key, errs in res["errors"].items():
            for name, (err, scale) in errs.items():
                kind = name if name in ("out", "d_input") else "d_weights"
                tol = TOL_REL_WEIGHTS if kind == "d_weights" else TOL_REL_ROWS
                assert err <= tol * max(scale, 1.0), (r, key, name, err, scale)
                worst[kind] = max(worst.get(kind, 0.0), err / max(scale, 1.0))
    assert results[0]["stats"]["gathered_total"] > 0
    print(f"cp={cp} {results[0]['stats']} worst relative errors {worst}")
