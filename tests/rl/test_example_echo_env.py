"""The README's own-environment example (examples/rl/echo_env.py) runs through harts-rl by its class
name: ragged prompts and observations, a stop token, per-turn rewards, the episode dump and a resume
that reloads the class from run.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl"


@pytest.mark.slow
def test_the_example_task_trains_dumps_and_resumes(tmp_path, monkeypatch, capsys):
    from harts_runtime.cli.rl import main

    monkeypatch.chdir(EXAMPLE)  # the README runs it from its folder: the module loads from there
    monkeypatch.syspath_prepend(str(EXAMPLE))
    out = tmp_path / "echo"
    argv = ["--task", "echo_env:EchoTask", "--flavor", "kimi-linear-tiny", "--out", str(out)]
    assert main([*argv, "--steps", "2", "--dump-episodes", "1", "--save-every", "1"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["rl"]["task"] == "echo_env:EchoTask"
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    assert all(0.0 <= r["reward_mean"] <= 2.0 for r in recs)  # two per-turn rewards in [0, 1]
    dumps = sorted(os.listdir(out / "episodes"))
    assert dumps and any(name.endswith(".txt") for name in dumps)
    assert main(["--resume", str(out), "--steps", "3"]) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    capsys.readouterr()
