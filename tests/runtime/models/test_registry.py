"""The model-family registry (:mod:`harts_runtime.models.registry`).

* the built-in families load on the first lookup and answer by ``model_type`` (``qwen3_5_moe`` and
  ``qwen3_5_moe_text`` both Qwen3.5-MoE), an unknown one names ``model_type`` and the supported ones;
* ``family_of`` picks the family a model built without a checkpoint config belongs to (KDA / MLA:
  Kimi-Linear, split GDN: Qwen3.5-MoE, else Qwen3-Next), the owner of the highest priority;
* a family's flavors are ``model_config`` / ``FLAVORS`` flavors; duplicates are refused;
* the registry imports no family at the top (the families import it).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from harts_runtime.errors import InvalidInputError
from harts_runtime.models import FLAVORS, ModelConfig, model_config, registry
from harts_runtime.models.registry import (
    Family,
    families,
    family_of,
    get_family,
    model_types,
    register_family,
)


def test_builtin_families_by_model_type():
    assert [f.name for f in families()][:3] == ["kimi_linear", "qwen3_next", "qwen3_5_moe"]
    assert model_types()[:4] == ("kimi_linear", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
    from harts_runtime.models import kimi_linear, qwen3_5_moe, qwen3_next

    assert get_family("kimi_linear").adapter is kimi_linear.KimiLinearStateDictAdapter
    assert get_family("kimi_linear").from_hf_config is kimi_linear.from_hf_config
    assert get_family("qwen3_next").to_hf_config is qwen3_next.to_hf_config
    assert get_family("qwen3_5_moe") is get_family("qwen3_5_moe_text") is qwen3_5_moe.FAMILY
    assert qwen3_5_moe.FAMILY.model_type == "qwen3_5_moe_text"
    assert qwen3_5_moe.FAMILY.read_only == ("qwen3_5_moe",)


def test_builtin_order_does_not_depend_on_import_order():
    code = (
        "from harts_runtime.models import qwen3_5_moe, qwen3_next\n"
        "from harts_runtime.models.registry import families, model_types\n"
        "print(','.join(f.name for f in families()), ','.join(model_types()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    names, types = (part.split(",") for part in out.split())
    assert names[:3] == ["kimi_linear", "qwen3_next", "qwen3_5_moe"] and "ling3" in names
    assert types[:4] == ["kimi_linear", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"]


@pytest.mark.parametrize("bad", ["llama", "", None, 3])
def test_unknown_model_type_names_the_supported_ones(bad):
    with pytest.raises(InvalidInputError) as e:
        get_family(bad)
    assert e.value.field == "model_type"
    assert f"{bad!r}; supported: kimi_linear, qwen3_next, qwen3_5_moe_text, qwen3_5_moe" in str(e.value)


@pytest.mark.parametrize(
    "changes, name",
    [
        (dict(mixers=("kda", "mla"), ffns=("dense", "moe")), "kimi_linear"),
        (dict(mixers=("gdn", "mla"), ffns=("moe", "moe"), gdn={"projection": "split"}), "kimi_linear"),
        (dict(mixers=("gdn", "gated_attention"), ffns=("moe", "moe")), "qwen3_next"),
        (
            dict(mixers=("gdn", "gated_attention"), ffns=("moe", "moe"), gdn={"projection": "split"}),
            "qwen3_5_moe",
        ),
        (dict(mixers=("gqa",), ffns=("dense",)), "qwen3_next"),
        (dict(mixers=("gated_attention",), ffns=("moe",), gdn={"projection": "split"}), "qwen3_next"),
    ],
)
def test_family_of_follows_the_mixers(changes, name):
    cfg = ModelConfig(**changes)
    assert family_of(cfg).name == name
    owners = [f for f in families() if f.owns(cfg)]  # they may overlap: the highest priority wins
    assert max(owners, key=lambda f: f.priority).name == name


def test_family_adapter_prefix():
    cfg = model_config("qwen3.5-tiny")
    fam = get_family("qwen3_5_moe")
    assert fam.make_adapter(cfg).prefix == "model."
    assert fam.make_adapter(cfg, "qwen3_5_moe").prefix == "model.language_model."
    with pytest.raises(InvalidInputError, match="model_type"):
        fam.make_adapter(cfg, "kimi_linear")


def test_family_flavors_are_flavors():
    assert set(FLAVORS) >= {
        "ling-tiny",
        "debug",
        "kimi-linear-tiny",
        "qwen3.5-tiny",
        "qwen3.5-35b-a3b",
        "ling3-tiny",
    }
    assert set(get_family("kimi_linear").flavors) == {"kimi-linear-tiny"}
    assert set(get_family("qwen3_5_moe").flavors) == {"qwen3.5-tiny", "qwen3.5-35b-a3b"}
    assert family_of(model_config("kimi-linear-tiny")).name == "kimi_linear"
    assert family_of(model_config("qwen3.5-tiny", num_layers=2)).name == "qwen3_5_moe"
    assert FLAVORS["qwen3.5-tiny"](2, chunk_size=16).chunk_size == 16


def _family(name, types, **kw):
    base = get_family("qwen3_next")
    return Family(
        name=name,
        model_types=types,
        from_hf_config=base.from_hf_config,
        to_hf_config=base.to_hf_config,
        adapter=base.adapter,
        owns=lambda cfg: False,
        **kw,
    )


def test_register_refuses_duplicates_and_bad_families():
    families()
    with pytest.raises(InvalidInputError) as e:
        register_family(_family("qwen3_next", ("other",)))
    assert e.value.field == "name"
    with pytest.raises(InvalidInputError) as e:
        register_family(_family("other", ("qwen3_5_moe",)))
    assert e.value.field == "model_types"
    with pytest.raises(InvalidInputError) as e:
        register_family(_family("other", ("other",), flavors={"qwen3.5-tiny": lambda n=None: None}))
    assert e.value.field == "flavors"
    assert register_family(get_family("kimi_linear")) is get_family("kimi_linear")  # the same: no-op
    with pytest.raises(InvalidInputError, match="model_types"):
        _family("x", ())
    with pytest.raises(InvalidInputError, match="read_only"):
        _family("x", ("x",), read_only=("x",))
    with pytest.raises(InvalidInputError, match="prefixes"):
        _family("x", ("x",), prefixes={"y": "model."})
    assert "other" not in [f.name for f in families()]


def test_registered_family_is_found(monkeypatch):
    families()
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    monkeypatch.setattr(registry, "_BY_TYPE", dict(registry._BY_TYPE))
    monkeypatch.setattr(registry, "_BY_FLAVOR", dict(registry._BY_FLAVOR))
    fam = register_family(_family("toy", ("toy", "toy_text"), flavors={"toy-tiny": lambda n=None, **o: None}))
    assert get_family("toy_text") is fam and model_types()[-2:] == ("toy", "toy_text")
    assert "toy-tiny" in FLAVORS


def test_registry_imports_no_family():
    tree = ast.parse(Path(registry.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("harts_runtime.models")], imported


def _imports(package: str) -> dict[str, set[str]]:
    """``{module: harts_runtime modules it imports}`` of every file of ``package`` (any import: at
    the top, under ``TYPE_CHECKING``, in functions)."""
    root = Path(registry.__file__).parents[2]
    out = {}
    for f in (root / package.replace(".", "/")).rglob("*.py"):
        names = set()
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Import):
                names.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.module:
                names.add(n.module)
        out[str(f.relative_to(root))] = {m for m in names if m.startswith("harts_runtime.")}
    return out


def test_layers_and_layout_import_no_model_code():
    """models -> layers -> layout, never back (no circle; ``TYPE_CHECKING`` imports count too)."""
    for package, banned in (
        (
            "harts_runtime.layout",
            ("harts_runtime.models", "harts_runtime.layers", "harts_runtime.step_inputs"),
        ),
        ("harts_runtime.layers", ("harts_runtime.models",)),
    ):
        for file, mods in _imports(package).items():
            assert not [m for m in mods if m.startswith(banned)], (file, mods)


def test_hybrid_args_imports_no_family():
    """The flavors of the checkpoint families come through the registry (no args <-> family circle)."""
    (mods,) = [m for f, m in _imports("harts_runtime.models.hybrid").items() if f.endswith("args.py")]
    allowed = ("harts_runtime.models.hybrid", "harts_runtime.models.registry")
    assert not [m for m in mods if m.startswith("harts_runtime.models") and not m.startswith(allowed)], mods
