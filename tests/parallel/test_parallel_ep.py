"""Expert-parallel MoE (EP2, all-to-all dispatch) on 2 gloo processes vs single-process CompactMoE.

Each rank feeds its own rows (a different microbatch, different row count, as two DP replicas of one
slot); outputs, router statistics and router gradients must equal the reference on those rows, and
each expert shard's gradient must equal the sum over both ranks' reference gradients of that shard.
"""

import copy

import pytest
import torch

from harts_runtime.layers.moe import CompactMoE, MoEConfig
from harts_runtime.layout import RowLayout
from harts_runtime.parallel.dims import ParallelConfigError
from harts_runtime.parallel.expert import ExpertParallelMoE
from harts_runtime.parallel.launch import run_distributed

CFGS = {
    "softmax": dict(
        hidden_size=16, num_experts=4, top_k=2, intermediate_size=8, aux_loss_coef=0.1, z_loss_coef=0.01
    ),
    "sigmoid-bias": dict(
        hidden_size=16,
        num_experts=8,
        top_k=3,
        intermediate_size=8,
        score_func="sigmoid",
        norm_topk_prob=True,
        use_expert_bias=True,
        aux_loss_coef=0.1,
    ),
    "grouped-shared-gated": dict(  # Kimi-Linear / Qwen3.5 routing: groups, shared expert, its gate
        hidden_size=16,
        num_experts=8,
        top_k=2,
        intermediate_size=8,
        score_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_expert_groups=4,
        topk_groups=2,
        num_shared_experts=1,
        shared_expert_gate=True,
        aux_loss_coef=0.1,
    ),
}
ROWS = (11, 5)


def _data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    n = ROWS[rank]
    x = torch.randn(n, 16, generator=g, dtype=torch.float64)
    q = torch.randint(1, 4, (n,), generator=g).double()
    w = torch.randn(n, 16, generator=g, dtype=torch.float64)
    return x, q, w


def _run(moe, x, q, w):
    xr = x.clone().requires_grad_(True)
    out = moe(xr, RowLayout(q.numel(), multiplicity=q))
    ((out.hidden * w).sum() + out.router_loss).backward()
    return out, xr.grad


def _ep_worker(rank, world, name):
    import torch.distributed as dist

    torch.manual_seed(0)
    ref = CompactMoE(MoEConfig(**CFGS[name])).double()
    if ref.config.use_expert_bias:
        ref.expert_bias.copy_(torch.linspace(-0.05, 0.05, ref.config.num_experts))
    ep = ExpertParallelMoE.from_dense(copy.deepcopy(ref), dist.group.WORLD, rank, world)
    x, q, w = _data(rank)
    out, dx = _run(ep, x, q, w)
    return {
        "hidden": out.hidden.detach(),
        "router_loss": out.router_loss.detach(),
        "dx": dx,
        "counts": ep.local_tokens_per_expert.clone(),
        "grads": {n: p.grad for n, p in ep.named_parameters()},
        "expert_flags": {n: getattr(p, "_harts_expert", False) for n, p in ep.named_parameters()},
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CFGS))
def test_expert_parallel_moe_matches_single_process(name):
    res = run_distributed(_ep_worker, 2, name, timeout=60)
    tol = dict(rtol=1e-10, atol=1e-10)
    torch.manual_seed(0)
    base = CompactMoE(MoEConfig(**CFGS[name])).double()
    if base.config.use_expert_bias:
        base.expert_bias.copy_(torch.linspace(-0.05, 0.05, base.config.num_experts))
    ref_grads = []
    for rank in range(2):
        ref = copy.deepcopy(base)
        out, dx = _run(ref, *_data(rank))
        r = res[rank]
        torch.testing.assert_close(r["hidden"], out.hidden.detach(), **tol)
        torch.testing.assert_close(r["router_loss"], out.router_loss.detach(), **tol)
        torch.testing.assert_close(r["dx"], dx, **tol)
        torch.testing.assert_close(r["counts"], ref.local_tokens_per_expert)
        torch.testing.assert_close(r["grads"]["router"], ref.router.grad, **tol)
        for n, p in ref.named_parameters():  # shared experts and their gate: replicated, own rows
            if n.startswith("shared_"):
                assert not r["expert_flags"][n]
                torch.testing.assert_close(r["grads"][n], p.grad, **tol, msg=lambda m, n=n: f"d{n}: {m}")
        ref_grads.append({n: p.grad for n, p in ref.named_parameters()})
    el = base.config.num_experts // 2
    for rank in range(2):
        for n in ("w_gate", "w_up", "w_down"):
            assert res[rank]["expert_flags"][n] and not res[rank]["expert_flags"]["router"]
            want = (ref_grads[0][n] + ref_grads[1][n])[rank * el : (rank + 1) * el]
            torch.testing.assert_close(res[rank]["grads"][n], want, **tol, msg=lambda m, n=n: f"d{n}: {m}")


def test_ep_must_divide_experts():
    moe = CompactMoE(MoEConfig(hidden_size=8, num_experts=3, top_k=1, intermediate_size=4))
    with pytest.raises(ParallelConfigError) as e:
        ExpertParallelMoE.from_dense(moe, None, 0, 2)
    assert e.value.field == "ep"
