"""GPU-only attention backends against the float32 reference (skipped without CUDA).

Backends: ``varlen`` (torch.nn.attention.varlen), ``fa4``, ``flash_attn`` and ``te`` (when installed),
``flex_tree`` (FlexAttention with the tree-ancestor mask; its backward does not run on CPU), plus
``sdpa`` / ``dense_tree`` on CUDA. Inputs are bfloat16; the oracle is the per-branch reference in
float32 on the same (rounded) inputs. Outputs and q/k/v gradients are compared by relative
Frobenius error, which is stable for bf16 kernels. MLA-shaped cases use Dqk = 192 != Dv = 128.
"""

import numpy as np
import pytest
import torch

from harts_runtime.layers.mla import CompactMLA, MLAConfig
from harts_runtime.layout import RowLayout
from harts_runtime.ops.attention import BACKENDS, available_backends, compact_attention
from harts_runtime.testing import random_batch, synthetic_tree_batch, views_from_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():  # flex_tree compiles once per (rows, shape): allow more than 8 graphs
    import torch._dynamo as dynamo

    dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
    if hasattr(dynamo.config, "recompile_limit"):
        dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)

GPU_BACKENDS = ["varlen", "fa4", "flash_attn", "te", "flex_tree", "sdpa", "dense_tree"]
SHAPES = {  # Hq, Hkv, Dqk, Dv
    "mha": (8, 8, 64, 64),
    "gqa": (8, 2, 128, 128),
    "mla": (4, 4, 192, 128),
    "mla_small": (4, 4, 96, 64),
}
CASES = {
    "random_forest": lambda: random_batch(3, num=24, vocab=3, max_new=40),
    "agentic_tree": lambda: synthetic_tree_batch(
        1, prompt=700, turns=4, turn_len=(40, 300), fork_prob=0.6, fanout=3
    ),
}
_CACHE: dict = {}


def case(name):
    if name not in _CACHE:
        batch = CASES[name]()
        _CACHE[name] = (batch, views_from_batch(batch).to("cuda"))
    return _CACHE[name]


def need(backend):
    if backend not in available_backends("cuda"):
        pytest.skip(f"backend {backend!r} unavailable here (not installed)")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def run(backend, views, leaves, weight):
    """Forward + weighted-sum backward; returns (out, dq, dk, dv) detached."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = compact_attention(*leaves, views, backend=backend)
    (out.float() * weight).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_backend_matches_reference(backend, shape, case_name):
    need(backend)
    if backend == "dense_tree" and case_name == "agentic_tree":
        pytest.skip("dense [C, C] mask: small cases only")
    batch, views = case(case_name)
    hq, hkv, dqk, dv = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    c = batch.compact_tokens
    leaves = [
        torch.randn(c, h, d, device="cuda", generator=gen).to(torch.bfloat16)
        for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv))
    ]
    weight = torch.randn(c, hq, dv, device="cuda", generator=gen)
    ref = run("reference", views, [t.float() for t in leaves], weight)
    got = run(backend, views, leaves, weight)
    for name, g, r in zip(["out", "dq", "dk", "dv"], got, ref):
        assert g.shape == r.shape, name
        assert torch.isfinite(g.float()).all(), name
        assert rel_err(g, r) < 2e-2, f"{backend} {name}: relative error {rel_err(g, r):.3e}"


@pytest.mark.parametrize("backend", ["varlen", "fa4", "flash_attn", "te", "flex_tree"])
def test_gpu_backend_on_remapped_rows_with_padding(backend):
    """A call-plan style physical layout (permuted rows + padding rows) gives the same real rows."""
    need(backend)
    batch, views = case("random_forest")
    c, pad = batch.compact_tokens, 37
    perm = torch.from_numpy(np.random.default_rng(0).permutation(c + pad)[:c]).cuda()
    phys = views.remap(perm, c + pad)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(c, 4, 64, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    place = lambda x: x.new_zeros((c + pad,) + x.shape[1:]).index_copy(0, perm, x)
    ref = compact_attention(q.float(), k.float(), v.float(), views, backend="reference")
    out = compact_attention(place(q), place(k), place(v), phys, backend=backend)
    assert rel_err(out[perm], ref) < 2e-2


@pytest.mark.parametrize("backend", ["varlen", "fa4", "flex_tree"])
def test_gpu_mla_module(backend):
    """CompactMLA in bf16 with a GPU backend equals the same module with the reference core."""
    need(backend)
    batch, views = case("random_forest")
    torch.manual_seed(0)
    mla = (
        CompactMLA(
            MLAConfig(
                hidden_size=256,
                num_heads=4,
                kv_lora_rank=64,
                qk_nope_head_dim=128,
                qk_rope_head_dim=64,
                v_head_dim=128,
                q_lora_rank=96,
            )
        )
        .cuda()
        .to(torch.bfloat16)
    )
    hidden = torch.randn(batch.compact_tokens, 256, device="cuda", dtype=torch.bfloat16)
    positions = torch.from_numpy(batch.row_depth.astype(np.int64)).cuda()
    outs = []
    for b in ("reference", backend):
        mla.zero_grad()
        h = hidden.clone().requires_grad_()
        out = mla(h, RowLayout(h.shape[0], positions=positions, views=views), backend=b)
        out.float().square().mean().backward()
        outs.append((out.detach(), h.grad, mla.kv_b_proj.weight.grad))
    for g, r in zip(*reversed(outs)):
        assert rel_err(g, r) < 3e-2


def test_backend_table_is_consistent():
    assert set(GPU_BACKENDS) <= set(BACKENDS)
    assert {"varlen", "flex_tree", "sdpa", "dense_tree"} <= set(available_backends("cuda"))
