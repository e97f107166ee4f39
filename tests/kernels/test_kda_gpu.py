"""KDA ChunkLA on the GPU path (Triton state scan + fla 0.6.0 stages). The CUDA cases are marked
``gpu`` and skipped without CUDA; the interpreter cases run the same Triton path on the CPU
(``TRITON_INTERPRET=1``, when triton and fla-core are installed; marked ``slow``: seconds each), and
the launcher checks need only triton.

Errors are reported as ``rmse(got - ref) / rms(ref)`` per tensor (fla's test metric) against
named tolerances, and printed, so one batch run on the device shows every number.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("HARTS_TEST_FULL_AUTOTUNE", "0") != "1":
    # Correctness tests only: tune nothing (first config of every kernel, ours and fla's), so a
    # cold machine compiles one variant per kernel instead of every autotune candidate.
    # Speed is measured in benchmarks/kda_rounds.py with full autotuning.
    from harts_kernels.tuning import use_first_config_only

    use_first_config_only()

from harts_kernels.kda import chunk_kda_with_states, naive_chunk_kda_with_states

_skip_without_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def needs_cuda(test):
    """Mark a test ``gpu`` (it needs CUDA) and skip it without CUDA."""
    return pytest.mark.gpu(_skip_without_cuda(test))


NAMES = ("o", "final", "states", "dq", "dk", "dv", "dg", "dbeta", "dh0")
# Tolerances on the error ratio, per dtype and tensor. fp32 inputs still go through TF32 dots.
TOL = {
    torch.bfloat16: {
        "o": 6e-3,
        "final": 6e-3,
        "states": 6e-3,
        "dq": 1e-2,
        "dk": 1e-2,
        "dv": 1e-2,
        "dg": 2e-2,
        "dbeta": 2e-2,
        "dh0": 1e-2,
    },
    torch.float32: {
        "o": 3e-3,
        "final": 3e-3,
        "states": 3e-3,
        "dq": 5e-3,
        "dk": 5e-3,
        "dv": 5e-3,
        "dg": 1e-2,
        "dbeta": 1e-2,
        "dh0": 5e-3,
    },
}


def err_ratio(ref, got):
    ref, got = ref.double(), got.double()
    return ((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def assert_close(name, ref, got, tol):
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    e = err_ratio(ref, got)
    print(f"  {name:7s} err_ratio={e:.3e} (tol {tol:.1e})")
    assert e <= tol, f"{name}: err_ratio {e:.3e} > {tol:.1e}"


def make(lens, H, K, V, dtype, seed=0, device="cuda"):
    g_ = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(lens)
    q = torch.randn(1, T, H, K, generator=g_)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g_), dim=-1)
    v = torch.randn(1, T, H, V, generator=g_)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, K, generator=g_) + 3.0)  # decays in (0, 1)
    beta = torch.rand(1, T, H, generator=g_)
    h0 = torch.randn(len(lens), H, K, V, generator=g_) * 0.1
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    xs = [t.to(device, dtype) for t in (q, k, v, g, beta)]
    return xs, h0.to(device), cu


def fwd_bwd(xs, h0, cu, B, rs, rc, backend, seed=1):
    leaves = [t.detach().clone().requires_grad_(True) for t in xs + [h0]]
    o, ft, bs = chunk_kda_with_states(
        *leaves[:5],
        initial_state=leaves[5],
        cu_seqlens=cu,
        chunk_size=B,
        request_seq=rs,
        request_chunk=rc,
        backend=backend,
    )
    g_ = torch.Generator(device=o.device).manual_seed(seed)
    w_o = torch.randn(o.shape, generator=g_, device=o.device)
    w_f = torch.randn(ft.shape, generator=g_, device=o.device)
    w_s = torch.randn(bs.shape, generator=g_, device=o.device)
    loss = (o.float() * w_o).sum() + (ft * w_f).sum() + (bs * w_s).sum()
    loss.backward()
    return [o.float(), ft, bs] + [t.grad.float() for t in leaves]


CASES = [
    # (lens, H, K, V, chunk_size, requests (seq, chunk))
    ([512], 2, 64, 64, 64, [(0, 1), (0, 4), (0, 8)]),
    ([300, 64, 1, 129, 200], 4, 128, 128, 64, [(0, 1), (0, 4), (1, 1), (3, 2), (4, 3), (0, 1)]),
    ([100, 250, 33], 2, 128, 64, 32, [(0, 3), (1, 7), (1, 1), (2, 1)]),
    ([64, 64, 64], 2, 32, 32, 64, []),
]
IDS = [f"lens{len(c[0])}-H{c[1]}-K{c[2]}-V{c[3]}-B{c[4]}-R{len(c[5])}" for c in CASES]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("lens,H,K,V,B,req", CASES, ids=IDS)
def test_triton_matches_reference(lens, H, K, V, B, req, dtype):
    xs, h0, cu = make(lens, H, K, V, dtype)
    rs, rc = [r[0] for r in req], [r[1] for r in req]
    ref = fwd_bwd([t.float() for t in xs], h0, cu, B, rs, rc, "naive")
    tri = fwd_bwd(xs, h0, cu, B, rs, rc, "triton")
    print(f"\n[{dtype}] lens={lens} H={H} K={K} V={V} B={B} R={len(req)}")
    for name, a, b in zip(NAMES, ref, tri):
        if a.numel():
            assert_close(name, a, b, TOL[dtype][name])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_matches_fla_chunk_kda_when_nothing_requested(dtype):
    from fla.ops.kda import chunk_kda

    xs, h0, cu = make([700, 64, 333, 1], 4, 128, 128, dtype, seed=2)
    ours = fwd_bwd(xs, h0, cu, 64, [], [], "triton", seed=5)
    leaves = [t.detach().clone().requires_grad_(True) for t in xs + [h0]]
    o, ft = chunk_kda(
        *leaves[:5],
        initial_state=leaves[5],
        output_final_state=True,
        cu_seqlens=torch.tensor(cu, device="cuda", dtype=torch.long),
    )
    g_ = torch.Generator(device="cuda").manual_seed(5)
    w_o = torch.randn(o.shape, generator=g_, device="cuda")
    w_f = torch.randn(ft.shape, generator=g_, device="cuda")
    ((o.float() * w_o).sum() + (ft * w_f).sum()).backward()
    theirs = [o.float(), ft] + [t.grad.float() for t in leaves]
    print(f"\n[{dtype}] vs fla.ops.kda.chunk_kda")
    for name, a, b in zip(
        ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"), theirs, ours[:2] + ours[3:]
    ):
        assert_close(name, a, b, 2e-3)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_split_at_boundary_and_resume_reproduces_unsplit(dtype):
    """Forward: the tail resumed from the returned S_c gives the unsplit outputs and final state.
    Backward: the gradients through the handoff equal the unsplit gradients."""
    B, L, c = 64, 777, 5
    cut = c * B
    xs, h0, _ = make([L], 4, 128, 128, dtype, seed=3)
    g_ = torch.Generator(device="cuda").manual_seed(4)
    w_o = torch.randn(1, L, 4, 128, generator=g_, device="cuda")
    w_f = torch.randn(1, 4, 128, 128, generator=g_, device="cuda")

    def run(split):
        leaves = [t.detach().clone().requires_grad_(True) for t in xs + [h0]]
        if split:
            o1, _, st = chunk_kda_with_states(
                *[t[:, :cut] for t in leaves[:5]],
                initial_state=leaves[5],
                chunk_size=B,
                request_seq=[0],
                request_chunk=[c],
                backend="triton",
            )
            o2, ft, _ = chunk_kda_with_states(
                *[t[:, cut:] for t in leaves[:5]], initial_state=st, chunk_size=B, backend="triton"
            )
            o = torch.cat([o1, o2], 1)
        else:
            o, ft, _ = chunk_kda_with_states(
                *leaves[:5],
                initial_state=leaves[5],
                chunk_size=B,
                request_seq=[0],
                request_chunk=[c],
                backend="triton",
            )
        ((o.float() * w_o).sum() + (ft * w_f).sum()).backward()
        return [o.float(), ft] + [t.grad.float() for t in leaves]

    tol = 1e-5 if dtype == torch.float32 else 2e-3
    print(f"\n[{dtype}] split at boundary {c} and resume")
    for name, a, b in zip(("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"), run(False), run(True)):
        assert_close(name, a, b, tol)


@needs_cuda
def test_requested_state_equals_reference_state_exactly_in_fp32_layout():
    xs, h0, cu = make([256, 130], 2, 64, 64, torch.float32, seed=6)
    _, _, bs = chunk_kda_with_states(
        *xs, initial_state=h0, cu_seqlens=cu, request_seq=[0, 1, 0], request_chunk=[4, 2, 1], backend="triton"
    )
    _, _, ref = naive_chunk_kda_with_states(
        *xs, initial_state=h0, cu_seqlens=cu, request_seq=[0, 1, 0], request_chunk=[4, 2, 1]
    )
    assert bs.dtype == torch.float32 and bs.shape == (3, 2, 64, 64)
    assert_close("states", ref, bs, 3e-3)


# --------------------------------------------------------------------------- interpreter (CPU)
def _have(mod):
    try:
        __import__(mod)
        return True
    except Exception:  # noqa: BLE001 - any import failure means: skip
        return False


def _interpret(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter under ``TRITON_INTERPRET=1`` with one intra-op thread (its
    tensors are tiny: a thread team only adds contention, many times over on a busy 2-core box)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900, check=False
    )


INTERP_CASES = [
    # (H, K, V, B, cu_seqlens, requests (seq, chunk)) -- unsorted, duplicated, final boundaries.
    # Under the interpreter a case costs about its (chunk, head, key block, value block) programs, so
    # each shape is the smallest that still crosses its paths: several sequences of several chunks,
    # partial last chunks, initial states, every key-register count (K = 32 and 64: one 64-row block,
    # 96: two, 200: four), a masked value block (V = 48 at BV = 32), H > 1, both chunk sizes, no
    # requests at all.
    (1, 32, 32, 64, [0, 70, 100, 164], [(0, 1), (2, 1), (2, 1), (0, 1)]),
    (2, 96, 48, 32, [0, 70, 102], [(1, 1), (0, 1), (1, 1), (0, 2)]),
    (1, 200, 32, 32, [0, 64], [(0, 2), (0, 1), (0, 1)]),
    (1, 64, 64, 32, [0, 40, 64], []),
]


@pytest.mark.slow
@pytest.mark.skipif(
    not (_have("triton") and _have("fla")), reason="needs triton and fla-core (interpreter check)"
)
@pytest.mark.parametrize(
    "H,K,V,B,cu,req",
    INTERP_CASES,
    ids=[f"H{c[0]}-K{c[1]}-V{c[2]}-B{c[3]}-N{len(c[4]) - 1}-R{len(c[5])}" for c in INTERP_CASES],
)
def test_triton_path_under_interpreter_matches_reference(H, K, V, B, cu, req):
    """The whole GPU path (fla stages + our state-scan kernels) under TRITON_INTERPRET=1 on CPU,
    forward and backward (gradients arriving at every output, final and requested state), against
    the fp32 chunked reference. Key dims of 1, 2 and 4 register blocks, a masked value block.
    ``save_intermediates=True`` (the forward's WY factors, gated q/k and chunk states kept for
    backward instead of recomputed) gives the same outputs and gradients bit for bit."""
    code = textwrap.dedent(f"""
        import os, torch
        import triton.runtime.autotuner as at
        at.Autotuner._bench = lambda self, *a, **k: [0.0, 0.0, 0.0]   # the interpreter cannot time
        from harts_kernels.kda import chunk_kda_with_states
        g_ = torch.Generator().manual_seed(0)
        H, K, V, B, cu, req = {H}, {K}, {V}, {B}, {cu}, {req}
        T = cu[-1]
        xs = [torch.randn(1, T, H, K, generator=g_),
              torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g_), dim=-1),
              torch.randn(1, T, H, V, generator=g_), -torch.rand(1, T, H, K, generator=g_) * 0.3,
              torch.rand(1, T, H, generator=g_), torch.randn(len(cu) - 1, H, K, V, generator=g_)]
        outs = {{}}
        for backend, save in (("naive", False), ("triton", False), ("triton", True)):
            lv = [t.clone().requires_grad_(True) for t in xs]
            o, ft, bs = chunk_kda_with_states(*lv[:5], initial_state=lv[5], cu_seqlens=cu, chunk_size=B,
                                              request_seq=[r[0] for r in req],
                                              request_chunk=[r[1] for r in req], backend=backend,
                                              save_intermediates=save)
            assert bs.shape == (len(req), H, K, V), bs.shape
            w = torch.Generator().manual_seed(1)
            ((o * torch.randn(o.shape, generator=w)).sum() + (ft * torch.randn(ft.shape, generator=w)).sum()
             + (bs * torch.randn(bs.shape, generator=w)).sum()).backward()
            outs[backend, save] = [o, ft, bs] + [t.grad for t in lv]
        names = ("o", "final", "states", "dq", "dk", "dv", "dg", "dbeta", "dh0")
        for name, a, b in zip(names, outs["triton", False], outs["triton", True]):
            assert torch.equal(a, b), ("save_intermediates changed", name)
        for name, a, b in zip(names, outs["naive", False], outs["triton", False]):
            if a.numel() == 0:
                continue
            e = ((a - b).double().pow(2).mean().sqrt() / a.double().pow(2).mean().sqrt()).item()
            print(name, e)
            assert e < 1e-5, (name, e)
    """)
    r = _interpret(code)
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(
    not (_have("triton") and _have("fla")), reason="needs triton and fla-core (interpreter check)"
)
def test_triton_core_in_a_recomputed_block_saves_its_intermediates_under_interpreter():
    """The Triton path (TRITON_INTERPRET=1) inside ``checkpoint(ops.keep.recomputed, ...)``, as
    ``apply_recompute`` runs a block: the first forward and the recomputation save the
    intermediates (the checkpoint needs the same saves in both; the first forward's are
    discarded), the backward uses the recomputation's (no WY recomputation, no second scan), and
    loss and every gradient are bit-equal to the plain call."""
    code = textwrap.dedent("""
        import torch
        import triton.runtime.autotuner as at
        at.Autotuner._bench = lambda self, *a, **k: [0.0, 0.0, 0.0]
        from torch.utils.checkpoint import checkpoint
        import harts_kernels.kda.chunk as chunk
        from harts_kernels.kda import chunk_kda_with_states
        from harts_runtime.ops.keep import recomputed, saves_are_transient
        seen = {"fwd": [], "bwd": []}
        fwd, bwd = chunk._fla_fwd, chunk._fla_bwd
        def spy_fwd(*a, **k):
            out = fwd(*a, **k)
            seen["fwd"].append(out[-1] is not None)
            return out
        def spy_bwd(*a, **k):
            seen["bwd"].append(a[-1] is not None)
            return bwd(*a, **k)
        chunk._fla_fwd, chunk._fla_bwd = spy_fwd, spy_bwd
        g_ = torch.Generator().manual_seed(0)
        H, K, V, B, cu = 1, 32, 32, 32, [0, 70]  # one sequence of three chunks, one boundary state
        T = cu[-1]
        xs = [torch.randn(1, T, H, K, generator=g_),
              torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g_), dim=-1),
              torch.randn(1, T, H, V, generator=g_), -torch.rand(1, T, H, K, generator=g_) * 0.3,
              torch.rand(1, T, H, generator=g_), torch.randn(1, H, K, V, generator=g_)]
        w = torch.randn(1, T, H, V, generator=torch.Generator().manual_seed(1))
        def block(*lv):
            o, ft, bs = chunk_kda_with_states(*lv[:5], initial_state=lv[5], cu_seqlens=cu, chunk_size=B,
                                              request_seq=[0], request_chunk=[1], backend="triton",
                                              save_intermediates=saves_are_transient())
            return (o * w).sum() + ft.square().sum() + bs.sum()
        outs = {}
        for mode in ("plain", "recomputed"):
            lv = [t.clone().requires_grad_(True) for t in xs]
            loss = block(*lv) if mode == "plain" else checkpoint(recomputed, True, block, *lv, use_reentrant=False)
            loss.backward()
            outs[mode] = [loss.detach()] + [t.grad for t in lv]
        assert seen == {"fwd": [False, True, True], "bwd": [False, True]}, seen
        for a, b in zip(outs["plain"], outs["recomputed"]):
            assert torch.equal(a, b)
        print("OK")
    """)
    r = _interpret(code)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


# --------------------------------------------------------------------------- layer over a plan (GPU)
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_compact_equals_trajectory_wise_on_triton(dtype):
    """The KDA layer over a real call plan (replay, handoffs, conv context) on the Triton path
    equals every trajectory run unshared through the same layer, forward and backward."""
    import random

    import numpy as np

    import harts_planner as hp
    from harts_runtime.layers.kda import KDAConfig, KDALayer
    from harts_runtime.layout import KDAExecutionPlan, RowLayout
    from harts_runtime.testing import FreshTokens

    B, rng, fresh = 64, random.Random(0), FreshTokens()

    trajs = [fresh(400)]
    for p in (B - 1, B, B + 1, 2 * B + 5, 2 * B + 7, 300):  # forks around chunk edges
        trajs.append(trajs[0][:p] + fresh(rng.randint(1, 200)))
    trajs.append(trajs[-1][:330] + fresh(90))  # nested fork
    trajs += [fresh(70), fresh(1)]  # another tree, a single token
    batch = hp.RolloutBatch.from_token_lists(trajs)
    plan = hp.plan_calls(batch, chunk_size=B, conv_width=4)
    assert plan.num_calls >= 2 and plan.replay_tokens > 0
    torch.manual_seed(0)
    layer = (
        KDALayer(
            KDAConfig(
                hidden_size=256, num_heads=4, head_k_dim=64, head_v_dim=64, chunk_size=B, backend="triton"
            )
        )
        .cuda()
        .to(dtype)
    )
    layout = RowLayout(plan.compact_tokens, kda=KDAExecutionPlan.from_call_plan(plan, device="cuda"))
    s2p = torch.from_numpy(np.asarray(plan.semantic_to_physical, dtype=np.int64)).cuda()
    x = torch.randn(plan.compact_tokens, 256, device="cuda", dtype=dtype)
    w = torch.randn(len(s2p), 256, device="cuda", dtype=dtype)
    params = [p for _, p in layer.named_parameters()]
    xc = x.clone().requires_grad_(True)
    y = layer(xc, layout)[s2p]
    gc = torch.autograd.grad((y.float() * w.float()).sum(), [xc] + params)
    xt = x.clone().requires_grad_(True)
    yt = layer.forward_trajectories(xt[s2p], plan.semantic_offsets)
    gt = torch.autograd.grad((yt.float() * w.float()).sum(), [xt] + params)
    tol = {torch.float32: {"y": 3e-3, "grad": 6e-3}, torch.bfloat16: {"y": 2e-2, "grad": 3e-2}}[dtype]
    assert_close("y", yt, y, tol["y"])
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, gt, gc):
        assert_close(f"d{name}", a, b, tol["grad"])


@pytest.mark.skipif(not _have("triton"), reason="needs triton")
def test_use_first_config_only_keeps_one_candidate():
    import triton
    import triton.language as tl

    from harts_kernels.tuning import use_first_config_only

    use_first_config_only()
    configs = [triton.Config({"B": b}, num_warps=w) for b in (16, 32) for w in (2, 4)]

    @triton.autotune(configs=configs, key=["n"])
    @triton.jit
    def kernel(x, n, B: tl.constexpr):
        pass

    assert len(kernel.configs) == 1 and kernel.configs[0].kwargs == {"B": 16}


@pytest.mark.skipif(not _have("triton"), reason="needs triton")
def test_state_scan_rejects_malformed_requests_before_launch():
    """The launchers check the request arrays (dtype, lengths) and the boundary-gradient rows
    before any kernel runs, naming the field."""
    from harts_kernels.kda.state_scan import state_scan_bwd, state_scan_fwd

    T, H, K, V = 64, 1, 32, 32
    x, u = torch.zeros(1, T, H, K), torch.zeros(1, T, H, V)
    cu, co = torch.tensor([0, T]), torch.tensor([0, 1])
    good = tuple(torch.tensor(a, dtype=torch.int32) for a in ([0, 1], [1], [0]))
    with pytest.raises(ValueError, match="requests"):
        state_scan_fwd(x, x, u, x, None, cu, co, 1, 64, False, requests=(good[0].long(), *good[1:]))
    with pytest.raises(ValueError, match="requests"):
        state_scan_fwd(
            x,
            x,
            u,
            x,
            None,
            cu,
            co,
            1,
            64,
            False,
            requests=(torch.tensor([0, 1, 1], dtype=torch.int32), *good[1:]),
        )
    with pytest.raises(ValueError, match="d_boundary"):
        state_scan_bwd(
            x,
            x,
            x,
            x,
            u,
            u,
            1.0,
            None,
            None,
            cu,
            co,
            1,
            64,
            requests=good,
            d_boundary=torch.zeros(2, H, K, V),
        )
