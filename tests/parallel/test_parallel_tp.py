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
    }


def _inputs(kind, batch):
    """Rows and the layout the layer reads (every layer is called as ``layer(x, layout)``)."""
    import harts_planner as hp
    from harts_runtime.layout import KDAExecutionPlan
    from harts_runtime.testing import views_from_batch

    if kind == "kda":
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


KINDS = ["gqa", "mqa", "mla", "mla_q_lora", "kda", "ffn"]


@pytest.fixture(scope="module")
def tp_results():
    return run_distributed(_tp_worker, 2, KINDS, timeout=120)


@pytest.mark.slow  # the module fixture runs every layer on 2 processes (seconds)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", KINDS)
def test_tensor_parallel_layer_matches_single_process(tp_results, kind, sp):
    # KDA keeps its decay and state math in float32 even for float64 inputs.
    tol = dict(rtol=1e-5, atol=1e-6) if kind == "kda" else dict(rtol=1e-9, atol=1e-9)
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
