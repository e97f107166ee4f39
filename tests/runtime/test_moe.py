"""Compact MoE routing against trajectory-wise MoE on the expanded batch (CPU).

Compact: one routing decision and expert computation per compact row, statistics weighted by the
multiplicity q_c. Expanded: the same module on all S semantic rows with weight one each. Outputs,
router z-loss, load-balancing loss, expert-load counts, expert-bias updates and all gradients agree;
both expert paths (grouped matmul and the per-expert loop) are checked.
"""

import numpy as np
import pytest
import torch

from harts_runtime.layers.moe import CompactMoE, MoEConfig, grouped_mm, route
from harts_runtime.layout import RowLayout
from harts_runtime.testing import random_batch


def rows(q: torch.Tensor) -> RowLayout:
    """A layout that only carries the multiplicities ``q`` (what the MoE reads)."""
    return RowLayout(q.numel(), multiplicity=q)


CONFIGS = {
    "softmax": {"score_func": "softmax"},
    "softmax_scaled": {"score_func": "softmax", "norm_topk_prob": True, "routed_scaling_factor": 2.5},
    "sigmoid_bias": {"score_func": "sigmoid", "norm_topk_prob": True, "use_expert_bias": True},
}


def make(config: str, grouped: bool, seed: int = 0) -> CompactMoE:
    torch.manual_seed(seed)
    moe = CompactMoE(
        MoEConfig(
            hidden_size=16,
            num_experts=8,
            top_k=3,
            intermediate_size=12,
            grouped=grouped,
            aux_loss_coef=0.7,
            z_loss_coef=0.3,
            **CONFIGS[config],
        )
    )
    if moe.config.use_expert_bias:
        moe.expert_bias.normal_(0.0, 0.05)
    return moe


def run(moe, hidden, sem, weights, compact: bool):
    """Forward + a loss mixing outputs (per semantic position) and router losses.

    compact: the module on the C rows with multiplicities, outputs gathered to semantic positions;
    expanded: the module on the S gathered rows, unweighted (trajectory-wise training).
    Returns the MoEOutput and the gradients of the compact rows and of every parameter.
    """
    moe.zero_grad()
    hidden.grad = None
    if compact:
        q = torch.bincount(sem, minlength=hidden.shape[0])
        out = moe(hidden, rows(q))
        picked = out.hidden[sem]
    else:
        out = moe(hidden[sem])
        picked = out.hidden
    ((picked * weights).sum() + out.router_loss).backward()
    return out, {"hidden": hidden.grad.clone(), **{n: p.grad.clone() for n, p in moe.named_parameters()}}


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_compact_routing_matches_expanded(config, grouped, seed):
    batch = random_batch(20 + seed, num=12)
    moe = make(config, grouped, seed)
    sem = torch.from_numpy(batch.compact_map.astype(np.int64))
    assert torch.equal(torch.bincount(sem), torch.from_numpy(batch.multiplicity.astype(np.int64)))
    hidden = torch.randn(batch.compact_tokens, 16, requires_grad=True)
    weights = torch.randn(batch.semantic_tokens, 16)

    compact, g_compact = run(moe, hidden, sem, weights, compact=True)
    expanded, g_expanded = run(moe, hidden, sem, weights, compact=False)

    assert torch.equal(compact.topk_idx[sem], expanded.topk_idx)
    torch.testing.assert_close(compact.hidden[sem], expanded.hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compact.z_loss, expanded.z_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compact.aux_loss, expanded.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compact.tokens_per_expert, expanded.tokens_per_expert, rtol=0, atol=0)
    assert float(compact.tokens_per_expert.sum()) == batch.semantic_tokens * moe.config.top_k
    for name, g in g_compact.items():
        torch.testing.assert_close(g, g_expanded[name], rtol=1e-4, atol=1e-5, msg=f"d{name}")


def test_multiplicity_weights_are_not_a_shortcut():
    """Unweighted compact statistics differ from the expanded ones whenever rows are shared."""
    batch = random_batch(3, num=12)
    assert batch.compression > 1.2
    moe = make("softmax", True)
    hidden = torch.randn(batch.compact_tokens, 16)
    sem = torch.from_numpy(batch.compact_map.astype(np.int64))
    unweighted, expanded = moe(hidden), moe(hidden[sem])
    assert not torch.allclose(unweighted.tokens_per_expert, expanded.tokens_per_expert)
    assert not torch.allclose(unweighted.z_loss, expanded.z_loss)


