"""Nemotron-H checkpoints: transformers' ``NemotronHForCausalLM`` against our ``HybridModel``.

A tiny random Nemotron-H (pattern ``M*-EM-*E``: Mamba2 with grouped B/C and a conv bias,
attention without RoPE sharing one KV head, relu2 MLPs, MoE with relu2 experts, sigmoid group
routing with a correction bias and a shared expert; fp32) is built by transformers with a fixed
seed, every tensor perturbed so that no default initialisation hides a mapping error, saved by
transformers and loaded by :func:`harts_runtime.load_pretrained`; then:

* logits on packed random trajectories (our trajectory layout) equal HF's per sequence;
* compact-execution log-probs of rollout trees (forks at B-1, B, B+1, nested, identical, a
  prefix; Mamba2 boundary states handed across forks) equal HF's per trajectory;
* parameter gradients of a logits functional equal HF's (mapped through the adapter), and the
  compact and trajectory executions give the same loss and gradients;
* load -> one AdamW step -> save -> reload is bit-equal, in HARTS and in transformers;
* ours -> :func:`save_pretrained` -> ``AutoModelForCausalLM.from_pretrained`` gives the same
  logits with no missing or unexpected keys; the adapter maps both spellings exactly;
* unsupported config fields raise ``InvalidInputError`` naming the field.

HF's Mamba2 mixer runs its PyTorch path on the CPU (no ``mamba_ssm`` kernels).
"""

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
hp = pytest.importorskip("harts_planner")

from hf_reference import (  # noqa: E402
    compact_and_trajectory_grads,
    hf_logits,
    hf_target_logprobs,
    ours_logits,
    rel_err,
)
from trees import fork_shapes  # noqa: E402

from harts_runtime import (  # noqa: E402
    HybridModel,
    InvalidInputError,
    StepInputs,
    load_pretrained,
    model_config,
    save_pretrained,
    train_step,
)
from harts_runtime.hf import save_setup  # noqa: E402
from harts_runtime.models.nemotron_h import (  # noqa: E402
    NemotronHStateDictAdapter,
    from_hf,
    from_hf_config,
    to_hf,
    to_hf_config,
)

V = 96
B = 16  # our chunk size (= HF's mamba chunk here)
PATTERN = "M*-EM-*E"
TOL_LOGITS = 1e-4
TOL_GRAD = 1e-4
TOL_TRAIN = {"loss": (1e-6, 1e-5), "grad": (2e-6, 2e-3)}

pytestmark = pytest.mark.usefixtures("one_thread")


