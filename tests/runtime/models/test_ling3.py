"""Ling-3.0 checkpoints (``model_type: bailing_hybrid``): transformers' ``BailingHybridForCausalLM``
against our ``HybridModel``.

A tiny random Ling-3.0 (KDA with the bounded gate and MLA with interleaved RoPE and the output gate
at 2:1, a dense first layer, a sigmoid MoE with a correction bias, group-limited top-k, renormalised
and scaled weights, one shared expert, per-layer SwiGLU limits; fp32) is built by transformers with a
fixed seed, every tensor perturbed, saved by transformers, given an MTP layer's tensors, and loaded by
:func:`harts_runtime.load_pretrained`; then:

* logits on packed random trajectories equal HF's per sequence;
* compact-execution log-probs of prefix-sharing rollout trees equal HF's, and equal our
  trajectory-wise execution;
* load -> one AdamW step -> save -> reload is bit-equal, the MTP tensors written back unchanged,
  and transformers loads the saved folder to the same logits;
* the adapter maps both spellings both ways exactly; unsupported config fields are named.
"""

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
hp = pytest.importorskip("harts_planner")

from hf_reference import hf_logits, hf_target_logprobs, ours_logits, rel_err  # noqa: E402
from trees import fork_shapes  # noqa: E402

from harts_runtime import InvalidInputError, StepInputs, load_pretrained, save_pretrained  # noqa: E402
from harts_runtime.models.ling3 import Ling3StateDictAdapter, from_hf, from_hf_config, to_hf  # noqa: E402

V = 96
TOL_LOGITS = 1e-4  # fp32: max |ours - HF| logit over max |HF| logit
MTP = ("model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight")  # an MTP layer's tensors (kept)

pytestmark = pytest.mark.usefixtures("one_thread")


def hf_config(**changes):
    kw = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=12,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        v_head_dim=8,
        qk_nope_head_dim=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        num_local_experts=8,
        first_k_dense_replace=1,
        head_dim=8,
        layer_group_size=2,
        num_mtp_layers=1,
        expert_swiglu_limit_list=[0, 0.4, 0.6],
        share_expert_swiglu_limit_list=[0, 0.5, 0],
        rope_theta=10_000.0,
        pad_token_id=None,
        eos_token_id=None,
    )
    kw.update(changes)
    return transformers.BailingHybridConfig(**kw)


def random_hf_model(seed: int = 0):
    """HF's model with every tensor redrawn (norm weights near 1, the correction bias and A_log
    spread, the rest N(0, 0.2^2)), so no default initialisation hides a mapping error."""
    torch.manual_seed(seed)
    model = transformers.BailingHybridForCausalLM(hf_config()).float().eval()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            if "norm" in name:
                t.copy_(1 + 0.3 * torch.randn_like(t))
            elif name.endswith("A_log"):
                t.uniform_(-1, 2)
            else:
                t.copy_(0.2 * torch.randn_like(t))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(HF model, its folder with an MTP layer's tensors added)."""
    from safetensors.torch import load_file, save_file

    hf = random_hf_model()
    path = tmp_path_factory.mktemp("ling3") / "hf"
    hf.save_pretrained(path)
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    gen = torch.Generator().manual_seed(9)
    tensors[MTP[0]] = torch.randn(32, 64, generator=gen)
    tensors[MTP[1]] = torch.randn(32, generator=gen)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return hf, path


def random_trajs(seed: int, lengths=(23, 40, 9)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=n).tolist() for n in lengths]


def tree_trajs(seed: int = 2) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    trunk = rng.integers(0, V, size=19).tolist()
    trajs = [trunk + rng.integers(0, V, size=n).tolist() for n in (5, 14, 30)] + [trunk[:7] + [3, 4, 5]]
    return trajs + fork_shapes(16, V, seed=3)  # forks at B-1, B, B+1, nested, identical, prefix


# ------------------------------------------------------------------------------ forward
def test_logits_match_transformers(checkpoint):
    hf, path = checkpoint
    ours = load_pretrained(path, chunk_size=16).eval()
    assert ours.config.mixers == ("kda", "mla", "kda") and ours.config.ffns == ("dense", "moe", "moe")
    assert ours.config.kda.gate_lower_bound == -5.0 and ours.config.mla.output_gate
    assert set(ours.hf_kept) == set(MTP)
    trajs = random_trajs(1)
    logits = ours_logits(ours, trajs)
    off, worst = 0, 0.0
    for t in trajs:
        worst = max(worst, rel_err(logits[off : off + len(t)], hf_logits(hf, t)))
        off += len(t)
    print(f"Ling-3.0: max relative logit error {worst:.2e}")
    assert worst <= TOL_LOGITS