def test_grouped_and_loop_paths_agree_in_float64_and_float32():
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        outs = []
        for grouped in (True, False):
            moe = make("sigmoid_bias", grouped).to(dtype)
            hidden = torch.randn(
                40, 16, dtype=dtype, generator=torch.Generator().manual_seed(5), requires_grad=True
            )
            out = moe(hidden, rows(torch.arange(40) % 3))
            (out.hidden.square().sum() + out.router_loss).backward()
            outs.append([out.hidden.detach(), hidden.grad] + [p.grad for p in moe.parameters()])
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("impl", ["grouped_mm", "bmm"])
def test_grouped_mm_matches_per_group_matmul(impl):
    if impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not available")
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1, 0, 7])
    x = torch.randn(int(counts.sum()), 8, generator=gen, requires_grad=True)
    w = torch.randn(6, 8, 4, generator=gen, requires_grad=True)
    out = grouped_mm(x, w, counts, impl=impl)
    g = torch.randn_like(out)
    out.backward(g)
    pieces = x.detach().split(counts.tolist())
    ref = torch.cat([p @ w.detach()[e] for e, p in enumerate(pieces)])
    torch.testing.assert_close(out, ref)
    gx = torch.cat([gp @ w.detach()[e].t() for e, gp in enumerate(g.split(counts.tolist()))])
    gw = torch.stack([p.t() @ gp for p, gp in zip(pieces, g.split(counts.tolist()))])
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(w.grad, gw)


def test_padding_rows_with_zero_multiplicity_add_nothing():
    batch = random_batch(8, num=10)
    moe = make("softmax", True)
    hidden = torch.randn(batch.compact_tokens, 16)
    q = torch.from_numpy(batch.multiplicity.astype(np.int64))
    padded = moe(torch.cat([hidden, torch.randn(4, 16)]), rows(torch.cat([q, torch.zeros(4, dtype=q.dtype)])))
    plain = moe(hidden, rows(q))
    torch.testing.assert_close(padded.z_loss, plain.z_loss)
    torch.testing.assert_close(padded.aux_loss, plain.aux_loss)
    torch.testing.assert_close(padded.tokens_per_expert, plain.tokens_per_expert)


def test_expert_bias_update_equals_expanded_training():
    batch = random_batch(6, num=12)
    sem = torch.from_numpy(batch.compact_map.astype(np.int64))
    q = torch.from_numpy(batch.multiplicity.astype(np.int64))
    hidden = torch.randn(batch.compact_tokens, 16, generator=torch.Generator().manual_seed(1))
    compact, expanded = make("sigmoid_bias", True), make("sigmoid_bias", True)
    for _ in range(3):  # accumulate over three micro-steps, then update
        compact(hidden, rows(q))
        expanded(hidden[sem])
    assert torch.equal(compact.local_tokens_per_expert, expanded.local_tokens_per_expert)
    counts = compact.update_expert_bias()
    expanded.update_expert_bias()
    assert float(counts.sum()) == 3 * batch.semantic_tokens * 3
    assert torch.equal(compact.expert_bias, expanded.expert_bias)
    assert not compact.local_tokens_per_expert.any()


def test_topk_ties_go_to_the_lower_expert():
    logits = torch.zeros(2, 6)
    logits[1, 4] = 1.0
    _, idx, _weight = route(logits, 3)
    assert idx.tolist() == [[0, 1, 2], [4, 0, 1]]
    _, idx, _ = route(logits, 2, expert_bias=torch.tensor([0.0, 0.0, 0.0, 0.5, 0.0, 0.0]))
    assert idx.tolist() == [[3, 0], [3, 4]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_path_on_cuda_bf16():
    """On CUDA (bf16, SM90) the grouped path uses torch._grouped_mm; it agrees with the loop."""
    import copy

    from harts_runtime.layers.moe import _grouped_mm_ok

    torch.manual_seed(0)
    base = (
        CompactMoE(
            MoEConfig(
                hidden_size=256,
                num_experts=16,
                top_k=4,
                intermediate_size=128,
                aux_loss_coef=0.01,
                z_loss_coef=0.001,
            )
        )
        .cuda()
        .to(torch.bfloat16)
    )
    x = torch.randn(3000, 256, device="cuda").to(torch.bfloat16)
    q = torch.randint(0, 4, (3000,), device="cuda")
    outs = []
    for grouped in (True, False):
        moe = copy.deepcopy(base)
        moe.config.grouped = grouped
        hidden = x.clone().requires_grad_()
        out = moe(hidden, rows(q))
        (out.hidden.float().square().mean() + out.router_loss).backward()
        outs.append([out.hidden, hidden.grad, moe.w_gate.grad, moe.w_down.grad, moe.router.grad])
    if hasattr(torch, "_grouped_mm"):
        assert _grouped_mm_ok(x, base.w_gate)
    for a, b in zip(*outs):
        err = float((a.float() - b.float()).norm() / b.float().norm())
        assert err < 2e-2, err
