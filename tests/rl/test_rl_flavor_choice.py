"""harts-rl's flavor must have a transformers family (the rollout engine runs it): a runtime-only
flavor (``debug``, ``ling-tiny``) and an unknown name are one line naming --flavor and the choices."""

from __future__ import annotations

import pytest

from harts_runtime.cli.rl import main
from harts_runtime.job_config import declared_flavors


@pytest.mark.parametrize("flavor", ["debug", "ling-tiny", "no-such-flavor"])
def test_a_flavor_without_a_transformers_family_is_one_line_with_the_choices(flavor, tmp_path, capsys):
    assert main(["--flavor", flavor, "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"harts-rl: error: --flavor: {flavor!r} ")
    kind = "is unknown" if flavor == "no-such-flavor" else "has no transformers family"
    assert kind in err[0]
    for name in declared_flavors(families_only=True):
        assert name in err[0]
    assert not (tmp_path / "run").exists()
