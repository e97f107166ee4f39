"""Checkpoints nothing can lose: ``HartsEngine.save`` and ``harts-train
--save`` write a staging folder and rename it into place, so a SIGKILL at any point leaves the
previous checkpoint or the new one, loadable; a full disk (``RLIMIT_FSIZE``) is one line naming the
file and leaves nothing half-written; a missing, truncated or bit-flipped file is caught (the
manifest's SHA-256) and named in one line, rc 2 from ``harts-train``; torch's
``CheckpointException`` never escapes; a resumed copy never saves into the original run's folder.

The kills and the file-size limit run in forked children of the test process (one fork costs
milliseconds; a fresh interpreter seconds)."""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import time

import pytest
import torch

from harts_runtime import HybridModel, InvalidInputError, model_config
from harts_runtime.cli import main
from harts_runtime.engine import EngineConfig, HartsEngine
from harts_runtime.parallel import checkpoint_folder

pytestmark = pytest.mark.usefixtures("one_thread")

SHARD = "__0_0.distcp"


def _engine(seed: int) -> HartsEngine:
    torch.manual_seed(seed)
    return HartsEngine(HybridModel(model_config("debug", dtype="float32")), EngineConfig(capacity=30))


def _weights(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _loaded(path) -> dict:
    e = _engine(99)
    e.load(path)
    return _weights(e)


def _in_child(fn, kill_after: float | None = None) -> tuple[int, str]:
    """Run ``fn()`` in a forked child; ``(exit status or -signal, what it wrote)``. With
    ``kill_after``, SIGKILL it after that many seconds (if it still runs)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        code = 0
        try:
            text = fn() or ""
        except BaseException as e:  # noqa: BLE001 - report anything
            text, code = f"{type(e).__name__}: {e}", 3
        try:
            os.write(w, str(text).encode())
        finally:
            os._exit(code)
    os.close(w)
    if kill_after is not None:
        time.sleep(kill_after)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        text = f.read().decode()
    return (-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)), text


def _data(tmp_path):
    """A tiny rollout file: 4 prefix-sharing trajectories of one step."""
    rows = []
    for g in range(4):
        toks = list(range(1, 13)) + [20 + g, 30 + g, 40]
        n = len(toks) - 1
        rows.append(
            {
                "tokens": toks,
                "advantages": [0.5 - g / 4] * n,
                "loss_mask": [0] * 11 + [1] * (n - 11),
                "old_logprobs": [-6.2] * n,
                "ref_logprobs": [-6.1] * n,
            }
        )
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _leftovers(parent, name) -> list[str]:
    return sorted(p for p in os.listdir(parent) if p.startswith(f".{name}."))


# ------------------------------------------------------------------------------------ layout
def test_a_save_writes_a_manifest_and_leaves_no_staging_folder(tmp_path):
    e = _engine(0)
    e.save(tmp_path / "ckpt", files={"note.txt": "hello"})
    names = set(os.listdir(tmp_path / "ckpt"))
    assert {".metadata", SHARD, "harts.json", "rng-0.pt", "manifest.json", "note.txt"} <= names
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert set(manifest["files"]) == names - {"manifest.json"}
    assert all(len(v["sha256"]) == 64 for v in manifest["files"].values())
    e2 = _engine(1)
    e2.save(tmp_path / "ckpt")  # over the first: replaced whole (note.txt was the old one's)
    assert "note.txt" not in os.listdir(tmp_path / "ckpt")
    assert _leftovers(tmp_path, "ckpt") == []
    assert _same(_loaded(tmp_path / "ckpt"), _weights(e2))


def test_a_save_never_replaces_what_is_not_a_checkpoint(tmp_path):
    e = _engine(0)
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "thesis.tex").write_text("years of work")
    for target in ("f", "d"):
        with pytest.raises(InvalidInputError) as err:
            e.save(tmp_path / target)
        assert err.value.field == "path" and "refusing to replace" in str(err.value)
    assert (tmp_path / "d" / "thesis.tex").read_text() == "years of work"
    (tmp_path / "empty").mkdir()
    e.save(tmp_path / "empty")  # an empty folder is fine
    assert (tmp_path / "empty" / "manifest.json").is_file()


def test_a_link_to_a_checkpoint_folder_is_saved_through(tmp_path):
    """``ckpt -> /big/disk/ckpt``: staged and replaced where the link points; the link stays."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    e = _engine(0)
    e.save(tmp_path / "link")
    e.save(tmp_path / "link")
    assert os.path.islink(tmp_path / "link") and (tmp_path / "real" / "manifest.json").is_file()
    assert _same(_loaded(tmp_path / "link"), _weights(e))


# ------------------------------------------------------------------------------------ kills
@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_kill_at_any_point_of_a_save_leaves_a_loadable_checkpoint(tmp_path, exchange, monkeypatch):
    """A child saves other weights over the checkpoint again and again and is SIGKILLed at random
    points; the folder then loads, holding the old weights or the new ones. ``two-renames``: where
    the filesystem cannot exchange two folders (the previous one renamed aside first)."""
    if not exchange:
        monkeypatch.setattr(checkpoint_folder, "_exchange", lambda a, b: False)
    path = tmp_path / "ckpt"
    old, new = _engine(0), _engine(1)
    old.save(path)
    want_old, want_new = _weights(old), _weights(new)
    rnd = random.Random(38)
    seen = set()

    def save_forever():
        while True:
            new.save(path)

    t0 = time.perf_counter()
    new.save(tmp_path / "timing")
    once = time.perf_counter() - t0
    for _ in range(4):
        code, text = _in_child(save_forever, kill_after=rnd.uniform(0.0, 3 * once))
        assert code == -signal.SIGKILL, text
        got = _loaded(path)
        assert _same(got, want_old) or _same(got, want_new)
        seen.add("new" if _same(got, want_new) else "old")
    new.save(path)  # the next save clears what a kill left
    assert _leftovers(tmp_path, "ckpt") == [] and _same(_loaded(path), want_new)


# ------------------------------------------------------------------------------------ full disk
def _limited(limit: int, fn):
    """``fn`` under a file-size limit of ``limit`` bytes (writes past it fail with EFBIG)."""

    def run():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return fn()

    return run


def test_a_full_disk_is_one_line_naming_the_file_and_keeps_the_old_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    old, new = _engine(0), _engine(1)
    old.save(path)
    code, text = _in_child(_limited(100_000, lambda: new.save(path)))
    assert code == 3, text
    assert text.startswith(f"InvalidInputError: {SHARD}: the file-size limit was reached"), text
    assert "\n" not in text and str(path) in text
    assert _leftovers(tmp_path, "ckpt") == []
    assert _same(_loaded(path), _weights(old))
    # a fresh target: nothing at all is left
    code, text = _in_child(_limited(100_000, lambda: new.save(tmp_path / "fresh")))
    assert code == 3 and SHARD in text
    assert not (tmp_path / "fresh").exists() and _leftovers(tmp_path, "fresh") == []


def test_harts_train_on_a_full_disk_exits_2_with_one_line(tmp_path, capfd):
    rows = _data(tmp_path)
    argv = ["--flavor", "debug", "--device", "cpu", "--progress", "off", "--data", str(rows)]
    argv += ["--steps", "1", "--save", str(tmp_path / "run")]
    code, _ = _in_child(_limited(200_000, lambda: os._exit(main(argv))))
    assert code == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"harts-train: error: {SHARD}: the file-size limit was reached"), err
    assert os.listdir(tmp_path / "run") == []


