"""The fused (fla) token-wise paths of the KDA and GDN layers against their PyTorch references.

* CPU: the two forms of :class:`ConvWindows` describe the same windows; the initial-state form
  (what fla's varlen convolution kernel reads) reproduces the reference gather forward and
  backward through a PyTorch convolution over ``[context, own rows]``;
* CPU under ``TRITON_INTERPRET=1`` (fla's kernels as Python): each layer's fused features (one
  q/k/v GEMM, fla's varlen convolution with context rows as initial states, ``l2norm``, the fused
  gates, ``rms_norm_gated``) and the block's ``RMSNorm`` (``rms_norm``) equal the reference; forward with context, forward and
  backward on plain trajectories (fla's initial-state gradient kernel does not run in the
  interpreter: the GPU test covers it);
* CUDA (``gpu``): the same comparisons in fp32 and bf16 at production shapes, initial-state
  gradients included, and the whole layer (core included) fused vs reference.
"""

import importlib.util
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton_interpreter

from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.conv import ConvWindows, sequence_conv_index
from harts_runtime.modules.convolution import _context_state, causal_conv, naive_varlen_causal_conv

W = 4
RANGES = [[0, 10], [10, 25], [25, 40], [40, 41]]
CONTEXT = [[-1, -1, -1], [7, 8, 9], [-1, 3, 4], [30, 31, 32]]
C = 41


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def test_conv_windows_forms_agree():
    win = ConvWindows.from_sequences(RANGES, CONTEXT, C, W)
    assert win.cu_seqlens_cpu.tolist() == [0, 10, 25, 40, 41]
    assert torch.equal(
        win.index, torch.from_numpy(sequence_conv_index(np.array(RANGES), np.array(CONTEXT), C))
    )
    assert win.index[10].tolist() == [7, 8, 9, 10] and win.index[25].tolist() == [-1, 3, 4, 25]
    traj = ConvWindows.trajectories([0, 5, 9], W)
    assert traj.context is None and traj.cu_seqlens_cpu.tolist() == [0, 5, 9]


def test_padded_conv_windows_keep_every_window():
    """The fused path's row bucket: the padded windows give the first C rows the same windows and
    the added rows one sequence of their own (reading nothing before it)."""
    for ranges, context, c in (
        (RANGES, CONTEXT, C),
        ([[0, 7]], [[-1, -1, -1]], 7),
        ([[0, 16]], [[-1] * 3], 16),
    ):
        win = ConvWindows.from_sequences(ranges, context, c, W)
        pad = win.padded(16)
        n = -(-c // 16) * 16
        assert pad.num_rows == n and pad.padded(16) is pad and win.padded(16) is pad
        assert torch.equal(pad.index[:c], win.index)
        lo = torch.arange(c, n)
        for j, row in enumerate(lo.tolist()):
            want = [-1] * max(0, W - 1 - j) + list(range(max(c, row - W + 1), row + 1))
            assert pad.index[row].tolist() == want
        assert int(pad.cu_seqlens_cpu[-1]) == n and torch.equal(pad.cu_seqlens, pad.cu_seqlens_cpu)


def test_conv_windows_reject_ranges_that_do_not_tile():
    with pytest.raises(InvalidInputError, match="tile"):
        ConvWindows.from_sequences([[0, 5], [6, 9]], [[-1] * 3] * 2, 9, W)
    with pytest.raises(InvalidInputError, match="context"):
        ConvWindows.from_sequences([[0, 5]], [[-1, -1, 7]], 5, W)


def _conv_with_initial_state(x, weight, win):
    """fla's kernel semantics in PyTorch: per sequence, a causal conv over [state[:, 1:], rows]."""
    state = _context_state(x, win.context, W)  # [N, D, W]
    cu = win.cu_seqlens_cpu.tolist()
    outs = []
    for n in range(len(cu) - 1):
        seq = torch.cat([state[n, :, 1:], x[cu[n] : cu[n + 1]].T], 1)[None]  # [1, D, W - 1 + L]
        outs.append(F.conv1d(seq, weight[:, None, :], groups=x.shape[1])[0].T)
    return F.silu(torch.cat(outs))


def test_initial_state_form_matches_the_gather_forward_and_backward():
    torch.manual_seed(0)
    win = ConvWindows.from_sequences(RANGES, CONTEXT, C, W)
    x = torch.randn(C, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, W, dtype=torch.float64, requires_grad=True)
    ref = causal_conv(x, w, win.index)
    got = _conv_with_initial_state(x, w, win)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(naive_varlen_causal_conv(x, w, win), ref, rtol=0, atol=0)
    dy = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, (x, w), dy)
    g_got = torch.autograd.grad(got, (x, w), dy)
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)  # context rows receive their consumers' gradient


