"""The one job loop (``harts_runtime.trainer.job``) under both commands: a resumed run with a
larger ``--steps`` stretches a decaying schedule to the new end by the same rule
(``job_config.resolve_total_steps``) in ``harts-train`` and ``harts-rl`` (``harts-rl`` used to keep
the old end and train the new steps at lr 0); the loop calls a source's ``next_step``,
``after_step`` and ``record`` in order and saves on its cadence."""

from __future__ import annotations

import json

import pytest

from harts_runtime.job_config import resolve_total_steps
from harts_runtime.trainer.job import run_job

LR = 1e-2
STRETCHED = [LR, LR / 2, LR / 2, LR / 4]
"""Linear decay without warm-up: steps 1-2 of a 2-step run (factors 1, 1/2), then steps 3-4 of
the schedule stretched to 4 (factors 1 - 2/4, 1 - 3/4)."""


def _lrs(path):
    return [json.loads(line)["lr"] for line in path.read_text().splitlines()]


def test_harts_train_resume_stretches_the_schedule(tmp_path, capsys):
    from harts_runtime.cli import main

    base = ["--preset", "tiny", "--device", "cpu", "--progress", "off", "--flavor", "debug", "--layers", "1"]
    sched = ["--lr", str(LR), "--lr-schedule", "linear"]
    m = tmp_path / "m.jsonl"
    assert main([*base, *sched, "--steps", "2", "--save", str(tmp_path / "a"), "--metrics", str(m)]) == 0
    assert main(["--resume", str(tmp_path / "a"), "--steps", "4"]) == 0
    assert _lrs(m) == pytest.approx(STRETCHED)
    capsys.readouterr()


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_harts_rl_resume_stretches_the_schedule_as_harts_train_does(tmp_path, capsys):
    pytest.importorskip("transformers")
    from harts_runtime.cli.rl import main

    out = tmp_path / "run"
    cfg = tmp_path / "rl.json"
    cfg.write_text(json.dumps({"forks": {"0": 2}, "sync_sequences": 1, "prompts": 2}))
    argv = ["--flavor", "qwen3.5-tiny", "--config", str(cfg), "--lr", str(LR)]
    assert main([*argv, "--lr-schedule", "linear", "--steps", "2", "--out", str(out)]) == 0
    assert main(["--resume", str(out), "--steps", "4"]) == 0
    assert _lrs(out / "metrics.jsonl") == pytest.approx(STRETCHED)
    assert "total_steps" not in json.loads((out / "run.json").read_text())["engine"]  # it follows --steps
    capsys.readouterr()


def test_resolve_total_steps_is_one_rule():
    assert resolve_total_steps(None, 4, "linear") == 4 and resolve_total_steps(None, 0, "cosine") == 1
    assert resolve_total_steps(7, 4, "linear") == 7  # given: kept (harts-train refuses one behind the run)
    assert resolve_total_steps(None, 4, "constant") is None


class _Engine:
    def __init__(self):
        self.calls = []

    def forward_backward(self, batch):
        self.calls.append(("fb", batch))
        return f"out{batch}"

    def optimizer_step(self):
        self.calls.append(("opt",))
        return "report"


class _Source:
    def __init__(self, engine):
        self.engine, self.n = engine, 0

    def next_step(self, engine):
        self.n += 1
        engine.calls.append(("next",))
        return self.n

    def after_step(self, engine, result, report):
        engine.calls.append(("after", result, report))

    def record(self, step, result, report, seconds):
        assert set(seconds) == {"data", "train", "after", "step"} and seconds["step"] >= seconds["train"] >= 0
        return {"step": step, "result": result}


def test_the_loop_calls_the_source_in_order_and_saves_on_its_cadence():
    engine = _Engine()
    saved, shown = [], []
    recs = run_job(
        engine, _Source(engine), done=2, steps=7, save=saved.append, save_every=2, show=shown.append
    )
    assert [r["step"] for r in recs] == [3, 4, 5, 6, 7] and shown == recs
    assert [r["result"] for r in recs] == ["out1", "out2", "out3", "out4", "out5"]
    assert saved == [4, 6, 7]  # every 2 steps, and the end
    assert engine.calls[:4] == [("next",), ("fb", 1), ("opt",), ("after", "out1", "report")]
    assert run_job(engine, _Source(engine), done=3, steps=3, save=saved.append) == [] and saved == [4, 6, 7]


def test_sigterm_finishes_the_step_saves_it_and_stops():
    import os
    import signal

    from harts_runtime.trainer.job import Stopped

    engine = _Engine()

    class Preempted(_Source):
        def next_step(self, engine):
            if self.n == 1:  # the scheduler's SIGTERM arrives during step 2
                os.kill(os.getpid(), signal.SIGTERM)
            return super().next_step(engine)

    saved, shown = [], []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped, match="stopped by SIGTERM after step 2; saved step 2"):
        run_job(
            engine, Preempted(engine), done=0, steps=5, save=saved.append, save_every=4, show=shown.append
        )
    assert saved == [2] and [r["step"] for r in shown] == [1, 2]
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is the caller's again
