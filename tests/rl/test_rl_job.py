"""``harts-rl``'s job around the environment: the task's class recorded in ``run.json`` and resumed
by it (refused naming ``task`` where it changed), the tokenizer bound before the size check,
``gamma`` reaching the advantages, ``--dump-episodes`` writing the advantages the step trained on,
response length and truncation in the step record."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl import RLConfig, RLRun
from harts_runtime.rl.advantages import advantages
from harts_runtime.rl.sampler import Leaf
from harts_runtime.rl.source import OnlineSource

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

FLAVOR = "qwen3.5-tiny"
SMALL = dict(flavor=FLAVOR, prompts=2, forks={0: 2}, sync_sequences=1, seed=3)

MODULE = """
from harts_runtime.rl.tasks import TokenSetTask


class Mine(TokenSetTask):
    name = "mine"
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "rl_job_tasks.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "rl_job_tasks.py"


def test_a_custom_tasks_class_is_recorded_and_resumed_by_it(user_module, tmp_path, capsys):
    from harts_runtime.cli.rl import main

    out = tmp_path / "run"
    argv = ["--flavor", FLAVOR, "--task", "rl_job_tasks:Mine", "--prompts", "2", "--sync-sequences", "1"]
    assert main([*argv, "--steps", "1", "--out", str(out)]) == 0
    assert json.loads((out / "run.json").read_text())["task"] == "rl_job_tasks:Mine"
    assert main(["--resume", str(out), "--steps", "2"]) == 0  # the class loads again by its name
    capsys.readouterr()
    # the module now names another class Mine: the run's task changed, refused naming task
    user_module.write_text(user_module.read_text() + "\n\nclass Other(Mine):\n    pass\n\n\nMine = Other\n")
    import sys

    sys.modules.pop("rl_job_tasks", None)
    assert main(["--resume", str(out), "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harts-rl: error: ") and "task" in err[0], err
    assert "'rl_job_tasks:Mine'" in err[0] and "rl_job_tasks:Other" in err[0], err


def test_a_python_api_task_is_recorded_not_the_configs_name(tmp_path):
    """The defect: a task given as an object was recorded as the config's default ``token-set``,
    so a resume trained token-set without a word."""
    from harts_runtime.rl.tasks import TokenSetTask

    class Local(TokenSetTask):
        pass

    run = RLRun(RLConfig(**SMALL, steps=1), {"lr": 1e-2}, tmp_path / "r", task=Local())
    run.run()
    recorded = json.loads((tmp_path / "r" / "run.json").read_text())["task"]
    assert recorded.endswith(":test_a_python_api_task_is_recorded_not_the_configs_name.<locals>.Local")
    with pytest.raises(InvalidInputError) as e:  # a class defined in a function cannot load again
        RLRun.resume(tmp_path / "r")
    assert e.value.field == "task" and recorded in str(e.value)
    # run.json edited to another task than the checkpoint was saved with: refused naming task
    rec = json.loads((tmp_path / "r" / "run.json").read_text())
    rec["task"] = "token-set"
    (tmp_path / "r" / "run.json").write_text(json.dumps(rec))
    with pytest.raises(InvalidInputError) as e:
        RLRun.resume(tmp_path / "r")
    assert e.value.field == "task" and "'token-set'" in str(e.value) and recorded in str(e.value)


def test_the_tokenizer_is_bound_before_the_size_check(tmp_path, monkeypatch):
    import harts_runtime.rl.source as source

    calls = []
    monkeypatch.setattr(source, "bind_tokenizer", lambda task, folder: calls.append(("bind", folder)))
    real = RLConfig.check_task
    monkeypatch.setattr(
        RLConfig, "check_task", lambda self, task, *a: calls.append("check") or real(self, task, *a)
    )
    folder = tmp_path / "ckpt"
    folder.mkdir()
    OnlineSource(RLConfig(model=str(folder), prompts=2))
    assert calls == [("bind", str(folder)), "check"]


def _leaf(prompt, path, turn_rewards, lengths=(2, 3)):
    tokens, segments, at = [1], [], 1
    for t, n in enumerate(lengths):
        segments.append((t, at, at + n))
        tokens += [2] * n + [3]
        at += n + 1
    return Leaf(prompt, tokens, path, segments, [-0.5] * sum(lengths), sum(turn_rewards), list(turn_rewards))


class _Vocab:
    vocab_size = 16


@pytest.mark.parametrize("gamma", [1.0, 0.5, 0.0])
def test_gamma_reaches_the_advantages(gamma):
    rng = np.random.default_rng(7)
    leaves = [
        _leaf(p, (i,), rng.integers(0, 3, 2).astype(float).tolist()) for p in range(2) for i in range(2)
    ]
    src = object.__new__(OnlineSource)
    src.config = RLConfig(flavor="x", forks={0: 2}, gamma=gamma)
    src.forks = {0: 2}
    ro = src.rollouts(_Vocab(), leaves)
    want = advantages("grpo", leaves, {0: 2}, gamma)
    assert src.last_advantages == [list(a) for a in want]
    got = ro.to_lists(ro.advantages, "advantages")
    for lf, a, g in zip(leaves, want, got):
        assert np.allclose(np.asarray(lf.per_token(a)[1:]), np.asarray(g))
    if gamma == 0.5:
        with pytest.raises(InvalidInputError, match="gamma"):
            RLConfig(flavor="x", gamma=1.5)


def test_dump_episodes_writes_the_trained_advantages_and_the_record_has_lengths(tmp_path):
    run = RLRun(RLConfig(**SMALL, steps=1, dump_episodes=1), {"lr": 1e-2}, tmp_path / "r")
    (rec,) = run.run()
    src = run.source
    text = (tmp_path / "r" / "episodes" / "step-1.txt").read_text()
    lines = (tmp_path / "r" / "episodes" / "step-1.jsonl").read_text().splitlines()
    first = [lf for lf in src.last_leaves if lf.prompt == src.last_leaves[0].prompt]
    assert len(lines) == len(first) and "advantages" in text
    for line, adv in zip(lines, src.last_advantages):
        turns = json.loads(line)["turns"]
        assert [a for t in turns for a in t["advantages"]] == pytest.approx(adv)
    lengths = [sum(b - a for _, a, b in lf.segments) for lf in src.last_leaves]
    assert rec["response_length_mean"] == pytest.approx(np.mean(lengths))
    cut = [c for lf in src.last_leaves for c in lf.truncated]
    assert rec["truncated_share"] == pytest.approx(sum(cut) / len(cut))
    assert rec["updates"] == 1 and rec["filtered_groups"] == 0
