"""``harts-train --resume DIR --fallback``: a newest ``step-N`` whose files do not verify is skipped,
said, for the newest that does; without ``--fallback`` the refusal names the older checkpoints it
could take. (``harts-rl``'s: ``tests/rl/test_rl_loop_knobs.py``.)"""

from __future__ import annotations

import json

from harts_runtime.cli import main

BASE = ["--preset", "tiny", "--device", "cpu", "--progress", "off", "--flavor", "debug", "--layers", "1"]


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x08
    path.write_bytes(bytes(data))


def _shard(folder):
    return max((p for p in folder.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)


def test_harts_train_falls_back_to_the_newest_intact_checkpoint(tmp_path, capsys):
    run, m = tmp_path / "run", tmp_path / "m.jsonl"
    assert main([*BASE, "--steps", "3", "--save-every", "1", "--save", str(run), "--metrics", str(m)]) == 0
    _flip(_shard(run / "step-3"))
    _flip(run / "step-2" / "trainer.json")
    capsys.readouterr()
    assert main(["--resume", str(run), "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("harts-train: error: ") and "SHA-256" in err[-1], err
    assert "older checkpoints: step-2, step-1" in err[-1] and "--fallback" in err[-1], err
    assert main(["--resume", str(run), "--steps", "3", "--fallback"]) == 0
    err = capsys.readouterr().err
    skipped = [
        line.split(":")[0].rsplit("/", 1)[-1] for line in err.splitlines() if line.startswith("skipped ")
    ]
    assert skipped == ["step-3", "step-2"], err
    assert "resumed from" in err and "step-1" in err
    assert [json.loads(x)["step"] for x in m.read_text().splitlines()] == [1, 2, 3]
    saved = json.loads((run / "step-3" / "trainer.json").read_text())
    assert saved["steps_done"] == 3 and "fallback" not in saved["args"]  # a later resume chooses anew