def hf_config(**changes):
    kw = dict(
        vocab_size=V,
        hidden_size=32,
        hybrid_override_pattern=PATTERN,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=24,
        intermediate_size=40,
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=B,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=12,
        moe_shared_expert_intermediate_size=20,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.7,
        norm_topk_prob=True,
        initializer_range=0.2,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    kw.update(changes)
    return transformers.NemotronHConfig(**kw)


def perturb(model):
    """Every tensor redrawn: matrices ~ N(0, 1 / fan_in), norms 1 + N(0, 0.09), A_log from
    log U(0.5, 4), the other vectors (conv bias, dt_bias, D, correction bias) given noise."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, t in sorted(model.named_parameters()) + sorted(model.named_buffers()):
            if not t.is_floating_point():
                continue
            noise = torch.randn(t.shape, generator=g)
            if t.dim() >= 2 and not name.endswith("conv1d.weight"):
                t.copy_(noise * t.shape[-1] ** -0.5)
            elif name.endswith("conv1d.weight"):
                t.copy_(noise * 0.5)
            elif "norm" in name:
                t.copy_(1 + 0.3 * noise)
            elif name.endswith("A_log"):
                t.copy_(torch.log(0.5 + 3.5 * torch.rand(t.shape, generator=g)))
            else:
                t.copy_(t + 0.3 * noise)
    return model


def random_hf_model(seed: int = 0, **changes):
    torch.manual_seed(seed)
    return perturb(transformers.NemotronHForCausalLM(hf_config(**changes)).float().eval())


def random_trajs(seed: int, lengths=(23, 40, 9)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = random_hf_model()
    path = tmp_path_factory.mktemp("nemotron_h") / "hf"
    hf.save_pretrained(path)
    return hf, path


# ------------------------------------------------------------------------------ forward
def test_logits_match_transformers(checkpoint):
    hf, path = checkpoint
    ours = load_pretrained(path, chunk_size=B).eval()
    assert ours.config.mixers == ("mamba2", "gqa", "none", "none", "mamba2", "none", "gqa", "none")
    assert ours.config.ffns == ("none", "none", "relu2", "moe", "none", "relu2", "none", "moe")
    trajs = random_trajs(1)
    logits, off, worst = ours_logits(ours, trajs), 0, 0.0
    for t in trajs:
        worst = max(worst, rel_err(logits[off : off + len(t)], hf_logits(hf, t)))
        off += len(t)
    print(f"max relative logit error {worst:.2e}")
    assert worst <= TOL_LOGITS


def test_compact_logprobs_match_transformers(checkpoint):
    """Compact execution (shared prefixes once, Mamba2 state handoffs and replay, ancestor-KV
    attention) against HF run on each trajectory separately."""
    hf, path = checkpoint
    ours = load_pretrained(path, chunk_size=B).eval()
    rng = np.random.default_rng(2)
    trunk = rng.integers(0, V, size=19).tolist()
    trajs = [trunk + rng.integers(0, V, size=n).tolist() for n in (5, 14, 30)] + [trunk[:7] + [3, 4, 5]]
    trajs += fork_shapes(B, V, seed=3)
    from harts_runtime import step_logprobs

    lp = step_logprobs(
        ours, StepInputs.synthetic(hp.RolloutBatch.from_token_lists(trajs), 0), "compact"
    ).double()
    ref = hf_target_logprobs(hf, trajs)
    err = float((lp - ref).abs().max())
    print(f"max compact log-prob error {err:.2e} (max |log p| {float(ref.abs().max()):.2f})")
    assert err <= TOL_LOGITS * float(ref.abs().max())


def test_gradients_match_transformers(checkpoint):
    hf, path = checkpoint
    hf = random_hf_model()  # a fresh copy: this test accumulates gradients
    ours = load_pretrained(path, chunk_size=B).train()
    hf.train()
    trajs = random_trajs(3, lengths=(17, 26))
    w = torch.randn(sum(map(len, trajs)), V, generator=torch.Generator().manual_seed(0))
    (ours_logits(ours, trajs, grad=True) * w).sum().backward()
    off = 0
    for t in trajs:
        (hf(torch.tensor([t])).logits[0] * w[off : off + len(t)]).sum().backward()
        off += len(t)
    adapter = NemotronHStateDictAdapter(ours.config)
    grads = {k: torch.zeros(s) for k, s in adapter.our_shapes.items()}
    grads.update({k: p.grad for k, p in ours.named_parameters()})
    ours_hf = dict(adapter._to_hf_items(grads, check=False))
    worst, checked = 0.0, 0
    for name, p in hf.named_parameters():
        assert p.grad is not None, name
        e = rel_err(ours_hf[name], p.grad)
        assert e <= TOL_GRAD, (name, e)
        worst, checked = max(worst, e), checked + 1
    assert checked + sum("e_score_correction_bias" in k for k in ours_hf) == len(ours_hf)
    print(f"max relative gradient error {worst:.2e} over {checked} tensors")


def test_compact_equals_trajectory(checkpoint):
    _, path = checkpoint
    out = compact_and_trajectory_grads(load_pretrained(path, chunk_size=8).train(), V)
    (lc, gc), (lt, gt) = out["compact"], out["trajectory"]
    rtol, atol = TOL_TRAIN["loss"]
    assert torch.allclose(lc, lt, rtol=rtol, atol=atol), (lc, lt)
    rtol, atol = TOL_TRAIN["grad"]
    assert gc.keys() == gt.keys()
    for k in gc:
        assert torch.allclose(gc[k], gt[k], rtol=rtol, atol=atol), k


@pytest.mark.parametrize("keep", [(), ("linear_attention",)], ids=["full", "keep_linear_attention"])
def test_recomputed_blocks_give_the_same_gradients(checkpoint, keep):
    """Block recomputation (the Mamba2 rounds re-run in backward, or kept) changes no gradient."""
    from harts_runtime.recompute import apply_recompute

    _, path = checkpoint
    plain = compact_and_trajectory_grads(load_pretrained(path, chunk_size=8).train(), V)["compact"]
    model = apply_recompute(load_pretrained(path, chunk_size=8).train(), keep=keep)
    again = compact_and_trajectory_grads(model, V)["compact"]
    assert torch.equal(plain[0], again[0])
    for k, g in plain[1].items():
        assert torch.allclose(again[1][k], g, rtol=1e-6, atol=1e-7), k


# ------------------------------------------------------------------------------ round trips
def test_state_dict_adapter_round_trip_is_exact(checkpoint, tmp_path):
    hf, path = checkpoint
    cfg = from_hf_config(hf.config, chunk_size=B)
    sd = hf.state_dict()
    back = to_hf(from_hf(sd, cfg), cfg)
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    adapter = NemotronHStateDictAdapter(cfg)  # the checkpoint spelling, both ways
    ck = adapter.to_checkpoint(from_hf(sd, cfg))
    assert (
        any(k.startswith("backbone.") for k in ck)
        and "backbone.layers.3.mixer.experts.7.up_proj.weight" in ck
    )
    again = adapter.from_hf(ck)
    ours = from_hf(sd, cfg)
    assert all(torch.equal(again[k], ours[k]) for k in ours)
    d = to_hf_config(cfg)
    assert from_hf_config(d, chunk_size=B) == cfg
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert transformers.AutoConfig.from_pretrained(tmp_path).hybrid_override_pattern == PATTERN


def test_trained_checkpoint_saves_and_reloads(checkpoint, tmp_path):
    """load -> one AdamW step (compact) -> save -> reload: bit-equal in HARTS and transformers."""
    _, path = checkpoint
    model = load_pretrained(path, chunk_size=B)
    _, adapter = save_setup(model, None)
    covered = {p.ours for name in adapter.checkpoint_names for p in adapter.pieces(name)}
    assert {n for n, _ in model.named_parameters()} <= covered
    rng = np.random.default_rng(3)
    trunk = rng.integers(0, V, size=19).tolist()
    trajs = [trunk + rng.integers(0, V, size=n).tolist() for n in (5, 14, 9)] + [trunk[:7] + [1, 2, 3]]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = StepInputs.synthetic(hp.RolloutBatch.from_token_lists(trajs), 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = train_step(model, optimizer, step, None, "compact", capacity=256)
    assert np.isfinite(float(result.loss))
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(not torch.equal(trained[n], before[n]) for n in trained)
    save_pretrained(model, tmp_path / "out")
    again = load_pretrained(tmp_path / "out", chunk_size=B)
    for n, t in trained.items():
        assert torch.equal(dict(again.named_parameters())[n], t), n
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    want, got = adapter.to_hf(model.state_dict()), hf.state_dict()
    assert set(want) <= set(got)
    for k, v in want.items():
        assert torch.equal(got[k].float(), v.float()), k
    hf.eval()
    t = random_trajs(4, lengths=(21,))
    assert rel_err(ours_logits(model.eval(), t), hf_logits(hf, t[0])) <= TOL_LOGITS


def test_tiny_flavor_saves_a_folder_both_load(tmp_path):
    torch.manual_seed(0)
    model = HybridModel(model_config("nemotron-h-tiny"))
    save_pretrained(model, tmp_path)
    again = load_pretrained(tmp_path)
    ours, theirs = model.state_dict(), again.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert hf.config.hybrid_override_pattern == "ME*-ME*-"


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "field,value",
    [
        ("moe_latent_size", 8),
        ("num_nextn_predict_layers", 1),
        ("mlp_hidden_act", "silu"),
        ("attention_bias", True),
        ("tie_word_embeddings", True),
        ("n_shared_experts", 2),
        ("hybrid_override_pattern", "M*X"),
    ],
)
def test_unsupported_config_fields_are_named(field, value):
    d = hf_config().to_dict()
    d.pop("layers_block_type")
    d.setdefault("hybrid_override_pattern", PATTERN)
    d[field] = value
    with pytest.raises(InvalidInputError) as e:
        from_hf_config(d)
    assert e.value.field.startswith(field)


# ------------------------------------------------------------------------------ FLOP model
def test_flop_model_counts_every_nemotron_h_layer():
    from harts_runtime.flops import layer_costs

    cfg = model_config("nemotron-h-tiny")
    d, m, moe, w, b = cfg.hidden_size, cfg.mamba2, cfg.moe, cfg.conv_size, cfg.chunk_size
    i, conv = m.num_heads * m.head_dim, m.num_heads * m.head_dim + 2 * m.n_groups * m.state_size
    core = m.num_heads * (2 * b * (m.state_size + m.head_dim) + 4 * m.state_size * m.head_dim)
    mamba2 = 2 * d * (i + conv + m.num_heads) + 2 * w * conv + core + 2 * i * d
    hd, h, hkv = cfg.gqa.head_dim, cfg.num_heads, cfg.num_kv_heads
    gqa = 2 * d * h * hd * 2 + 2 * 2 * d * hkv * hd
    relu2 = 2 * 2 * d * cfg.dense_intermediate
    experts = 2 * d * moe.num_experts + (moe.top_k * 2 * 2 * d * moe.intermediate_size)
    experts += 2 * 2 * d * moe.shared_intermediate_size
    per = {"mamba2": mamba2, "gqa": gqa, "relu2": relu2, "moe": experts, "none": 0}
    c = layer_costs(cfg)
    want = sum(per[x] + per[f] for x, f in zip(cfg.mixers, cfg.ffns)) + 2 * d * cfg.vocab_size
    assert c["row"] == want
    assert c["linear_core"] == cfg.mixers.count("mamba2") * core
    assert c["attn_per_key"] == cfg.mixers.count("gqa") * 2 * h * 2 * hd


def test_legacy_config_spellings_read_the_same():
    """Released configs' names (``mamba_n_groups``, ``mamba_d_conv``, ``mamba_conv_bias``,
    ``mamba_dt_limit``, ``hybrid_override_pattern``, legacy ``mamba`` / ``attention`` layer names)
    give the same model as transformers' current ones."""
    d = hf_config().to_dict()
    modern = from_hf_config(d, chunk_size=B)
    legacy = {
        k: v for k, v in d.items() if k not in ("n_groups", "conv_kernel", "use_conv_bias", "time_step_limit")
    }
    legacy.update(mamba_n_groups=2, mamba_d_conv=4, mamba_conv_bias=True, mamba_dt_limit=[0.0, float("inf")])
    legacy.pop("layers_block_type")
    assert from_hf_config({**legacy, "hybrid_override_pattern": PATTERN}, chunk_size=B) == modern
    names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    assert (
        from_hf_config({**legacy, "layers_block_type": [names[c] for c in PATTERN]}, chunk_size=B) == modern
    )
