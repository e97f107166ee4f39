"""CompactMoE on CUDA: the grouped path runs forward and backward without host
synchronisation, and agrees with the fp32 per-expert loop.

The grouped module runs in bf16 (its SwiGLU and gather-sums through harts_kernels.moe's fused
kernels when triton and fla-core are importable, ``MoEConfig.backend="auto"``) with ``torch._grouped_mm``'s device-offset kernel (SM90/SM100); after
one warm-up step (cuBLAS/CUTLASS workspaces, allocator blocks, lazy initialisation) a second
forward + backward + expert-bias step runs under ``torch.cuda.set_sync_debug_mode("error")``, so
any synchronising CUDA call PyTorch makes (``.item()``, ``.tolist()``, ``nonzero``, a blocking
copy, a stream synchronisation) raises. The reference is the same module (same bf16-rounded
weights, upcast) in fp32 with ``grouped=False``. Both compute the router logits in fp32 from the
same values, so they route identically; outputs and every gradient are compared by their relative
Frobenius error against a per-tensor tolerance (:data:`RTOL`), the router statistics exactly or
to fp32 rounding.
"""

import copy

import pytest
import torch

from harts_runtime.layers.moe import CompactMoE, MoEConfig
from harts_runtime.layout import RowLayout
from harts_runtime.modules.fused import fla_available
from harts_runtime.ops.grouped_gemm import _grouped_mm_ok, gate_up_mm, grouped_mm
from harts_runtime.ops.swiglu import swiglu_rows

pytestmark = pytest.mark.gpu

N, D, INTER, E, K = 4096, 256, 128, 16, 4
NEVER = 5  # an expert whose selection bias keeps it empty (configs with an expert bias)

CONFIGS = {
    "plain": {},
    "shared_gated": {"num_shared_experts": 2, "shared_expert_gate": True},  # Qwen3-Next / Qwen3.5
    "groups_shared": {  # Kimi-Linear / DeepSeek-V3
        "score_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "use_expert_bias": True,
        "num_expert_groups": 4,
        "topk_groups": 2,
        "num_shared_experts": 1,
    },
}

RTOL = {
    # Relative Frobenius error, bf16 grouped path vs the fp32 loop. bf16 rounds to 2^-9 relative;
    # an expert rounds its gate/up products, h and its output (fp32 accumulation inside), the
    # combine and every gradient round once more: ~0.5% (0.41-0.61% for every entry in a CPU run
    # of this test with CPU bf16 kernels). A permutation or grouping bug is O(1).
    "hidden": 1.5e-2,
    "d_hidden": 2e-2,
    "router": 2e-2,  # through the bf16 combine weights; the z-/aux-loss parts are fp32
    "w_gate": 2e-2,
    "w_up": 2e-2,
    "w_down": 2e-2,
    "shared_experts.gate.weight": 2e-2,
    "shared_experts.up.weight": 2e-2,
    "shared_experts.down.weight": 2e-2,
    "shared_expert_gate.weight": 2e-2,  # [1, D]: one reduction over all N rows
}


