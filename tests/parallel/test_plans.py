"""Single-process oracle of the tensor-parallel plans (:mod:`harts_runtime.parallel.plans`) and of
the layers' head counts read from their (local) weights.

For every layer kind of ``TP_PLANS`` (GQA, MQA, MLA with and without a query latent, KDA with and
without its output-gate bias, fused and split GDN with grouped value heads, gated GQA and MQA,
Mamba2 with grouped B / C (whole groups per rank), the dense and relu2 FFNs) at tp = 2 and 4, in float64
on the CPU with the reference backends: each rank's local parameters are built from the full ones by the
plan (``Shard(d)``: chunk ``r`` of dim ``d``; ``Replicate()``: the full tensor) and the layer's
ordinary forward runs on them through :func:`torch.func.functional_call` (plain tensors swapped in,
the config untouched). What TP's collectives would do is then checked by sums over ranks:

* the outputs (row-parallel partial sums) add up to the full output;
* a sharded parameter's local gradient is the matching chunk of the full gradient;
* a replicated parameter's gradients (each rank's partial) add up to the full gradient;
* the input-row gradients add up to the full input gradient.

And ``LayerPlan.check`` (or the plan itself) rejects a tp that does not divide the head field.
"""

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.func import functional_call

from harts_runtime.errors import ParallelConfigError
from harts_runtime.layers.attention import AttentionConfig, CompactAttention
from harts_runtime.layers.ffn import DenseFFN
from harts_runtime.layers.gated_attention import CompactGatedAttention, GatedAttentionConfig
from harts_runtime.layers.gdn import CompactGatedDeltaNet, GatedDeltaNetConfig
from harts_runtime.layers.kda import KDAConfig, KDALayer
from harts_runtime.layers.mamba2 import Mamba2Config, Mamba2Mixer
from harts_runtime.layers.mla import CompactMLA, MLAConfig
from harts_runtime.layers.relu2_mlp import Relu2MLP
from harts_runtime.layout import KDAExecutionPlan, RowLayout
from harts_runtime.parallel.plans import TP_PLANS, LayerPlan, tp_plan
from harts_runtime.testing import random_batch, views_from_batch

hp = pytest.importorskip("harts_planner")

pytestmark = pytest.mark.usefixtures("one_thread")

D = 16
CHUNK = 8
TOL = dict(rtol=1e-9, atol=1e-11)
"""float64 layers: only the order of the row-parallel sum differs."""
TOL_F32 = dict(rtol=1e-5, atol=1e-6)
"""Layers that compute in float32 inside (the KDA / GDN decay and core, the gated output norms,
gated attention's q/k norms, as transformers' do): float32 rounding differs with the number of heads
in a batched op and in a summed gradient (measured: at most 1.3e-6 absolute, on values up to 20 to
55; the float64 layers 7e-15); a misplaced head is off by order 1."""

LAYERS = {
    # name: (factory, tp degrees, tolerance)
    "gqa": (
        lambda: CompactAttention(AttentionConfig(hidden_size=D, num_heads=8, num_kv_heads=4, head_dim=4)),
        (2, 4),
        TOL,
    ),
    "mqa": (
        lambda: CompactAttention(AttentionConfig(hidden_size=D, num_heads=4, num_kv_heads=1, head_dim=4)),
        (2, 4),
        TOL,
    ),
    "mla": (
        lambda: CompactMLA(
            MLAConfig(
                hidden_size=D,
                num_heads=4,
                kv_lora_rank=6,
                qk_nope_head_dim=4,
                qk_rope_head_dim=2,
                v_head_dim=3,
            )
        ),
        (2, 4),
        TOL,
    ),
    "mla_q_lora": (
        lambda: CompactMLA(
            MLAConfig(
                hidden_size=D,
                num_heads=4,
                kv_lora_rank=6,
                qk_nope_head_dim=2,
                qk_rope_head_dim=4,
                v_head_dim=3,
                q_lora_rank=5,
            )
        ),
        (2, 4),
        TOL,
    ),
    "kda": (
        lambda: KDALayer(
            KDAConfig(
                hidden_size=D, num_heads=4, head_k_dim=4, head_v_dim=3, chunk_size=CHUNK, backend="naive"
            )
        ),
        (2, 4),
        TOL_F32,
    ),
    "kda_no_gate_bias": (  # Kimi-Linear's KDA: no output-gate bias (the plan places none)
        lambda: KDALayer(
            KDAConfig(
                hidden_size=D,
                num_heads=4,
                head_k_dim=4,
                head_v_dim=3,
                chunk_size=CHUNK,
                backend="naive",
                output_gate_bias=False,
            )
        ),
        (2, 4),
        TOL_F32,
    ),
    "gdn_fused": (lambda: _gdn("fused"), (2, 4), TOL_F32),
    "gdn_split": (lambda: _gdn("split"), (2, 4), TOL_F32),
    "gated_gqa": (lambda: _gated(num_heads=8, num_kv_heads=4), (2, 4), TOL_F32),
    "gated_mqa": (lambda: _gated(num_heads=4, num_kv_heads=1), (2, 4), TOL_F32),
    "ffn": (lambda: DenseFFN(D, 12), (2, 4), TOL),
    "mamba2": (lambda: _mamba2(n_groups=4), (2, 4), TOL_F32),  # 2 heads per group
    "relu2": (lambda: Relu2MLP(D, 12), (2, 4), TOL),
}


