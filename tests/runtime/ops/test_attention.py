"""Full attention on compact tokens against trajectory-wise attention on the expanded batch (CPU).

Every case builds a random rollout forest (forks, prefix trajectories, duplicates), runs attention
once per compact row through ancestor-KV views (or the tree mask), and compares outputs and input
gradients with ordinary causal attention run separately on every trajectory. The semantic loss
weights differ between positions that share a row, so gradient accumulation into shared ancestor
rows is checked, not just a count multiple.
"""

import numpy as np
import pytest
import torch

from harts_runtime.layers.attention import AttentionConfig, CompactAttention
from harts_runtime.layers.mla import CompactMLA, MLAConfig
from harts_runtime.layout import Branches, RowLayout, TreeOrder, build_views
from harts_runtime.ops.attention import BACKENDS, available_backends, compact_attention, trajectory_attention
from harts_runtime.testing import (
    chain_branches,
    path_branches,
    random_batch,
    segment_branches,
    trajectory_rows,
    tree_dense_mask,
    views_dense_mask,
    views_from_batch,
)

CPU_BACKENDS = ["reference", "sdpa", "dense_tree"]


def random_chains(batch, rng) -> list[list[int]]:
    """A random decomposition of the segment forest into parent-to-child chains."""
    offsets, children = batch.segment_child_offsets, batch.segment_children
    chains, stack = [], [[int(r)] for r in batch.segment_roots]
    while stack:
        chain = stack.pop()
        while True:
            kids = children[offsets[chain[-1]] : offsets[chain[-1] + 1]].tolist()
            if not kids:
                break
            cont = int(rng.integers(-1, len(kids)))  # -1: every child starts a new chain
            stack.extend([k] for i, k in enumerate(kids) if i != cont)
            if cont < 0:
                break
            chain.append(kids[cont])
        chains.append(chain)
    return chains


def decompositions(batch, rng):
    yield "paths", path_branches(batch)
    yield "segments", segment_branches(batch)
    yield "random_chains", chain_branches(batch, random_chains(batch, rng))


# ----------------------------------------------------------------------------------- views
@pytest.mark.parametrize("seed", range(12))
def test_views_define_exactly_the_tree_mask(seed):
    batch = random_batch(seed, num=int(3 + seed))
    tree = TreeOrder.from_batch(batch)
    generic = TreeOrder.from_parent(batch.row_parent)
    np.testing.assert_array_equal(tree.pre, generic.pre)
    np.testing.assert_array_equal(tree.end, generic.end)
    expected = torch.from_numpy(tree_dense_mask(tree))
    for name, branches in decompositions(batch, np.random.default_rng(seed)):
        views = build_views(batch.row_parent, branches, tree)
        assert torch.equal(views_dense_mask(views), expected), name
        assert sorted(views.q_index.tolist()) == list(range(batch.compact_tokens))


@pytest.mark.parametrize("seed", range(6))
def test_packed_kv_length(seed):
    """paths: |KV| = C + sum over forks of (|ch| - 1) e_v; segments: |KV| = sum over segments of e_v."""
    batch = random_batch(seed, num=10)
    fanout = np.diff(batch.segment_child_offsets)
    ends = batch.segment_end.astype(np.int64)
    paths = views_from_batch(batch, "paths")
    assert paths.kv_index.numel() == batch.compact_tokens + int(((fanout - 1).clip(0) * ends).sum())
    assert paths.num_branches == int((fanout == 0).sum())
    assert views_from_batch(batch, "segments").kv_index.numel() == int(ends.sum())


def test_bad_branches_are_rejected():
    batch = random_batch(0, num=6)
    parent = batch.row_parent
    c = batch.compact_tokens
    with pytest.raises(ValueError, match="not a chain"):
        build_views(parent, Branches.from_lists([list(range(c))[::-1]]))
    with pytest.raises(ValueError, match="two branches"):
        build_views(parent, Branches.from_lists([[0], [0]]))
    with pytest.raises(ValueError, match="out of range"):
        build_views(parent, Branches.from_lists([[c]]))


