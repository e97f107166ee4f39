"""``harts_runtime.hf.freeze_family_constants``: the one rule for the parameters a model must not
train because its transformers family has no tensor for them."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from harts_runtime import InvalidInputError  # noqa: E402
from harts_runtime.hf import freeze_family_constants, save_pretrained, save_setup  # noqa: E402
from harts_runtime.models import HybridModel, model_config  # noqa: E402

CASES = {  # name -> (flavor, overrides, family written, parameters frozen (suffixes))
    "kimi_linear with a KDA output-gate bias": (
        "kimi-linear-tiny",
        {"kda": {"output_gate_bias": True}},
        "kimi_linear",
        ("mixer.g_proj.1.bias",),
    ),
    "kimi_linear": ("kimi-linear-tiny", {}, "kimi_linear", ()),
    "qwen3_5_moe_text": ("qwen3.5-tiny", {}, "qwen3_5_moe_text", ()),
    "qwen3_next": ("qwen3.5-tiny", {"gdn": {"projection": "fused"}}, "qwen3_next", ()),
}


def _model(flavor, overrides):
    torch.manual_seed(0)
    return HybridModel(model_config(flavor, 2, **overrides))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_parameters_no_checkpoint_tensor_carries_are_frozen(case):
    flavor, overrides, model_type, suffixes = CASES[case]
    model = _model(flavor, overrides)
    hf_config, adapter = save_setup(model)
    assert hf_config["model_type"] == model_type
    params = dict(model.named_parameters())
    want = sorted(n for n in params if suffixes and n.endswith(suffixes))
    assert bool(want) == bool(suffixes)

    names = freeze_family_constants(model)
    assert sorted(names) == want
    assert all(not params[n].requires_grad for n in names)
    assert all(p.requires_grad for n, p in params.items() if n not in names)
    assert freeze_family_constants(model) == names  # idempotent: the same names again

    # the rule: our tensors that no checkpoint tensor carries (the adapter's extra_ours) ...
    carried = {p.ours for n in adapter.checkpoint_names for p in adapter.pieces(n)}
    assert set(adapter.our_shapes) - carried == set(adapter.extra_ours())
    assert set(names) == set(adapter.extra_ours()) & set(params)
    # ... contains the zero_only rule (verl's freeze_unexportable): every zero_only tensor is one
    zero_only = tuple(s for s, _ in adapter.zero_only)
    assert {k for k in adapter.our_shapes if k.endswith(zero_only)} <= set(adapter.extra_ours())
    assert {n for n in params if n.endswith(zero_only)} <= set(names)


def test_a_trained_model_with_its_constants_frozen_still_saves(tmp_path):
    """Every trainable parameter moved by a step (the frozen ones receive no update) and the model
    saves; the same step without freezing leaves the family and is refused naming the tensor."""
    for freeze in (True, False):
        model = _model("kimi-linear-tiny", {"kda": {"output_gate_bias": True}})
        frozen = freeze_family_constants(model) if freeze else []
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(trainable, lr=0.1)
        for p in trainable:
            p.grad = torch.ones_like(p)
        opt.step()
        if freeze:
            assert frozen and all(float(dict(model.named_parameters())[n].abs().max()) == 0 for n in frozen)
            save_pretrained(model, tmp_path / "ok")
            assert (tmp_path / "ok" / "config.json").is_file()
        else:
            with pytest.raises(InvalidInputError) as e:
                save_pretrained(model, tmp_path / "refused")
            assert e.value.field.endswith("mixer.g_proj.1.bias") and "non-zero" in str(e.value)


def test_what_the_family_cannot_express_is_raised_or_skipped():
    """The debug flavor's MLA has RoPE, which Kimi-Linear's has not: strict raises naming the field
    before anything is frozen; strict=False returns [] and freezes nothing."""
    model = _model("debug", {})
    with pytest.raises(InvalidInputError) as e:
        freeze_family_constants(model)
    assert e.value.field == "mla.use_rope"
    assert all(p.requires_grad for p in model.parameters())
    assert freeze_family_constants(model, strict=False) == []
    assert all(p.requires_grad for p in model.parameters())
