"""Hybrid model: flavors and config errors, the chunked LM-head log-probs against materialised
logits, MoE expert-load counts under recomputation, and the FLOP model against brute force."""

import numpy as np
import pytest
import torch

import harts_planner as hp
from harts_runtime import ConfigError, HybridModel, StepInputs, apply_recompute, model_config, run_microbatch
from harts_runtime.flops import attended_keys, layer_costs, model_flops, work_compression
from harts_runtime.layout import TreeOrder, lm_chunks
from harts_runtime.loss.logprobs import lm_head_logprobs
from harts_runtime.models.hybrid import FFN_BUILDERS, FFNS, MIXER_BUILDERS, MIXERS
from harts_runtime.testing import random_trajectories, tree_dense_mask

TOL_LP = (1e-12, 1e-10)  # float64 chunked vs materialised log-probs and their gradients


pytestmark = pytest.mark.usefixtures("one_thread")


def test_ling_tiny_matches_table_1():
    c = model_config("ling-tiny")
    assert c.num_layers == 24
    assert c.mixers == (("kda",) * 3 + ("mla",)) * 6  # 6 x (3 KDA + 1 MLA)
    assert c.ffns == ("dense",) + ("moe",) * 23  # layer 1 dense, 2-24 MoE
    assert (c.hidden_size, c.num_heads, c.dense_intermediate) == (1536, 16, 4608)
    assert (c.num_experts, c.top_k, c.expert_intermediate, c.num_shared_experts) == (128, 8, 512, 1)
    # Ling-3.0-tiny's public sizes: 7.9B parameters, 1.3B active (meta device: no memory)
    m = HybridModel(c, device="meta")
    total = sum(p.numel() for p in m.parameters())
    routed = sum(
        p.numel() for n, p in m.named_parameters() if n.split(".")[-1] in ("w_gate", "w_up", "w_down")
    )
    active = total - routed + routed * c.top_k // c.num_experts
    assert abs(total / 7.9e9 - 1) < 0.02 and abs(active / 1.3e9 - 1) < 0.02, (total, active)
    assert (c.conv_size, c.chunk_size, c.vocab_size, c.dtype) == (4, 64, 157_184, "bfloat16")
    r = model_config("ling-tiny", num_layers=8)
    assert r.mixers == (("kda",) * 3 + ("mla",)) * 2 and r.ffns == ("dense",) + ("moe",) * 7


def test_qwen35_flavor_has_the_public_shape():
    c = model_config("qwen3.5-35b-a3b")
    assert c.num_layers == 40 and c.mixers == (("gdn",) * 3 + ("gated_attention",)) * 10
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (2048, 16, 2, 256)
    assert (c.gdn_num_k_heads, c.gdn_num_v_heads, c.gdn_head_k_dim, c.gdn_head_v_dim) == (16, 32, 128, 128)
    assert (c.num_experts, c.top_k, c.expert_intermediate, c.num_shared_experts) == (256, 8, 512, 1)
    m = HybridModel(c, device="meta")  # 35B parameters, about 3B active (embeddings included)
    total = sum(p.numel() for p in m.parameters())
    routed = sum(
        p.numel() for n, p in m.named_parameters() if n.split(".")[-1] in ("w_gate", "w_up", "w_down")
    )
    active = total - routed + routed * c.top_k // c.num_experts
    assert abs(total / 35e9 - 1) < 0.03 and 3e9 < active < 3.6e9, (total, active)
    assert model_config("qwen3.5-35b-a3b", num_layers=8).mixers == (("gdn",) * 3 + ("gated_attention",)) * 2


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"flavor": "nope"}, "flavor"),
        ({"flavor": "ling-tiny", "num_layers": 25}, "num_layers"),
        ({"flavor": "debug", "mixers": ("kda", "rnn", "kda", "mla")}, "mixers[1]"),
        ({"flavor": "debug", "ffns": ("dense",)}, "ffns"),
        ({"flavor": "debug", "top_k": 9}, "top_k"),
        ({"flavor": "debug", "dtype": "float16"}, "dtype"),
        ({"flavor": "debug", "bogus": 1}, "bogus"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        model_config(**kwargs)
    assert e.value.field == field and isinstance(e.value, ValueError)


def test_builder_tables_cover_every_layer_name():
    assert set(MIXER_BUILDERS) == set(MIXERS) and set(FFN_BUILDERS) == set(FFNS)


def test_any_layer_pattern_builds_and_runs():
    from harts_runtime import step_logprobs

    cfg = model_config(
        "debug", mixers=("gqa", "kda", "kda", "mla", "kda"), ffns=("moe", "dense", "moe", "moe", "dense")
    )
    model = HybridModel(cfg)
    assert [b.mixer_kind for b in model.blocks] == list(cfg.mixers)
    batch = hp.RolloutBatch.from_token_lists(random_trajectories(np.random.default_rng(0), num=5, max_new=12))
    lp = step_logprobs(model, StepInputs.synthetic(batch, 0), "compact")
    assert lp.shape == (batch.semantic_tokens - batch.num_trajectories,) and bool((lp < 0).all())


@pytest.mark.parametrize("rows", [1, 3, 7, 100])
def test_chunked_lm_head_equals_materialised_log_softmax(rows):
    g = torch.Generator().manual_seed(rows)
    n, d, v, p = 11, 6, 13, 40
    h = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True)
    row_index = torch.randint(0, n, (p,), generator=g)  # shared rows, own labels
    labels = torch.randint(0, v, (p,), generator=g)
    gout = torch.randn(p, generator=g, dtype=torch.float64)
    lp = lm_head_logprobs(h, w, row_index, labels, lm_chunks(row_index.numpy(), n, rows), rows)
    dh, dw = torch.autograd.grad((lp * gout).sum(), [h, w])
    ref = (h @ w.t()).log_softmax(-1)[row_index, labels]
    rh, rw = torch.autograd.grad((ref * gout).sum(), [h, w])
    for name, a, b in (("logprobs", lp, ref), ("dhidden", dh, rh), ("dweight", dw, rw)):
        torch.testing.assert_close(a, b, atol=TOL_LP[0], rtol=TOL_LP[1], msg=lambda m, n=name: f"{n}: {m}")