def _mamba2(**kw):
    c = Mamba2Config(
        hidden_size=D, num_heads=8, head_dim=3, state_size=4, chunk_size=CHUNK, backend="naive", **kw
    )
    return Mamba2Mixer(c)


def _gdn(projection):
    c = GatedDeltaNetConfig(
        hidden_size=D,
        num_k_heads=4,
        num_v_heads=8,
        head_k_dim=4,
        head_v_dim=3,
        projection=projection,
        chunk_size=CHUNK,
        backend="naive",
    )
    return CompactGatedDeltaNet(c)


def _gated(**heads):
    c = GatedAttentionConfig(hidden_size=D, head_dim=4, partial_rotary_factor=0.5, **heads)
    return CompactGatedAttention(c)


def test_every_planned_layer_kind_is_covered():
    built = {type(make()) for make, _, _ in LAYERS.values()}
    assert built == set(TP_PLANS)


@pytest.fixture(scope="module")
def layouts():
    """The two layouts of one random rollout batch: the KDA plan's (KDA, GDN) and the attention
    views' (attention layers; the FFN reads none)."""
    batch = random_batch(13, num=6, max_new=6)
    plan = KDAExecutionPlan.from_call_plan(hp.plan_calls(batch, chunk_size=CHUNK, conv_width=4))
    c = batch.compact_tokens
    positions = torch.from_numpy(batch.row_depth.astype(np.int64))
    attn = RowLayout(c, positions=positions, views=views_from_batch(batch, "segments"))
    return {"kda": RowLayout(plan.num_rows, kda=plan), "attention": attn}


def _perturb(layer: torch.nn.Module) -> None:
    """Random values for parameters initialised to constants (norm weights, ``dt_bias``, biases)
    so that their per-head or replicated structure shows."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _local(full: torch.Tensor, placement, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s local tensor of ``full`` under ``placement`` (a leaf requiring grad)."""
    if isinstance(placement, Shard):
        full = torch.chunk(full, tp, dim=placement.dim)[rank]
    else:
        assert isinstance(placement, Replicate), placement
    return full.detach().clone().requires_grad_(True)


def _run(layer, params, x, w, layout):
    """Output and the gradients of ``sum(y * w)`` w.r.t. x and ``params`` (a name -> tensor dict)."""
    x = x.detach().clone().requires_grad_(True)
    y = functional_call(layer, params, (x, layout))
    grads = torch.autograd.grad((y * w).sum(), [x, *params.values()])
    return y.detach(), grads[0], dict(zip(params, grads[1:]))


CASES = [(kind, tp) for kind, (_, tps, _) in LAYERS.items() for tp in tps]


