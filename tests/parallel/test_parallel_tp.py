"""Tensor (+ sequence) parallel layers on 2 gloo processes vs the single-process layer.

Every layer kind runs in one 2-process job (to keep CI fast); for each kind and mode the worker
returns the TP output, the hidden-row gradient and every parameter gradient next to the matching
slice of the unsharded reference, and the parent checks them (float64, tight tolerances).
"""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from harts_runtime.layers.attention import AttentionConfig, CompactAttention
from harts_runtime.layers.mla import CompactMLA, MLAConfig
from harts_runtime.layout import RowLayout
from harts_runtime.parallel.dims import ParallelConfigError
from harts_runtime.parallel.launch import run_distributed
from harts_runtime.parallel.tensor import tensor_parallel_layer
from harts_runtime.testing import random_batch

D = 32


GDN_HEADS = dict(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6)


def _gdn(projection):
    from harts_runtime.layers.gdn import CompactGatedDeltaNet, GatedDeltaNetConfig

    return CompactGatedDeltaNet(
        GatedDeltaNetConfig(hidden_size=D, **GDN_HEADS, chunk_size=8, projection=projection)
    )


def _gated(num_kv_heads):
    from harts_runtime.layers.gated_attention import CompactGatedAttention, GatedAttentionConfig

    return CompactGatedAttention(
        GatedAttentionConfig(
            hidden_size=D, num_heads=4, num_kv_heads=num_kv_heads, head_dim=8, partial_rotary_factor=0.5
        )
    )


def _layers():
    from harts_runtime.layers.ffn import DenseFFN
    from harts_runtime.layers.kda import KDAConfig, KDALayer

    return {
        "gqa": lambda: CompactAttention(AttentionConfig(hidden_size=D, num_heads=4, num_kv_heads=2)),
        "mqa": lambda: CompactAttention(AttentionConfig(hidden_size=D, num_heads=4, num_kv_heads=1)),
        "mla": lambda: CompactMLA(
            MLAConfig(
                hidden_size=D,
                num_heads=2,
                kv_lora_rank=12,
                qk_nope_head_dim=6,
                qk_rope_head_dim=4,
                v_head_dim=5,
            )
        ),
        "mla_q_lora": lambda: CompactMLA(
            MLAConfig(
                hidden_size=D,
                num_heads=4,
                kv_lora_rank=8,
                qk_nope_head_dim=4,
                qk_rope_head_dim=6,
                v_head_dim=8,
                q_lora_rank=10,
            )
        ),
        "kda": lambda: KDALayer(
            KDAConfig(hidden_size=D, num_heads=4, head_k_dim=8, head_v_dim=8, chunk_size=8)
        ),
        "ffn": lambda: DenseFFN(D, 24),
        "gated_gqa": lambda: _gated(2),
        "gated_mqa": lambda: _gated(1),
        "gdn_fused": lambda: _gdn("fused"),
        "gdn_split": lambda: _gdn("split"),
    }