@pytest.fixture(autouse=True)
def fp32_reference():
    """Full-precision fp32 matmuls for the reference (no TF32), restored afterwards."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(precision)
    torch.cuda.set_sync_debug_mode("default")


def fast_grouped_mm_device() -> bool:
    return torch.cuda.get_device_capability()[0] in (9, 10)


def build(name: str):
    """(bf16 grouped module, fp32 loop reference with the same bf16-rounded weights)."""
    torch.manual_seed(0)
    moe = CompactMoE(
        MoEConfig(
            hidden_size=D,
            num_experts=E,
            top_k=K,
            intermediate_size=INTER,
            aux_loss_coef=0.01,
            z_loss_coef=0.001,
            **CONFIGS[name],
        )
    ).cuda()
    if moe.config.use_expert_bias:
        moe.expert_bias.normal_(0.0, 0.05)
        moe.expert_bias[NEVER] = -1e3
    moe = moe.to(torch.bfloat16)
    moe.expert_bias.data = moe.expert_bias.data.float()  # as HybridModel keeps them
    moe.local_tokens_per_expert.data = moe.local_tokens_per_expert.data.float()
    ref = copy.deepcopy(moe).float()
    ref.config.grouped = False
    assert moe.config.grouped
    return moe, ref


def inputs():
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(N, D, device="cuda", generator=gen).to(torch.bfloat16)
    probe = torch.randn(N, D, device="cuda", generator=gen)  # a generic output gradient
    q = torch.randint(0, 4, (N,), device="cuda", generator=gen)  # q = 0: padding rows
    return x, probe, RowLayout(N, multiplicity=q)


def step(moe, x, probe, layout):
    moe.zero_grad(set_to_none=True)
    h = x.detach().to(moe.w_gate.dtype).requires_grad_()
    out = moe(h, layout)
    ((out.hidden.float() * probe).sum() + out.router_loss).backward()
    return out, h.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_grouped_moe_has_no_host_sync_and_matches_the_loop(name):
    if not fast_grouped_mm_device():
        pytest.skip("torch._grouped_mm reads offsets on the device only on SM90/SM100")
    moe, ref = build(name)
    x, probe, layout = inputs()
    assert _grouped_mm_ok(x, moe.w_gate) and _grouped_mm_ok(x[:, :INTER], moe.w_down)

    step(moe, x, probe, layout)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, dx = step(moe, x, probe, layout)
        counts = moe.update_expert_bias()
        moe.eval()
        with torch.no_grad():
            moe(x, layout)
        moe.train()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

    ref_out, ref_dx = step(ref, x, probe, layout)
    assert torch.equal(out.topk_idx, ref_out.topk_idx)
    assert torch.equal(out.tokens_per_expert, ref_out.tokens_per_expert)
    assert torch.equal(counts, 2 * ref_out.tokens_per_expert)  # warm-up + measured step
    torch.testing.assert_close(out.z_loss, ref_out.z_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(out.aux_loss, ref_out.aux_loss, rtol=1e-5, atol=0)
    if moe.config.use_expert_bias:  # an empty group in every grouped matmul: exact zeros
        assert out.tokens_per_expert[NEVER] == 0
        assert not any(getattr(moe, w).grad[NEVER].any() for w in ("w_gate", "w_up", "w_down"))

    errors = {"hidden": rel(out.hidden, ref_out.hidden), "d_hidden": rel(dx, ref_dx)}
    ref_params = dict(ref.named_parameters())
    for pname, p in moe.named_parameters():
        assert pname in RTOL, f"no tolerance named for parameter {pname}"
        errors[pname] = rel(p.grad, ref_params[pname].grad)
    bad = {k: (v, RTOL[k]) for k, v in errors.items() if not v <= RTOL[k]}
    assert not bad, f"relative errors over tolerance: {bad} (all: {errors})"


def test_sync_debug_mode_catches_the_loop_reference():
    """The guard itself works: the per-expert loop (nonzero per expert) raises under it."""
    _, ref = build("plain")
    x, _, layout = inputs()
    ref(x.float(), layout)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            ref(x.float(), layout)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_grouped_mm_ok_on_cuda():
    """bf16 with 16-byte rows on SM90/SM100 takes torch._grouped_mm (production widths D=1536,
    I=512 included); fp32/fp16 and odd widths take the padded bmm (PyTorch's fp32 grouped_mm on
    CUDA is a per-group host loop)."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.zeros(64, 1536, **bf)
    fast = fast_grouped_mm_device()
    assert _grouped_mm_ok(x, torch.zeros(8, 1536, 512, **bf)) == fast
    assert _grouped_mm_ok(torch.zeros(64, 512, **bf), torch.zeros(8, 512, 1536, **bf)) == fast
    assert not _grouped_mm_ok(x.float(), torch.zeros(8, 1536, 512, device="cuda"))
    assert not _grouped_mm_ok(x.half(), torch.zeros(8, 1536, 512, device="cuda", dtype=torch.half))
    assert not _grouped_mm_ok(x, torch.zeros(8, 1536, 500, **bf))  # 1000-byte rows
    assert not _grouped_mm_ok(x[:, 1:1025], torch.zeros(8, 1024, 512, **bf))  # misaligned start


FUSED_SWIGLU_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
"""Relative Frobenius error of the fused SwiGLU (``swiglu_rows(..., "triton")``,
harts_kernels.moe) against the fp32 reference on the same (rounded) inputs: fp32 math in both, so
fp32 agrees to rounding; in bf16 the kernel rounds h and each gradient once (~2^-9 relative)."""


