"""Our KDA layer has fla's ``KimiDeltaAttention`` parameters (flash-linear-attention 0.6.0) and its math.

* everywhere fla-core is importable: our state dict's keys and shapes equal what fla's layer
  constructor builds, derived from fla-core's own modules (``ShortConvolution``,
  ``FusedRMSNormGated``) and fla's layer structure;
* where fla's layer is importable (the ``fla`` extra): its state dict loads into ours with
  ``strict=True`` and no key map, and, under ``TRITON_INTERPRET=1`` on the CPU (fla's layer runs
  only through Triton), forward and backward on a few packed trajectories match ours (our
  trajectory layout, the reference KDA core) in every output and parameter gradient.
"""

import importlib.util
import textwrap

import pytest
import torch
import triton_interpreter
from torch import nn

from harts_runtime.layers.kda import KDAConfig, KDALayer

D, H, K, V, W, B = 32, 2, 16, 16, 4, 16  # model width, heads, key / value head dims, conv width, chunk
EPS = 1e-5


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def ours() -> KDALayer:
    return KDALayer(
        KDAConfig(
            hidden_size=D, num_heads=H, head_k_dim=K, head_v_dim=V, conv_size=W, chunk_size=B, norm_eps=EPS
        )
    )


def fla_shapes() -> dict:
    """Key -> shape of ``fla.layers.kda.KimiDeltaAttention(hidden_size=D, head_dim=K, expand_v=V / K,
    num_heads=H, conv_size=W)`` (``num_v_heads = H``, short convolutions without bias), from the
    modules its constructor builds: torch's ``nn.Linear`` / ``nn.Sequential`` and fla-core's
    ``ShortConvolution`` and ``FusedRMSNormGated``; ``A_log`` [num_v_heads] and ``dt_bias``
    [num_v_heads * head_k_dim] are plain parameters."""
    fla_modules = pytest.importorskip("fla.modules", reason="needs fla-core")
    conv = lambda c: fla_modules.ShortConvolution(hidden_size=c, kernel_size=W, bias=False, activation="silu")
    parts = {
        "q_proj": nn.Linear(D, H * K, bias=False),
        "k_proj": nn.Linear(D, H * K, bias=False),
        "v_proj": nn.Linear(D, H * V, bias=False),
        "q_conv1d": conv(H * K),
        "k_conv1d": conv(H * K),
        "v_conv1d": conv(H * V),
        "f_proj": nn.Sequential(nn.Linear(D, V, bias=False), nn.Linear(V, H * K, bias=False)),
        "b_proj": nn.Linear(D, H, bias=False),
        "g_proj": nn.Sequential(nn.Linear(D, V, bias=False), nn.Linear(V, H * V, bias=True)),
        "o_norm": fla_modules.FusedRMSNormGated(V, activation="sigmoid", eps=EPS),
        "o_proj": nn.Linear(H * V, D, bias=False),
    }
    shapes = {f"{name}.{k}": tuple(t.shape) for name, m in parts.items() for k, t in m.state_dict().items()}
    shapes.update({"A_log": (H,), "dt_bias": (H * K,)})
    return shapes


def test_parameter_names_and_shapes_are_fla_kimi_delta_attention():
    want = fla_shapes()
    got = {k: tuple(t.shape) for k, t in ours().state_dict().items()}
    assert got == want


@pytest.mark.skipif(not _importable("fla.layers"), reason="needs flash-linear-attention (the fla extra)")
def test_fla_state_dict_loads_strictly_without_a_key_map():
    from fla.layers.kda import KimiDeltaAttention

    torch.manual_seed(0)
    theirs = KimiDeltaAttention(
        hidden_size=D, head_dim=K, expand_v=V / K, num_heads=H, conv_size=W, norm_eps=EPS
    )
    sd = theirs.state_dict()
    assert {k: tuple(t.shape) for k, t in sd.items()} == fla_shapes()  # the derivation above is fla's
    layer = ours()
    layer.load_state_dict(sd, strict=True)
    for k, t in layer.state_dict().items():
        assert torch.equal(t, sd[k]), k


