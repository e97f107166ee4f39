"""Hybrid model: flavors and config errors, the chunked LM-head log-probs against materialised
logits, MoE expert-load counts under recomputation, and the FLOP model against brute force."""

import dataclasses
import importlib.util
import textwrap

import numpy as np
import pytest
import torch
import triton_interpreter

import harts_planner as hp
from harts_runtime import ConfigError, HybridModel, StepInputs, apply_recompute, model_config, run_microbatch
from harts_runtime.engine import microbatch_call_plan
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
    assert (c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size, c.moe.num_shared_experts) == (
        128,
        8,
        512,
        1,
    )
    # Ling-3.0-tiny's public sizes: 7.9B parameters, 1.3B active (meta device: no memory)
    m = HybridModel(c, device="meta")
    total = sum(p.numel() for p in m.parameters())
    routed = sum(
        p.numel() for n, p in m.named_parameters() if n.split(".")[-1] in ("w_gate", "w_up", "w_down")
    )
    active = total - routed + routed * c.moe.top_k // c.moe.num_experts
    assert abs(total / 7.9e9 - 1) < 0.02 and abs(active / 1.3e9 - 1) < 0.02, (total, active)
    assert (c.conv_size, c.chunk_size, c.vocab_size, c.dtype) == (4, 64, 157_184, "bfloat16")
    r = model_config("ling-tiny", num_layers=8)
    assert r.mixers == (("kda",) * 3 + ("mla",)) * 2 and r.ffns == ("dense",) + ("moe",) * 7


def test_qwen35_flavor_has_the_public_shape():
    c = model_config("qwen3.5-35b-a3b")
    assert c.num_layers == 40 and c.mixers == (("gdn",) * 3 + ("gated_attention",)) * 10
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.gated_attention.head_dim) == (2048, 16, 2, 256)
    g = c.gdn
    assert (g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim) == (16, 32, 128, 128)
    assert (c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size, c.moe.num_shared_experts) == (
        256,
        8,
        512,
        1,
    )
    m = HybridModel(c, device="meta")  # 35B parameters, about 3B active (embeddings included)
    total = sum(p.numel() for p in m.parameters())
    routed = sum(
        p.numel() for n, p in m.named_parameters() if n.split(".")[-1] in ("w_gate", "w_up", "w_down")
    )
    active = total - routed + routed * c.moe.top_k // c.moe.num_experts
    assert abs(total / 35e9 - 1) < 0.03 and 3e9 < active < 3.6e9, (total, active)
    assert model_config("qwen3.5-35b-a3b", num_layers=8).mixers == (("gdn",) * 3 + ("gated_attention",)) * 2


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"flavor": "nope"}, "flavor"),
        ({"flavor": "ling-tiny", "num_layers": 25}, "num_layers"),
        ({"flavor": "debug", "mixers": ("kda", "rnn", "kda", "mla")}, "mixers[1]"),
        ({"flavor": "debug", "ffns": ("dense",)}, "ffns"),
        ({"flavor": "debug", "moe": {"top_k": 9}}, "moe.top_k"),
        ({"flavor": "debug", "moe": {"num_expertz": 8}}, "moe.num_expertz"),
        ({"flavor": "debug", "moe": 8}, "moe"),
        ({"flavor": "debug", "gdn": {"num_k_heads": 3, "num_v_heads": 4}}, "gdn.num_v_heads"),
        ({"flavor": "debug", "kda": {"head_k_dim": 0}}, "kda.head_k_dim"),
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


