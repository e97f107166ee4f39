"""The settings tree reads some declarations from their source text (no torch at ``--help``); these
tests import the real declarations and pin the text-read values to them, so a declaration written in
a form the reader does not follow fails here instead of drifting silently."""

from __future__ import annotations

import dataclasses

import pytest

from harts_runtime import job_config


def test_objective_defaults_equal_default_loss_config():
    from harts_runtime.loss.objectives import PolicyLossConfig
    from harts_runtime.step_inputs import default_loss_config

    read = job_config._objective_defaults()
    assert set(read) == {"grpo", "ppo"}
    base = PolicyLossConfig()
    for objective, fields in read.items():
        assert dataclasses.replace(base, **fields) == default_loss_config(objective), objective


def test_loss_field_defaults_read_from_source_equal_the_class():
    from harts_runtime.loss.objectives import PolicyLossConfig

    consts = job_config._constants(sorted((job_config._ROOT / "loss").glob("*.py")))
    docs = job_config._field_docs(job_config._ROOT / "loss" / "objectives.py", "PolicyLossConfig", consts)
    real = PolicyLossConfig()
    assert list(docs) == [f.name for f in dataclasses.fields(real)]
    for name, (_ann, default, doc, _meta) in docs.items():
        assert default == getattr(real, name), name
        assert doc, f"{name}: no docstring to use as help"


def test_rl_task_choices_are_the_registered_tasks():
    from harts_runtime.rl.tasks import TASKS

    assert f"built-in task: {' or '.join(TASKS)}" == job_config.setting("task").help


@pytest.mark.parametrize("families_only", [False, True])
def test_declared_flavors_are_the_registry_flavors(families_only):
    from harts_runtime.models import registry
    from harts_runtime.models.hybrid.args import HYBRID_FLAVORS

    families = set(registry.family_flavors())
    want = families if families_only else families | set(HYBRID_FLAVORS)
    assert set(job_config.declared_flavors(families_only)) == want
