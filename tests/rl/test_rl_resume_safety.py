"""``harts-rl --resume`` trusts only what the checkpoint's manifest covers (issue 47, items 2-3):
a flipped bit in the RL state, an RL state or engine folder from another step, a missing or
garbage ``rl.json`` / ``run.json`` or a ``run.json`` of another run are each one line naming the
file (exit 2, no traceback); the RL state is JSON (an older ``rl.pt`` is read with
``weights_only=True``: a crafted one runs nothing); ``run.json`` and ``metrics.jsonl`` are replaced
by rename, so a run killed while starting still resumes with every metrics record it keeps."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from harts_runtime.cli.rl import main
from harts_runtime.errors import InvalidInputError
from harts_runtime.parallel import checkpoint_folder
from harts_runtime.rl import RLConfig, RLRun
from harts_runtime.rl.source import RUN_NAME, STATE_NAME, latest_checkpoint
from harts_runtime.trainer.metrics import MetricsWriter, read_metrics

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(flavor="qwen3.5-tiny", prompts=2, forks={0: 2}, sync_sequences=1, seed=5)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 2-step run saved after each step (``step-1``, ``step-2``)."""
    out = tmp_path_factory.mktemp("rl") / "run"
    RLRun(RLConfig(**SMALL, steps=2, save_every=1), {"lr": 1e-2}, out).run()
    return out


