"""Qwen3-Next and Qwen3.5-MoE (text) checkpoints: transformers against our ``HybridModel``.

Tiny random fp32 models of both families (``Qwen3NextForCausalLM``, ``Qwen3_5MoeForCausalLM``),
built by transformers with a fixed seed, saved by transformers and loaded by
:func:`harts_runtime.load_pretrained`; layer types all ``full_attention`` (gated attention only)
and mixed (gated delta net and gated attention); Qwen3-Next with a dense layer
(``mlp_only_layers``). Checked:

* logits on random trajectories (our trajectory layout) equal HF's per sequence;
* compact-execution log-probs of a prefix-sharing rollout tree equal HF's per trajectory;
* parameter gradients of a logits functional equal HF's (mapped through the adapter);
* ours -> :func:`save_pretrained` -> ``AutoModelForCausalLM.from_pretrained`` gives the same
  logits with no missing or unexpected keys, and loads back to the same tensors;
* both tensor spellings (fused in-memory experts, per-expert checkpoint), sharded folders, the
  ``model.language_model.`` spelling of a vision-language ``qwen3_5_moe`` folder (vision tower and
  MTP head skipped); missing / unknown / misshapen tensors and unsupported config fields raise
  ``InvalidInputError`` naming the tensor or field.

HF's gated delta net prefers fla's Triton kernels when fla is installed; they cannot run on the
CPU, so the fixture swaps in transformers' own PyTorch functions (as ``test_gdn.py`` does).
"""

import json
import shutil

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
hp = pytest.importorskip("harts_planner")


from hf_configs import MIXED, V  # noqa: E402
from hf_configs import qwen_config as hf_config  # noqa: E402
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
from harts_runtime.models import qwen3_5_moe, qwen3_next  # noqa: E402

TOL_LOGITS = 1e-4  # fp32: max |ours - HF| logit over max |HF| logit
TOL_GRAD = 3e-4  # fp32: max |ours - HF| gradient entry over max |HF| entry, per tensor (the GDN
# decay parameters dt_bias / A_log sum over every row: measured 1.1e-4 through three layers)
FULL = ["full_attention"] * 3
FAMILIES = ("qwen3_next", "qwen3_5_moe_text")

pytestmark = pytest.mark.usefixtures("one_thread", "hf_torch_gdn")


def _hf_class(family):
    return transformers.Qwen3NextForCausalLM if family == "qwen3_next" else transformers.Qwen3_5MoeForCausalLM


@pytest.fixture
def hf_torch_gdn(monkeypatch):
    """Run HF's gated delta rule and causal conv through their PyTorch functions."""
    use_torch_paths(monkeypatch, gdn=True)


def random_hf_model(family: str, layer_types=MIXED, seed: int = 0, **changes):
    """HF's model with a fixed seed and every parameter perturbed (norm weights redrawn, all others
    given noise), so that no default initialisation hides a swapped or dropped tensor."""
    torch.manual_seed(seed)
    model = _hf_class(family)(hf_config(family, layer_types, **changes)).float().eval()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            if "norm" in name:
                t.copy_(0.3 * torch.randn_like(t) + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                t.add_(0.02 * torch.randn_like(t))
    return model


def random_trajs(seed: int, lengths=(23, 40, 9)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=n).tolist() for n in lengths]


def _adapter(cfg, family):
    return (
        qwen3_next.QwenStateDictAdapter if family == "qwen3_next" else qwen3_5_moe.Qwen35MoeStateDictAdapter
    )(cfg)


def _module(family):
    return qwen3_next if family == "qwen3_next" else qwen3_5_moe


def _max_logit_err(ours, hf, trajs) -> float:
    logits, off, worst = ours_logits(ours, trajs), 0, 0.0
    for t in trajs:
        worst = max(worst, rel_err(logits[off : off + len(t)], hf_logits(hf, t)))
        off += len(t)
    return worst


