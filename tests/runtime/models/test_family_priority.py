"""The registry resolves family overlaps (:func:`harts_runtime.models.registry.family_of`): each
family's ``owns`` tests only its own marks and the highest declared ``priority`` wins, so a new family
claims configs without any other family's file being edited; two owners at one priority are refused
naming both; the five built-in families still resolve every tiny config (the flavors, the
transformers tiny configs of ``tests/hf_configs.py`` and their round trips) to the family that made it."""

import pytest

from harts_runtime.errors import InvalidInputError
from harts_runtime.models import ModelConfig, model_config, registry
from harts_runtime.models.registry import Family, families, family_of, get_family, register_family


@pytest.fixture
def scratch_registry(monkeypatch):
    """The registry as it is, restored after the test (a test family registered here is gone after)."""
    families()  # the built-ins loaded first
    for name in ("_FAMILIES", "_BY_TYPE", "_BY_FLAVOR"):
        monkeypatch.setattr(registry, name, dict(getattr(registry, name)))


def _fake(name, owns, priority, **kw):
    base = get_family("qwen3_next")
    return Family(
        name=name,
        model_types=(name,),
        from_hf_config=base.from_hf_config,
        to_hf_config=base.to_hf_config,
        adapter=base.adapter,
        owns=owns,
        priority=priority,
        **kw,
    )


def _only_gqa(cfg) -> bool:
    return set(cfg.mixers) == {"gqa"}


def test_a_new_family_claims_a_config_without_editing_another(scratch_registry):
    cfg = ModelConfig(mixers=("gqa", "gqa"), ffns=("dense", "dense"))
    assert family_of(cfg).name == "qwen3_next"  # the fallback owned it
    before = {f.name: (f.owns, f.priority) for f in families()}
    fake = register_family(_fake("gqa_family", _only_gqa, 5, flavors={"gqa-tiny": lambda n=None: cfg}))
    assert family_of(cfg) is fake
    assert family_of(model_config("gqa-tiny")) is fake  # its flavor too
    assert {f.name: (f.owns, f.priority) for f in families() if f is not fake} == before  # untouched
    # the configs other families own stay theirs (a lower priority than theirs, or not its marks)
    assert family_of(model_config("kimi-linear-tiny")).name == "kimi_linear"
    assert family_of(ModelConfig(mixers=("gdn", "gated_attention"), ffns=("moe", "moe"))).name == "qwen3_next"


def test_a_more_specific_family_wins_over_a_builtin(scratch_registry):
    """A family refining Kimi-Linear (any model with MLA layers) wins with a higher priority and
    loses with a lower one."""
    cfg = model_config("kimi-linear-tiny")
    register_family(_fake("low", lambda c: "mla" in c.mixers, 29))
    assert family_of(cfg).name == "kimi_linear"
    register_family(_fake("high", lambda c: "mla" in c.mixers, 31))
    assert family_of(cfg).name == "high"


def test_owners_at_one_priority_are_refused_naming_both(scratch_registry):
    register_family(_fake("split_gdn_too", lambda c: "gdn" in c.mixers and c.gdn.projection == "split", 20))
    with pytest.raises(InvalidInputError) as e:
        family_of(model_config("qwen3.5-tiny", num_layers=2))
    assert e.value.field == "config"
    assert "qwen3_5_moe" in str(e.value) and "split_gdn_too" in str(e.value) and "priority 20" in str(e.value)


def test_a_config_nobody_owns_is_refused(scratch_registry, monkeypatch):
    monkeypatch.setattr(registry, "_FAMILIES", {"none": _fake("none", lambda c: False, 0)})
    monkeypatch.setitem(registry._state, "builtins", "yes")
    with pytest.raises(InvalidInputError, match="no model family owns this config") as e:
        family_of(ModelConfig())
    assert e.value.field == "config"


@pytest.mark.parametrize("bad", ["high", 1.5, True, None])
def test_priority_must_be_an_integer(bad):
    with pytest.raises(InvalidInputError) as e:
        _fake("x", lambda c: True, bad)
    assert e.value.field == "priority"


def test_builtin_priorities_are_distinct():
    """No two built-in families can tie (each overlap has a winner)."""
    prios = [f.priority for f in families() if f.name in registry.BUILTIN_FAMILIES]
    assert len(prios) == len(registry.BUILTIN_FAMILIES) == len(set(prios)) == 5


def test_every_flavor_resolves_to_its_family_and_back():
    """Each family's flavors, and their ``config.json`` round trips, resolve to that family."""
    seen = set()
    for fam in families():
        for name in fam.flavors:
            cfg = model_config(name)
            assert family_of(cfg) is fam, name
            assert family_of(fam.from_hf_config(fam.to_hf_config(cfg))) is fam, name
            seen.add(fam.name)
    assert seen == {"kimi_linear", "qwen3_5_moe", "nemotron_h", "ling3"}


@pytest.mark.parametrize(
    "make, model_type, family",
    [
        (lambda h: h.kimi_linear_config(), "kimi_linear", "kimi_linear"),
        (lambda h: h.qwen_config("qwen3_next"), "qwen3_next", "qwen3_next"),
        (lambda h: h.qwen_config("qwen3_next", ["linear_attention"] * 2), "qwen3_next", "qwen3_next"),
        (lambda h: h.qwen_config("qwen3_5_moe_text"), "qwen3_5_moe_text", "qwen3_5_moe"),
        # no GDN layer: nothing of Qwen3.5-MoE's marks, so the fallback (as before)
        (
            lambda h: h.qwen_config("qwen3_5_moe_text", ["full_attention"] * 2),
            "qwen3_5_moe_text",
            "qwen3_next",
        ),
    ],
)
def test_tiny_transformers_configs_resolve_as_before(make, model_type, family):
    pytest.importorskip("transformers")
    import hf_configs

    cfg = get_family(model_type).from_hf_config(make(hf_configs).to_dict())
    assert family_of(cfg).name == family