@pytest.mark.skipif(not fla_available(), reason="needs fla-core and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "plain"])
def test_fused_swiglu_matches_the_reference(dtype, weighted):
    """The grouped path's SwiGLU on [N*k, 2I] rows (routing weights folded in or not): fla's kernels
    against ``F.silu(a) * b * w`` in fp32, forward and backward."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    m = N * K
    gu0 = torch.randn(m, 2 * INTER, device="cuda", generator=gen).to(dtype)
    w0 = torch.rand(m, device="cuda", generator=gen).to(dtype)
    g = torch.randn(m, INTER, device="cuda", generator=gen).to(dtype)
    res = []
    for backend, dt in (("triton", dtype), ("naive", torch.float32)):
        gu = gu0.to(dt).clone().requires_grad_()  # a fresh leaf per backend (.to is a no-op at dt)
        w = w0.to(dt).clone().requires_grad_() if weighted else None
        h = swiglu_rows(gu, w, backend)
        assert (type(h.grad_fn).__name__ == "_FusedSwiGLUBackward") == (backend == "triton")
        assert h.dtype == dt and h.shape == (m, INTER)
        h.backward(g.to(dt))
        res.append({"h": h, "d_gu": gu.grad} | ({"d_w": w.grad} if weighted else {}))
    errors = {k: rel(v, res[1][k]) for k, v in res[0].items()}
    assert all(e <= FUSED_SWIGLU_RTOL[dtype] for e in errors.values()), errors


FUSED_VS_NAIVE_MOE_RTOL = 2e-2
"""Relative Frobenius error, bf16 grouped MoE with the fused kernels vs with the PyTorch ops: two
bf16 computations that round h differently (the kernel once, the reference after silu, the product
and the weight) and sum the k slots in float32 (both), each ~0.5% from the exact result (the
:data:`RTOL` scale)."""


@pytest.mark.skipif(not fla_available(), reason="needs fla-core and triton")
def test_grouped_moe_fused_and_reference_swiglu_agree():
    """The whole bf16 grouped MoE with ``backend="auto"`` (the fused kernels) and ``"naive"``: same
    routing, outputs and gradients within bf16 rounding."""
    if not fast_grouped_mm_device():
        pytest.skip("torch._grouped_mm reads offsets on the device only on SM90/SM100")
    moe, _ = build("groups_shared")
    naive = copy.deepcopy(moe)
    naive.config.backend = "naive"
    assert moe.config.backend == "auto"
    x, probe, layout = inputs()
    out, dx = step(moe, x, probe, layout)
    ref, ref_dx = step(naive, x, probe, layout)
    assert torch.equal(out.topk_idx, ref.topk_idx)
    errors = {"hidden": rel(out.hidden, ref.hidden), "d_hidden": rel(dx, ref_dx)}
    ref_params = dict(naive.named_parameters())
    errors |= {n: rel(p.grad, ref_params[n].grad) for n, p in moe.named_parameters()}
    assert all(e <= FUSED_VS_NAIVE_MOE_RTOL for e in errors.values()), errors


def test_gate_up_mm_matches_the_concatenated_product_without_host_sync():
    """bf16 on the device-offset kernel: gate_up_mm (the concatenation rebuilt in backward, the
    weight gradient as one x^T dY product split in two) against grouped_mm of autograd's cat, the
    output and the three gradients bit for bit (the same kernels on the same operands), with no
    host synchronisation after a warm-up; empty groups included."""
    if not fast_grouped_mm_device():
        pytest.skip("needs torch._grouped_mm's SM90/SM100 kernel")
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([700, 0, 1300, 1, 0, 2094], device="cuda")
    bf = dict(device="cuda", dtype=torch.bfloat16)
    leaves = [torch.randn(4095, 256, generator=gen, **bf)] + [
        torch.randn(6, 256, 128, generator=gen, **bf) * 0.05 for _ in range(2)
    ]
    probe = torch.randn(4095, 256, generator=gen, **bf)
    results = []
    for fn in (gate_up_mm, lambda x, g, u, c: grouped_mm(x, torch.cat([g, u], dim=-1), c)):
        for warm in (True, False):
            ts = [t.clone().requires_grad_() for t in leaves]
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("default" if warm else "error")
            try:
                y = fn(*ts, counts)
                y.backward(probe)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        results.append([y.detach()] + [t.grad for t in ts])
    for name, a, b in zip(("y", "x", "w_gate", "w_up"), *results):
        assert torch.equal(a, b), (name, rel(a, b))


ROUTER_RTOL = {
    "logits": 1e-5,
    "d_hidden": 2e-3,
    "d_weight": 2e-3,
    "d_hidden_fp32": 2e-5,
    "d_weight_fp32": 2e-5,
}
"""Relative Frobenius error of ``router_logits`` on bf16 operands (bf16 tensor cores, float32
outputs) against the float32 product of the same values: products of bf16 values are exact in
float32, so the logits differ only by the accumulation order (~1e-7). The backward's split of the
float32 gradient into two bf16 terms is float32's product to ~2^-16 before the gradients are
rounded to bf16, where values that differ in their last bits can round one bf16 ulp apart (2^-8 on
a few elements): ``*_fp32`` compares the float32 values before that rounding."""


def test_router_logits_on_bf16_tensor_cores_match_the_float32_product():
    from harts_runtime.ops.router import router_logits

    gen = torch.Generator(device="cuda").manual_seed(4)
    h0 = torch.randn(N, D, device="cuda", generator=gen).to(torch.bfloat16)
    w0 = (torch.randn(E, D, device="cuda", generator=gen) * D**-0.5).to(torch.bfloat16)
    g = torch.randn(N, E, device="cuda", generator=gen)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    out = router_logits(h, w)
    assert type(out.grad_fn).__name__ == "_Bf16RouterLogitsBackward" and out.dtype == torch.float32
    out.backward(g)
    hf, wf = h0.float().requires_grad_(), w0.float().requires_grad_()
    ref = hf @ wf.t()
    ref.backward(g)
    from harts_runtime.ops.router import mm_split, split_bf16

    hi, lo = split_bf16(g)
    errors = {
        "logits": rel(out, ref),
        "d_hidden": rel(h.grad, hf.grad.bfloat16()),
        "d_weight": rel(w.grad, wf.grad.bfloat16()),
        "d_hidden_fp32": rel(mm_split(hi, lo, w0), hf.grad),
        "d_weight_fp32": rel(mm_split(hi.t(), lo.t(), h0), wf.grad),
    }
    assert all(errors[k] <= ROUTER_RTOL[k] for k in errors), errors
