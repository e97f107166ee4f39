"""States-mode CP attention's core (``cp_attention.rank_attention``) with the CUDA backends, in one
process (skipped without CUDA): every rank's queries over its key rows (gathered ancestors + own
rows, here indexed from the full tensors), bf16 inputs, against the one-process float32 reference on
the same (rounded) inputs; outputs and the q / k / v gradients summed over the ranks by relative
Frobenius error, as ``test_attention_gpu.py``. Needs no planner: random forests in DFS preorder
with long paths, cut into C = 4 ranks at random rows."""

import numpy as np
import pytest
import torch

from harts_runtime.layout.views import Branches, TreeOrder, build_views
from harts_runtime.ops.attention import available_backends, compact_attention
from harts_runtime.parallel.cp_attention import StatesAttentionPlan, rank_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL_BF16 = (
    2e-2  # relative Frobenius error of bf16 kernels against the float32 reference (as test_attention_gpu)
)
SHAPES = {"gqa": (8, 2, 128, 128), "mla": (4, 4, 192, 128)}  # Hq, Hkv, Dqk, Dv


def preorder_forest(n: int, seed: int) -> np.ndarray:
    """Parents of a random forest numbered in DFS preorder: each row continues the previous one
    (p = 0.97) or forks from one of its last 300 ancestors (or starts a new tree)."""
    rng = np.random.default_rng(seed)
    parent = np.full(n, -1, dtype=np.int64)
    path: list[int] = []
    for x in range(n):
        if path and rng.random() >= 0.97:  # a fork at most 300 rows back, or (1 in 20) a new tree
            cut = 0 if rng.random() < 0.05 else len(path) - int(rng.integers(1, min(len(path), 300) + 1))
            del path[cut:]
        parent[x] = path[-1] if path else -1
        path.append(x)
    return parent


def runs(parent: np.ndarray) -> Branches:
    n = len(parent)
    idx = np.arange(n)
    starts = idx[(parent != idx - 1) | (idx == 0)]
    return Branches(idx, np.append(starts, n))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("backend", ["varlen", "fa4", "flash_attn", "te", "sdpa", "flex_tree"])
def test_rank_attention_cuda_backends(backend, shape):
    if backend not in available_backends("cuda"):
        pytest.skip(f"backend {backend!r} unavailable here (not installed)")
    parent = preorder_forest(3000, 0)
    tree = TreeOrder.from_parent(parent)
    assert np.array_equal(tree.pre, np.arange(len(parent)))  # the generator numbers in preorder
    views = build_views(parent, runs(parent), tree).to("cuda")
    cuts = np.concatenate([[0], np.sort(np.random.default_rng(1).integers(0, 3001, 3)), [3000]])
    plan = StatesAttentionPlan.build(parent, cuts, end=tree.end)
    assert plan.stats()["gathered_max"] > 0
    hq, hkv, dqk, dv = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    leaves = [
        torch.randn(3000, h, d, device="cuda", generator=gen).to(torch.bfloat16)
        for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv))
    ]
    weight = torch.randn(3000, hq, dv, device="cuda", generator=gen)

    ref_in = [t.float().requires_grad_() for t in leaves]
    ref = compact_attention(*ref_in, views, backend="reference")
    (ref * weight).sum().backward()

    q, k, v = (t.clone().requires_grad_() for t in leaves)
    outs = []
    for r in range(plan.cp_size):
        lo, hi = plan.rank_rows(r)
        keys = torch.from_numpy(plan.key_rows(r)).cuda()
        o = rank_attention(q[lo:hi], k[keys], v[keys], plan, r, backend=backend)
        (o.float() * weight[lo:hi]).sum().backward()
        outs.append(o.detach())
    got = [torch.cat(outs), q.grad, k.grad, v.grad]
    want = [ref.detach()] + [t.grad for t in ref_in]
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        err = float((g.float() - w).norm() / w.norm().clamp_min(1e-12))
        assert torch.isfinite(g.float()).all() and err < TOL_BF16, (
            f"{backend} {name}: relative error {err:.3e}"
        )
