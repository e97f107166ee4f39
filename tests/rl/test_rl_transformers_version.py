"""A transformers without a family's model (an older release, as verl's pins bring) is one line naming
the installed version and the release the family needs, before any work; the families' minimum
releases are those whose auto-config table first lists their model_type."""

from __future__ import annotations

import pytest
from transformers.models.auto import configuration_auto

from harts_runtime.errors import InvalidInputError
from harts_runtime.models.registry import families, get_family


@pytest.mark.parametrize("family", [f.name for f in families()])
def test_each_family_names_its_minimum_and_the_installed_one_has_it(family):
    fam = next(f for f in families() if f.name == family)
    fam.check_transformers()  # the installed transformers has every family's model
    if fam.transformers_min is not None:
        parts = fam.transformers_min.split(".")
        assert len(parts) == 3 and all(p.isdigit() for p in parts)


def test_a_missing_model_type_is_refused_naming_the_version_needed(monkeypatch):
    import transformers

    fam = get_family("kimi_linear")
    monkeypatch.delitem(configuration_auto.CONFIG_MAPPING_NAMES, "kimi_linear")
    with pytest.raises(InvalidInputError) as e:
        fam.check_transformers("flavor")
    assert e.value.field == "flavor"
    msg = str(e.value)
    assert f"transformers {transformers.__version__} has no 'kimi_linear' model" in msg
    assert f">= {fam.transformers_min}" in msg


def test_harts_rl_says_it_before_any_work(monkeypatch, tmp_path, capsys):
    from harts_runtime.cli.rl import main

    monkeypatch.delitem(configuration_auto.CONFIG_MAPPING_NAMES, "kimi_linear")
    out = tmp_path / "run"
    assert main(["--flavor", "kimi-linear-tiny", "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harts-rl: error: --flavor: transformers ")
    assert "needs transformers >= 5.17.0" in err[0]
    assert not out.exists()
