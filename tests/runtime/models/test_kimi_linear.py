"""Kimi-Linear checkpoints: transformers' ``KimiLinearForCausalLM`` against our ``HybridModel``.

A tiny random Kimi-Linear (KDA and NoPE-MLA layers mixed, a dense first layer, sigmoid MoE with a
correction bias, group-limited top-k, renormalised and scaled top-k weights, one shared expert;
fp32) is built by transformers with a fixed seed, saved by transformers and loaded by
:func:`harts_runtime.load_pretrained`; then:

* logits on packed random trajectories (our trajectory layout) equal HF's per sequence;
* compact-execution log-probs of a prefix-sharing rollout tree equal HF's;
* parameter gradients of a logits functional equal HF's (mapped through the adapter);
* ours -> :func:`save_pretrained` -> ``AutoModelForCausalLM.from_pretrained`` gives the same
  logits, with no missing or unexpected keys;
* sharded checkpoints load; missing / unknown / misshapen tensors and unsupported config fields
  raise ``InvalidInputError`` naming the tensor or field;
* the group-limited router equals HF's ``KimiLinearTopkRouter``, and the multiplicity-weighted
  router statistics stay exact with groups and shared experts.

HF's KDA prefers fla's Triton ``chunk_kda`` when fla is installed; it cannot run on the CPU, so
the fixture swaps in transformers' own PyTorch reference (the function it falls back to).
"""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
hp = pytest.importorskip("harts_planner")

from hf_configs import V, perturb_kimi_linear  # noqa: E402
from hf_configs import kimi_linear_config as hf_config  # noqa: E402
from hf_reference import (  # noqa: E402
    compact_and_trajectory_grads,
    hf_logits,
    hf_target_logprobs,
    ours_logits,
    rel_err,
    use_torch_paths,
)
from trees import fork_shapes  # noqa: E402

from harts_runtime import HybridModel, InvalidInputError, StepInputs, load_pretrained, save_pretrained  # noqa: E402
from harts_runtime.layers.moe import CompactMoE, MoEConfig, route, router_losses  # noqa: E402
from harts_runtime.layout import RowLayout  # noqa: E402
from harts_runtime.models.kimi_linear import (  # noqa: E402
    KimiLinearStateDictAdapter,
    from_hf,
    from_hf_config,
    to_hf,
    to_hf_config,
)
from harts_runtime.ops.attention import resolve_backend  # noqa: E402

TOL_LOGITS = 1e-4  # fp32: max |ours - HF| logit over max |HF| logit
TOL_GRAD = 1e-4  # fp32: max |ours - HF| gradient entry over max |HF| entry, per tensor
TOL_TRAIN = {"loss": (1e-6, 1e-5), "grad": (2e-6, 2e-3)}  # compact vs trajectory, as test_train.py

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def hf_torch_kda(monkeypatch):
    """Run HF's KDA through its PyTorch reference (fla's Triton kernels need a GPU)."""
    use_torch_paths(monkeypatch, kda=True)


def random_hf_model(seed: int = 0, **changes):
    """HF's model with a fixed seed and every parameter perturbed (norm weights and the correction
    bias redrawn, all others given noise) so that a swapped or dropped tensor shows."""
    torch.manual_seed(seed)
    return perturb_kimi_linear(transformers.KimiLinearForCausalLM(hf_config(**changes)).float().eval())


def random_trajs(seed: int, lengths=(23, 40, 9)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=n).tolist() for n in lengths]


@pytest.fixture
def checkpoint(tmp_path, hf_torch_kda):
    hf = random_hf_model()
    hf.save_pretrained(tmp_path / "hf")
    return hf, tmp_path / "hf"