def test_option_groups_nest_merge_and_pass_through_to_the_layers():
    """Each mixer / FFN kind's options are one group of the config: set as the dataclass or a dict
    (a dict over the flavor's group keeps its other fields), copied per config, and passed through
    to the layer's own config by the model's builders."""
    from harts_runtime.layers.moe import MoEConfig
    from harts_runtime.models import ModelConfig
    from harts_runtime.models.hybrid.args import KDAArgs, MoEArgs

    c = model_config("ling-tiny", 2, moe={"num_experts": 64})
    assert (c.moe.num_experts, c.moe.top_k, c.moe.score_func) == (64, 8, "sigmoid")
    assert ModelConfig(moe={"num_experts": 8}).moe == MoEArgs(num_experts=8)
    d = model_config("debug", kda=KDAArgs(num_heads=3, head_k_dim=4, head_v_dim=6))
    assert d.replace(vocab_size=100).kda is not d.kda  # configs never share a group
    model = HybridModel(d.replace(moe={"num_shared_experts": 1}))
    kda = model.blocks[0].mixer.config
    assert (kda.num_heads, kda.head_k_dim, kda.head_v_dim, kda.chunk_size) == (3, 4, 6, d.chunk_size)
    moe = model.moe_layers()[0].config
    per_layer = ("swiglu_limits", "shared_swiglu_limits")  # the layer gets its entry (none: 0)
    want = MoEConfig(
        hidden_size=d.hidden_size,
        accumulate_counts=False,
        **{k: v for k, v in vars(d.moe).items() if k not in per_layer},
    )
    assert moe == dataclasses.replace(want, num_shared_experts=1)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


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


FUSED_LM_HEAD_TOL = (2e-5, 1e-5)
"""(atol, rtol) fp32, fla's cross-entropy kernels (under the interpreter) against the PyTorch chunk
loop: the same logits, the logsumexp over 64k-column blocks then a reduction (PyTorch: one
max-shifted sum), the fork rows' moved target gradients in a second accumulation; rounding only."""


@pytest.mark.slow
@pytest.mark.skipif(not _importable("fla"), reason="needs fla-core and triton (interpreter check)")
@pytest.mark.parametrize("v", [300, 70_000], ids=["one_block", "split_vocab"])
def test_fused_lm_head_matches_the_reference_under_the_interpreter(v):
    """fla's cross-entropy kernels (``fla_kernels=True``, TRITON_INTERPRET=1) against the PyTorch
    chunk loop: log-probs and the hidden / weight gradients, fp32, with rows that have no target,
    rows whose targets share a label, fork rows whose targets have two or three labels, and chunks
    that split the rows unevenly; a vocabulary in one 64k block and one split over two (fla's
    partial logsumexps and their reduction, labels on both sides of the block edge)."""
    code = triton_interpreter.prelude("fla.modules.fused_cross_entropy.ops") + textwrap.dedent("""
        import torch
        from harts_runtime.layout import lm_chunks
        from harts_runtime.loss.logprobs import lm_head_logprobs
        g = torch.Generator().manual_seed(0)
        n, d, v, rows = 37, 16, VOCAB, 8
        h = torch.randn(n, d, generator=g)
        w = torch.randn(v, d, generator=g) * 0.5
        row_index = torch.cat([torch.arange(0, 30, 2), torch.arange(0, 30, 2), torch.tensor([5, 5, 5, 7, 7, 36])])
        labels = torch.randint(0, v, (row_index.numel(),), generator=g)
        labels[15:30] = labels[:15]  # two targets with one label on each even row
        labels[30:33] = torch.tensor([1, 1, 2])  # fork rows: two labels, then two distinct ones
        labels[33:35] = torch.tensor([3, 4])
        labels[:4] = torch.tensor([9, 10, 11, v - 1])  # forks of the even rows 0..6
        if v > 65536:  # a fork across fla's 64k-column block edge
            labels[33:35] = torch.tensor([65535, 65536])
        gout = torch.randn(row_index.numel(), generator=g)
        out = {}
        for backend in ("naive", "triton"):
            hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
            lp = lm_head_logprobs(hl, wl, row_index, labels, lm_chunks(row_index.numpy(), n, rows), rows,
                                  fla_kernels=backend == "triton")
            dh, dw = torch.autograd.grad((lp * gout).sum(), [hl, wl])
            out[backend] = (lp, dh, dw)
        assert out["naive"][1][1].abs().sum() == 0 and out["naive"][1][36].abs().sum() > 0  # no target, target
        for name, a, b in zip(("logprobs", "dhidden", "dweight"), out["triton"], out["naive"]):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: n + ": " + m)
        print("OK")
        """)
    for key, value in (("ATOL", FUSED_LM_HEAD_TOL[0]), ("RTOL", FUSED_LM_HEAD_TOL[1]), ("VOCAB", v)):
        code = code.replace(key, repr(value))
    r = triton_interpreter.run(code)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


