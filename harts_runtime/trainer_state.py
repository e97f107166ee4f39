"""The one owner of resume for both commands: the step folders (:func:`step_folder`), the newest
complete one (:func:`latest_step`: ``harts-train``'s ``DIR/step-N`` with ``trainer.json``,
:func:`latest_checkpoint`: ``harts-rl``'s ``DIR/checkpoints/step-N`` with ``done.json``), the
records a checkpoint carries, read and checked against the folder's manifest before use
(:func:`read_trainer_state`, :func:`read_json`).

``harts-train``'s record is ``trainer.json``, beside what :meth:`harts_runtime.engine.HartsEngine.save`
writes: the steps done, the data position and the run's settings; ``harts-rl``'s is its run folder's
``run.json`` (:func:`read_run`, :func:`write_run`) and, in each checkpoint, the source's state (the
sampler's, ``rl.json``: :class:`harts_runtime.rl.source.OnlineSource`) and a copy of ``run.json``,
saved and checked by :class:`harts_runtime.trainer.run_folder.JobRun`. Each is written into the
staged folder with the rest (``HartsEngine.save(files=...)``), so a folder with it is a complete
checkpoint. No torch here (``harts-train`` reads it while resolving its settings).

``--save DIR`` writes ``DIR/step-N`` after N steps; ``--resume PATH`` takes a checkpoint folder, or
the ``step-N`` folder of ``PATH`` with the largest N that is complete. ``--keep-last K`` keeps the
K newest complete checkpoints (:func:`prune_checkpoints`, both commands).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from harts_runtime.errors import InvalidInputError

__all__ = [
    "DONE_NAME",
    "FORMAT",
    "RUN_NAME",
    "STATE_NAME",
    "check_done",
    "complete_steps",
    "latest_checkpoint",
    "latest_step",
    "prune_checkpoints",
    "read_json",
    "read_run",
    "read_trainer_state",
    "resolve_checkpoint",
    "run_text",
    "step_folder",
    "trainer_state_text",
    "write_atomic",
    "write_done",
    "write_run",
    "write_trainer_state",
]

STATE_NAME = "trainer.json"
FORMAT = "harts-train/1"
_STEP = re.compile(r"^step-(\d+)$")
DONE_NAME = "done.json"
"""``harts-rl``'s marker of a complete ``checkpoints/step-N`` (written last)."""
RUN_NAME = "run.json"
"""A run folder's record (``harts-rl``): its settings, read back by a resume."""


def complete_steps(root, marker: str) -> list[tuple[int, Path]]:
    """``(N, folder)`` of every ``root/step-N`` folder holding ``marker``, newest first."""
    root = Path(root)
    found = []
    for child in root.iterdir() if root.is_dir() else ():
        m = _STEP.match(child.name)
        if m and (child / marker).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found, key=lambda x: x[0], reverse=True)


def latest_step(root, marker: str) -> Path | None:
    """The ``root/step-N`` folder holding ``marker`` with the largest N, or None."""
    found = complete_steps(root, marker)
    return found[0][1] if found else None


def prune_checkpoints(root, marker: str, keep_last: int) -> list[Path]:
    """Remove the complete ``root/step-N`` checkpoints (those holding ``marker``) but the
    ``keep_last`` newest (0: keep all); returns the folders removed. Only folders this module
    recognises as complete checkpoints are touched (a folder without ``marker``, or any other
    name, stays)."""
    if keep_last <= 0:
        return []
    removed = []
    for _, folder in complete_steps(root, marker)[keep_last:]:
        shutil.rmtree(folder)
        removed.append(folder)
    return removed


def latest_checkpoint(out_dir) -> Path | None:
    """An RL run folder's newest complete ``DIR/checkpoints/step-N`` (with its ``done.json``), or None."""
    return latest_step(Path(out_dir) / "checkpoints", DONE_NAME)