# ------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("sharded", [False, True])
def test_logits_match_transformers(tmp_path, hf_torch_kda, sharded):
    hf = random_hf_model()
    path = tmp_path / "hf"
    hf.save_pretrained(path, max_shard_size="40KB" if sharded else "5GB")
    assert (path / "model.safetensors.index.json").is_file() == sharded
    ours = load_pretrained(path, chunk_size=16).eval()
    assert ours.config.mixers == ("kda", "mla", "kda", "mla")
    assert ours.config.ffns == ("dense", "moe", "moe", "moe")
    # "auto" flows to the layers and is resolved per call: the reference on the CPU
    assert ours.config.attn_backend == "auto" and ours.blocks[1].mixer.backend == "auto"
    assert resolve_backend("auto", "cpu", 48, 32) == "reference"
    trajs = random_trajs(1)
    logits = ours_logits(ours, trajs)
    off, worst = 0, 0.0
    for t in trajs:
        worst = max(worst, rel_err(logits[off : off + len(t)], hf_logits(hf, t)))
        off += len(t)
    print(f"max relative logit error {worst:.2e}")
    assert worst <= TOL_LOGITS


def test_compact_logprobs_match_transformers(checkpoint):
    """Compact execution (shared prefixes computed once, KDA state handoffs, ancestor-KV MLA)
    against HF run on each trajectory separately."""
    hf, path = checkpoint
    ours = load_pretrained(path, chunk_size=16).eval()
    rng = np.random.default_rng(2)
    trunk = rng.integers(0, V, size=19).tolist()
    trajs = [trunk + rng.integers(0, V, size=n).tolist() for n in (5, 14, 30)] + [trunk[:7] + [3, 4, 5]]
    trajs += fork_shapes(16, V, seed=3)  # forks at B-1, B, B+1, nested, identical, prefix (B = 16)
    batch = hp.RolloutBatch.from_token_lists(trajs)
    from harts_runtime import step_logprobs

    lp = step_logprobs(ours, StepInputs.synthetic(batch, 0), "compact").double()
    ref = hf_target_logprobs(hf, trajs)
    err = float((lp - ref).abs().max())
    print(f"max compact log-prob error {err:.2e}")
    assert err <= TOL_LOGITS * float(ref.abs().max())


def test_gradients_match_transformers(checkpoint):
    hf, path = checkpoint
    ours = load_pretrained(path, chunk_size=16)
    ours.train()
    hf.train()  # no dropout in this config; train mode only enables autograd paths
    trajs = random_trajs(3, lengths=(17, 26))
    w = torch.randn(sum(map(len, trajs)), V, generator=torch.Generator().manual_seed(0))
    (ours_logits(ours, trajs, grad=True) * w).sum().backward()
    off = 0
    for t in trajs:
        (hf(torch.tensor([t])).logits[0] * w[off : off + len(t)]).sum().backward()
        off += len(t)
    adapter = KimiLinearStateDictAdapter(ours.config)
    grads = {k: torch.zeros(s) for k, s in adapter.our_shapes.items()}
    grads.update({k: p.grad for k, p in ours.named_parameters()})
    ours_hf = dict(adapter._to_hf_items(grads, check=False))
    worst, checked = 0.0, 0
    for name, p in hf.named_parameters():
        assert p.grad is not None, name
        e = rel_err(ours_hf[name], p.grad)
        assert e <= TOL_GRAD, (name, e)
        worst, checked = max(worst, e), checked + 1
    assert checked + sum("e_score_correction_bias" in k for k in ours_hf) == len(ours_hf)  # all but buffers
    print(f"max relative gradient error {worst:.2e} over {checked} tensors")


# ------------------------------------------------------------------------------ round trip
def test_ours_saved_loads_in_transformers(tmp_path, hf_torch_kda):
    cfg = from_hf_config(hf_config(), chunk_size=16, init_std=0.2)
    torch.manual_seed(5)
    ours = HybridModel(cfg).eval()
    with torch.no_grad():
        for name, t in ours.state_dict().items():
            if "norm" in name:
                t.copy_(1 + 0.3 * torch.randn_like(t))
            elif name.endswith("expert_bias"):
                t.copy_(0.3 * torch.randn_like(t))
    save_pretrained(ours, tmp_path / "ours")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype=torch.float32, output_loading_info=True
    )
    assert type(hf).__name__ == "KimiLinearForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf.eval()
    trajs = random_trajs(4)
    logits, off = ours_logits(ours, trajs), 0
    for t in trajs:
        assert rel_err(logits[off : off + len(t)], hf_logits(hf, t)) <= TOL_LOGITS
        off += len(t)
    again = load_pretrained(tmp_path / "ours", chunk_size=16)  # and back: the same tensors
    for k, v in ours.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v, rtol=0, atol=0)