# ------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layers", ["full", "mixed"])
def test_logits_match_transformers(tmp_path, family, layers):
    types = FULL if layers == "full" else MIXED
    hf = random_hf_model(family, types)
    path = tmp_path / "hf"
    sharded = layers == "mixed"
    hf.save_pretrained(path, max_shard_size="20KB" if sharded else "5GB")
    assert (path / "model.safetensors.index.json").is_file() == sharded
    ours = load_pretrained(path, chunk_size=16).eval()
    mixer = {"full_attention": "gated_attention", "linear_attention": "gdn"}
    assert ours.config.mixers == tuple(mixer[t] for t in types)
    assert ours.config.ffns == (("moe", "dense", "moe") if family == "qwen3_next" else ("moe",) * 3)
    worst = _max_logit_err(ours, hf, random_trajs(1))
    print(f"{family} {layers}: max relative logit error {worst:.2e}")
    assert worst <= TOL_LOGITS


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layers", ["full", "mixed"])
def test_compact_logprobs_match_transformers(tmp_path, family, layers):
    """Compact execution (shared prefixes computed once, GDN state handoffs, ancestor-KV gated
    attention) against HF run on each trajectory separately."""
    from harts_runtime import step_logprobs

    hf = random_hf_model(family, FULL if layers == "full" else MIXED)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf", chunk_size=16).eval()
    rng = np.random.default_rng(2)
    trunk = rng.integers(0, V, size=19).tolist()
    trajs = [trunk + rng.integers(0, V, size=n).tolist() for n in (5, 14, 30)] + [trunk[:7] + [3, 4, 5]]
    trajs += fork_shapes(16, V, seed=3)  # forks at B-1, B, B+1, nested, identical, prefix (B = 16)
    lp = step_logprobs(ours, StepInputs.synthetic(hp.RolloutBatch.from_token_lists(trajs), 0), "compact")
    ref = hf_target_logprobs(hf, trajs)
    err = float((lp.double() - ref).abs().max())
    print(
        f"{family} {layers}: max compact log-prob error {err:.2e} (max |log-prob| {float(ref.abs().max()):.2f})"
    )
    assert err <= TOL_LOGITS * float(ref.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_transformers(tmp_path, family):
    hf = random_hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf", chunk_size=16).train()
    hf.train()  # no dropout in this config
    trajs = random_trajs(3, lengths=(17, 26))
    w = torch.randn(sum(map(len, trajs)), V, generator=torch.Generator().manual_seed(0))
    (ours_logits(ours, trajs, grad=True) * w).sum().backward()
    off = 0
    for t in trajs:
        (hf(torch.tensor([t])).logits[0] * w[off : off + len(t)]).sum().backward()
        off += len(t)
    adapter = _adapter(ours.config, family)
    grads = {k: torch.zeros(s) for k, s in adapter.our_shapes.items()}
    grads.update({k: p.grad for k, p in ours.named_parameters() if p.grad is not None})
    ours_hf = dict(adapter._to_hf_items(grads, check=False))
    worst, checked = 0.0, 0
    for name, p in hf.named_parameters():
        assert p.grad is not None, name
        e = rel_err(ours_hf[name], p.grad)
        assert e <= TOL_GRAD, (name, e)
        worst, checked = max(worst, e), checked + 1
    assert checked == len(ours_hf)
    print(f"{family}: max relative gradient error {worst:.2e} over {checked} tensors")


# ------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("family", FAMILIES)
def test_ours_saved_loads_in_transformers(tmp_path, family):
    cfg = _module(family).from_hf_config(hf_config(family), chunk_size=16, init_std=0.2)
    torch.manual_seed(5)
    ours = HybridModel(cfg).eval()
    with torch.no_grad():
        for name, t in ours.state_dict().items():
            if "norm" in name:
                t.copy_(0.3 * torch.randn_like(t) + (1.0 if "mixer.norm" in name else 0.0))
    save_pretrained(ours, tmp_path / "ours")  # family from the mixers (fused / split GDN)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == family
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype=torch.float32, output_loading_info=True
    )
    assert type(hf) is _hf_class(family)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert _max_logit_err(ours, hf.eval(), random_trajs(4)) <= TOL_LOGITS
    again = load_pretrained(tmp_path / "ours", chunk_size=16)
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    assert _module(family).from_hf_config(hf.config, chunk_size=16, init_std=0.2) == cfg


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_adapter_round_trip_is_exact(family):
    hf = random_hf_model(family)
    mod = _module(family)
    cfg = mod.from_hf_config(hf.config)
    sd = hf.state_dict()
    back = mod.to_hf(mod.from_hf(sd, cfg), cfg)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_in_memory_spelling_and_vision_language_folder_load(tmp_path):
    """The fused in-memory state dict written as is, and a ``qwen3_5_moe`` folder (text config
    nested, ``model.language_model.`` prefix, vision and MTP tensors) load to the same weights."""
    from safetensors.torch import load_file, save_file

    hf = random_hf_model("qwen3_5_moe_text")
    path = tmp_path / "hf"
    hf.save_pretrained(path)
    ref = load_pretrained(path).state_dict()
    memory, vl = tmp_path / "memory", tmp_path / "vl"
    memory.mkdir()
    vl.mkdir()
    shutil.copy(path / "config.json", memory / "config.json")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(memory / "model.safetensors"))
    text = json.loads((path / "config.json").read_text())
    (vl / "config.json").write_text(
        json.dumps({"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 1}})
    )
    ck = load_file(str(path / "model.safetensors"))
    ck = {
        k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
        for k, v in ck.items()
    }
    ck["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 3)
    ck["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(ck, str(vl / "model.safetensors"))
    for d in (memory, vl):
        got = load_pretrained(d)
        for k, v in ref.items():
            assert torch.equal(got.state_dict()[k], v), (d.name, k)
    got.hf_config = json.loads((vl / "config.json").read_text())  # saved as the text model
    save_pretrained(got, tmp_path / "text")
    assert json.loads((tmp_path / "text" / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"


# ------------------------------------------------------------------------------ errors
def _rewrite(path, fn):
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    save_file(fn(load_file(str(f))), str(f), metadata={"format": "pt"})


def test_missing_unknown_and_misshapen_tensors_are_named(tmp_path):
    hf = random_hf_model("qwen3_next")
    path = tmp_path / "hf"
    hf.save_pretrained(path)
    name = "model.layers.2.mlp.experts.3.down_proj.weight"  # the checkpoint spelling
    _rewrite(path, lambda sd: {k: v for k, v in sd.items() if k != name})
    with pytest.raises(InvalidInputError) as e:
        load_pretrained(path)
    assert e.value.field == name and "missing" in str(e.value)
    cfg = qwen3_next.from_hf_config(hf.config)
    sd = hf.state_dict()
    for bad in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.linear_attn.in_proj_qkvz.weight"):
        with pytest.raises(InvalidInputError) as e:
            qwen3_next.from_hf({**sd, bad: sd[bad][:, :-1]}, cfg)
        assert e.value.field == bad and "shape" in str(e.value)
    with pytest.raises(InvalidInputError) as e:
        qwen3_next.from_hf({**sd, "model.layers.1.mlp.gate.weight": sd["lm_head.weight"]}, cfg)
    assert e.value.field == "model.layers.1.mlp.gate.weight"  # layer 1 is dense
    ours = qwen3_next.from_hf(sd, cfg)
    with pytest.raises(InvalidInputError) as e:
        qwen3_next.to_hf(
            {k: v for k, v in ours.items() if k != "blocks.2.ffn.shared_expert_gate.weight"}, cfg
        )
    assert e.value.field == "blocks.2.ffn.shared_expert_gate.weight"
    ours["blocks.0.ffn.expert_bias"] = torch.ones_like(ours["blocks.0.ffn.expert_bias"])
    with pytest.raises(InvalidInputError) as e:
        qwen3_next.to_hf(ours, cfg)
    assert e.value.field == "blocks.0.ffn.expert_bias"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"attention_bias": True}, "attention_bias"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters"),
        ({"layer_types": ["linear_attention", "sliding_attention", "full_attention"]}, "layer_types[1]"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"attn_output_gate": False}, "attn_output_gate"),
    ],
)
def test_unsupported_config_fields_are_named(changes, field):
    d = {**hf_config("qwen3_next").to_dict(), **changes}
    with pytest.raises(InvalidInputError) as e:
        qwen3_next.from_hf_config(d)
    assert e.value.field == field


def test_unsupported_model_fields_are_named_on_save(tmp_path):
    cfg = qwen3_next.from_hf_config(hf_config("qwen3_next"))
    for changes, field, family in (
        ({"mixers": ("gdn", "gqa", "gdn")}, "mixers", None),
        ({"moe": {"score_func": "sigmoid"}}, "moe.score_func", None),
        ({"zero_centered_norms": False}, "zero_centered_norms", None),
        ({"gdn": {"projection": "split"}}, "ffns", "qwen3_5_moe_text"),  # a dense layer
        ({"ffns": ("moe",) * 3}, "gdn.projection", "qwen3_5_moe_text"),  # fused projections
    ):
        with pytest.raises(InvalidInputError) as e:
            save_pretrained(HybridModel(cfg.replace(**changes)), tmp_path / "x", model_type=family)
        assert e.value.field == field
    with pytest.raises(InvalidInputError) as e:
        qwen3_next.from_hf_config(
            {**hf_config("qwen3_next").to_dict(), "model_type": "qwen3_next"}, family="llama"
        )
    assert e.value.field == "family"


def test_dense_layer_pattern_and_defaults():
    d = hf_config("qwen3_next", ["full_attention"] * 6, mlp_only_layers=[4], decoder_sparse_step=2).to_dict()
    cfg = qwen3_next.from_hf_config(d)
    assert cfg.ffns == ("dense", "moe", "dense", "moe", "dense", "moe")
    assert cfg.zero_centered_norms and cfg.moe.shared_expert_gate and cfg.moe.score_func == "softmax"
    back = transformers.Qwen3NextConfig(**qwen3_next.to_hf_config(cfg))
    assert qwen3_next.from_hf_config(back) == cfg
    no_experts = qwen3_next.from_hf_config({**d, "num_experts": 0})
    assert no_experts.ffns == ("dense",) * 6
    types = transformers.Qwen3_5MoeTextConfig(num_hidden_layers=8).layer_types  # full_attention_interval 4
    assert qwen3_5_moe.from_hf_config(
        {"num_hidden_layers": 8, "model_type": "qwen3_5_moe_text"}
    ).mixers == tuple("gdn" if t == "linear_attention" else "gated_attention" for t in types)


def test_kimi_linear_refuses_qwen_options(tmp_path):
    from harts_runtime.models import kimi_linear

    cfg = kimi_linear.from_hf_config(
        dict(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, linear_num_heads=2,
            linear_head_dim=8, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
            kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        )
    )  # fmt: skip
    for changes, field in (
        ({"zero_centered_norms": True}, "zero_centered_norms"),
        ({"moe": {"shared_expert_gate": True}}, "moe.shared_expert_gate"),
    ):
        with pytest.raises(InvalidInputError) as e:
            save_pretrained(HybridModel(cfg.replace(**changes)), tmp_path / "x")
        assert e.value.field == field


def test_loaded_model_trains_compact_as_trajectory(tmp_path):
    """One prefix-sharing microbatch through run_microbatch: a loaded mixed Qwen3-Next gives the
    same loss and gradients compact and trajectory-wise (float64 weights; GDN boundary states are
    fp32, so test_train.py's tolerances)."""
    random_hf_model("qwen3_next").save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf", dtype=torch.float64, chunk_size=16)
    out = compact_and_trajectory_grads(model, V)
    (lc, gc), (lt, gt) = out["compact"], out["trajectory"]
    torch.testing.assert_close(lc, lt, atol=1e-6, rtol=1e-5)
    assert set(gc) == set(gt) and len(gc) == len(list(model.parameters()))
    for n in gc:
        torch.testing.assert_close(gc[n], gt[n], atol=2e-6, rtol=2e-3, msg=lambda m, n=n: f"d{n}: {m}")


def test_bfloat16_load_and_gdn_head_check(tmp_path):
    hf = random_hf_model("qwen3_5_moe_text")
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf", dtype=torch.bfloat16, chunk_size=16).eval()
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    t = random_trajs(6, lengths=(20,))[0]
    ref = hf_logits(hf, t)  # float32
    ours_err = rel_err(ours_logits(ours, [t]).float(), ref)
    hf_err = rel_err(hf_logits(hf.to(torch.bfloat16), t), ref)
    print(f"bfloat16 vs float32 transformers: ours {ours_err:.2e}, transformers' bfloat16 {hf_err:.2e}")
    assert ours_err <= 2 * hf_err + 1e-2  # no worse than transformers' own bfloat16 rounding
    d = {**hf_config("qwen3_next").to_dict(), "linear_num_key_heads": 3}
    with pytest.raises(InvalidInputError) as e:
        qwen3_next.from_hf_config(d)
    assert e.value.field == "gdn.num_v_heads"


def test_hub_style_config_json():
    """The released configs' spelling: no layer_types (full_attention_interval), top-level
    rope_theta / partial_rotary_factor, sliding-window and MTP fields."""
    d = {
        "model_type": "qwen3_next",
        "vocab_size": V,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "full_attention_interval": 4,
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    cfg = qwen3_next.from_hf_config(d)
    assert cfg.mixers == ("gdn", "gdn", "gdn", "gated_attention") * 2
    assert (cfg.rope_theta, cfg.gated_attention.partial_rotary_factor, cfg.dtype, cfg.ffns) == (
        1e7,
        0.25,
        "bfloat16",
        ("moe",) * 8,
    )
    ref = transformers.Qwen3NextConfig(**{k: v for k, v in d.items() if k != "model_type"})
    assert qwen3_next.from_hf_config(ref) == cfg
    assert qwen3_next.from_hf_config(transformers.Qwen3NextConfig(**qwen3_next.to_hf_config(cfg))) == cfg
