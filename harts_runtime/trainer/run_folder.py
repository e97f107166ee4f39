"""A job in its run folder (:class:`JobRun`): the data source trained by the job loop
(:func:`harts_runtime.trainer.job.run_job`), its checkpoints and its resume. ``harts-rl``'s runs
(:class:`harts_runtime.rl.run.RLRun` builds one from its settings) live in one.

A run lives in one folder ``DIR``: ``run.json`` (the run's record: its settings by table,
:func:`harts_runtime.trainer_state.write_run`), ``metrics.jsonl`` (:mod:`harts_runtime.trainer.metrics`)
and ``checkpoints/step-N/``: ``engine/`` (:meth:`HartsEngine.save
<harts_runtime.engine.HartsEngine.save>`: weights, optimizer, schedule, torch RNG, with the job's
step ``N`` in its record under :attr:`JobRun.step_key`; beside them, listed in its manifest, the
source's state files (``source.state_files()``) and ``run.json``, a copy of the run's record) and
last ``done.json`` (a folder without it is incomplete and never resumed). ``run.json`` is written
to a temporary file, synced and renamed over the old one, so a kill at any point leaves a whole one.

:meth:`JobRun.load_latest` continues the run exactly and trusts only what the checkpoint's manifest
covers: every file it reads is checked against the manifest's size and SHA-256
(:meth:`HartsEngine.load`), and the step numbers must agree (the folder's ``N``, ``done.json``, the
engine record's step, and the source's state: ``source.load_state``; the engine's optimizer steps
at most ``N`` times the source's ``max_updates`` a step, 1 if it has none), as must
``DIR/run.json`` with the copy saved in the checkpoint (``steps`` aside). A
missing, damaged or mismatched file is one :class:`~harts_runtime.errors.InvalidInputError` naming
it; with ``fallback`` the resume takes the newest checkpoint that loads instead, saying which it
skipped and why. ``keep_last`` keeps the K newest checkpoints
(:func:`harts_runtime.trainer_state.prune_checkpoints`).

A source kept in a run folder has, beside the job loop's methods:

* ``state_files(step) -> {name: text}``: its state after ``step``, saved in the checkpoint's engine folder;
* ``load_state(engine, folder, engine_dir, listed, extra, step, log)``: restore it from the
  checkpoint ``folder`` (``engine_dir``: where the engine's files are, ``listed``: the names its
  manifest covers, ``extra``: the engine record's caller keys, ``step``: ``N``), checked;
* ``line(record, steps)``: the step's progress line;
* optionally ``max_updates``: the most optimizer steps one job step takes (PPO epochs x
  mini-batches; default 1).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from harts_runtime.errors import InvalidInputError
from harts_runtime.trainer.job import run_job
from harts_runtime.trainer.metrics import MetricsWriter
from harts_runtime.trainer_state import (
    DONE_NAME,
    RUN_NAME,
    check_done,
    complete_steps,
    latest_checkpoint,
    prune_checkpoints,
    read_json,
    run_text,
    write_done,
    write_run,
)

__all__ = ["JobRun"]


class JobRun:
    """``source`` trained on ``engine`` in the run folder ``out_dir`` (module docstring).
    ``record``: the run's record (``run.json``: tables of settings); ``normalize(record, path)``:
    a record with its settings' defaults filled in (a resume compares the run's record with the
    checkpoint's copy through it). ``steps``: the total; ``save_every`` / ``keep_last``: the save
    cadence and the checkpoints kept (0: all); ``log(line)``: notes."""

    step_key = "rl_step"
    """The engine record's key for the job's step (``HartsEngine.save(extra=...)``)."""

    def __init__(
        self,
        engine,
        source,
        out_dir,
        record: dict,
        *,
        steps: int,
        save_every: int = 0,
        keep_last: int = 0,
        normalize: Callable[[dict, Path], dict] | None = None,
        log: Callable[[str], None] | None = None,
    ):
        self.engine, self.source, self.dir = engine, source, Path(out_dir)
        self.record, self.steps = record, steps
        self.save_every, self.keep_last = save_every, keep_last
        self.normalize = normalize or (lambda rec, path: rec)
        self.log = log or (lambda line: None)
        self.step = 0
        self.skipped: list[tuple[Path, str]] = []
        """The checkpoints a fallback resume skipped, with why."""

    # ------------------------------------------------------------------ the run folder
    def write_run(self) -> None:
        write_run(self.dir, self.record)

    def save(self) -> Path:
        """Save the checkpoint ``DIR/checkpoints/step-N`` of the current step ``N``."""
        folder = self.dir / "checkpoints" / f"step-{self.step}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / DONE_NAME).unlink(missing_ok=True)
        files = dict(self.source.state_files(self.step))
        files[RUN_NAME] = run_text(self.record)
        self.engine.save(folder / "engine", files=files, extra={self.step_key: self.step})
        cleanup = getattr(self.source, "saved", None)
        if cleanup is not None:
            cleanup(folder)
        write_done(folder, self.step)
        prune_checkpoints(self.dir / "checkpoints", DONE_NAME, self.keep_last)
        return folder

    def load(self, folder) -> None:
        """Restore the checkpoint ``DIR/checkpoints/step-N`` (module docstring: what is checked)."""
        from harts_runtime.parallel.checkpoint_folder import loadable_folder, read_manifest

        folder = Path(folder)
        n = check_done(folder)
        engine_dir = folder / "engine"
        extra = self.engine.load(engine_dir)  # verifies every file its manifest lists first
        where = loadable_folder(engine_dir)
        listed = set(read_manifest(where) or {})
        notes: list[str] = []  # said once the checkpoint has loaded (a refused one says only why)
        self.source.load_state(self.engine, folder, where, listed, extra, n, notes.append)
        most = n * getattr(self.source, "max_updates", 1)
        if not (0 <= self.engine.step <= most):
            raise InvalidInputError(
                "engine",
                f"{engine_dir} has {self.engine.step} optimizer steps, more than the job's step {n} "
                f"allows ({most})",
            )
        if RUN_NAME in listed:
            self._check_run(where / RUN_NAME)
        self.step = n
        for note in notes:
            self.log(note)
        resumed = getattr(self.source, "resumed", None)
        if resumed is not None:
            resumed(self.engine)

    def load_latest(self, *, fallback: bool = False) -> Path | None:
        """Load the newest complete checkpoint (None: there is none, the run starts at step 0).
        ``fallback``: a checkpoint that does not load (damaged, incomplete, of another step) is
        skipped, said in :attr:`skipped` and the log, for the next newest; without it, the error
        names the file and the checkpoints left to fall back on."""
        found = complete_steps(self.dir / "checkpoints", DONE_NAME)
        for i, (_, folder) in enumerate(found):
            try:
                self.load(folder)
                return folder
            except InvalidInputError as e:
                older = [f.name for _, f in found[i + 1 :]]
                if not fallback or not older:
                    if older and not fallback:
                        hint = f" (older checkpoints: {', '.join(older)}; --fallback resumes from the newest that loads)"
                        raise InvalidInputError(e.field, _message(e) + hint) from None
                    raise
                why = " ".join(str(e).split())
                self.skipped.append((folder, why))
                self.log(f"skipped {folder}: {why}")
        return None

    def _check_run(self, saved_path: Path) -> None:
        """``DIR/run.json`` (this run's settings) must be the one saved with the checkpoint,
        ``steps`` aside."""
        saved = read_json(saved_path, RUN_NAME, "the run record saved with the checkpoint")
        tables = [k for k, v in self.record.items() if isinstance(v, dict)]
        if not (isinstance(saved, dict) and all(isinstance(saved.get(t), dict) for t in tables)):
            raise InvalidInputError(RUN_NAME, f"{saved_path} is not a run record of this kind")
        want = _plain(self.normalize(saved, saved_path))
        have = _plain(self.normalize(self.record, self.dir / RUN_NAME))
        ours, ckpt = self.dir / RUN_NAME, saved_path.parent.parent
        for table in tables:
            a, b = dict(want.get(table, {})), dict(have.get(table, {}))
            if table == tables[0]:
                a.pop("steps", None)
                b.pop("steps", None)
            what = "" if table == tables[0] else f"{table} option "
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    raise InvalidInputError(
                        RUN_NAME,
                        f"{ours} has {what}{k} = {b.get(k)!r}, the checkpoint {ckpt} was saved with "
                        f"{a.get(k)!r}" + (" (a run.json of another run?)" if not what else ""),
                    )
        for k in sorted(k for k in set(want) | set(have) if k not in tables):
            if k in want and k in have and want[k] != have[k]:
                raise InvalidInputError(
                    k, f"{ours} has {k} = {have[k]!r}, the checkpoint {ckpt} was saved with {want[k]!r}"
                )

    # ------------------------------------------------------------------ steps
    def run_step(self) -> dict:
        """One step; returns its record (:attr:`step` advanced)."""
        from harts_runtime.trainer.job import train_one

        rec = train_one(self.engine, self.source, self.step + 1)
        self.step += 1
        return rec

    def _save_at(self, k: int) -> None:
        self.step = k
        self.save()

    def run(self, progress=None) -> list[dict]:
        """Steps until :attr:`steps` (a total), checkpointing every ``save_every`` steps and at the
        end (and on SIGTERM), through the job loop; returns the records written.
        ``progress(line)``: one plain line per step (``source.line``)."""
        self.write_run()
        writer = MetricsWriter.of_run(self.dir, self.step)
        start, steps = self.step, self.steps
        line = getattr(self.source, "line", None)

        def show(rec: dict) -> None:
            self.step = rec["step"]
            if progress is not None and line is not None:
                progress(line(rec, steps))

        try:
            records = run_job(
                self.engine,
                self.source,
                done=start,
                steps=steps,
                save=self._save_at,
                save_every=self.save_every,
                writer=writer,
                show=show,
            )
            if self.step and latest_checkpoint(self.dir) is None:
                self.save()
        finally:
            writer.close()
        return records


def _message(e: InvalidInputError) -> str:
    text = str(e)
    return text[len(e.field) + 2 :] if text.startswith(f"{e.field}: ") else text


def _plain(obj):
    """JSON values as JSON reads them back (tuples as lists, keys as strings)."""
    return json.loads(json.dumps(obj))