# ------------------------------------------------------------------------------------ damage
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    e = HartsEngine(HybridModel(model_config("debug", dtype="float32")), EngineConfig(capacity=30))
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    e.save(path)
    return path


def _damaged(saved, tmp_path, damage) -> object:
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    damage(path)
    return path


def _refused(path, field, *words) -> str:
    with pytest.raises(InvalidInputError) as e:
        _engine(5).load(path)
    text = str(e.value)
    assert e.value.field == field and "\n" not in text, text
    for w in words:
        assert w in text, (w, text)
    return text


def _flip(file, offsets):
    data = bytearray(file.read_bytes())
    for o in offsets:
        data[o % len(data)] ^= 0x10
    file.write_bytes(bytes(data))


def test_bit_flips_in_a_shard_are_caught_by_the_checksum(saved, tmp_path):
    """Three flipped bits, 4 KiB apart: the file's size is intact, the SHA-256 is not."""
    path = _damaged(saved, tmp_path, lambda p: _flip(p / SHARD, [4096, 8192, 12288]))
    _refused(path, SHARD, "damaged", "SHA-256")


@pytest.mark.parametrize("name", [SHARD, ".metadata", "rng-0.pt", "harts.json"])
def test_a_truncated_file_is_named(saved, tmp_path, name):
    def cut(p):
        data = (p / name).read_bytes()
        (p / name).write_bytes(data[: len(data) // 2])

    _refused(_damaged(saved, tmp_path, cut), name, "truncated")


@pytest.mark.parametrize("name", [SHARD, "rng-0.pt", "harts.json", "manifest.json"])
def test_a_missing_file_is_named(saved, tmp_path, name):
    path = _damaged(saved, tmp_path, lambda p: (p / name).unlink())
    _refused(path, name, "missing")


def test_a_damaged_manifest_is_named(saved, tmp_path):
    path = _damaged(saved, tmp_path, lambda p: (p / "manifest.json").write_text("{"))
    _refused(path, "manifest.json", "damaged")


def test_an_oversized_manifest_is_refused_unread(saved, tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.setattr(checkpoint_folder, "MAX_MANIFEST_BYTES", 64)
    read = []
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: read.append(self) or "")
    with pytest.raises(InvalidInputError, match=r"manifest\.json.*over the 64"):
        checkpoint_folder.read_manifest(Path(saved))
    assert read == []


def test_a_folder_without_a_manifest_still_checks_its_shards(saved, tmp_path):
    """A checkpoint written before manifests: a truncated shard is named from DCP's metadata."""

    def old_style(p):
        (p / "manifest.json").unlink()
        rec = json.loads((p / "harts.json").read_text())
        rec.pop("manifest")
        (p / "harts.json").write_text(json.dumps(rec))
        data = (p / SHARD).read_bytes()
        (p / SHARD).write_bytes(data[:1000])

    _refused(_damaged(saved, tmp_path, old_style), SHARD, "truncated")


def test_torch_checkpoint_exception_never_escapes(saved, monkeypatch):
    """DCP's ``CheckpointException`` is a ``BaseException``; load and save turn it into one
    ``InvalidInputError`` naming the file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def fail(*a, **k):
        raise CheckpointException("read", {0: (OSError(5, "Input/output error", str(saved / SHARD)), None)})

    monkeypatch.setattr(dcp, "load", fail)
    monkeypatch.setattr(dcp, "save", fail)
    _refused(saved, SHARD, "Input/output error")
    with pytest.raises(InvalidInputError) as e:
        _engine(0).save(saved.parent / "other")
    assert e.value.field == SHARD
    assert not (saved.parent / "other").exists() and _leftovers(saved.parent, "other") == []


def test_harts_train_resume_of_a_damaged_checkpoint_exits_2_with_one_line(tmp_path, capsys):
    rows = _data(tmp_path)
    base = ["--flavor", "debug", "--device", "cpu", "--progress", "off", "--data", str(rows)]
    assert main([*base, "--steps", "1", "--save", str(tmp_path / "run")]) == 0
    _flip(tmp_path / "run" / "step-1" / SHARD, [5000])
    capsys.readouterr()
    assert main(["--resume", str(tmp_path / "run"), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the data and model notes, then the error
    assert err[-1].startswith(f"harts-train: error: {SHARD}: "), err
    assert "SHA-256" in err[-1] and not any("Traceback" in line for line in err)


# ------------------------------------------------------------------------------------ --save of a copy
def test_a_resumed_copy_saves_beside_itself_not_into_the_original_run(tmp_path, capsys):
    rows = _data(tmp_path)
    base = ["--flavor", "debug", "--device", "cpu", "--progress", "off", "--data", str(rows)]
    metrics = tmp_path / "m.jsonl"
    assert main([*base, "--steps", "1", "--save", str(tmp_path / "run"), "--metrics", str(metrics)]) == 0
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    before = metrics.read_text()
    assert main(["--resume", str(tmp_path / "copy"), "--steps", "2"]) == 0
    assert sorted(os.listdir(tmp_path / "run")) == ["step-1"]  # the original run is untouched
    assert metrics.read_text() == before
    assert (tmp_path / "copy" / "step-2" / "trainer.json").is_file()
    # the run itself going on keeps its folders
    assert main(["--resume", str(tmp_path / "run"), "--steps", "2"]) == 0
    assert sorted(os.listdir(tmp_path / "run")) == ["step-1", "step-2"]
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2]
    # an explicit --save is obeyed
    argv = ["--resume", str(tmp_path / "copy" / "step-1"), "--steps", "3", "--save", str(tmp_path / "run")]
    assert main(argv) == 0
    assert sorted(os.listdir(tmp_path / "run")) == ["step-1", "step-2", "step-3"]
    capsys.readouterr()


@pytest.mark.slow
def test_harts_train_killed_while_saving_over_its_checkpoints_leaves_them_loadable(tmp_path, capsys):
    """A run that saves every step over an earlier run's ``step-N`` folders (same ``--save``) is
    SIGKILLed at random points, three times: every ``step-N`` folder then loads (the earlier
    run's or the new one, each with its ``trainer.json``), and ``--resume`` goes on from them."""
    run = tmp_path / "run"
    argv = ["--flavor", "debug", "--device", "cpu", "--progress", "off", "--data", str(_data(tmp_path))]
    argv += ["--steps", "3", "--save-every", "1", "--save", str(run)]
    assert main(argv) == 0
    rnd = random.Random(38)
    for _ in range(3):
        _in_child(lambda: os._exit(main(argv)), kill_after=rnd.uniform(0.3, 4.0))
        steps = sorted(d for d in os.listdir(run) if d.startswith("step-"))
        assert steps == ["step-1", "step-2", "step-3"], steps
        for d in steps:
            e = HartsEngine(HybridModel(model_config("debug")), EngineConfig(lr=1e-3))
            e.load(run / d)
            assert json.loads((run / d / "trainer.json").read_text())["steps_done"] == int(d[5:])
    assert main(["--resume", str(run), "--steps", "4"]) == 0
    assert (run / "step-4" / "manifest.json").is_file() and _leftovers(run, "step-4") == []
    capsys.readouterr()


# ------------------------------------------------------------------------------------ a save deletes nothing it did not write
def _tree(root) -> dict:
    """Every file under ``root`` with its bytes (folders as ``name/``)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirs:
            out[os.path.join(rel, d) + "/"] = None
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.join(rel, f)] = fh.read()
    return out


def _user_folder(path, name, content: bytes):
    path.mkdir()
    (path / "README.md").write_text("# my web app\n")
    (path / "src").mkdir()
    (path / "src" / "main.py").write_text("print('hello')\n")
    (path / name).write_bytes(content)
    return path


@pytest.mark.parametrize("name", ["manifest.json", ".metadata", "harts.json"])
def test_a_user_folder_with_a_checkpoint_file_name_survives_a_save(saved, tmp_path, name):
    """A web app or IDE workspace holding a file named like a checkpoint's (here even a real HARTS
    checkpoint's copy of it) is refused, naming the path and what it holds, and left untouched."""
    target = _user_folder(tmp_path / "app", name, (saved / name).read_bytes())
    before = _tree(target)
    with pytest.raises(InvalidInputError) as err:
        _engine(0).save(target)
    text = str(err.value)
    assert err.value.field == "path" and "\n" not in text
    assert str(target) in text and "README.md" in text and "src/" in text and "refusing to replace" in text
    assert _tree(target) == before
    assert _leftovers(tmp_path, "app") == []


def test_a_checkpoint_a_user_added_a_file_to_is_not_replaced(saved, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    (path / "notes.txt").write_text("do not lose")
    with pytest.raises(InvalidInputError) as err:
        _engine(0).save(path)
    assert err.value.field == "path" and "notes.txt" in str(err.value)
    assert (path / "notes.txt").read_text() == "do not lose"


def test_a_checkpoint_without_a_manifest_is_still_replaced(saved, tmp_path):
    """A checkpoint saved before manifests (its ``harts.json`` of HARTS's format beside DCP's
    ``.metadata``) is recognised by that content and overwritten."""
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    (path / "manifest.json").unlink()
    e = _engine(3)
    e.save(path)
    assert (path / "manifest.json").is_file() and _same(_loaded(path), _weights(e))


def test_a_foreign_folder_in_the_staging_place_is_not_removed(tmp_path):
    stale = tmp_path / ".ckpt.saving"
    stale.mkdir()
    (stale / "mine.txt").write_text("x")
    with pytest.raises(InvalidInputError) as err:
        _engine(0).save(tmp_path / "ckpt")
    assert str(stale) in str(err.value) and (stale / "mine.txt").read_text() == "x"
    assert not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------------------------------ no code runs on load
class _Plant:
    """A pickle that creates ``path`` when it is read (a crafted checkpoint's payload)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _rewrite_manifest(folder):
    """The manifest made consistent again (what a checkpoint's author can do)."""
    m = json.loads((folder / "manifest.json").read_text())
    for n in m["files"]:
        m["files"][n] = checkpoint_folder._digest(folder / n)
    (folder / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("manifest", [True, False], ids=["consistent-manifest", "no-manifest"])
def test_a_crafted_metadata_pickle_is_refused_and_runs_nothing(saved, tmp_path, manifest):
    import pickle

    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    (path / ".metadata").write_bytes(pickle.dumps(_Plant(marker)))
    if manifest:
        _rewrite_manifest(path)
    else:
        (path / "manifest.json").unlink()
        rec = json.loads((path / "harts.json").read_text())
        rec.pop("manifest")
        (path / "harts.json").write_text(json.dumps(rec))
    text = _refused(path, ".metadata", str(path / ".metadata"), "open, which is not a DCP metadata type")
    assert not marker.exists(), text
    dcp.FileSystemReader(str(path)).read_metadata()  # DCP's own reader would have run it
    assert marker.exists()


def test_a_crafted_rng_state_is_refused_and_runs_nothing(saved, tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    torch.save({"torch": _Plant(marker)}, path / "rng-0.pt")
    _rewrite_manifest(path)
    _refused(path, "rng-0.pt", str(path / "rng-0.pt"), "refused")
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_crafted_non_tensor_item_of_a_dcp_file_runs_nothing(tmp_path):
    """DCP stores non-tensor items (the optimizer's param groups) as ``torch.save`` pickles and
    reads them with ``weights_only=False``; HARTS's planner reads them with ``weights_only=True``."""
    import torch.distributed.checkpoint as dcp

    from harts_runtime.parallel.safe_load import SafeFileSystemReader, SafeLoadPlanner

    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(2), "lr": _Plant(marker)}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert not marker.exists()  # pickling calls __reduce__, not what it returns
    state = {"w": torch.zeros(2), "lr": 0.0}
    reader = SafeFileSystemReader(str(tmp_path / "c"))
    with pytest.raises(BaseException) as err:  # noqa: PT011 - DCP wraps it in CheckpointException
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(reader), no_dist=True)
    e = checkpoint_folder.as_input_error(err.value, tmp_path / "c", "loading")
    assert e.field == SHARD and str(tmp_path / "c" / SHARD) in str(e) and "item lr" in str(e), str(e)
    assert not marker.exists()
    dcp.load({"w": torch.zeros(2), "lr": 0.0}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert marker.exists()  # DCP's default planner would have run it


def test_an_rng_state_saved_before_it_held_tensors_only_still_loads(saved, tmp_path):
    """``rng-0.pt`` written with numpy arrays (before this format) loads with ``weights_only=True``
    (numpy arrays of numbers admitted) and restores the same numpy and torch streams."""
    import numpy as np

    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    torch.manual_seed(11)
    np.random.seed(12)
    old = {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    want = (torch.rand(3), np.random.rand(3))
    torch.save(old, path / "rng-0.pt")
    _rewrite_manifest(path)
    _engine(5).load(path)
    got = (torch.rand(3), np.random.rand(3))
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_a_distributed_result_file_is_read_only_with_its_rank_signature(tmp_path):
    """``run_distributed`` reads a rank's result file only when it carries the signature made with
    the key the parent gave its ranks: a planted file is refused before it is unpickled."""
    from harts_runtime.parallel import launch

    marker, path = tmp_path / "ran", str(tmp_path / "rank0.pt")
    key = b"k" * 32
    launch._write_result(path, key, {"ok": True, "result": {"x": torch.ones(2)}})
    assert torch.equal(launch._read_result(path, key)["result"]["x"], torch.ones(2))
    launch._write_result(path, b"other key".ljust(32), {"ok": True, "result": _Plant(marker)})
    rec = launch._read_result(path, key)
    assert rec["ok"] is False and "signature" in rec["error"] and not marker.exists()


def test_harts_train_resume_checks_trainer_json_before_reading_its_settings(tmp_path, capsys):
    """``trainer.json`` (the settings a resume inherits) is checked against the manifest before it
    is read, and its step count against the ``step-N`` folder it is in."""
    rows = _data(tmp_path)
    base = ["--flavor", "debug", "--device", "cpu", "--progress", "off", "--data", str(rows)]
    assert main([*base, "--steps", "2", "--save-every", "1", "--save", str(tmp_path / "run")]) == 0
    two = tmp_path / "run" / "step-2"
    rec = json.loads((two / "trainer.json").read_text())
    (two / "trainer.json").write_text(json.dumps(dict(rec, steps_done=1)))
    capsys.readouterr()
    assert main(["--resume", str(two), "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("harts-train: error: trainer.json: ") and "SHA-256" in err[-1], err
    m = json.loads((two / "manifest.json").read_text())
    m["files"]["trainer.json"] = checkpoint_folder._digest(two / "trainer.json")
    (two / "manifest.json").write_text(json.dumps(m))
    assert main(["--resume", str(two), "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("harts-train: error: trainer.json: ") and "step-2" in err[-1], err