FUSED_LM_HEAD_CUDA_RTOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
"""Relative Frobenius error, fla's kernels vs the PyTorch chunk loop on CUDA: fp32 to rounding; in
bf16 both read the same bf16 logits and reduce in fp32, both round each logit gradient to bf16
once (fork rows' moved gradients twice), then the same bf16 GEMMs: ~2^-9 at most."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_lm_head_matches_the_reference_on_cuda(dtype):
    """ling-tiny's vocabulary (157,184 columns: three 64k blocks and fla's split reduction),
    4,096 rows in chunks of 2,048 with shared and forked targets: log-probs and gradients of the
    fused path against the PyTorch loop, and the fused path's peak memory below the loop's (no
    float32 [rows, V] temporaries)."""
    if not _importable("fla"):
        pytest.skip("needs fla-core")
    dev, n, d, v, rows = torch.device("cuda"), 4096, 1536, 157_184, 2048
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(n, d, generator=g, device=dev).to(dtype)
    w = (torch.randn(v, d, generator=g, device=dev) * 0.02).to(dtype)
    row_index = torch.cat([torch.arange(n, device=dev), torch.arange(0, n, 3, device=dev)])
    labels = torch.randint(0, v, (row_index.numel(),), generator=g, device=dev)
    labels[n : n + 700] = labels[0 : 3 * 700 : 3]  # the same label on 700 rows, forks elsewhere
    gout = torch.randn(row_index.numel(), generator=g, device=dev)
    chunks = lm_chunks(row_index.cpu().numpy(), n, rows)
    out, peak = {}, {}
    for backend in ("naive", "triton"):
        hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp = lm_head_logprobs(hl, wl, row_index, labels, chunks, rows, fla_kernels=backend == "triton")
        dh, dw = torch.autograd.grad((lp * gout).sum(), [hl, wl])
        torch.cuda.synchronize()
        peak[backend] = torch.cuda.max_memory_allocated() - base
        out[backend] = (lp.float(), dh.float(), dw.float())
    for name, a, b in zip(("logprobs", "dhidden", "dweight"), out["triton"], out["naive"]):
        err = ((a - b).double().norm() / b.double().norm()).item()
        print(dtype, name, f"{err:.2e}")
        assert err < FUSED_LM_HEAD_CUDA_RTOL[dtype], (name, err)
    print(dtype, "peak bytes", peak)
    assert peak["triton"] < peak["naive"], peak


def test_moe_counts_accumulate_once_with_recomputation():
    batch = hp.RolloutBatch.from_token_lists(random_trajectories(np.random.default_rng(1), num=6, max_new=10))
    step = StepInputs.synthetic(batch, 0)
    counts = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = apply_recompute(HybridModel(model_config("debug")), recompute)
        traj = np.arange(batch.num_trajectories)
        run_microbatch(model, step, traj, "compact", call_plan=microbatch_call_plan(model, step, traj))
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
    cfg = model_config(
        "debug",
        mixers=(mixer,) * 2,
        ffns=("dense",) * 2,
        kda={"num_heads": 3},
        gated_attention={"head_dim": 8},
    )
    model = HybridModel(cfg)
    mod = model.blocks[0].mixer
    linear = sum(m.weight.numel() for m in mod.modules() if isinstance(m, torch.nn.Linear))
    b = cfg.chunk_size
    extra = 0
    if mixer == "kda":
        h, k = cfg.kda.num_heads, cfg.kda.head_k_dim
        extra = 2 * cfg.conv_size * 3 * h * k + h * (4 * b * k + 2 * b * k + 6 * k * k)
    elif mixer == "gdn":
        hk, hv, k, v = cfg.gdn.num_k_heads, cfg.gdn.num_v_heads, cfg.gdn.head_k_dim, cfg.gdn.head_v_dim
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