@pytest.mark.slow
@pytest.mark.skipif(
    not (_importable("triton") and _importable("fla.layers")),
    reason="needs triton and flash-linear-attention (interpreter check)",
)
def test_forward_and_backward_match_fla_under_the_interpreter():
    """fla's layer (its Triton short convolution, gated norm and chunk_kda with the gate, the L2
    norm and beta's sigmoid in the kernel) under TRITON_INTERPRET=1 against ours (the reference
    KDA core at chunk size B) on packed trajectories of 70, 25 and 1 tokens, from fla's weights."""
    code = triton_interpreter.prelude("fla.layers.kda") + textwrap.dedent(f"""
        import torch
        from fla.layers.kda import KimiDeltaAttention
        from harts_runtime.layers.kda import KDAConfig, KDALayer
        from harts_runtime.layout import KDAExecutionPlan, RowLayout

        D, H, K, V, W, B, EPS = {D}, {H}, {K}, {V}, {W}, {B}, {EPS}
        torch.manual_seed(0)
        theirs = KimiDeltaAttention(hidden_size=D, head_dim=K, expand_v=V / K, num_heads=H, conv_size=W,
                                    norm_eps=EPS)
        ours = KDALayer(KDAConfig(hidden_size=D, num_heads=H, head_k_dim=K, head_v_dim=V, conv_size=W,
                                  chunk_size=B, norm_eps=EPS))
        ours.load_state_dict(theirs.state_dict(), strict=True)
        offsets = [0, 70, 95, 96]
        S = offsets[-1]
        g = torch.Generator().manual_seed(1)
        x, w = torch.randn(S, D, generator=g), torch.randn(S, D, generator=g)
        xa = x.clone().requires_grad_(True)
        o = theirs(xa[None], cu_seqlens=torch.tensor(offsets))[0][0]
        (o * w).sum().backward()
        xb = x.clone().requires_grad_(True)
        y = ours(xb, RowLayout(S, kda=KDAExecutionPlan.trivial(offsets, B, W)))
        (y * w).sum().backward()
        ratio = lambda a, b: ((a - b).double().pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt()).item()
        errors = {{"y": ratio(y, o), "dx": ratio(xb.grad, xa.grad)}}
        grads = dict(theirs.named_parameters())
        for name, p in ours.named_parameters():
            errors["d" + name] = ratio(p.grad, grads[name].grad)
        for name, e in errors.items():
            print(name, e)
            assert e < 2e-5, (name, e)
    """)
    r = triton_interpreter.run(code)
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-3000:]


# Error ratios ||ours - fla|| / ||fla|| allowed on CUDA: both run Triton kernels (ours: fla's stages
# with our state scan, the gate / L2 norm / sigmoid outside the kernel; fla's: all fused in).
CUDA_TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.gpu
@pytest.mark.skipif(not _importable("fla.layers"), reason="needs flash-linear-attention (the fla extra)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_and_backward_match_fla_on_cuda(dtype):
    """fla's KimiDeltaAttention and our KDA layer (Triton core) with the same weights, on packed
    trajectories of 700, 300, 64 and 1 tokens at a production head shape (K = V = 128, chunk 64)."""
    from fla.layers.kda import KimiDeltaAttention

    from harts_runtime.layout import KDAExecutionPlan, RowLayout

    d, h, k, w, b = 512, 4, 128, 4, 64
    torch.manual_seed(0)
    dev = torch.device("cuda")
    theirs = KimiDeltaAttention(
        hidden_size=d, head_dim=k, expand_v=1.0, num_heads=h, conv_size=w, norm_eps=EPS
    )
    mine = KDALayer(
        KDAConfig(
            hidden_size=d, num_heads=h, head_k_dim=k, head_v_dim=k, conv_size=w, chunk_size=b, norm_eps=EPS
        )
    )
    mine.load_state_dict(theirs.state_dict(), strict=True)
    theirs, mine = theirs.to(dev, dtype), mine.to(dev, dtype)
    offsets = [0, 700, 1000, 1064, 1065]
    s = offsets[-1]
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(s, d, generator=g, device=dev, dtype=dtype)
    wt = torch.randn(s, d, generator=g, device=dev, dtype=dtype)
    xa = x.clone().requires_grad_(True)
    o = theirs(xa[None], cu_seqlens=torch.tensor(offsets, device=dev, dtype=torch.int32))[0][0]
    (o.float() * wt.float()).sum().backward()
    xb = x.clone().requires_grad_(True)
    y = mine(xb, RowLayout(s, kda=KDAExecutionPlan.trivial(offsets, b, w).to(dev)))
    (y.float() * wt.float()).sum().backward()

    def ratio(a, ref):
        return ((a.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item()

    errors = {"y": ratio(y, o), "dx": ratio(xb.grad, xa.grad)}
    theirs_grads = dict(theirs.named_parameters())
    for name, p in mine.named_parameters():
        errors["d" + name] = ratio(p.grad, theirs_grads[name].grad)
    print({n: f"{e:.2e}" for n, e in errors.items()})
    for name, e in errors.items():
        assert e < CUDA_TOL[dtype], (name, e)
