"""The vLLM and SGLang spellings of the weight stream (``names="vllm" | "sglang"``,
:mod:`harts_runtime.engine.weight_names`) for the five families' tiny models.

The oracle is independent of the adapters: our model is written with ``save_pretrained``, read by
transformers (``AutoModelForCausalLM``) and written again by transformers' own ``save_pretrained``;
the names, shapes and values in that folder, renamed by the engines' rules as written here from
their model files (vLLM 0.34.0, SGLang 0.5.23: every loader takes the checkpoint's names except
vLLM's Qwen3.5-MoE, whose text and vision-language classes both take ``model.language_model.``, and
Ling-3.0's KDA layers, whose output projection both engines take as ``attention.o_proj``, the
released checkpoints' name, where transformers writes ``attention.dense`` for every layer), must be
the stream's exactly, in manifest order; the stream read back through the adapter gives the model's
own tensors. Names the engines' loaders skip (rotary ``inv_freq``, MTP) never appear."""

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.usefixtures("one_thread")

# The engines' rules, as read from their loaders (the test's own copy, not the table under test).
ENGINE_PREFIX = {("vllm", "qwen3_5_moe"): ("model.", "model.language_model.")}
# (engine, family) -> (the layer's type in transformers' config ``layer_types``, name ending as
# transformers writes it, as the engine takes it): vLLM's KDA module registers o_proj (its MLA module
# dense); SGLang's KDA module o_proj (and it retries a missing name with .dense. -> .o_proj.)
LAYER_RENAME = {
    (e, "ling3"): ("linear_attention", ".attention.dense.weight", ".attention.o_proj.weight")
    for e in ("vllm", "sglang")
}
SKIPPED = ("inv_freq", "mtp", "cos_cached", "sin_cached", "visual")
FAMILIES = ("kimi_linear", "qwen3_next", "qwen3_5_moe", "nemotron_h", "ling3")


def _config(family):
    from harts_runtime import model_config

    if family == "qwen3_next":  # no tiny flavor: the shared tiny transformers config
        from hf_configs import qwen_config

        from harts_runtime.models.registry import get_family

        return get_family("qwen3_next").from_hf_config(qwen_config("qwen3_next").to_dict(), dtype="float32")
    flavor = {
        "kimi_linear": "kimi-linear-tiny",
        "qwen3_5_moe": "qwen3.5-tiny",
        "nemotron_h": "nemotron-h-tiny",
        "ling3": "ling3-tiny",
    }[family]
    return model_config(flavor, dtype="float32")


