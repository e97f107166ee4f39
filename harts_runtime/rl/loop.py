"""The RL loop (:class:`RLRun`): sample -> reward -> advantages -> ``forward_backward`` /
``optimizer_step`` -> weight sync (checked) -> metrics -> checkpoint.

A run lives in one folder ``DIR``: ``run.json`` (the :class:`~harts_runtime.rl.config.RLConfig`,
the engine's options and objective), ``metrics.jsonl`` (:mod:`harts_runtime.rl.metrics`) and
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

One step, timed in four parts (``generate`` / ``logprobs`` / ``train`` / ``sync`` seconds in each
record): the tree sampler's leaves from the rollout engine; their old log-probs recomputed by the
trainer (a forward-only step, unless ``recompute_logprobs`` is off: the sampler's then); the built-in
GRPO objective (no KL term) over every leaf with the estimator's per-token advantages; one optimizer
step; the weights pushed to the rollout engine and :func:`~harts_runtime.rl.rollout_engine.check_sync`.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import numpy as np
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.loss.objectives import PolicyLossConfig
from harts_runtime.rl.advantages import advantages
from harts_runtime.rl.config import RLConfig
from harts_runtime.rl.metrics import MetricsWriter, write_atomic
from harts_runtime.rl.rollout_engine import check_sync
from harts_runtime.rl.sampler import Leaf, TreeSampler
from harts_runtime.rl.tasks import make_task

__all__ = ["RUN_NAME", "STATE_NAME", "RLRun", "latest_checkpoint", "read_run", "tree_chunk_size"]

RUN_NAME = "run.json"
STATE_NAME = "rl.json"
"""The RL state of a checkpoint (in ``step-N/engine/``, listed in its manifest)."""
_STATE_FORMAT = "harts-rl-state/1"
_OLD_STATE = "rl.pt"  # step-N/rl.pt: the RL state before rl.json


def _read_json(path: Path, field: str, what: str):
    if not path.is_file():
        raise InvalidInputError(field, f"{path} is missing ({what})")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidInputError(
            field, f"{path} is unreadable or damaged ({' '.join(str(e).split())})"
        ) from None


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


def latest_checkpoint(out_dir) -> Path | None:
    """The newest complete ``DIR/checkpoints/step-N`` (with its ``done.json``), or None."""
    root = Path(out_dir) / "checkpoints"
    best = None
    for p in root.glob("step-*") if root.is_dir() else ():
        try:
            n = int(p.name.split("-", 1)[1])
        except ValueError:
            continue
        if (p / "done.json").is_file() and (best is None or n > best[0]):
            best = (n, p)
    return None if best is None else best[1]


def tree_chunk_size(task, device="cpu") -> int:
    """The KDA / GDN chunk size for a task's trees: the power of two at most half its shortest
    segment between forks (each turn's action tokens), in [8, 64]. A fork inside a chunk
    replays the chunk's rows before it, so short trees want short chunks: on kimi-linear-tiny,
    token-set's trees (4 x (5 + 8 x 4 + 8 x 2) tokens, 672 trajectory rows) ran 404 compact + 268
    replay rows at chunk 16 to 64 (no gain over trajectory-wise) and 404 + 140 at chunk 8; 16
    leaves of 67 tokens ran 642 + 430 at chunk 64 and 642 + 46 at chunk 16 (4.6x faster on a CPU);
    long trees (8 x (64 + 64 x 4 + 64 x 2)) run no replay and were 2.5x slower at chunk 8 than 16.
    On CUDA the floor is 32 (the Triton KDA kernels take 32 or 64)."""
    shortest = min(task.action_tokens(t) for t in range(task.turns))
    c = 8 if torch.device(device).type == "cpu" else 32  # the Triton KDA path takes 32 or 64
    while c * 2 <= min(64, shortest // 2):
        c *= 2
    return c


def _engine_config(options: dict):
    from harts_runtime.engine import EngineConfig

    options = dict(options)
    loss = PolicyLossConfig(**options.pop("loss_config"))
    objective = options.pop("objective")
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
        opts.setdefault("loss_config", {"kl_coef": 0.0, "loss_agg_mode": "token-mean"})
        self.engine_options = opts
        torch.manual_seed(config.seed)
        self.task = task or make_task(config.task, **config.task_args)
        config.check_task(self.task)  # the tree's size, before any work
        self.chunk_size = config.chunk_size or tree_chunk_size(self.task, config.device)
        source = config.model if config.model is not None else config.flavor
        layers = {} if config.layers is None else {"num_layers": config.layers}
        self.engine = HartsEngine.build(
            source, _engine_config(opts), device=config.device, chunk_size=self.chunk_size, **layers
        )
        self.forks = dict(config.forks if config.forks is not None else self.task.default_forks)
        self.sampler = TreeSampler(
            self.task,
            self.forks,
            config.prompts,
            config.temperature,
            config.seed,
            max_step_tokens=config.max_step_tokens,
        )
        if rollout_factory is None:
            from harts_runtime.rl.transformers_backend import TransformersRollout

            rollout_factory = TransformersRollout.from_engine
        self.rollout = rollout_factory(self.engine)
        self.step = 0
        self.last_leaves: list[Leaf] = []

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
        (folder / "done.json").unlink(missing_ok=True)
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
        write_atomic(folder / "done.json", json.dumps({"step": self.step}) + "\n")
        return folder

    def load(self, folder) -> None:
        """Restore the checkpoint ``DIR/checkpoints/step-N`` (module docstring: what is checked)."""
        from harts_runtime.parallel.checkpoint_folder import loadable_folder, read_manifest

        folder = Path(folder)
        try:
            n = int(folder.name.split("-", 1)[1])
        except (IndexError, ValueError):
            raise InvalidInputError("resume", f"{folder} is not a step-N checkpoint folder") from None
        done = _read_json(folder / "done.json", "done.json", "an incomplete checkpoint")
        if not isinstance(done, dict) or done.get("step") != n:
            got = done.get("step") if isinstance(done, dict) else done
            raise InvalidInputError(
                "done.json", f"{folder / 'done.json'} says step {got!r}, the folder is step-{n}"
            )
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
        self.rollout.load_weights(self.engine.export_weights(names="transformers"))

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

    # ------------------------------------------------------------------ one step
    def rollouts(self, leaves: list[Leaf], old_logprobs=None):
        """The :class:`~harts_runtime.rollouts.Rollouts` of ``leaves``: per-token advantages of the
        config's estimator, loss mask on the action tokens, old log-probs (``old_logprobs`` [P], or
        the sampler's)."""
        from harts_runtime.rollouts import Rollouts

        adv = advantages(self.config.advantage, leaves, self.forks)
        kw = dict(
            advantages=[lf.per_token(a) for lf, a in zip(leaves, adv)],
            loss_mask=[lf.loss_mask() for lf in leaves],
            vocab_size=self.engine.vocab_size,
        )
        if old_logprobs is None:
            kw["old_logprobs"] = [np.minimum(lf.per_token(), 0.0) for lf in leaves]
        ro = Rollouts.from_lists([lf.tokens for lf in leaves], **kw)
        if old_logprobs is not None:
            ro.old_logprobs = torch.where(
                ro.loss_mask, old_logprobs.float(), torch.zeros_like(old_logprobs.float())
            )
            ro.check(self.engine.vocab_size)
        return ro

    def _sync_atol(self) -> float:
        if self.config.sync_atol is not None:
            return self.config.sync_atol
        return 2e-3 if next(self.engine.model.parameters()).dtype in (torch.float32, torch.float64) else 1.0

    def run_step(self) -> dict:
        """One step; returns its record (also kept as the run's state: :attr:`step` advanced)."""
        from harts_runtime.rollouts import Rollouts

        t0 = time.perf_counter()
        leaves = self.sampler.sample(self.rollout)
        t1 = time.perf_counter()
        old = None
        if self.config.recompute_logprobs:
            old = self.engine.logprobs(Rollouts.from_lists([lf.tokens for lf in leaves]))
        t2 = time.perf_counter()
        ro = self.rollouts(leaves, old)
        out = self.engine.forward_backward(ro)
        rep = self.engine.optimizer_step()
        t3 = time.perf_counter()
        self.rollout.load_weights(self.engine.export_weights(names="transformers"))
        diff = 0.0
        if self.config.sync_sequences:
            seqs = [lf.tokens for lf in leaves[:: max(1, len(leaves) // self.config.sync_sequences)]]
            diff = check_sync(
                self.engine, self.rollout, seqs[: self.config.sync_sequences], self._sync_atol()
            )
        t4 = time.perf_counter()
        self.step += 1
        self.last_leaves, self.last_output = leaves, out
        rewards = np.array([lf.reward for lf in leaves])
        m = out.metrics
        mask = ro.loss_mask
        sample_lp = torch.tensor([v for lf in leaves for v in lf.action_logprobs], dtype=torch.float64)
        rec = {
            "step": self.step,
            "reward_mean": float(rewards.mean()),
            "reward_min": float(rewards.min()),
            "reward_max": float(rewards.max()),
            "loss": float(out.loss),
            "grad_norm": float(rep.grad_norm),
            "lr": float(rep.lr),
            "skipped": bool(rep.skipped),
            "leaves": len(leaves),
            "tokens": int(sum(len(lf.tokens) for lf in leaves)),
            "semantic_tokens": int(m["semantic_tokens"]),
            "rows": int(m["rows"]),
            "replay_rows": int(m["replay_tokens"]),
            "compression": float(m["compression"]),
            "chunk_size": self.chunk_size,
            "compression_with_replay": int(m["semantic_tokens"])
            / max(1, int(m["rows"]) + int(m["replay_tokens"])),
            "sampler_drift": float((out.logprobs[mask].double() - sample_lp).abs().max())
            if len(sample_lp)
            else 0.0,
            "sync_diff": diff,
            "generate_seconds": t1 - t0,
            "logprobs_seconds": t2 - t1,
            "train_seconds": t3 - t2,
            "sync_seconds": t4 - t3,
            "step_seconds": t4 - t0,
        }
        return rec

    def run(self, progress=None) -> list[dict]:
        """Steps until ``config.steps`` (a total), checkpointing every ``save_every`` steps and at the
        end; returns the records written. ``progress(line)``: one plain line per step."""
        self.write_run()
        writer = MetricsWriter(self.dir, self.step)
        records = []
        try:
            while self.step < self.config.steps:
                rec = self.run_step()
                writer.write(rec)
                records.append(rec)
                if progress is not None:
                    progress(_line(rec, self.config.steps))
                every = self.config.save_every
                if every and self.step % every == 0:
                    self.save()
            if self.step and (
                latest_checkpoint(self.dir) is None or latest_checkpoint(self.dir).name != f"step-{self.step}"
            ):
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