def test_state_dict_adapter_round_trip_is_exact(checkpoint):
    hf, _ = checkpoint
    cfg = from_hf_config(hf.config, chunk_size=16)
    sd = hf.state_dict()
    back = to_hf(from_hf(sd, cfg), cfg)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


# ------------------------------------------------------------------------------ errors
def _rewrite(path, fn):
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    save_file(fn(load_file(str(f))), str(f), metadata={"format": "pt"})


def test_missing_unknown_and_misshapen_tensors_are_named(checkpoint):
    hf, path = checkpoint
    name = "model.layers.2.self_attn.A_log"  # the checkpoint spelling (HF's save_pretrained)
    _rewrite(path, lambda sd: {k: v for k, v in sd.items() if k != name})
    with pytest.raises(InvalidInputError) as e:
        load_pretrained(path)
    assert e.value.field == name and "missing" in str(e.value)
    cfg = from_hf_config(hf.config)
    sd = hf.state_dict()
    bad = "model.layers.1.mlp.experts.gate_up_proj"
    with pytest.raises(InvalidInputError) as e:
        from_hf({**sd, bad: sd[bad][:, :-1]}, cfg)
    assert e.value.field == bad and "shape" in str(e.value)
    with pytest.raises(InvalidInputError) as e:
        from_hf({**sd, "model.layers.0.mlp.gate.weight": sd["lm_head.weight"]}, cfg)
    assert e.value.field == "model.layers.0.mlp.gate.weight"
    ours = from_hf(sd, cfg)
    with pytest.raises(InvalidInputError) as e:
        to_hf({k: v for k, v in ours.items() if k != "blocks.3.ffn.w_up"}, cfg)
    assert e.value.field == "blocks.3.ffn.w_up"
    # A Kimi-Linear model has exactly Kimi-Linear's tensors: no KDA output-gate bias (fla's layer
    # has one). A model built with it exports while the bias is zero, and refuses a non-zero one.
    assert not any(k.endswith("g_proj.1.bias") for k in ours)
    biased = from_hf_config(hf.config, kda={"output_gate_bias": True})
    ours = from_hf(sd, biased)
    ours["blocks.0.mixer.g_proj.1.bias"] = torch.ones_like(ours["blocks.0.mixer.g_proj.1.bias"])
    with pytest.raises(InvalidInputError) as e:
        to_hf(ours, biased)
    assert e.value.field == "blocks.0.mixer.g_proj.1.bias"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
        ({"n_shared_experts": 0}, "n_shared_experts"),
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types[1]"),
        ({"n_group": 3}, "moe.num_expert_groups"),
        ({"use_grouped_topk": False}, "use_grouped_topk"),
    ],
)
def test_unsupported_config_fields_are_named(changes, field):
    d = {**hf_config(num_hidden_layers=2, layer_types=None, mlp_layer_types=None).to_dict(), **changes}
    with pytest.raises(InvalidInputError) as e:
        from_hf_config(d)
    assert e.value.field == field


def test_unsupported_model_fields_are_named_on_save(tmp_path):
    cfg = from_hf_config(hf_config())
    for changes, field in (
        ({"mixers": ("kda", "gqa", "kda", "mla")}, "mixers"),
        ({"mla": {"use_rope": True}}, "mla.use_rope"),
        ({"moe": {"score_func": "softmax"}}, "moe.score_func"),
    ):
        with pytest.raises(InvalidInputError) as e:
            save_pretrained(HybridModel(cfg.replace(**changes)), tmp_path / "x")
        assert e.value.field == field


