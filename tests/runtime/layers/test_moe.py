"""Compact MoE routing against trajectory-wise MoE on the expanded batch (CPU).

Compact: one routing decision and expert computation per compact row, statistics weighted by the
multiplicity q_c. Expanded: the same module on all S semantic rows with weight one each. Outputs,
router z-loss, load-balancing loss, expert-load counts, expert-bias updates and all gradients agree;
both expert paths (grouped matmul and the per-expert loop) are checked. The grouped path is also
checked to issue no op that would synchronise the host with a CUDA device (on the CPU, through the
aten ops it dispatches; tests/runtime/layers/test_moe_gpu.py checks it on the device).
"""

import importlib.util
import textwrap

import numpy as np
import pytest
import torch
import triton_interpreter
from torch.utils._python_dispatch import TorchDispatchMode

from harts_runtime.errors import InvalidInputError
from harts_runtime.layers.moe import CompactMoE, MoEConfig, route
from harts_runtime.layout import RowLayout
from harts_runtime.ops.dispatch import sort_assignments
from harts_runtime.ops.grouped_gemm import _grouped_mm_ok, gate_up_mm, grouped_mm
from harts_runtime.ops.swiglu import swiglu_rows
from harts_runtime.testing import random_batch


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def rows(q: torch.Tensor) -> RowLayout:
    """A layout that only carries the multiplicities ``q`` (what the MoE reads)."""
    return RowLayout(q.numel(), multiplicity=q)


CONFIGS = {
    "softmax": {"score_func": "softmax"},
    "softmax_scaled": {"score_func": "softmax", "norm_topk_prob": True, "routed_scaling_factor": 2.5},
    "sigmoid_bias": {"score_func": "sigmoid", "norm_topk_prob": True, "use_expert_bias": True},
}
SYNC_CONFIGS = {  # the no-host-sync test also covers shared experts and group-limited routing
    **CONFIGS,
    "shared_gated": {"num_shared_experts": 1, "shared_expert_gate": True},
    "groups_shared": {
        "score_func": "sigmoid",
        "norm_topk_prob": True,
        "use_expert_bias": True,
        "num_expert_groups": 4,
        "topk_groups": 2,
        "num_shared_experts": 2,
    },
}


