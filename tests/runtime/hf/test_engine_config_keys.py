"""The ``config.json`` keys the rollout engines read that transformers' own configs lack: a folder
``save_pretrained`` writes carries them, with the values the model's config implies, and
transformers still loads it to the same model.

Qwen3-Next: ``full_attention_interval`` (SGLang's config derives the layer schedule from it alone).
Ling-3.0: the released checkpoints' ``architectures`` (``BailingMoeV3ForCausalLM``) and the keys
vLLM's ``BailingMoeV3ForCausalLM`` reads: ``use_bias``, ``moe_shared_expert_intermediate_size``,
``no_kda_lora``, ``gated_attention_proj_granularity_type``, ``layer_group_size``,
``first_k_dense_replace``."""

from __future__ import annotations

import itertools
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from harts_runtime import load_pretrained, save_pretrained  # noqa: E402
from harts_runtime.hf import save_setup  # noqa: E402
from harts_runtime.models import HybridModel, model_config  # noqa: E402
from harts_runtime.models.ling3.args import first_k_dense_replace, layer_group_size  # noqa: E402
from harts_runtime.models.qwen3_next.args import full_attention_interval  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _released_ling_schedule(n: int, g: int) -> list[str]:
    """The released checkpoints' config code (and vLLM's ``_is_kda_layer``): MLA at the end of
    every group of ``g`` and on the layers past the last whole group."""
    return ["mla" if (i + 1) % g == 0 or i >= n // g * g else "kda" for i in range(n)]


def _schedules(kinds, max_len=7):
    for n in range(1, max_len + 1):
        yield from itertools.product(kinds, repeat=n)


# ---------------------------------------------------------------- the schedule keys, exhaustively
def _expands(n: int, k: int) -> list[str]:
    """transformers' own rule for ``full_attention_interval`` (when ``layer_types`` is absent)."""
    return transformers.Qwen3NextConfig(num_hidden_layers=n, full_attention_interval=k).layer_types


def test_full_attention_interval_is_the_period_transformers_expands_to_the_schedule():
    for mixers in _schedules(("gdn", "gated_attention"), max_len=6):
        n = len(mixers)
        types = ["linear_attention" if m == "gdn" else "full_attention" for m in mixers]
        k = full_attention_interval(mixers)
        if k is None:
            assert all(_expands(n, j) != types for j in range(1, n + 2)), mixers
        else:
            assert _expands(n, k) == types, (mixers, k)


def test_layer_group_size_gives_the_released_schedule_or_none():
    for mixers in _schedules(("kda", "mla")):
        n = len(mixers)
        g = layer_group_size(mixers)
        fits = [j for j in range(1, n + 1) if _released_ling_schedule(n, j) == list(mixers)]
        assert g == (fits[0] if fits else None), mixers
    # the released checkpoints: Ling-3.0-tiny (24 layers, MLA at 3, 7, ..., 23), -flash (42, group 6)
    assert layer_group_size(_released_ling_schedule(24, 4)) == 4
    assert layer_group_size(_released_ling_schedule(42, 6)) == 6
    assert layer_group_size(("kda",) * 5) is None  # no MLA: no group size gives it


def test_first_k_dense_replace_is_the_dense_prefix_or_none():
    for ffns in _schedules(("dense", "moe")):
        k = first_k_dense_replace(ffns)
        fits = [j for j in range(len(ffns) + 1) if ffns == ("dense",) * j + ("moe",) * (len(ffns) - j)]
        assert k == (fits[0] if fits else None), ffns


# ---------------------------------------------------------------- folders save_pretrained writes
def _model(flavor, num_layers, **overrides):
    torch.manual_seed(0)
    return HybridModel(model_config(flavor, num_layers, dtype="float32", **overrides))


def _save_and_check_round_trip(model, path):
    """Save; HARTS reads the folder back to the same config and weights, and transformers loads
    it with no missing / unexpected / mismatched key to the same tensors. Returns config.json."""
    save_pretrained(model, path)
    again = load_pretrained(path, chunk_size=model.config.chunk_size)
    assert again.config == model.config
    before, after = model.state_dict(), again.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    _, adapter = save_setup(model)
    want, got = adapter.to_hf(model.state_dict()), hf.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    return json.loads((path / "config.json").read_text()), hf


@pytest.mark.parametrize(
    "mixers",
    [("gdn", "gdn", "gdn", "gated_attention"), ("gdn", "gated_attention", "gated_attention", "gdn")],
    ids=["periodic", "not-periodic"],
)
def test_qwen3_next_folder_carries_full_attention_interval(tmp_path, mixers):
    model = _model("qwen3.5-tiny", 4, gdn={"projection": "fused"}, mixers=mixers)
    config, hf = _save_and_check_round_trip(model, tmp_path)
    assert config["model_type"] == "qwen3_next"
    if mixers[-1] == "gated_attention":  # every fourth layer full attention
        assert config["full_attention_interval"] == 4
    else:  # no period gives it: no key (SGLang cannot build such a model)
        assert "full_attention_interval" not in config
    assert hf.config.layer_types == config["layer_types"]  # transformers still reads layer_types


@pytest.mark.parametrize("num_layers", [6, 4], ids=["whole-groups", "tail-kda"])
def test_ling3_folder_carries_the_released_config_keys(tmp_path, num_layers):
    model = _model("ling3-tiny", num_layers)
    cfg = model.config
    config, hf = _save_and_check_round_trip(model, tmp_path)
    assert config["architectures"] == ["BailingMoeV3ForCausalLM"]
    assert type(hf).__name__ == "BailingHybridForCausalLM"  # transformers dispatches on model_type
    assert config["use_bias"] is False
    shared = cfg.moe.shared_intermediate_size or cfg.moe.num_shared_experts * cfg.moe.intermediate_size
    assert config["moe_shared_expert_intermediate_size"] * config["num_shared_experts"] == shared
    assert config["no_kda_lora"] is True and not cfg.kda.low_rank_gates
    assert config["gated_attention_proj_granularity_type"] == "head_wise"
    assert tuple(hf.model.layers[cfg.mixers.index("mla")].self_attn.g_proj.weight.shape) == (
        cfg.num_heads,
        cfg.hidden_size,
    )
    dense = cfg.ffns.index("moe")
    assert config["first_k_dense_replace"] == dense and set(cfg.ffns[dense:]) == {"moe"}
    if num_layers == 6:  # KDA, KDA, MLA twice: the released rule with groups of 3
        assert config["layer_group_size"] == 3
        assert _released_ling_schedule(6, 3) == list(cfg.mixers)
    else:  # KDA, KDA, MLA, KDA: the released rule makes a tail layer MLA, so no group size
        assert "layer_group_size" not in config
        assert all(_released_ling_schedule(4, g) != list(cfg.mixers) for g in range(1, 5))
