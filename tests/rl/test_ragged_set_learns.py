"""``harts-rl --task ragged-set``: episodes shaped like an agent's (ragged prompts, actions ending at
stop tokens, ragged observations, per-turn rewards) learn through the command from a fixed seed."""

from __future__ import annotations

import pytest

from harts_runtime.cli.rl import main
from harts_runtime.trainer.metrics import read_metrics

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_ragged_set_learns_on_kimi_linear_tiny(tmp_path):
    """10 steps at lr 0.03 (the flavor default 0.01 takes 20). Seeds 0-5: 0.16-0.20 over the first
    three steps, 0.51-0.63 over the last three (seed 0: 0.20, 0.51)."""
    out = tmp_path / "rs"
    argv = ["--task", "ragged-set", "--flavor", "kimi-linear-tiny", "--steps", "10", "--lr", "0.03"]
    assert main([*argv, "--out", str(out), "--seed", "0"]) == 0
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 11))
    first = sum(r["reward_mean"] for r in recs[:3]) / 3
    last = sum(r["reward_mean"] for r in recs[-3:]) / 3
    assert first < 0.3 and last > 0.45, (first, last)
