"""The ``kimi-linear-tiny`` and ``qwen3.5-tiny`` flavors: the documented way to make a small
checkpoint folder (``save_pretrained(HybridModel(model_config(...)), path)``) that HARTS and
transformers both load."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from harts_runtime import HybridModel, InvalidInputError, load_pretrained, model_config, save_pretrained

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(importlib.util.find_spec("safetensors") is None, reason="needs the hf extra"),
]

FAMILIES = {
    "kimi-linear-tiny": "kimi_linear",
    "qwen3.5-tiny": "qwen3_5_moe_text",
    "ling3-tiny": "bailing_hybrid",
}


@pytest.mark.parametrize("flavor", sorted(FAMILIES))
@pytest.mark.parametrize("layers", [None, 2])
def test_tiny_flavor_saves_a_folder_both_load(tmp_path, flavor, layers):
    torch.manual_seed(0)
    model = HybridModel(model_config(flavor, layers))
    save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == FAMILIES[flavor]
    assert config["num_hidden_layers"] == (layers or model_config(flavor).num_layers)
    again = load_pretrained(tmp_path)
    ours, theirs = model.state_dict(), again.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    if importlib.util.find_spec("transformers") is None:
        return
    import transformers

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert hf.config.vocab_size == model.config.vocab_size


def test_the_hybrid_flavors_say_why_they_cannot_be_saved(tmp_path):
    """``debug`` has no checkpoint format (mixers of two families); the refusal names the field."""
    with pytest.raises(InvalidInputError) as e:
        save_pretrained(HybridModel(model_config("debug")), tmp_path)
    assert e.value.field and str(e.value).startswith(e.value.field)