def test_compact_logprobs_match_transformers_and_trajectory_wise(checkpoint):
    """Compact execution (shared prefixes once, KDA state handoffs, ancestor-KV MLA) against HF run
    on each trajectory separately, and against our trajectory-wise execution."""
    from harts_runtime import step_logprobs

    hf, path = checkpoint
    ours = load_pretrained(path, chunk_size=16).eval()
    trajs = tree_trajs()
    step = StepInputs.synthetic(hp.RolloutBatch.from_token_lists(trajs), 0)
    lp = step_logprobs(ours, step, "compact").double()
    ref = hf_target_logprobs(hf, trajs)
    err = float((lp - ref).abs().max())
    print(f"Ling-3.0: max compact log-prob error {err:.2e} (|ref| <= {float(ref.abs().max()):.1f})")
    assert err <= TOL_LOGITS * float(ref.abs().max())
    traj = step_logprobs(ours, step, "trajectory").double()
    torch.testing.assert_close(lp, traj, atol=1e-5, rtol=1e-5)


def test_gradients_match_transformers(checkpoint):
    """Every parameter's gradient of a logits functional, ours mapped through the adapter, against
    transformers' (the bounded gate, the MLA output gate and the clipped experts included)."""
    hf, path = checkpoint
    hf = random_hf_model()  # a fresh copy: the fixture's model is shared
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
    adapter = Ling3StateDictAdapter(ours.config)
    grads = {k: torch.zeros(s) for k, s in adapter.our_shapes.items()}
    grads.update({k: p.grad for k, p in ours.named_parameters()})
    ours_hf = dict(adapter._to_hf_items(grads, check=False))
    worst = 0.0
    for name, p in hf.named_parameters():
        assert p.grad is not None, name
        e = rel_err(ours_hf[name], p.grad)
        assert e <= 1e-4, (name, e)
        worst = max(worst, e)
    print(f"Ling-3.0: max relative gradient error {worst:.2e}")


# ------------------------------------------------------------------------------ round trip
def test_adamw_step_save_reload_is_bit_equal_and_transformers_loads_it(checkpoint, tmp_path):
    from safetensors import safe_open

    from harts_runtime import run_microbatch
    from harts_runtime.engine import microbatch_call_plan

    hf, path = checkpoint
    ours = load_pretrained(path, chunk_size=16)
    ours.train()
    trajs = random_trajs(5, (17, 26))
    step = StepInputs.synthetic(hp.RolloutBatch.from_token_lists(trajs), 0)
    traj = np.arange(len(trajs))  # the loss and its backward:
    run_microbatch(ours, step, traj, "compact", call_plan=microbatch_call_plan(ours, step, traj))
    assert all(p.grad is not None for p in ours.parameters())
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt.step()
    save_pretrained(ours, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["model_type"] == "bailing_hybrid" and config["num_nextn_predict_layers"] == 1
    again = load_pretrained(tmp_path / "ours", chunk_size=16)
    before, after = ours.state_dict(), again.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        if not k.endswith("local_tokens_per_expert"):  # expert-load counts: not a checkpoint tensor
            assert torch.equal(before[k], after[k]), k
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:
        for name in MTP:
            assert torch.equal(f.get_tensor(name), ours.hf_kept[name]), name
    hf2, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype=torch.float32, output_loading_info=True
    )
    assert type(hf2).__name__ == "BailingHybridForCausalLM"
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert set(info["unexpected_keys"]) <= set(MTP), info  # the MTP layer: transformers does not run it
    hf2.eval()
    trajs = random_trajs(4)
    logits, off = ours_logits(again.eval(), trajs), 0
    for t in trajs:
        assert rel_err(logits[off : off + len(t)], hf_logits(hf2, t)) <= TOL_LOGITS
        off += len(t)