def test_moe_counts_accumulate_once_with_recomputation():
    batch = hp.RolloutBatch.from_token_lists(random_trajectories(np.random.default_rng(1), num=6, max_new=10))
    step = StepInputs.synthetic(batch, 0)
    counts = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = apply_recompute(HybridModel(model_config("debug")), recompute)
        run_microbatch(model, step, np.arange(batch.num_trajectories), "compact")
        counts.append(
            torch.stack([b.ffn.local_tokens_per_expert.clone() for b in model.blocks if b.ffn_kind == "moe"])
        )
    torch.testing.assert_close(counts[0], counts[1], atol=0, rtol=0)
    # every semantic position is counted top_k times per MoE layer (multiplicity weighting)
    assert counts[0].sum(1).tolist() == [2.0 * batch.semantic_tokens] * counts[0].shape[0]


def test_attended_keys_equals_brute_force_tree_mask():
    for seed in range(5):
        batch = hp.RolloutBatch.from_token_lists(
            random_trajectories(np.random.default_rng(seed), num=9, max_new=8)
        )
        mask = tree_dense_mask(TreeOrder.from_batch(batch))  # [C, C] ancestor-or-self
        assert attended_keys(batch.row_depth) == int(mask.sum())
        lengths = np.asarray(batch.lengths)
        assert attended_keys(np.concatenate([np.arange(n) for n in lengths])) == sum(
            int(np.tril(np.ones((n, n))).sum()) for n in lengths
        )
        plan = hp.plan_calls(batch, 8, conv_width=4)
        assert attended_keys(plan.position_ids) == int(mask.sum())


@pytest.mark.parametrize("mixer", ["kda", "gdn", "mla", "gqa", "gated_attention"])
def test_mixer_flops_count_every_projection_of_the_module(mixer):
    """Per-row matmul FLOPs of each mixer = 2 x the weights of its linear layers (from the built
    module); the convolution and the linear-attention core are added by formula."""
    cfg = model_config("debug", mixers=(mixer,) * 2, ffns=("dense",) * 2, kda_num_heads=3, head_dim=8)
    model = HybridModel(cfg)
    mod = model.blocks[0].mixer
    linear = sum(m.weight.numel() for m in mod.modules() if isinstance(m, torch.nn.Linear))
    b = cfg.chunk_size
    extra = 0
    if mixer == "kda":
        h, k = cfg.kda_num_heads, cfg.kda_head_dim
        extra = 2 * cfg.conv_size * 3 * h * k + h * (4 * b * k + 2 * b * k + 6 * k * k)
    elif mixer == "gdn":
        hk, hv, k, v = cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_head_k_dim, cfg.gdn_head_v_dim
        extra = 2 * cfg.conv_size * (2 * hk * k + hv * v) + hv * (4 * b * k + 2 * b * v + 6 * k * v)
    assert layer_costs(cfg)["per_layer"][mixer] == 2 * linear + extra
    assert layer_costs(cfg)["row"] > 0


def test_model_flops_equal_a_per_row_brute_force_sum():
    cfg = model_config("debug")
    costs = layer_costs(cfg)
    per = costs["per_layer"]
    positions = np.array([0, 1, 2, 2, 3, 7])
    brute = 0.0
    for p in positions:
        for m, f in zip(cfg.mixers, cfg.ffns):
            brute += per[m] + per[f] + (per[f"{m}_per_key"] * (p + 1) if m != "kda" else 0)
        brute += per["lm_head"]
    assert model_flops(cfg, len(positions), attended_keys(positions), training=False) == pytest.approx(
        brute, rel=1e-12
    )
    # no sharing: ideal work compression 1; sharing: above row compression (shared rows sit early)
    lens = [5, 7]
    w = work_compression(cfg, lens, [np.arange(5), np.arange(7)])
    assert w["ideal_work_compression"] == pytest.approx(1.0)
    trunk = list(range(100))
    batch = hp.RolloutBatch.from_token_lists([trunk + [1000 + i] for i in range(4)])
    plan = hp.plan_calls(batch, 8, conv_width=4)
    w = work_compression(cfg, batch.lengths, [plan.position_ids])
    assert w["row_compression"] == pytest.approx(batch.semantic_tokens / batch.compact_tokens)
    assert w["ideal_work_compression"] > 1.0