def test_original_checkpoint_config_json(tmp_path):
    """The moonshotai config.json spelling: linear_attn_config, first_k_dense_replace, num_experts, ..."""
    d = {
        "model_type": "kimi_linear",
        "vocab_size": V,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 2,
        "num_expert_group": 2,
        "topk_group": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "first_k_dense_replace": 2,
        "moe_layer_freq": 1,
        "mla_use_nope": True,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "rms_norm_eps": 1e-5,
        "linear_attn_config": {
            "full_attn_layers": [3, 6],
            "kda_layers": [1, 2, 4, 5],
            "head_dim": 8,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
        },
        "torch_dtype": "bfloat16",
    }
    cfg = from_hf_config(d)
    assert cfg.mixers == ("kda", "kda", "mla", "kda", "kda", "mla")
    assert cfg.ffns == ("dense", "dense", "moe", "moe", "moe", "moe")
    assert (
        cfg.moe.num_experts,
        cfg.moe.top_k,
        cfg.moe.num_shared_experts,
        cfg.moe.shared_intermediate_size,
    ) == (
        8,
        2,
        2,
        32,
    )
    assert (cfg.moe.num_expert_groups, cfg.moe.topk_groups, cfg.kda.num_heads, cfg.dtype) == (
        2,
        1,
        4,
        "bfloat16",
    )
    hf = transformers.KimiLinearConfig(**to_hf_config(cfg))  # what we write, transformers reads the same
    assert from_hf_config(hf) == cfg
    ref = transformers.KimiLinearConfig(**{k: v for k, v in d.items() if k != "model_type"})
    assert from_hf_config(ref) == cfg


# ------------------------------------------------------------------------------ router and MoE
def test_group_limited_router_equals_transformers():
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

    c = hf_config(num_local_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    router = KimiLinearTopkRouter(c)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(200, c.hidden_size)
    _, w_ref, idx_ref = router(x)
    logits = x @ router.weight.t()
    _, idx, w = route(
        logits, 4, "sigmoid", router.e_score_correction_bias, True, c.routed_scaling_factor, 4, 2
    )
    order_ref, order = idx_ref.sort(-1), idx.sort(-1)
    assert torch.equal(order_ref.values, order.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices))
    groups = idx // 4  # every selected expert lies in one of the 2 kept groups
    assert all(len(set(row.tolist())) <= 2 for row in groups)


def test_router_statistics_stay_exact_with_groups_and_shared_experts():
    """Compact rows with multiplicities q give the statistics and outputs of the expanded rows."""
    torch.manual_seed(1)
    moe = CompactMoE(
        MoEConfig(
            hidden_size=16,
            num_experts=8,
            top_k=3,
            intermediate_size=8,
            score_func="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=2.0,
            use_expert_bias=True,
            num_expert_groups=4,
            topk_groups=2,
            num_shared_experts=1,
            aux_loss_coef=0.1,
            z_loss_coef=0.01,
        )
    ).double()
    moe.expert_bias.normal_(0, 0.5)
    x = torch.randn(7, 16, dtype=torch.float64)
    q = torch.tensor([1, 3, 2, 1, 4, 1, 2])
    compact = moe(x, RowLayout(7, multiplicity=q.double()))
    expanded = moe(x.repeat_interleave(q, 0))
    torch.testing.assert_close(compact.hidden.repeat_interleave(q, 0), expanded.hidden)
    for a, b in ((compact.aux_loss, expanded.aux_loss), (compact.z_loss, expanded.z_loss)):
        torch.testing.assert_close(a, b)
    assert torch.equal(compact.tokens_per_expert, expanded.tokens_per_expert)
    shared_only = moe.shared_experts(x)
    assert not torch.allclose(compact.hidden, shared_only)  # routed and shared parts both present
    logits = x @ moe.router.t()
    probs, idx, _ = route(logits, 3, "sigmoid", moe.expert_bias, True, 2.0, 4, 2)
    aux, _, counts = router_losses(logits, probs, idx, q.double())
    torch.testing.assert_close(aux, compact.aux_loss)


# ------------------------------------------------------------------------------ spellings, dtypes
def test_both_spellings_load_the_same_weights(checkpoint, tmp_path):
    """transformers' in-memory state dict written as is, and the checkpoint spelling with ``mlp.``
    instead of ``block_sparse_moe.``, load to the same model as HF's own save_pretrained."""
    import shutil

    from safetensors.torch import load_file, save_file

    hf, path = checkpoint
    ref = load_pretrained(path).state_dict()
    memory, renamed = tmp_path / "memory", tmp_path / "renamed"
    for d in (memory, renamed):
        d.mkdir()
        shutil.copy(path / "config.json", d / "config.json")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(memory / "model.safetensors"))
    ck = load_file(str(path / "model.safetensors"))
    assert any(".block_sparse_moe.experts.0.w1." in k for k in ck)
    save_file(
        {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in ck.items()},
        str(renamed / "model.safetensors"),
    )
    for d in (memory, renamed):
        got = load_pretrained(d).state_dict()
        for k, v in ref.items():
            assert torch.equal(got[k], v), (d.name, k)


