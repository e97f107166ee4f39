"""An RL run (:class:`RLRun`): the online source (:class:`harts_runtime.rl.source.OnlineSource`:
sample -> reward -> advantages, and after each optimizer step the weight sync, checked) trained by
the one job loop (:func:`harts_runtime.trainer.job.run_job`: ``forward_backward`` /
``optimizer_step`` -> metrics -> checkpoint), in its run folder.

A run lives in one folder ``DIR``: ``run.json`` (the :class:`~harts_runtime.rl.config.RLConfig`,
the engine's options and objective), ``metrics.jsonl`` (:mod:`harts_runtime.trainer.metrics`) and
``checkpoints/step-N/``: ``engine/`` (:meth:`HartsEngine.save <harts_runtime.engine.HartsEngine.save>`:
weights, optimizer, schedule, torch RNG, with ``rl_step = N`` in its record; beside them, listed in
its manifest, ``rl.json``, the RL state: the step, the sampler's ``torch.Generator`` and the
environment's numpy RNG states, and ``run.json``, a copy of the run's record) and last
``done.json`` (a folder without it is incomplete and never resumed). ``run.json`` is written to a
temporary file, synced and renamed over the old one, so a kill at any point leaves a whole one.

:meth:`RLRun.resume` continues the run exactly (the later steps' rewards and losses equal the
uninterrupted run's) and trusts only what the checkpoint's manifest covers: every file it reads
is checked against the manifest's size and SHA-256 (:meth:`HartsEngine.load`), and the step numbers
must agree (the folder's ``N``, ``done.json``, ``rl.json`` and the engine record's ``rl_step``;
the engine's optimizer steps at most ``N``), as must ``DIR/run.json`` with the copy saved in the
checkpoint (``steps`` aside). A missing, damaged or mismatched file is one
:class:`~harts_runtime.errors.InvalidInputError` naming it. Nothing read runs code (JSON; a run
saved before ``rl.json`` existed has ``step-N/rl.pt``, read with ``torch.load(weights_only=True)``
and step-checked, but not covered by a manifest).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.job_config import ONLINE_LOSS, JobConfig, resolve_total_steps
from harts_runtime.loss.objectives import PolicyLossConfig
from harts_runtime.rl.config import RLConfig
from harts_runtime.rl.source import OnlineSource, tree_chunk_size
from harts_runtime.trainer.job import run_job, train_one
from harts_runtime.trainer.metrics import MetricsWriter
from harts_runtime.trainer_state import (
    DONE_NAME,
    check_done,
    latest_checkpoint,
    read_json,
    write_atomic,
    write_done,
)

__all__ = ["RUN_NAME", "STATE_NAME", "RLRun", "latest_checkpoint", "read_run", "tree_chunk_size"]

RUN_NAME = "run.json"
STATE_NAME = "rl.json"
"""The RL state of a checkpoint (in ``step-N/engine/``, listed in its manifest)."""
_STATE_FORMAT = "harts-rl-state/1"
_OLD_STATE = "rl.pt"  # step-N/rl.pt: the RL state before rl.json


_read_json = read_json


def read_run(out_dir) -> dict:
    """The record of ``DIR/run.json`` (``{"rl": {...}, "engine": {...}}``); one
    :class:`InvalidInputError` naming the file when it is missing, damaged or of another shape."""
    path = Path(out_dir) / RUN_NAME
    record = _read_json(path, RUN_NAME, f"{out_dir} is not a harts-rl run folder")
    if not (
        isinstance(record, dict)
        and isinstance(record.get("rl"), dict)
        and isinstance(record.get("engine"), dict)
    ):
        raise InvalidInputError(
            RUN_NAME, f"{path} is not a harts-rl run record (expected 'rl' and 'engine' tables)"
        )
    return record


def _rl_config(rl: dict, path: Path) -> RLConfig:
    try:
        return RLConfig(**rl)
    except TypeError as e:
        raise InvalidInputError(RUN_NAME, f"{path}: {' '.join(str(e).split())}") from None
    except InvalidInputError as e:
        raise InvalidInputError(RUN_NAME, f"{path}: {' '.join(str(e).split())}") from None


def _plain(obj):
    """A numpy bit generator's state as JSON values (arrays as lists)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return {"ndarray": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def _unplain(obj):
    if isinstance(obj, dict):
        if set(obj) == {"ndarray", "dtype"}:
            return np.asarray(obj["ndarray"], dtype=np.dtype(obj["dtype"]))
        return {k: _unplain(v) for k, v in obj.items()}
    return obj