def test_state_dict_adapter_round_trip_is_exact(checkpoint):
    hf, _ = checkpoint
    cfg = from_hf_config(hf.config, chunk_size=16)
    sd = hf.state_dict()
    ours = from_hf(sd, cfg)
    back = to_hf(ours, cfg)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    adapter = Ling3StateDictAdapter(cfg)
    ckpt = adapter.to_checkpoint(ours)
    assert "model.word_embeddings.weight" in ckpt and "model.layers.1.attention.dense.weight" in ckpt
    again = adapter.from_hf(ckpt)
    for k in ours:
        assert torch.equal(again[k], ours[k]), k


def test_config_round_trip_and_refusals():
    cfg = from_hf_config(hf_config(), chunk_size=16)
    from harts_runtime.models.ling3 import to_hf_config

    again = from_hf_config(transformers.BailingHybridConfig(**to_hf_config(cfg)), chunk_size=16)
    assert again == cfg
    for field, change in (
        ("hidden_act", dict(hidden_act="gelu")),
        ("tie_word_embeddings", dict(tie_word_embeddings=True)),
        ("num_key_value_heads", dict(num_key_value_heads=1)),
    ):
        with pytest.raises(InvalidInputError) as e:
            from_hf_config({**hf_config().to_dict(), **change})
        assert e.value.field == field
    with pytest.raises(InvalidInputError) as e:
        from_hf_config({**hf_config().to_dict(), "expert_swiglu_limit_list": [0, 1]})
    assert e.value.field == "expert_swiglu_limit_list"


# ------------------------------------------------------------------------------ FLOPs
def test_flop_model_counts_every_matmul_of_ling():
    """``layer_costs`` per row: the KDA layer's matmuls (full-rank gate projections), the MLA's
    (with its output gate) and the MoE's (router, top-k experts, shared expert) are twice their
    weights' sizes; conv and core on top for KDA."""
    from torch import nn

    from harts_runtime import HybridModel, model_config
    from harts_runtime.flops import layer_costs

    cfg = model_config("ling3-tiny")
    model = HybridModel(cfg, device="meta")
    per = layer_costs(cfg)["per_layer"]

    def linear_flops(module) -> int:
        return sum(2 * m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))

    kda, mla, moe = model.blocks[0], model.blocks[2], model.blocks[1]
    assert (kda.mixer_kind, mla.mixer_kind, moe.ffn_kind) == ("kda", "mla", "moe")
    h, k, w = cfg.kda.num_heads, cfg.kda.head_k_dim, cfg.conv_size
    conv = 2 * w * 3 * h * k
    core = h * (4 * cfg.chunk_size * k + 2 * cfg.chunk_size * k + 6 * k * k)
    assert per["kda"] == linear_flops(kda.mixer) + conv + core
    assert per["mla"] == linear_flops(mla.mixer)
    e, d, i = moe.ffn.w_gate.shape
    assert per["moe"] == 2 * e * d + cfg.moe.top_k * 3 * 2 * d * i + linear_flops(moe.ffn.shared_experts)


def test_registered_as_bailing_hybrid_and_listed_in_the_refusal():
    from harts_runtime import HybridModel, model_config
    from harts_runtime.models.registry import family_of, get_family

    fam = get_family("bailing_hybrid")
    assert fam.name == "ling3" and "ling3-tiny" in fam.flavors
    assert family_of(model_config("ling3-tiny")) is fam
    assert family_of(model_config("kimi-linear-tiny")).name == "kimi_linear"
    with pytest.raises(InvalidInputError) as e:
        get_family("mamba")
    assert e.value.field == "model_type" and "bailing_hybrid" in str(e.value)
    assert HybridModel(model_config("ling3-tiny", 2)).config.moe.swiglu_limits == (0.0, 0.5)


def test_ling_flash_shapes_match_transformers_on_the_meta_device():
    """Ling-3.0-Flash's default config (6 of its 42 layers: KDA x 5, MLA, the first two dense),
    built by transformers and by us on the meta device: the adapter names every tensor of
    transformers' model with its shape, and nothing else."""
    cfg = transformers.BailingHybridConfig(num_hidden_layers=6)
    with torch.device("meta"):
        hf = transformers.BailingHybridForCausalLM(cfg)
    ours = from_hf_config(cfg)
    assert ours.mixers == ("kda",) * 5 + ("mla",) and ours.ffns == ("dense",) * 2 + ("moe",) * 4
    assert (ours.kda.head_k_dim, ours.mla.qk_rope_head_dim, ours.moe.num_experts) == (128, 64, 512)
    adapter = Ling3StateDictAdapter(ours)
    want = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert adapter.hf_shapes == want