def test_missing_expert_is_named(checkpoint):
    _, path = checkpoint
    name = "model.layers.3.block_sparse_moe.experts.5.w2.weight"
    _rewrite(path, lambda sd: {k: v for k, v in sd.items() if k != name})
    with pytest.raises(InvalidInputError) as e:
        load_pretrained(path)
    assert e.value.field == name


def test_bfloat16_keeps_transformers_fp32_parameters(checkpoint):
    _, path = checkpoint
    ours = load_pretrained(path, dtype=torch.bfloat16)
    fp32 = {n for n, p in ours.named_parameters() if p.dtype == torch.float32}
    assert fp32 == {n for n, _ in ours.named_parameters() if n.endswith(("ffn.router", "mixer.dt_bias"))}
    assert len(fp32) == 5 and all(b.dtype == torch.float32 for b in (ours.blocks[1].ffn.expert_bias,))


def test_loaded_model_trains_compact_as_trajectory(checkpoint):
    """One microbatch of a prefix-sharing rollout through run_microbatch: the loaded Kimi-Linear
    gives the same loss and gradients compact and trajectory-wise (float64 weights; KDA boundary states are fp32, so test_train.py's tolerances)."""
    _, path = checkpoint
    model = load_pretrained(path, dtype=torch.float64, chunk_size=16)
    out = compact_and_trajectory_grads(model, V)
    (lc, gc), (lt, gt) = out["compact"], out["trajectory"]
    torch.testing.assert_close(lc, lt, atol=TOL_TRAIN["loss"][0], rtol=TOL_TRAIN["loss"][1])
    assert set(gc) == set(gt) and len(gc) >= len(list(model.parameters())) - 2  # KDA gate biases may get none
    for n in gc:
        atol, rtol = TOL_TRAIN["grad"]
        torch.testing.assert_close(gc[n], gt[n], atol=atol, rtol=rtol, msg=lambda m, n=n: f"d{n}: {m}")


def test_harts_train_runs_a_checkpoint_folder(checkpoint, capsys):
    """``harts-train --model PATH``: both modes train the loaded checkpoint from the same weights."""
    from harts_runtime.cli import main

    _, path = checkpoint
    argv = ["--model", str(path), "--preset", "tiny", "--steps", "1", "--mode", "both", "--device", "cpu"]
    assert main([*argv, "--capacity", "4096", "--max-len", "64"]) == 0
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    assert out[0].startswith("step 0 compact") and out[1].startswith("step 0 trajectory")
    diff = float(out[2].rsplit("=", 1)[1])
    assert diff < 1e-4, out
    assert f"model: {path}" in captured.err


@pytest.mark.slow
def test_train_eval_runs_a_checkpoint_folder(checkpoint, tmp_path):
    """``benchmarks/train_eval.py --model PATH`` at CPU smoke sizes: the sections run on the loaded
    checkpoint (KDA + MLA + MoE with shared experts) and report."""
    import importlib.util
    import json
    import os

    _, path = checkpoint
    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "train_eval.py")
    spec = importlib.util.spec_from_file_location("train_eval", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "eval"
    argv = [
        "--device",
        "cpu",
        "--model",
        str(path),
        "--tiny",
        "--sections",
        "speedup,fidelity",
        "--out",
        str(out),
    ]
    assert mod.main(argv) == 0
    res = json.loads((out / "train_eval.json").read_text())
    assert str(path) in res["meta"]["model"]
    for name in ("speedup", "fidelity"):
        assert "error" not in res[name], res[name].get("traceback")
    assert res["speedup"]["ideal_work_compression"] > 1
    assert res["fidelity"]["no_recompute"]["harts_cos"] > 0.9999