def _set_backend(layer, backend):
    layer.config.backend = backend
    for m in layer.modules():
        if hasattr(m, "backend"):
            m.backend = backend


@pytest.mark.slow
@pytest.mark.skipif(not (_importable("triton") and _importable("fla")), reason="needs triton and fla-core")
def test_fused_features_match_the_reference_under_the_interpreter():
    code = triton_interpreter.prelude(
        "fla.modules.l2norm",
        "fla.modules.causal_conv1d",
        "fla.modules.fused_norm_gate",
        "fla.modules.layernorm",
        "fla.ops.kda.gate",
        "fla.ops.gated_delta_rule.gate",
    ) + textwrap.dedent(f"""
        import torch
        from harts_runtime.layers.gdn import CompactGatedDeltaNet, GatedDeltaNetConfig
        from harts_runtime.layers.kda import KDAConfig, KDALayer
        from harts_runtime.layout.conv import ConvWindows
        from harts_runtime.modules.norms import GatedRMSNorm, RMSNorm
        from tests.runtime.modules.test_fused_modules import _set_backend

        torch.manual_seed(0)
        win = ConvWindows.from_sequences({RANGES}, {CONTEXT}, {C}, {W})
        traj = ConvWindows.trajectories([0, 10, {C}], {W})
        layers = {{
            "kda": KDALayer(KDAConfig(hidden_size=32, num_heads=2, head_k_dim=16, head_v_dim=16, conv_size={W})),
            "gdn": CompactGatedDeltaNet(GatedDeltaNetConfig(hidden_size=32, num_k_heads=2, num_v_heads=4,
                                                            head_k_dim=16, head_v_dim=8)),
        }}
        for name, layer in layers.items():
            with torch.no_grad():
                for p in layer.parameters():
                    p.add_(0.1 * torch.randn_like(p))
            x = torch.randn({C}, 32, requires_grad=True)
            for windows, grad in ((win, False), (traj, True)):
                outs, grads = {{}}, {{}}
                for backend in ("triton", "naive"):
                    _set_backend(layer, backend)
                    feats = layer._features(x, windows)
                    outs[backend] = feats
                    if grad:
                        wts = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) for i, t in enumerate(feats)]
                        loss = sum((t.float() * w.float()).sum() for t, w in zip(feats, wts))
                        params = [x] + [p for _, p in layer.named_parameters()]
                        grads[backend] = torch.autograd.grad(loss, params, allow_unused=True)
                for i, (a, b) in enumerate(zip(outs["triton"], outs["naive"])):
                    err = (a.float() - b.float()).abs().max().item()
                    print(name, "out", i, err)
                    assert err < 1e-5, (name, i, err)
                if grad:
                    names = ["x"] + [n for n, _ in layer.named_parameters()]
                    for n, a, b in zip(names, grads["triton"], grads["naive"]):
                        assert (a is None) == (b is None), n
                        if a is not None:
                            err = ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()
                            print(name, "grad", n, err)
                            assert err < 1e-5, (name, n, err)
        for act in ("sigmoid", "silu"):
            norm = GatedRMSNorm(8, eps=1e-6, activation=act)
            with torch.no_grad():
                norm.weight.add_(torch.randn(8))
            o, z = torch.randn(20, 3, 8, requires_grad=True), torch.randn(20, 3, 8, requires_grad=True)
            res = {{}}
            for backend in ("triton", "naive"):
                norm.backend = backend
                y = norm(o, z)
                res[backend] = (y,) + torch.autograd.grad((y * torch.cos(y)).sum(), (o, z, norm.weight))
            for a, b in zip(res["triton"], res["naive"]):
                assert (a - b).abs().max().item() < 1e-5, act
        for zc in (False, True):
            norm = RMSNorm(8, 1e-6, zero_centered=zc)
            with torch.no_grad():
                norm.weight.add_(torch.randn(8))
            o = torch.randn(20, 8, requires_grad=True)
            res = {{}}
            for backend in ("triton", "naive"):
                norm.backend = backend
                y = norm(o)
                res[backend] = (y,) + torch.autograd.grad((y * torch.cos(y)).sum(), (o, norm.weight))
            for a, b in zip(res["triton"], res["naive"]):
                err = (a - b).abs().max().item()
                print("rmsnorm", zc, err)
                assert err < 1e-5, ("rmsnorm", zc, err)
    """)
    r = triton_interpreter.run(code)
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-3000:]


# Error ratios ||fused - reference|| / ||reference|| on CUDA (both layers over the same plan; the
# reference is every token-wise part in PyTorch with the reference chunked core in fp32).
CUDA_TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