def make(config: str, grouped: bool, seed: int = 0, **sizes) -> CompactMoE:
    torch.manual_seed(seed)
    moe = CompactMoE(
        MoEConfig(
            **{"hidden_size": 16, "num_experts": 8, "top_k": 3, "intermediate_size": 12, **sizes},
            grouped=grouped,
            aux_loss_coef=0.7,
            z_loss_coef=0.3,
            **SYNC_CONFIGS[config],
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


GROUPED_VS_LOOP_FP32_TOL = {"rtol": 2e-5, "atol": 2e-6}
"""fp32, grouped path vs the per-expert loop: the same products, summed in another order (the
routing weight scales the I-wide rows before the down projection instead of the D-wide output;
one grouped matmul for [w_gate | w_up]). Observed: at most ~3e-7 of the largest entry; a
permutation or weighting bug is O(1)."""


@pytest.mark.parametrize("config", ["softmax_scaled", "shared_gated", "groups_shared"])
def test_grouped_path_equals_the_loop_forward_and_backward_fp32(config):
    """Top-3 of 8 experts, shared experts (gated and not), group-limited routing: the grouped path
    (one gate/up grouped matmul, weights folded into h, plain slot sum) against the loop reference,
    output and every gradient (router, w_gate, w_up, w_down, shared experts, input)."""
    outs = []
    for grouped in (True, False):
        moe = make(config, grouped, seed=3, hidden_size=32, intermediate_size=16)
        hidden = torch.randn(50, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
        probe = torch.randn(50, 32, generator=torch.Generator().manual_seed(5))
        out = moe(hidden, rows(torch.arange(50) % 4))
        ((out.hidden * probe).sum() + out.router_loss).backward()
        outs.append(
            {"hidden": out.hidden.detach(), "d_hidden": hidden.grad, "topk": out.topk_idx}
            | {n: p.grad for n, p in moe.named_parameters()}
        )
    grouped, loop = outs
    assert moe.config.top_k > 1 and (config == "softmax_scaled" or moe.config.num_shared_experts > 0)
    assert torch.equal(grouped.pop("topk"), loop.pop("topk"))
    assert grouped.keys() == loop.keys()
    for name, g in grouped.items():
        assert g is not None and g.abs().sum() > 0, name
        torch.testing.assert_close(
            g, loop[name], **GROUPED_VS_LOOP_FP32_TOL, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_swiglu_rows_reference_folds_the_row_weights():
    """``swiglu_rows`` (reference backend): silu(a) * b * w per row, and its gradients."""
    gen = torch.Generator().manual_seed(0)
    gu = torch.randn(7, 10, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(7, dtype=torch.float64, generator=gen, requires_grad=True)
    a, b = gu[:, :5], gu[:, 5:]
    torch.testing.assert_close(swiglu_rows(gu, w, "naive"), torch.nn.functional.silu(a) * b * w[:, None])
    torch.testing.assert_close(swiglu_rows(gu, None, "naive"), torch.nn.functional.silu(a) * b)
    assert torch.autograd.gradcheck(lambda g, v: swiglu_rows(g, v, "naive"), (gu, w))
    assert not gu.is_cuda and swiglu_rows(gu, w, "auto").grad_fn is not None  # auto: reference on CPU
    with pytest.raises(InvalidInputError, match="unknown"):
        swiglu_rows(gu, w, "fused")


@pytest.mark.slow
@pytest.mark.skipif(not (_importable("triton") and _importable("fla")), reason="needs triton and fla-core")
def test_fused_swiglu_matches_the_reference_under_the_interpreter():
    """The fused kernels (``backend="triton"``: harts_kernels.moe's weighted SwiGLU and gather-sums;
    TRITON_INTERPRET=1 on the CPU): ``swiglu_rows`` with and without row weights, and the whole
    grouped MoE, forward and backward, against the reference backend in fp32. The CUDA comparison is in test_moe_gpu.py."""
    code = triton_interpreter.prelude() + textwrap.dedent(
        """
        import torch
        from harts_runtime.layers.moe import CompactMoE, MoEConfig
        from harts_runtime.ops.swiglu import swiglu_rows
        from harts_runtime.layout import RowLayout

        tol = dict(rtol=1e-5, atol=1e-6)
        gen = torch.Generator().manual_seed(0)
        gu0 = torch.randn(37, 24, generator=gen)
        w0 = torch.rand(37, generator=gen)
        g = torch.randn(37, 12, generator=gen)
        for weighted in (True, False):
            res = []
            for backend in ("triton", "naive"):
                gu = gu0.clone().requires_grad_()
                w = w0.clone().requires_grad_() if weighted else None
                h = swiglu_rows(gu, w, backend)
                assert (type(h.grad_fn).__name__ == "_FusedSwiGLUBackward") == (backend == "triton")
                h.backward(g)
                res.append([h.detach(), gu.grad] + ([w.grad] if weighted else []))
            for x, y in zip(*res):
                torch.testing.assert_close(x, y, **tol)

        outs = []
        for backend in ("triton", "naive"):
            torch.manual_seed(0)
            moe = CompactMoE(MoEConfig(hidden_size=32, num_experts=8, top_k=3, intermediate_size=16,
                                       num_shared_experts=1, aux_loss_coef=0.1, backend=backend))
            x = torch.randn(40, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
            out = moe(x, RowLayout(40, multiplicity=torch.arange(40) % 3))
            (out.hidden.square().sum() + out.router_loss).backward()
            outs.append([out.hidden.detach(), x.grad] + [p.grad for p in moe.parameters()])
        for x, y in zip(*outs):
            torch.testing.assert_close(x, y, **tol)
        print("OK")
        """
    )
    r = triton_interpreter.run(code)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


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

    from harts_runtime.ops.grouped_gemm import _grouped_mm_ok

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


# ------------------------------------------------------------------------ host synchronisation
aten = torch.ops.aten


class HostSyncError(AssertionError):
    pass


class NoHostSync(TorchDispatchMode):
    """Raises :class:`HostSyncError` on every aten op that, on CUDA tensors, makes the host wait for the
    device: scalar reads (``item``, ``bool(t)``, ``int(t)``: ``_local_scalar_dense``), data-dependent
    output sizes (nonzero, bincount, unique, masked_select, boolean-mask indexing,
    ``repeat_interleave`` without ``output_size``) and ops returning a Python bool of tensor data.
    ``tolist``/``numpy``/``cpu`` do not dispatch for CPU tensors; :func:`no_host_sync` patches them.

    Also checks the layout of every 2-D x 2-D ``_grouped_mm`` (the weight gradients): column-major
    times row-major, the one layout whose CUDA kernel takes any group size, empty ones included
    (every other 2-D x 2-D layout asserts 16-byte aligned, non-empty groups on the device).
    """

    SYNCING = {
        aten._local_scalar_dense.default,
        aten.item.default,
        aten.is_nonzero.default,
        aten.equal.default,
        aten.nonzero.default,
        aten.bincount.default,
        aten.masked_select.default,
        aten._unique.default,
        aten._unique2.default,
        aten.unique_dim.default,
        aten.unique_consecutive.default,
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SYNCING:
            raise HostSyncError(f"{func} synchronises with the device")
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            raise HostSyncError("repeat_interleave without output_size synchronises with the device")
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
                raise HostSyncError(f"{func} with a boolean mask synchronises with the device")
        if func is aten._grouped_mm.default and args[0].dim() == 2 and args[1].dim() == 2:
            a, b = args[0], args[1]
            if not (a.stride(-2) == 1 and b.stride(-1) == 1):
                raise HostSyncError(f"2-D x 2-D _grouped_mm with strides {a.stride()} x {b.stride()}")
        return func(*args, **kwargs)


def _refuse(name):
    def refuse(*_args, **_kwargs):
        raise HostSyncError(f"Tensor.{name} copies to the host")

    return refuse


@pytest.fixture
def no_host_sync(monkeypatch):
    """A context manager: :class:`NoHostSync` plus ``Tensor.tolist/numpy/cpu`` refused."""
    import contextlib

    @contextlib.contextmanager
    def guard():
        with monkeypatch.context() as m, NoHostSync():
            for name in ("tolist", "numpy", "cpu"):
                m.setattr(torch.Tensor, name, _refuse(name))
            yield

    return guard


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm not available")
@pytest.mark.parametrize("config", list(SYNC_CONFIGS))
def test_grouped_path_issues_no_host_sync(config, no_host_sync):
    """Forward, backward and the expert-bias step of the grouped path (torch._grouped_mm): no op
    that would synchronise on CUDA. The loop reference (nonzero) trips the same guard."""
    moe = make(config, True, hidden_size=32, intermediate_size=16)
    moe.expert_bias[5] = -1e3  # never selected: an empty group in every grouped matmul
    hidden = torch.randn(40, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    layout = rows(torch.arange(40) % 3)
    assert _grouped_mm_ok(hidden, moe.w_gate) and _grouped_mm_ok(hidden[:, :16], moe.w_down)
    with no_host_sync():
        out = moe(hidden, layout)
        (out.hidden.square().sum() + out.router_loss).backward()
        moe.update_expert_bias()
    if moe.config.use_expert_bias:
        assert out.tokens_per_expert[5] == 0 and not moe.w_gate.grad[5].any()
    assert all(p.grad is not None for p in moe.parameters())

    loop = make(config, False, hidden_size=32, intermediate_size=16)
    with pytest.raises(HostSyncError), no_host_sync():
        loop(hidden, layout)


def test_no_host_sync_guard_catches_the_usual_syncs(no_host_sync):
    t = torch.tensor([0, 2, 1, 2])
    for sync in (
        lambda: t.tolist(),
        lambda: t.sum().item(),
        lambda: bool(t[0]),
        lambda: torch.bincount(t, minlength=3),
        lambda: t.nonzero(),
        lambda: t[t > 0],
        lambda: torch.repeat_interleave(t, t),
        lambda: torch.unique(t),
        lambda: t.cpu(),
    ):
        with pytest.raises(HostSyncError), no_host_sync():
            sync()
    with no_host_sync():  # the device-side replacements pass
        torch.repeat_interleave(t, t, output_size=5)
        torch.zeros(3, dtype=torch.long).scatter_add_(0, t, torch.ones_like(t))


def test_sort_assignments_is_one_stable_permutation():
    topk_idx = torch.tensor([[2, 0], [0, 3], [2, 3], [0, 2]])
    order, inverse, counts = sort_assignments(topk_idx, 5)
    flat = topk_idx.reshape(-1)
    assert order.tolist() == [1, 2, 6, 0, 4, 7, 3, 5]  # by expert, slots ascending inside one
    assert torch.equal(order[inverse], torch.arange(8)) and torch.equal(inverse[order], torch.arange(8))
    assert torch.equal(counts, torch.bincount(flat, minlength=5))
    assert torch.equal(flat[order], torch.sort(flat, stable=True).values)


def test_grouped_mm_ok_conditions_on_cpu():
    """CPU: fp32/bf16 with 16-byte aligned rows and one dtype (fp64 and odd widths: padded bmm).
    The CUDA conditions (bf16, SM90/SM100) are checked in test_moe_gpu.py."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not available")
    x = torch.zeros(10, 1536)
    assert _grouped_mm_ok(x, torch.zeros(4, 1536, 512))
    assert _grouped_mm_ok(x.bfloat16(), torch.zeros(4, 1536, 512, dtype=torch.bfloat16))
    assert _grouped_mm_ok(x, torch.zeros(4, 512, 1536).transpose(1, 2))  # column-major weights
    assert not _grouped_mm_ok(x.double(), torch.zeros(4, 1536, 512, dtype=torch.float64))
    assert not _grouped_mm_ok(x, torch.zeros(4, 1536, 6))  # 24-byte rows
    assert not _grouped_mm_ok(x.bfloat16(), torch.zeros(4, 1536, 512))  # mixed dtypes


@pytest.mark.parametrize("impl", ["grouped_mm", "bmm"])
def test_gate_up_mm_equals_the_grouped_mm_of_the_concatenation(impl):
    """gate_up_mm(x, w_gate, w_up) == grouped_mm(x, [w_gate | w_up]): output and the gradients of
    x and of both weights (fp32; empty groups included), on the rebuilt-concatenation autograd
    function and on the padded-bmm fallback."""
    if impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not available")
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 5, 1, 0, 7])
    leaves = [
        torch.randn(16, 8, generator=gen, requires_grad=True),
        torch.randn(6, 8, 4, generator=gen, requires_grad=True),
        torch.randn(6, 8, 4, generator=gen, requires_grad=True),
    ]
    probe = torch.randn(16, 8, generator=gen)
    got = gate_up_mm(*leaves, counts, impl=impl)
    got.backward(probe)
    mine = [got.detach()] + [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    x, wg, wu = leaves
    ref = grouped_mm(x, torch.cat([wg, wu], dim=-1), counts, impl=impl)
    ref.backward(probe)
    for name, a, b in zip(("y", "x", "w_gate", "w_up"), mine, [ref.detach()] + [t.grad for t in leaves]):
        assert b.abs().sum() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_gate_up_mm_keeps_no_concatenated_weights_for_backward():
    """The grouped path saves no [E, D, 2I] tensor between forward and backward (autograd's cat of
    w_gate and w_up used to: 2 E D I elements per MoE layer), and still trains w_gate and w_up."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not available")
    moe = make("softmax", True, hidden_size=16, intermediate_size=8)
    e, d, i = moe.w_gate.shape
    hidden = torch.randn(30, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = moe(hidden, rows(torch.ones(30, dtype=torch.int64)))
    assert (e, d, i) in saved  # the parameters themselves are saved (they live anyway)
    assert (e, d, 2 * i) not in saved, saved
    out.hidden.square().sum().backward()
    assert moe.w_gate.grad.abs().sum() > 0 and moe.w_up.grad.abs().sum() > 0


def test_gate_up_mm_refuses_mismatched_weights():
    x = torch.zeros(4, 8)
    with pytest.raises(InvalidInputError, match="w_up"):
        gate_up_mm(x, torch.zeros(2, 8, 4), torch.zeros(2, 8, 6), torch.tensor([2, 2]))
    with pytest.raises(InvalidInputError, match="impl"):
        gate_up_mm(x, torch.zeros(2, 8, 4), torch.zeros(2, 8, 4), torch.tensor([2, 2]), impl="x")


def test_router_logits_are_the_float32_product_off_cuda():
    """``router_logits`` off CUDA: the float32 product (float64 rows: float64), gradients in the
    operands' dtypes. The bf16 tensor-core form is compared on CUDA in test_moe_gpu.py."""
    from harts_runtime.ops.router import router_logits

    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        h = torch.randn(33, 24, generator=gen).to(dtype).requires_grad_()
        w = torch.randn(6, 24, generator=gen).to(dtype).requires_grad_()
        out = router_logits(h, w)
        assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(out, h.detach().to(out.dtype) @ w.detach().to(out.dtype).t())
        out.sum().backward()
        assert h.grad.dtype == dtype and w.grad.dtype == dtype


def test_split_bf16_carries_a_float32_value_to_two_to_the_minus_16():
    """The router backward's split of a float32 gradient into two bf16 terms (``ops/router.py``):
    ``hi + lo`` is the value to 2^-16 relative (the bound), and ``(hi + lo) @ b`` for bf16 ``b`` (the products
    ``mm_split`` forms on CUDA; here in float32) is float32's product to that order."""
    from harts_runtime.ops.router import split_bf16

    gen = torch.Generator().manual_seed(5)
    g = torch.randn(300, 40, generator=gen) * torch.logspace(-6, 6, 40)  # every scale
    hi, lo = split_bf16(g)
    assert hi.dtype == lo.dtype == torch.bfloat16
    err = (hi.float() + lo.float() - g).abs() / g.abs()
    assert float(err.max()) <= 2.0**-16
    b = torch.randn(40, 24, generator=gen).to(torch.bfloat16).float()
    ref = g.double() @ b.double()
    got = hi.float().double() @ b.double() + lo.float().double() @ b.double()
    assert float((got - ref).norm() / ref.norm()) <= 2.0**-16