def test_tree_order_from_parent_handles_any_row_order():
    batch = random_batch(4, num=9)
    c = batch.compact_tokens
    perm = np.random.default_rng(0).permutation(c)  # new row of old row r: perm[r]
    parent = np.full(c, -1, dtype=np.int64)
    old_parent = batch.row_parent.astype(np.int64)
    parent[perm] = np.where(old_parent >= 0, perm[old_parent.clip(0)], -1)
    mask = tree_dense_mask(TreeOrder.from_parent(parent))
    ref = tree_dense_mask(TreeOrder.from_batch(batch))
    np.testing.assert_array_equal(mask[np.ix_(perm, perm)], ref)


# --------------------------------------------------------------------------- attention core
def expanded_core(q, k, v, batch, weights):
    """Trajectory-wise: causal attention on each expanded trajectory; returns (outputs [S], loss)."""
    outs = [trajectory_attention(q[r], k[r], v[r]) for r in map(torch.from_numpy, trajectory_rows(batch))]
    out = torch.cat(outs)
    return out, (out * weights).sum()


SHAPES = {  # Hq, Hkv, Dqk, Dv
    "mha": (4, 4, 8, 8),
    "gqa": (4, 2, 8, 8),
    "mqa_mla_dims": (4, 1, 12, 6),
    "mla_dims": (2, 2, 10, 6),
}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("decomposition", ["paths", "segments"])
def test_core_matches_expanded_outputs_and_gradients(backend, shape, decomposition):
    hq, hkv, dqk, dv = SHAPES[shape]
    batch = random_batch(7, num=10)
    views = views_from_batch(batch, decomposition)
    c, s = batch.compact_tokens, batch.semantic_tokens
    gen = torch.Generator().manual_seed(1)
    leaves = [
        torch.randn(c, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
        for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv))
    ]
    weights = torch.randn(s, hq, dv, generator=gen, dtype=torch.float64)
    sem = torch.from_numpy(batch.compact_map.astype(np.int64))

    out = compact_attention(*leaves, views, backend=backend)
    (out[sem] * weights).sum().backward()
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    ref_out, ref_loss = expanded_core(*leaves, batch, weights)
    ref_loss.backward()

    torch.testing.assert_close(out[sem], ref_out, rtol=1e-10, atol=1e-10)
    for name, g, t in zip("qkv", grads, leaves):
        torch.testing.assert_close(g, t.grad, rtol=1e-9, atol=1e-9, msg=f"d{name}")


def test_view_backends_agree_on_random_chains_float32():
    batch = random_batch(11, num=14)
    views = build_views(
        batch.row_parent, chain_branches(batch, random_chains(batch, np.random.default_rng(3)))
    )
    c = batch.compact_tokens
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(c, h, d, generator=gen) for h, d in ((4, 16), (2, 16), (2, 8)))
    ref = compact_attention(q, k, v, views, backend="reference")
    for backend in CPU_BACKENDS[1:]:
        torch.testing.assert_close(
            compact_attention(q, k, v, views, backend=backend), ref, rtol=1e-5, atol=1e-5
        )