def _cuda_tree(b):
    from harts_runtime.testing import FreshTokens

    t = FreshTokens()
    trunk = t(3 * b + 5)
    trajs = [trunk] + [trunk[:p] + t(b + 3) for p in (b - 1, b, b + 1, 2 * b + 7)]
    trajs.append(trajs[2][: b + 9] + t(40))  # nested fork
    return trajs


def _cuda_layer(kind: str, d: int, b: int):
    """A KDA or GDN layer at a production head shape (K = V = 128; GDN with grouped value heads)."""
    from harts_runtime.layers.gdn import CompactGatedDeltaNet, GatedDeltaNetConfig
    from harts_runtime.layers.kda import KDAConfig, KDALayer

    if kind == "kda":
        return KDALayer(KDAConfig(hidden_size=d, num_heads=4, head_k_dim=128, head_v_dim=128, chunk_size=b))
    return CompactGatedDeltaNet(
        GatedDeltaNetConfig(hidden_size=d, num_k_heads=2, num_v_heads=4, head_k_dim=128, head_v_dim=128)
    )


def _ratio(a, ref):
    return ((a.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_fused_layer_matches_reference_on_cuda(kind, dtype):
    """The whole layer on a compact tree plan (replay, handoffs, context rows as the convolution's
    initial states, their gradients included): fused path (auto on CUDA) vs the reference path."""
    import harts_planner as hp
    from harts_runtime.layout import KDAExecutionPlan, RowLayout

    b, d, dev = 64, 512, torch.device("cuda")
    torch.manual_seed(0)
    layer = _cuda_layer(kind, d, b)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    plan = hp.plan_calls(hp.RolloutBatch.from_token_lists(_cuda_tree(b)), chunk_size=b, conv_width=4)
    ep = KDAExecutionPlan.from_call_plan(plan).to(dev)
    assert ep.conv.context is not None and plan.replay_tokens > 0
    lay = RowLayout(ep.num_rows, kda=ep)
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(ep.num_rows, d, generator=gen, device=dev)
    w_out = torch.randn(ep.num_rows, d, generator=gen, device=dev)
    res = {}
    for backend, dt in (("auto", dtype), ("naive", torch.float32)):
        _set_backend(layer, backend)
        m = layer.to(dev, dt)
        xc = x.to(dt).requires_grad_(True)
        y = m(xc, lay)
        grads = torch.autograd.grad((y.float() * w_out).sum(), [xc] + list(m.parameters()))
        res[backend] = [y.detach().float()] + [g.float() for g in grads]
    names = ["y", "dx"] + ["d" + n for n, _ in layer.named_parameters()]
    errors = {n: _ratio(a, r) for n, a, r in zip(names, res["auto"], res["naive"])}
    print(kind, dtype, {n: f"{e:.2e}" for n, e in errors.items()})
    for n, e in errors.items():
        assert e < CUDA_TOL[dtype], (n, e)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_fused_compact_equals_fused_trajectory_on_cuda(kind):
    """bf16, fused path on both sides: the compact layer over a chunk-64 tree plan against the same
    layer on every trajectory unshared (``forward_trajectories``), outputs at every semantic
    position and all gradients (a compact row's gradient sums its semantic positions'). Measured
    on the H200 on a 65k-row swe-like microbatch (layer_speed.py): y 0, gradients <= 6.8e-3."""
    import harts_planner as hp
    from harts_runtime.layout import KDAExecutionPlan, RowLayout

    b, d, dev, dt = 64, 512, torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    layer = _cuda_layer(kind, d, b)
    layer = layer.to(dev, dt)
    plan = hp.plan_calls(hp.RolloutBatch.from_token_lists(_cuda_tree(b)), chunk_size=b, conv_width=4)
    ep = KDAExecutionPlan.from_call_plan(plan).to(dev)
    s2p = torch.from_numpy(np.asarray(plan.semantic_to_physical, dtype=np.int64)).to(dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(ep.num_rows, d, generator=gen, device=dev, dtype=dt)
    w_out = torch.randn(s2p.numel(), d, generator=gen, device=dev)
    params = list(layer.parameters())
    xc = x.clone().requires_grad_(True)
    y = layer(xc, RowLayout(ep.num_rows, kda=ep))[s2p]
    gc = torch.autograd.grad((y.float() * w_out).sum(), [xc] + params)
    xt = x.clone().requires_grad_(True)
    yt = layer.forward_trajectories(xt[s2p], plan.semantic_offsets)
    gt = torch.autograd.grad((yt.float() * w_out).sum(), [xt] + params)
    names = ["y", "dx"] + ["d" + n for n, _ in layer.named_parameters()]
    errors = {n: _ratio(a.float(), r.float()) for n, a, r in zip(names, [y, *gc], [yt, *gt])}
    print(kind, {n: f"{e:.2e}" for n, e in errors.items()})
    for n, e in errors.items():
        assert e < CUDA_TOL[torch.bfloat16], (n, e)


KEPT_VS_RECOMPUTED_RTOL = 5e-3
"""Relative Frobenius error of the output and gradients, kept rounds against full recomputation
(bf16): the recomputed core also computes the gated q and saves its WY factors and chunk states,
the kept one recomputes them in backward, through other argument signatures, which Triton
autotunes on their own. Bit-equal when the same configurations compile (the CPU interpreter);
otherwise about one bf16 rounding of the intermediates."""


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_kept_linear_attention_equals_full_recomputation_on_cuda(kind):
    """bf16, fused path: a block (the layer plus an identity FFN) under full recomputation and
    under ``keep=("linear_attention",)`` (fla's chunk kernels and our state scan keep their saves
    through the kept region's hooks): output and gradients within :data:`KEPT_VS_RECOMPUTED_RTOL`,
    the rounds run once instead of twice."""
    import harts_planner as hp
    from harts_runtime import apply_recompute
    from harts_runtime.layers import kda as kda_mod
    from harts_runtime.layout import KDAExecutionPlan, RowLayout

    class Block(torch.nn.Module):
        def __init__(self, mixer):
            super().__init__()
            self.mixer, self.ffn = mixer, torch.nn.Identity()

        def forward(self, x, layout):
            return self.ffn(self.mixer(x, layout))

    b, d, dev, dt = 64, 512, torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(_cuda_layer(kind, d, b))).to(dev, dt)
    plan = hp.plan_calls(hp.RolloutBatch.from_token_lists(_cuda_tree(b)), chunk_size=b, conv_width=4)
    ep = KDAExecutionPlan.from_call_plan(plan).to(dev)
    lay = RowLayout(ep.num_rows, kda=ep)
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(ep.num_rows, d, generator=gen, device=dev, dtype=dt)
    w_out = torch.randn(ep.num_rows, d, generator=gen, device=dev)
    runs, rounds = {}, kda_mod._run_rounds
    for keep in ((), ("linear_attention",)):
        apply_recompute(model, True, keep=keep)
        calls = []
        kda_mod._run_rounds = lambda *a, _f=rounds, _c=calls: (_c.append(1), _f(*a))[1]
        try:
            xc = x.clone().requires_grad_(True)
            y = model[0](xc, lay)
            grads = torch.autograd.grad((y.float() * w_out).sum(), [xc] + list(model.parameters()))
        finally:
            kda_mod._run_rounds = rounds
        runs[keep] = ([y.detach()] + list(grads), len(calls))
    (full, n_full), (kept, n_kept) = runs[()], runs[("linear_attention",)]
    assert (n_full, n_kept) == (2, 1)
    for i, (a, r) in enumerate(zip(kept, full)):
        assert _ratio(a.float(), r.float()) < KEPT_VS_RECOMPUTED_RTOL, (i, _ratio(a.float(), r.float()))


def test_unknown_backend_is_named():
    from harts_runtime.modules.fused import use_fla

    with pytest.raises(InvalidInputError, match="backend: unknown 'cuda'"):
        use_fla(torch.zeros(1), "cuda")
    assert use_fla(torch.zeros(1), "naive") is False
    assert use_fla(torch.zeros(1), "auto") is False  # CPU tensors take the reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zero_centered"])
@pytest.mark.parametrize(
    "dtype,wdtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
    ids=["fp32", "bf16", "bf16_fp32_weight"],
)
def test_fused_rms_norm_matches_reference_on_cuda(dtype, wdtype, zero_centered):
    """The block RMSNorm through fla's ``rms_norm`` against the float32 reference at the model width
    (bf16 activations with bf16 or fp32 weights, as ``ModelConfig.fp32_params`` keeps them)."""
    from harts_runtime.modules.norms import RMSNorm

    gen = torch.Generator(device="cuda").manual_seed(0)
    norm = RMSNorm(1536, 1e-6, zero_centered=zero_centered).cuda().to(wdtype)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(1536, device="cuda", generator=gen).to(wdtype))
    x0 = torch.randn(4096, 1536, device="cuda", generator=gen).to(dtype)
    g = torch.randn(4096, 1536, device="cuda", generator=gen)
    res = {}
    for backend in ("triton", "naive"):
        norm.backend, norm.weight.grad = backend, None
        x = x0.clone().requires_grad_()
        y = norm(x)
        assert y.dtype == dtype
        (y.float() * g).sum().backward()
        res[backend] = (y, x.grad, norm.weight.grad)
    for name, a, b in zip(("y", "dx", "dweight"), res["triton"], res["naive"]):
        assert _ratio(a, b) < CUDA_TOL[dtype], (name, _ratio(a, b))