def _perturb(layer):
    """Random values for parameters initialised to constants (norm weights, ``dt_bias``), so the
    test sees their per-head / replicated structure."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight") or name == "dt_bias":
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _gdn_conv_rows(rank, world):
    """The rows of ``in_proj_qkv`` / ``conv1d.weight`` (q, k, v channels) a GDN TP rank keeps."""
    Hk, Hv, K, V = (GDN_HEADS[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"))
    hk, hv = Hk // world, Hv // world
    qk = torch.arange(rank * hk * K, (rank + 1) * hk * K)
    vv = torch.arange(rank * hv * V, (rank + 1) * hv * V)
    return torch.cat([qk, qk + Hk * K, vv + 2 * Hk * K])


def _inputs(kind, batch):
    """Rows and the layout the layer reads (every layer is called as ``layer(x, layout)``)."""
    import harts_planner as hp
    from harts_runtime.layout import KDAExecutionPlan
    from harts_runtime.testing import views_from_batch

    if kind == "kda" or kind.startswith("gdn"):
        plan = KDAExecutionPlan.from_call_plan(hp.plan_calls(batch, chunk_size=8, conv_width=4))
        return plan.num_rows, RowLayout(plan.num_rows, kda=plan)
    c = batch.compact_tokens
    if kind == "ffn":
        return c, RowLayout(c)
    views = views_from_batch(batch, "segments")
    return c, RowLayout(c, positions=torch.from_numpy(batch.row_depth.astype(np.int64)), views=views)


def _tp_worker(rank, world, kinds):
    import torch.distributed as dist

    from harts_runtime.parallel.comm import row_split

    torch.set_default_dtype(torch.float64)
    group = dist.group.WORLD
    batch = random_batch(13, num=9, max_new=8)
    out = {}
    for kind in kinds:
        for sp in (False, True):
            torch.manual_seed(0)
            ref = _layers()[kind]()
            _perturb(ref)
            n, layout = _inputs(kind, batch)
            g = torch.Generator().manual_seed(1)
            x = torch.randn(n, D, generator=g)
            w = torch.randn(n, D, generator=g)
            xr = x.clone().requires_grad_(True)
            (ref(xr, layout) * w).sum().backward()

            layer = tensor_parallel_layer(copy.deepcopy(ref), group, rank, world, sequence_parallel=sp)
            layer.zero_grad()
            if sp:
                sizes = row_split(n, world)
                rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
            else:
                rows = slice(0, n)
            xt = x[rows].clone().requires_grad_(True)
            y = layer(xt, layout)
            (y * w[rows]).sum().backward()
            grads = {}
            ref_params = dict(ref.named_parameters())
            for name, p in layer.named_parameters():
                r = ref_params[name]
                if p.shape == r.shape:
                    grads[name] = (
                        "partial" if getattr(p, "_harts_tp_partial", False) else "full",
                        p.grad,
                        r.grad,
                    )
                elif kind.startswith("gdn") and name in ("in_proj_qkv.weight", "conv1d.weight"):
                    grads[name] = ("shard", p.grad, r.grad.index_select(0, _gdn_conv_rows(rank, world)))
                else:
                    dim = next(i for i in range(p.dim()) if p.shape[i] != r.shape[i])
                    per = p.shape[dim]
                    grads[name] = ("shard", p.grad, r.grad.narrow(dim, rank * per, per))
            out[(kind, sp)] = {
                "y": y.detach(),
                "y_ref": ref(x, layout).detach()[rows],
                "dx": xt.grad,
                "dx_ref": xr.grad[rows],
                "grads": grads,
            }
    return out


KINDS = ["gqa", "mqa", "mla", "mla_q_lora", "kda", "ffn", "gated_gqa", "gated_mqa", "gdn_fused", "gdn_split"]


@pytest.fixture(scope="module")
def tp_results():
    return run_distributed(_tp_worker, 2, KINDS, timeout=120)


@pytest.mark.slow  # the module fixture runs every layer on 2 processes (seconds)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", KINDS)
def test_tensor_parallel_layer_matches_single_process(tp_results, kind, sp):
    # KDA and GDN keep their decay and state math in float32 even for float64 inputs, and the
    # q/k norms of gated attention (and GDN's gated norm) compute in float32 as transformers' do.
    # GDN's larger gradients (unit-scale random weights through its float32 core) need 10x more.
    f32 = ("kda", "gated_gqa", "gated_mqa")
    if kind.startswith("gdn"):
        tol = dict(rtol=1e-4, atol=1e-5)
    else:
        tol = dict(rtol=1e-5, atol=1e-6) if kind in f32 else dict(rtol=1e-9, atol=1e-9)
    for rank, res in enumerate(tp_results):
        r = res[(kind, sp)]
        torch.testing.assert_close(
            r["y"], r["y_ref"], **tol, msg=lambda m, rank=rank: f"rank {rank} output: {m}"
        )
        torch.testing.assert_close(
            r["dx"], r["dx_ref"], **tol, msg=lambda m, rank=rank: f"rank {rank} d hidden: {m}"
        )
    names = tp_results[0][(kind, sp)]["grads"].keys()
    kinds_seen = set()
    for name in names:
        mode = tp_results[0][(kind, sp)]["grads"][name][0]
        kinds_seen.add(mode)
        if mode == "partial":
            total = sum(res[(kind, sp)]["grads"][name][1] for res in tp_results)
            torch.testing.assert_close(
                total,
                tp_results[0][(kind, sp)]["grads"][name][2],
                **tol,
                msg=lambda m, n=name: f"d{n} (sum of TP partials): {m}",
            )
        else:
            for rank, res in enumerate(tp_results):
                _, got, want = res[(kind, sp)]["grads"][name]
                torch.testing.assert_close(
                    got, want, **tol, msg=lambda m, n=name, r=rank: f"rank {r} d{n}: {m}"
                )
    assert "shard" in kinds_seen


def test_tp_degree_must_divide_heads():
    layer = CompactAttention(AttentionConfig(hidden_size=D, num_heads=6, num_kv_heads=3))
    with pytest.raises(ParallelConfigError) as e:
        tensor_parallel_layer(layer, None, 0, 2)
    assert e.value.field == "tp"
    with pytest.raises(ParallelConfigError) as e:
        tensor_parallel_layer(nn.Linear(3, 3), None, 0, 2)
    assert e.value.field == "module"


@pytest.mark.parametrize("projection", ["fused", "split"])
def test_tp_degree_must_divide_gdn_key_heads(projection):
    from harts_runtime.layers.gdn import CompactGatedDeltaNet, GatedDeltaNetConfig

    c = GatedDeltaNetConfig(
        hidden_size=D, num_k_heads=3, num_v_heads=6, head_k_dim=8, head_v_dim=8, projection=projection
    )
    with pytest.raises(ParallelConfigError) as e:
        tensor_parallel_layer(CompactGatedDeltaNet(c), None, 0, 2)
    assert e.value.field == "num_k_heads"


def test_tp_degree_must_divide_gated_attention_heads():
    from harts_runtime.layers.gated_attention import CompactGatedAttention, GatedAttentionConfig

    layer = CompactGatedAttention(
        GatedAttentionConfig(hidden_size=D, num_heads=6, num_kv_heads=3, head_dim=8)
    )
    with pytest.raises(ParallelConfigError) as e:
        tensor_parallel_layer(layer, None, 0, 2)
    assert e.value.field == "tp"
    layer = CompactGatedAttention(
        GatedAttentionConfig(hidden_size=D, num_heads=3, num_kv_heads=1, head_dim=8)
    )
    with pytest.raises(ParallelConfigError) as e:
        tensor_parallel_layer(layer, None, 0, 2)
    assert e.value.field == "num_heads"