def test_flex_tree_forward_on_cpu():
    """FlexAttention's forward runs on CPU (eager); its backward is tested in test_attention_gpu.py."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    batch = random_batch(5, num=8)
    views = views_from_batch(batch)
    c = batch.compact_tokens
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(c, h, d, generator=gen) for h, d in ((4, 16), (2, 16), (2, 8)))
    ref = compact_attention(q, k, v, views, backend="reference")
    try:
        out = compact_attention(q, k, v, views, backend="flex_tree")
    except (NotImplementedError, RuntimeError) as err:  # pragma: no cover - depends on torch build
        pytest.skip(f"flex_attention forward unavailable on CPU: {err}")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_remap_to_physical_rows_with_padding():
    """A call-plan layout permutes rows and adds padding rows; views remapped to it give the same
    outputs at the new rows and zeros at padding rows."""
    batch = random_batch(9, num=10)
    views = views_from_batch(batch)
    c, pad = batch.compact_tokens, 5
    perm = torch.from_numpy(np.random.default_rng(1).permutation(c + pad)[:c])  # physical row of compact row
    phys = views.remap(perm, c + pad)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(c, 2, 8, generator=gen) for _ in range(3))
    place = lambda x: x.new_zeros((c + pad,) + x.shape[1:]).index_copy(0, perm, x)
    ref = compact_attention(q, k, v, views, backend="reference")
    for backend in CPU_BACKENDS:
        out = compact_attention(place(q), place(k), place(v), phys, backend=backend)
        torch.testing.assert_close(out[perm], ref, rtol=1e-5, atol=1e-5)
        if BACKENDS[backend].kind == "views":
            padding = torch.ones(c + pad, dtype=torch.bool).index_fill(0, perm, False)
            assert not out[padding].any()


def test_unknown_backend_and_row_mismatch():
    batch = random_batch(0, num=4)
    views = views_from_batch(batch)
    x = torch.zeros(batch.compact_tokens, 1, 4)
    with pytest.raises(ValueError, match="backend"):
        compact_attention(x, x, x, views, backend="nope")
    with pytest.raises(ValueError, match="rows"):
        compact_attention(x[1:], x[1:], x[1:], views)
    assert set(CPU_BACKENDS) <= set(available_backends("cpu"))


def test_auto_backend_resolution(monkeypatch):
    """``auto`` is the reference on the CPU and the first importable CUDA_PREFERENCE entry on CUDA;
    a named backend is itself, an unknown one is named in the error."""
    from harts_runtime.ops import attention as att

    assert att.resolve_backend("auto", "cpu") == "reference"
    assert att.resolve_backend("sdpa", "cuda") == "sdpa"
    with pytest.raises(ValueError, match="backend.*'nope'"):
        att.resolve_backend("nope", "cpu")
    assert set(att.CUDA_PREFERENCE) <= set(BACKENDS)
    present = {None, "torch.nn.attention.varlen"}  # a machine without flash_attn.cute
    monkeypatch.setattr(att, "_importable", lambda name: name in present)
    bf16 = torch.bfloat16
    att._auto.cache_clear()
    try:  # _auto(device type, compute-capability major, Dqk, Dv, dtype): what resolve_backend asks
        assert att._auto("cuda", 9, 192, 128, bf16) == "varlen"
        present.add(BACKENDS["fa4"].needs)
        att._auto.cache_clear()
        assert att.CUDA_PREFERENCE[0] == "fa4"
        assert att._auto("cuda", 9, 192, 128, bf16) == "fa4"
        assert att._auto("cuda", 9, 48, 32, bf16) == "varlen"  # not a verified fa4 shape
        assert att._auto("cuda", 8, 192, 128, bf16) == "varlen"  # fa4 verified on SM90 only
        assert att._auto("cuda", 9, None, None, bf16) == "varlen"  # unknown dims: no restricted backend
        assert att._auto("cuda", 9, 192, 128, torch.float32) == "sdpa"  # the flash kernels are half only
    finally:
        att._auto.cache_clear()
    q = torch.zeros(3, 1, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dims"):
        att._varlen_fa4(q, q, q[..., :32], None, 1.0)
    batch = random_batch(0, num=4)
    views = views_from_batch(batch)
    x = torch.randn(batch.compact_tokens, 2, 8)
    torch.testing.assert_close(
        compact_attention(x, x, x, views, backend="auto"),
        compact_attention(x, x, x, views, backend="reference"),
        rtol=0,
        atol=0,
    )


# ------------------------------------------------------------------------------- modules
MODULES = {
    "mha": lambda: CompactAttention(AttentionConfig(hidden_size=32, num_heads=4)),
    "gqa": lambda: CompactAttention(AttentionConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=6)),
    "mla": lambda: CompactMLA(
        MLAConfig(
            hidden_size=32, num_heads=2, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5
        )
    ),
    "mla_q_lora": lambda: CompactMLA(
        MLAConfig(
            hidden_size=32,
            num_heads=3,
            kv_lora_rank=8,
            qk_nope_head_dim=4,
            qk_rope_head_dim=6,
            v_head_dim=8,
            q_lora_rank=10,
        )
    ),
}


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("kind", list(MODULES))
def test_module_matches_trajectory_wise(kind, backend):
    """Projections + RoPE once per compact row at row_depth, views, scatter, o_proj: outputs and the
    gradients of the compact hidden rows and of every parameter equal the trajectory-wise layer."""
    torch.manual_seed(0)
    layer = MODULES[kind]().double()
    batch = random_batch(13, num=9, max_new=8)
    views = views_from_batch(batch, "segments")
    c, s = batch.compact_tokens, batch.semantic_tokens
    hidden = torch.randn(c, 32, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(s, 32, dtype=torch.float64)
    sem = torch.from_numpy(batch.compact_map.astype(np.int64))
    positions = torch.from_numpy(batch.row_depth.astype(np.int64))

    out = layer(hidden, RowLayout(c, positions=positions, views=views), backend=backend)
    (out[sem] * weights).sum().backward()
    got = {"hidden": hidden.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}
    layer.zero_grad()
    hidden.grad = None

    ref = torch.cat([layer.forward_trajectory(hidden[torch.from_numpy(r)]) for r in trajectory_rows(batch)])
    (ref * weights).sum().backward()
    torch.testing.assert_close(out[sem], ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.pop("hidden"), hidden.grad, rtol=1e-9, atol=1e-9)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-9, atol=1e-9, msg=f"d{name}")


def test_simple_batch_and_run_branches_match_the_planner():
    """The pure-Python fallback (used where the planner is not built, e.g. a bare GPU box) numbers rows
    like RolloutBatch, and run_branches equals path_branches on preorder rows."""
    from harts_runtime.testing import SimpleBatch, random_trajectories, run_branches

    for seed in range(5):
        trajs = random_trajectories(np.random.default_rng(seed), num=12)
        native, simple = random_batch(seed, num=12), SimpleBatch(trajs)
        for name in ("compact_map", "multiplicity", "row_parent", "row_depth"):
            np.testing.assert_array_equal(getattr(simple, name), getattr(native, name), err_msg=name)
        runs, paths = run_branches(native.row_parent), path_branches(native)
        np.testing.assert_array_equal(runs.cu, paths.cu)
        np.testing.assert_array_equal(runs.rows, paths.rows)


def test_module_head_dims_are_the_core_dims():
    """Each attention module's ``head_dims`` (what ``auto`` is resolved for) is the (Dqk, Dv) its
    core receives."""
    from harts_runtime.ops import attention as att

    batch = random_batch(2, num=5)
    views = views_from_batch(batch)
    positions = torch.from_numpy(batch.row_depth.astype(np.int64))
    seen = {}

    def spy(q, k, v, views, scale):
        seen["dims"] = (q.shape[-1], v.shape[-1])
        return att.BACKENDS["reference"].fn(q, k, v, views, scale)

    for name, build in MODULES.items():
        m = build()
        h = torch.randn(batch.compact_tokens, m.config.hidden_size)
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(att.BACKENDS, "spy", att.Backend("spy", "views", spy))
            m(h, RowLayout(h.shape[0], positions=positions, views=views), backend="spy")
        assert seen.pop("dims") == m.head_dims, name


def test_flash_attn_backend_needs_fa2_not_fa4s_namespace(tmp_path, monkeypatch):
    """The flash-attn-4 wheel installs ``flash_attn/cute`` only (``flash_attn`` a namespace
    package without ``flash_attn_varlen_func``): the ``flash_attn`` backend (FA2's function) must
    not count as importable then, while ``fa4`` does (measured on the H200: every flash_attn case
    failed with an ImportError before)."""
    import sys

    from harts_runtime.ops import attention as att

    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    assert att._importable(att.BACKENDS["fa4"].needs)
    assert not att._importable(att.BACKENDS["flash_attn"].needs)
    (tmp_path / "flash_attn" / "flash_attn_interface.py").write_text("")  # an FA2 install
    assert att._importable(att.BACKENDS["flash_attn"].needs)