def _model(family):
    from harts_runtime import HybridModel
    from harts_runtime.hf.save import save_setup

    torch.manual_seed(0)
    model = HybridModel(_config(family))
    zero = ("local_tokens_per_expert",) + tuple(s for s, _ in save_setup(model)[1].zero_only)
    with torch.no_grad():  # every tensor off its initialisation (but what the family keeps at 0)
        for name, t in model.state_dict().items():
            if t.is_floating_point() and not name.endswith(zero):
                t.add_(0.1 * torch.randn_like(t))
    return model


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (our model, what transformers' save_pretrained of it writes: name -> tensor,
    transformers' config ``layer_types`` or None)."""
    from harts_runtime import save_pretrained

    out = {}
    for family in FAMILIES:
        model = _model(family)
        ours = tmp_path_factory.mktemp(f"{family}_ours")
        save_pretrained(model, ours)
        hf = transformers.AutoModelForCausalLM.from_pretrained(ours, dtype=torch.float32)
        theirs = tmp_path_factory.mktemp(f"{family}_hf")
        hf.save_pretrained(theirs)
        folder = {}
        for f in sorted(theirs.glob("*.safetensors")):
            folder.update(safetensors_torch.load_file(f))
        out[family] = (model, folder, getattr(hf.config, "layer_types", None))
    return out


def _released(family, name):
    """transformers' save_pretrained name -> the released checkpoints' (and both engines'). One
    difference: transformers (5.25) writes a Kimi-Linear *dense* layer's FFN under
    ``block_sparse_moe.`` (its load-time rename ``block_sparse_moe`` -> ``mlp`` reversed for every
    layer), where the released checkpoints and both engines' dense layers (``KimiMLP`` as ``.mlp``)
    have ``mlp.``; the MoE layers' names (``block_sparse_moe.experts`` / ``gate`` /
    ``shared_experts``) are kept."""
    if family == "kimi_linear":
        return re.sub(r"\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$", r".mlp.\1", name)
    return name


def _layer_rename(engine, family, name, layer_types, back=False):
    """``name`` renamed as the engine's rule for its layer's type (``layer_types`` None: no layer
    known, unchanged); ``back``: the engine's name back to transformers'."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if (engine, family) not in LAYER_RENAME or m is None or layer_types is None:
        return name
    kind, old, new = LAYER_RENAME[engine, family]
    if back:
        old, new = new, old
    if layer_types[int(m.group(1))] == kind and name.endswith(old):
        return name[: -len(old)] + new
    return name


def _oracle(engine, family, name, layer_types=None):
    name = _layer_rename(engine, family, name, layer_types)
    old, new = ENGINE_PREFIX.get((engine, family), ("", ""))
    return new + name[len(old) :] if old and name.startswith(old) else name


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("family", FAMILIES)
def test_stream_is_the_engines_spelling_of_the_checkpoint(families, engine, family):
    from harts_runtime.engine.weights import weight_manifest, weights
    from harts_runtime.hf.save import save_setup

    model, folder, layer_types = families[family]
    want = {_oracle(engine, family, _released(family, n), layer_types): t for n, t in folder.items()}
    assert len(want) == len(folder)
    if (engine, family) in LAYER_RENAME:  # the tiny model has layers of both kinds
        kind, old, new = LAYER_RENAME[engine, family]
        assert kind in layer_types and set(layer_types) - {kind}, layer_types
        assert any(n.endswith(new) for n in want) and any(n.endswith(old) for n in want)
    manifest = weight_manifest(model, engine)
    stream = weights(model, engine, bucket_bytes=1 << 14)
    flat = [(n, t) for b in stream for n, t in b]
    assert [n for n, _ in flat] == [e.name for e in manifest]
    assert sorted(n for n, _ in flat) == sorted(want)  # every tensor once, nothing else
    for (n, t), e in zip(flat, manifest):
        assert (tuple(t.shape), t.dtype) == (e.shape, e.dtype) == (tuple(want[n].shape), want[n].dtype), n
        torch.testing.assert_close(t, want[n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
        assert not any(s in n for s in SKIPPED), n
    # read back: renamed to the checkpoint's spelling, the adapter gives the model's own tensors
    old, new = ENGINE_PREFIX.get((engine, family), ("", ""))
    back = {(old + n[len(new) :] if new and n.startswith(new) else n): t for n, t in flat}
    back = {_layer_rename(engine, family, n, layer_types, back=True): t for n, t in back.items()}
    _, adapter = save_setup(model)
    got = adapter.from_hf(back)
    sd = model.state_dict()
    assert sorted(got) == sorted(sd)
    for k, v in sd.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_rule_table_covers_both_engines_and_refuses_the_rest():
    from harts_runtime import InvalidInputError
    from harts_runtime.engine.weight_names import RULES, engine_name, engine_rule
    from harts_runtime.models.registry import BUILTIN_FAMILIES

    assert set(RULES) == {(e, f) for e in ("vllm", "sglang") for f in BUILTIN_FAMILIES}
    for (engine, family), rule in RULES.items():
        assert rule.checkpoint_names == ((engine, family) not in ENGINE_PREFIX | LAYER_RENAME)
        for n in ("model.layers.3.mlp.gate.weight", "lm_head.weight", "backbone.norm_f.weight"):
            assert engine_name(rule, n) == _oracle(engine, family, n)
        # layer 0 a linear-attention (our mixer kind kda) layer, layer 1 a full-attention (mla) one
        types = ("linear_attention", "full_attention")
        for i, mixer in enumerate(("kda", "mla")):
            for end in ("attention.dense.weight", "attention.dense.bias", "attention.o_proj.weight"):
                n = f"model.layers.{i}.{end}"
                assert engine_name(rule, n, mixer) == _oracle(engine, family, n, types), (engine, family, n)
    with pytest.raises(InvalidInputError, match="^names: vllm has no loader for the mamba3 family$"):
        engine_rule("vllm", "mamba3")
    with pytest.raises(InvalidInputError, match=r"^names: choose one of \('vllm', 'sglang'\), got 'tgi'$"):
        engine_rule("tgi", "qwen3_next")


def test_unknown_spelling_is_refused_naming_names(families):
    from harts_runtime import InvalidInputError
    from harts_runtime.engine.weights import weights

    model, _, _ = families["qwen3_5_moe"]
    msg = r"^names: choose one of \('transformers', 'checkpoint', 'vllm', 'sglang'\), got 'VLLM'$"
    with pytest.raises(InvalidInputError, match=msg):
        weights(model, "VLLM")


def test_a_family_without_a_loader_is_refused_before_streaming(families, monkeypatch):
    from harts_runtime import InvalidInputError
    from harts_runtime.engine import weight_names
    from harts_runtime.engine.weights import weight_manifest, weights

    model, _, _ = families["nemotron_h"]
    monkeypatch.delitem(weight_names.RULES, ("sglang", "nemotron_h"))  # as for a family added later
    msg = "^names: sglang has no loader for the nemotron_h family$"
    with pytest.raises(InvalidInputError, match=msg):
        weight_manifest(model, "sglang")
    with pytest.raises(InvalidInputError, match=msg):
        weights(model, "sglang")
    assert weight_manifest(model, "vllm")  # the other engine's rule still applies