@pytest.mark.parametrize(("kind", "tp"), CASES, ids=[f"{k}-tp{t}" for k, t in CASES])
def test_plan_shards_sum_to_the_full_layer(layouts, kind, tp):
    make, _, tol = LAYERS[kind]
    torch.manual_seed(0)
    layer = make().double()
    _perturb(layer)
    plan = tp_plan(layer, tp)
    assert plan is not None
    layout = layouts[
        "kda" if isinstance(layer, (KDALayer, CompactGatedDeltaNet, Mamba2Mixer)) else "attention"
    ]
    n = layout.num_rows
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    w = torch.randn(n, D, generator=g, dtype=torch.float64)
    full = {name: p.detach() for name, p in layer.named_parameters()}
    y, dx, dparams = _run(layer, {k: _local(t, Replicate(), 0, 1) for k, t in full.items()}, x, w, layout)

    ranks = []
    for r in range(tp):
        local = {name: _local(t, plan.placements[name], r, tp) for name, t in full.items()}
        ranks.append(_run(layer, local, x, w, layout))
    where = f"{kind} tp={tp}"
    torch.testing.assert_close(sum(o[0] for o in ranks), y, **tol, msg=lambda m: f"{where} output: {m}")
    torch.testing.assert_close(sum(o[1] for o in ranks), dx, **tol, msg=lambda m: f"{where} d input: {m}")
    kinds = set()
    for name, placement in plan.placements.items():
        if isinstance(placement, Shard):
            kinds.add("shard")
            for r, (_, _, local) in enumerate(ranks):
                want = torch.chunk(dparams[name], tp, dim=placement.dim)[r]
                torch.testing.assert_close(
                    local[name], want, **tol, msg=lambda m, r=r, n=name: f"{where} rank {r} d{n}: {m}"
                )
        else:
            kinds.add("replicate")
            total = sum(o[2][name] for o in ranks)
            torch.testing.assert_close(
                total, dparams[name], **tol, msg=lambda m, n=name: f"{where} d{n} (sum over ranks): {m}"
            )
    assert "shard" in kinds


# ------------------------------------------------------------------------------ errors
BAD = {
    # name: (layer, tp, the field named)
    "gqa_heads": (
        lambda: CompactAttention(AttentionConfig(hidden_size=D, num_heads=3, num_kv_heads=1)),
        2,
        "num_heads",
    ),
    "gqa_kv_heads": (
        lambda: CompactAttention(AttentionConfig(hidden_size=D, num_heads=6, num_kv_heads=3)),
        2,
        "num_kv_heads",
    ),
    "gated_heads": (lambda: _gated(num_heads=3, num_kv_heads=1), 2, "num_heads"),
    "gated_kv_heads": (lambda: _gated(num_heads=4, num_kv_heads=2), 4, "num_kv_heads"),
    "mla_heads": (
        lambda: CompactMLA(
            MLAConfig(
                hidden_size=D,
                num_heads=3,
                kv_lora_rank=6,
                qk_nope_head_dim=4,
                qk_rope_head_dim=2,
                v_head_dim=3,
            )
        ),
        2,
        "num_heads",
    ),
    "kda_heads": (
        lambda: KDALayer(KDAConfig(hidden_size=D, num_heads=3, head_k_dim=4, head_v_dim=4)),
        2,
        "num_heads",
    ),
    "gdn_fused_k_heads": (
        lambda: CompactGatedDeltaNet(
            GatedDeltaNetConfig(hidden_size=D, num_k_heads=3, num_v_heads=6, head_k_dim=4, head_v_dim=4)
        ),
        2,
        "num_k_heads",
    ),
    "gdn_split_k_heads": (
        lambda: CompactGatedDeltaNet(
            GatedDeltaNetConfig(
                hidden_size=D, num_k_heads=2, num_v_heads=4, head_k_dim=4, head_v_dim=4, projection="split"
            )
        ),
        4,
        "num_k_heads",
    ),
    "ffn_width": (lambda: DenseFFN(D, 10), 4, "intermediate_size"),
    "mamba2_groups": (lambda: _mamba2(n_groups=2), 4, "n_groups"),  # a rank would split a group
    "relu2_width": (lambda: Relu2MLP(D, 10), 4, "intermediate_size"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_tp_must_divide_the_head_field(case):
    make, tp, field = BAD[case]
    layer = make()
    with pytest.raises(ParallelConfigError) as e:
        TP_PLANS[type(layer)](layer, tp).check(layer, tp)
    assert e.value.field == field
    assert tp_plan(layer, 1) is not None  # tp = 1 always divides


def test_plan_must_place_every_parameter():
    layer = DenseFFN(D, 12)
    plan = tp_plan(layer, 2)
    partial = LayerPlan({k: v for k, v in plan.placements.items() if k != "down.weight"}, plan.divides)
    with pytest.raises(ParallelConfigError) as e:
        partial.check(layer, 2)
    assert e.value.field == "module" and "down.weight" in str(e.value)
    biased = _gated(num_heads=4, num_kv_heads=2)
    biased.o_proj.bias = torch.nn.Parameter(torch.zeros(D))
    with pytest.raises(ParallelConfigError) as e:
        tp_plan(biased, 2)
    assert e.value.field == "attention_bias"