def _engine_config(options: dict, steps: int):
    """The engine's config of the run's options; a decaying schedule without ``total_steps`` ends at
    the run's ``steps`` (a resumed run's new total: :func:`harts_runtime.job_config.resolve_total_steps`,
    the rule ``harts-train`` follows)."""
    from harts_runtime.engine import EngineConfig

    options = dict(options)
    loss = PolicyLossConfig(**options.pop("loss_config"))
    objective = options.pop("objective")
    total = resolve_total_steps(options.get("total_steps"), steps, options.get("lr_schedule", "constant"))
    if total is not None:
        options["total_steps"] = total
    return EngineConfig(objective=objective, loss_config=loss, **options)


class RLRun:
    """One RL run in ``out_dir``. ``engine_options``: flat :class:`EngineConfig` options (``lr``,
    ``capacity``, ``mode``, ...); the objective is GRPO without a KL term unless ``loss_config``
    (a dict of :class:`PolicyLossConfig` fields) says otherwise. ``task``: a
    :class:`~harts_runtime.rl.environment.Task` instead of the config's built-in one.
    ``rollout_factory(engine)``: the rollout engine (default: the transformers backend)."""

    def __init__(
        self, config: RLConfig, engine_options: dict, out_dir, *, task=None, rollout_factory=None, log=None
    ):
        from harts_runtime.engine import HartsEngine

        self.config, self.dir, self.log = config, Path(out_dir), log or (lambda s: None)
        opts = dict(engine_options)
        opts.setdefault("objective", "grpo")
        opts.setdefault("loss_config", dict(ONLINE_LOSS))
        self.engine_options = opts
        torch.manual_seed(config.seed)
        self.source = OnlineSource(config, task=task)
        self.task, self.forks, self.sampler = self.source.task, self.source.forks, self.source.sampler
        job = JobConfig(model={"chunk_size": config.chunk_size})
        self.chunk_size = job.resolve(config.device, "online", chunk_size=self.source.chunk_size).chunk_size
        self.source.trained_chunk_size = self.chunk_size
        source = config.model if config.model is not None else config.flavor
        layers: dict[str, Any] = {} if config.layers is None else {"num_layers": config.layers}
        self.engine = HartsEngine.build(
            source,
            _engine_config(opts, config.steps),
            device=config.device,
            chunk_size=self.chunk_size,
            **layers,
        )
        self.source.attach(self.engine, rollout_factory)
        self.rollout = self.source.rollout
        self.step = 0

    @property
    def last_leaves(self):
        return self.source.last_leaves

    @property
    def last_output(self):
        return self.source.last_output

    # ------------------------------------------------------------------ run folder
    def _run_record(self) -> dict:
        return {"rl": self.config.to_dict(), "engine": self.engine_options}

    def write_run(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.dir / RUN_NAME, json.dumps(self._run_record(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def resume(cls, out_dir, *, steps: int | None = None, task=None, rollout_factory=None, log=None) -> RLRun:
        """The run of ``out_dir`` at its newest complete checkpoint (``steps``: a new total)."""
        record = read_run(out_dir)
        rl = dict(record["rl"])
        if steps is not None:
            rl["steps"] = steps
        config = _rl_config(rl, Path(out_dir) / RUN_NAME)
        run = cls(config, record["engine"], out_dir, task=task, rollout_factory=rollout_factory, log=log)
        ckpt = latest_checkpoint(out_dir)
        if ckpt is not None:
            run.load(ckpt)
        return run

    def save(self) -> Path:
        folder = self.dir / "checkpoints" / f"step-{self.step}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / DONE_NAME).unlink(missing_ok=True)
        sampler = self.sampler.state_dict()
        state = {
            "format": _STATE_FORMAT,
            "step": self.step,
            "sampler": {
                "generator": base64.b64encode(sampler["generator"].numpy().tobytes()).decode("ascii"),
                "env_rng": _plain(sampler["env_rng"]),
            },
        }
        files = {
            STATE_NAME: json.dumps(state, indent=1, sort_keys=True) + "\n",
            RUN_NAME: json.dumps(self._run_record(), indent=2, sort_keys=True) + "\n",
        }
        self.engine.save(folder / "engine", files=files, extra={"rl_step": self.step})
        (folder / _OLD_STATE).unlink(missing_ok=True)  # an older version's, for this step
        write_done(folder, self.step)
        return folder

    def load(self, folder) -> None:
        """Restore the checkpoint ``DIR/checkpoints/step-N`` (module docstring: what is checked)."""
        from harts_runtime.parallel.checkpoint_folder import loadable_folder, read_manifest

        folder = Path(folder)
        n = check_done(folder)
        engine_dir = folder / "engine"
        extra = self.engine.load(engine_dir)  # verifies every file its manifest lists first
        listed = read_manifest(loadable_folder(engine_dir)) or {}
        if STATE_NAME in listed:
            state_file = loadable_folder(engine_dir) / STATE_NAME
            generator, env_rng, step = self._read_state(state_file)
            if extra.get("rl_step") != step:
                raise InvalidInputError(
                    STATE_NAME,
                    f"{state_file} holds step {step}, its engine checkpoint rl_step {extra.get('rl_step')!r}",
                )
        elif (folder / _OLD_STATE).is_file():
            state_file = folder / _OLD_STATE
            generator, env_rng, step = self._read_old_state(state_file)
            self.log(f"{state_file}: saved before RL states were checksummed; read unverified")
        else:
            raise InvalidInputError(
                STATE_NAME, f"{engine_dir / STATE_NAME} is missing (no RL state in the checkpoint {folder})"
            )
        if step != n:
            raise InvalidInputError(
                state_file.name,
                f"{state_file} holds step {step}, the checkpoint is step-{n} (an RL state from another step)",
            )
        if not (0 <= self.engine.step <= n):
            raise InvalidInputError(
                "engine", f"{engine_dir} has {self.engine.step} optimizer steps, more than the RL step {n}"
            )
        if RUN_NAME in listed:
            self._check_run(loadable_folder(engine_dir) / RUN_NAME)
        try:
            self.sampler.load_state_dict({"generator": generator, "env_rng": env_rng})
        except (TypeError, ValueError, KeyError, RuntimeError) as e:
            raise InvalidInputError(
                state_file.name,
                f"{state_file} holds no sampler state ({type(e).__name__}: {' '.join(str(e).split())})",
            ) from None
        self.step = n
        self.source.sync(self.engine)

    @staticmethod
    def _read_state(path: Path):
        """``(generator state, environment RNG state, step)`` of an ``rl.json``."""
        state = _read_json(path, STATE_NAME, "the RL state")
        try:
            if state["format"] != _STATE_FORMAT:
                raise ValueError(f"format {state['format']!r}, expected {_STATE_FORMAT!r}")
            step = state["step"]
            if not isinstance(step, int) or isinstance(step, bool):
                raise TypeError(f"step {step!r} is not an integer")
            raw = base64.b64decode(state["sampler"]["generator"], validate=True)
            generator = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            env_rng = _unplain(state["sampler"]["env_rng"])
            if not isinstance(env_rng, dict):
                raise TypeError("sampler.env_rng is not a table")
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidInputError(
                STATE_NAME, f"{path} is not an RL state ({type(e).__name__}: {' '.join(str(e).split())})"
            ) from None
        return generator, env_rng, step

    @staticmethod
    def _read_old_state(path: Path):
        from harts_runtime.parallel.safe_load import load_weights_only

        state = load_weights_only(path)
        try:
            step = state["step"]
            if not isinstance(step, int) or isinstance(step, bool):
                raise TypeError(f"step {step!r} is not an integer")
            return state["sampler"]["generator"], state["sampler"]["env_rng"], step
        except (KeyError, TypeError) as e:
            raise InvalidInputError(
                path.name, f"{path} is not an RL state ({type(e).__name__}: {e})"
            ) from None

    def _check_run(self, saved_path: Path) -> None:
        """``DIR/run.json`` (this run's settings) must be the one saved with the checkpoint,
        ``steps`` aside."""
        saved = _read_json(saved_path, RUN_NAME, "the run record saved with the checkpoint")
        if not (
            isinstance(saved, dict)
            and isinstance(saved.get("rl"), dict)
            and isinstance(saved.get("engine"), dict)
        ):
            raise InvalidInputError(RUN_NAME, f"{saved_path} is not a harts-rl run record")
        want = _rl_config(saved["rl"], saved_path).to_dict()
        have = self.config.to_dict()
        want.pop("steps", None)
        have.pop("steps", None)
        ours = self.dir / RUN_NAME
        for k in sorted(set(want) | set(have)):
            if want.get(k) != have.get(k):
                raise InvalidInputError(
                    RUN_NAME,
                    f"{ours} has {k} = {have.get(k)!r}, the checkpoint {saved_path.parent.parent} was saved "
                    f"with {want.get(k)!r} (a run.json of another run?)",
                )
        a, b = json.loads(json.dumps(saved["engine"])), json.loads(json.dumps(self.engine_options))
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                raise InvalidInputError(
                    RUN_NAME,
                    f"{ours} has engine option {k} = {b.get(k)!r}, the checkpoint {saved_path.parent.parent} "
                    f"was saved with {a.get(k)!r}",
                )

    # ------------------------------------------------------------------ steps
    def rollouts(self, leaves, old_logprobs=None):
        """The :class:`~harts_runtime.rollouts.Rollouts` of ``leaves`` (:meth:`OnlineSource.rollouts`)."""
        return self.source.rollouts(self.engine, leaves, old_logprobs)

    def run_step(self) -> dict:
        """One step; returns its record (also kept as the run's state: :attr:`step` advanced)."""
        rec = train_one(self.engine, self.source, self.step + 1)
        self.step += 1
        return rec

    def _save_at(self, k: int) -> None:
        self.step = k
        self.save()

    def run(self, progress=None) -> list[dict]:
        """Steps until ``config.steps`` (a total), checkpointing every ``save_every`` steps and at the
        end, through the job loop; returns the records written. ``progress(line)``: one plain line
        per step."""
        self.write_run()
        writer = MetricsWriter.of_run(self.dir, self.step)
        start, steps = self.step, self.config.steps

        def show(rec: dict) -> None:
            self.step = rec["step"]
            if progress is not None:
                progress(_line(rec, steps))

        try:
            records = run_job(
                self.engine,
                self.source,
                done=start,
                steps=steps,
                save=self._save_at,
                save_every=self.config.save_every,
                writer=writer,
                show=show,
            )
            if self.step and latest_checkpoint(self.dir) is None:
                self.save()
        finally:
            writer.close()
        return records


def _line(rec: dict, steps: int) -> str:
    return (
        f"step {rec['step']}/{steps} reward {rec['reward_mean']:.3f} loss {rec['loss']:+.4f} "
        f"rows {rec['rows']} (replay {rec['replay_rows']}, semantic {rec['semantic_tokens']}) "
        f"gen {rec['generate_seconds']:.2f}s logprobs {rec['logprobs_seconds']:.2f}s "
        f"train {rec['train_seconds']:.2f}s sync {rec['sync_seconds']:.2f}s"
    )