@pytest.fixture
def run(run_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    return out


def _engine(run, step=2):
    return run / "checkpoints" / f"step-{step}" / "engine"


def _rewrite_manifest(folder):
    """The manifest made consistent with the folder again (what a careless tool or an author can do)."""
    m = json.loads((folder / "manifest.json").read_text())
    m["files"] = {
        n: checkpoint_folder._digest(folder / n)
        for n in sorted(os.listdir(folder))
        if n != "manifest.json" and (folder / n).is_file()
    }
    (folder / "manifest.json").write_text(json.dumps(m))


def _refused(run, capsys, *words) -> str:
    """``harts-rl --resume`` exits 2 with one line holding ``words``."""
    capsys.readouterr()
    assert main(["--resume", str(run), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harts-rl: error: "), err
    for w in words:
        assert w in err[0], (w, err[0])
    return err[0]


def test_a_saved_run_resumes_with_its_state_checked(run, capsys):
    """The files a resume reads are in the manifest, and the step numbers agree."""
    listed = json.loads((_engine(run) / "manifest.json").read_text())["files"]
    assert {STATE_NAME, RUN_NAME, "harts.json"} <= set(listed)
    assert json.loads((_engine(run) / "harts.json").read_text())["extra"]["rl_step"] == 2
    assert not (run / "checkpoints" / "step-2" / "rl.pt").exists()
    again = RLRun.resume(run)
    assert again.step == 2
    assert main(["--resume", str(run), "--steps", "2"]) == 0
    assert "resumed" in capsys.readouterr().err


def test_a_flipped_bit_in_the_rl_state_is_refused(run, capsys):
    f = _engine(run) / STATE_NAME
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x04
    f.write_bytes(bytes(data))
    _refused(run, capsys, f"{STATE_NAME}: ", "SHA-256")


def test_an_rl_state_from_another_step_is_refused(run, capsys):
    shutil.copy(_engine(run, 1) / STATE_NAME, _engine(run) / STATE_NAME)
    _refused(run, capsys, f"{STATE_NAME}: ", "SHA-256")  # the manifest catches the copy
    _rewrite_manifest(_engine(run))  # ... and with a manifest made to match, the steps disagree
    _refused(run, capsys, f"{STATE_NAME}: ", "holds step 1", "rl_step 2")


def test_an_engine_checkpoint_from_another_step_is_refused(run, capsys):
    shutil.rmtree(_engine(run))
    shutil.copytree(_engine(run, 1), _engine(run))
    _refused(run, capsys, f"{STATE_NAME}: ", "holds step 1", "the checkpoint is step-2")


@pytest.mark.parametrize("how", ["missing", "garbage", "not-a-state"])
def test_a_missing_or_garbage_rl_state_is_one_line_naming_it(run, capsys, how):
    f = _engine(run) / STATE_NAME
    if how == "missing":
        f.unlink()
        _refused(run, capsys, f"{STATE_NAME}: ", "missing")
        return
    f.write_bytes(b"\x00\xff garbage" if how == "garbage" else b'{"format": "harts-rl-state/1", "step": 2}')
    _rewrite_manifest(_engine(run))
    _refused(run, capsys, f"{STATE_NAME}: ", str(f))


@pytest.mark.parametrize("how", ["missing", "garbage", "another-run"])
def test_a_missing_garbage_or_foreign_run_json_is_one_line_naming_it(run, capsys, how):
    f = run / RUN_NAME
    if how == "missing":
        f.unlink()
        _refused(run, capsys, f"{RUN_NAME}: ", "missing")
    elif how == "garbage":
        f.write_text('{"rl": {"flavor": ')
        _refused(run, capsys, f"{RUN_NAME}: ", str(f), "damaged")
    else:
        rec = json.loads(f.read_text())
        rec["rl"]["seed"] = 6
        f.write_text(json.dumps(rec))
        _refused(run, capsys, f"{RUN_NAME}: ", "seed = 6", "saved with 5")


def test_an_old_rl_pt_is_read_without_running_code(run, tmp_path, capsys):
    """A run saved before ``rl.json``: ``step-N/rl.pt`` loads with ``weights_only=True`` (and is
    step-checked); a crafted one is refused naming it, its payload not run."""
    from harts_runtime.rl.run import RLRun as R

    gen, env, _ = R._read_state(_engine(run) / STATE_NAME)
    (_engine(run) / STATE_NAME).unlink()
    (_engine(run) / RUN_NAME).unlink()
    _rewrite_manifest(_engine(run))
    old = run / "checkpoints" / "step-2" / "rl.pt"
    torch.save({"step": 2, "sampler": {"generator": gen, "env_rng": env}}, old)
    assert RLRun.resume(run).step == 2
    torch.save({"step": 1, "sampler": {"generator": gen, "env_rng": env}}, old)
    _refused(run, capsys, "rl.pt: ", "holds step 1")

    class Plant:
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))

    torch.save({"step": 2, "sampler": Plant()}, old)
    _refused(run, capsys, "rl.pt: ", "refused without running it")
    assert not (tmp_path / "ran").exists()


def test_a_kill_while_a_run_starts_leaves_run_json_and_metrics_whole(run, monkeypatch, capsys):
    """``run.json`` and ``metrics.jsonl`` are replaced by rename: a run that dies at the rename
    (here: ``os.replace`` raising) leaves both as they were, and the run then resumes."""
    before = {n: (run / n).read_bytes() for n in (RUN_NAME, "metrics.jsonl")}
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    resumed = RLRun.resume(run, steps=3)

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        resumed.run()
    monkeypatch.undo()
    assert {n: (run / n).read_bytes() for n in before} == before
    assert main(["--resume", str(run), "--steps", "3"]) == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    assert latest_checkpoint(run).name == "step-3"
    capsys.readouterr()


def test_metrics_past_the_resumed_step_and_a_cut_line_are_dropped_by_rename(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 0.1 * s}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + '\n{"step": 4, "lo')  # a kill cut the last record
    inode = path.stat().st_ino
    w = MetricsWriter(tmp_path, resumed_step=2)
    w.write({"step": 3, "loss": 9.0})
    w.close()
    assert path.read_text().splitlines() == lines[:2] + [json.dumps({"step": 3, "loss": 9.0})]
    assert path.stat().st_ino != inode  # replaced, not rewritten in place
    inode = path.stat().st_ino
    MetricsWriter(tmp_path, resumed_step=3).close()  # nothing to drop: appended to as it is
    assert path.stat().st_ino == inode and len(read_metrics(path)) == 3


def test_a_resumed_run_with_a_bad_config_in_run_json_names_the_file(run):
    rec = json.loads((run / RUN_NAME).read_text())
    rec["rl"]["no_such_key"] = 1
    (run / RUN_NAME).write_text(json.dumps(rec))
    with pytest.raises(InvalidInputError) as e:
        RLRun.resume(run)
    assert e.value.field == RUN_NAME and "no_such_key" in str(e.value)