def write_atomic(path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, synced, renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot sync a folder
        pass
    finally:
        os.close(fd)


def read_run(out_dir, tables=("rl", "engine")) -> dict:
    """The record of ``DIR/run.json`` (a table with the tables ``tables``); one
    :class:`InvalidInputError` naming the file when it is missing, damaged or of another shape."""
    path = Path(out_dir) / RUN_NAME
    record = read_json(path, RUN_NAME, f"{out_dir} is not a run folder")
    if not (isinstance(record, dict) and all(isinstance(record.get(t), dict) for t in tables)):
        names = " and ".join(repr(t) for t in tables)
        raise InvalidInputError(RUN_NAME, f"{path} is not a run record (expected {names} tables)")
    return record


def run_text(record: dict) -> str:
    """The text of a ``run.json`` record."""
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


def write_run(out_dir, record: dict) -> None:
    """Write ``DIR/run.json`` whole or not at all (:func:`write_atomic`)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_atomic(Path(out_dir) / RUN_NAME, run_text(record))


def write_done(folder, step: int) -> None:
    """Mark ``folder`` (``step-N``) complete: ``done.json``, written last (whole or not at all)."""
    write_atomic(Path(folder) / DONE_NAME, json.dumps({"step": step}) + "\n")


def check_done(folder) -> int:
    """N of a complete ``step-N`` folder: its name, and its ``done.json`` saying the same step;
    one :class:`InvalidInputError` naming what disagrees or is missing."""
    folder = Path(folder)
    m = _STEP.match(folder.name)
    if not m:
        raise InvalidInputError("resume", f"{folder} is not a step-N checkpoint folder")
    n = int(m.group(1))
    done = read_json(folder / DONE_NAME, DONE_NAME, "an incomplete checkpoint")
    if not isinstance(done, dict) or done.get("step") != n:
        got = done.get("step") if isinstance(done, dict) else done
        raise InvalidInputError(DONE_NAME, f"{folder / DONE_NAME} says step {got!r}, the folder is step-{n}")
    return n


def read_json(path, field: str, what: str):
    """The JSON of ``path``; one :class:`InvalidInputError` naming ``field`` when it is missing
    (``what`` says what it is) or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(field, f"{path} is missing ({what})")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidInputError(
            field, f"{path} is unreadable or damaged ({' '.join(str(e).split())})"
        ) from None


def step_folder(save_dir, step: int) -> Path:
    """Where ``--save DIR`` puts the checkpoint after ``step`` steps."""
    return Path(save_dir) / f"step-{step}"


def resolve_checkpoint(path, check=None, say=None) -> Path:
    """The checkpoint folder ``path`` names: itself when it holds ``trainer.json``, else its
    complete ``step-N`` folder with the largest N; :class:`InvalidInputError` (``resume``)
    otherwise. ``check(folder)`` (``--fallback``): a ``step-N`` folder it refuses (raising
    :class:`InvalidInputError`) is skipped, said through ``say(line)``, for the next newest; the
    last refusal is raised when none passes."""
    p = Path(path)
    if not p.exists():
        raise InvalidInputError("--resume", f"{str(path)!r}: no such folder")
    if not p.is_dir():
        raise InvalidInputError("--resume", f"{str(path)!r} is not a folder")
    if (p / STATE_NAME).is_file():
        return p
    found = complete_steps(p, STATE_NAME)
    if found and check is not None:
        for i, (_, folder) in enumerate(found):
            try:
                check(folder)
                return folder
            except InvalidInputError as e:
                if i == len(found) - 1:
                    raise
                if say is not None:
                    say(f"skipped {folder}: {' '.join(str(e).split())}")
    if found:
        return found[0][1]
    if (p / "harts.json").is_file():
        raise InvalidInputError(
            "--resume",
            f"{str(path)!r} has no {STATE_NAME}: an incomplete save, or a checkpoint not written by harts-train",
        )
    raise InvalidInputError(
        "--resume", f"{str(path)!r} holds no checkpoint (no {STATE_NAME}, no complete step-N folder)"
    )


def read_trainer_state(folder) -> dict:
    """The ``trainer.json`` record of a checkpoint folder: checked against the folder's manifest
    (size and SHA-256) when it has one, before it is read, and its ``steps_done`` against the
    folder's ``step-N`` name."""
    f = Path(folder) / STATE_NAME
    _check_listed(Path(folder))
    try:
        state = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInputError("--resume", f"{str(f)!r} is unreadable ({e})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise InvalidInputError("--resume", f"{str(f)!r}: unknown format {got!r} (expected {FORMAT!r})")
    for key in ("steps_done", "data", "args"):
        if key not in state:
            raise InvalidInputError("--resume", f"{str(f)!r} has no {key!r}")
    m = _STEP.match(Path(folder).name)
    if m and state["steps_done"] != int(m.group(1)):
        raise InvalidInputError(
            STATE_NAME, f"{f} says {state['steps_done']!r} steps done, the folder is {Path(folder).name}"
        )
    return state


def _check_listed(folder: Path) -> None:
    """``trainer.json`` as the folder's ``manifest.json`` lists it (size and SHA-256), when the
    folder has a manifest (the whole folder is verified again when the engine loads it)."""
    m = folder / "manifest.json"
    if not m.is_file():
        return
    f = folder / STATE_NAME
    try:
        entry = json.loads(m.read_text())["files"][STATE_NAME]
        size, digest = int(entry["bytes"]), str(entry["sha256"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise InvalidInputError(STATE_NAME, f"{f} is not listed in a readable {m}") from None
    try:
        data = f.read_bytes()
    except OSError as e:
        raise InvalidInputError(STATE_NAME, f"{f} cannot be read ({e.strerror or e})") from None
    if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
        raise InvalidInputError(STATE_NAME, f"{f} is damaged: its size or SHA-256 differs from the saved one")


def trainer_state_text(state: dict) -> str:
    """The text of ``trainer.json`` for ``state`` (passed to ``HartsEngine.save(files=...)``, which
    writes it into the staged checkpoint folder)."""
    return json.dumps(dict(state, format=FORMAT), indent=2, sort_keys=True) + "\n"


def write_trainer_state(folder, state: dict) -> None:
    """Write ``trainer.json`` atomically (a temporary file renamed over it)."""
    f = Path(folder) / STATE_NAME
    tmp = f.with_suffix(".json.tmp")
    tmp.write_text(trainer_state_text(state))
    os.replace(tmp, f)
