"""The online data source of the job loop (:class:`OnlineSource`) and its state, and ``harts-rl``'s
job (:class:`RLRun`: an :class:`~harts_runtime.rl.config.RLConfig`'s source and engine, run and
resumed in its run folder by :class:`harts_runtime.trainer.run_folder.JobRun`).

``next_step(engine)``: the tree sampler's leaves from the rollout engine; the prompts whose leaves
all earned one reward dropped when ``filter_groups`` is on (their advantages are all zero: they
train nothing; counted in the record); their old log-probs recomputed by the trainer (a
forward-only step, unless ``recompute_logprobs`` is off: the sampler's then); the
:class:`~harts_runtime.rollouts.Rollouts` of the leaves with the estimator's per-token advantages
(:func:`harts_runtime.rl.advantages.advantages`, discounted by ``gamma``). ``updates(batch)``: the
batch trained ``ppo_epochs`` times in ``mini_batches`` optimizer steps each (a prompt's tree kept
whole in one mini-batch; the old log-probs stay the ones fixed from the rollout, so the clip acts
from the second update on); nothing when the filter left no prompt. ``after_step``: the weights
pushed to the rollout engine and :func:`~harts_runtime.rl.rollout_engine.check_sync`. ``record``: the
step's rewards, losses (the updates' mean), rows (one pass over the batch), response lengths, the
objective's statistics and timings (``generate`` / ``logprobs`` / ``train`` / ``sync`` seconds);
with ``dump_episodes`` the step's first trees as text (:func:`harts_runtime.rl.episodes.write_episodes`)
in the run folder. ``state_files`` / ``load_state``: the RL state a checkpoint carries (``rl.json``:
the step, the sampler's ``torch.Generator`` and the environment's numpy RNG states), read as JSON
(a run saved before ``rl.json`` existed has ``step-N/rl.pt``, read with
``torch.load(weights_only=True)`` and step-checked, but not covered by a manifest).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.job_config import ONLINE_LOSS, JobConfig, resolve_total_steps
from harts_runtime.rl.advantages import advantages
from harts_runtime.rl.config import RLConfig
from harts_runtime.rl.rollout_engine import RolloutEngine, check_sync
from harts_runtime.rl.sampler import Leaf, TreeSampler
from harts_runtime.rl.tasks import make_task, task_identity
from harts_runtime.rl.text import bind_tokenizer
from harts_runtime.trainer.run_folder import JobRun
from harts_runtime.trainer_state import RUN_NAME, latest_checkpoint, read_json, read_run

if TYPE_CHECKING:
    from harts_runtime.rollouts import Rollouts

__all__ = [
    "RUN_NAME",
    "STATE_NAME",
    "OnlineSource",
    "RLRun",
    "latest_checkpoint",
    "read_run",
    "read_state",
    "tree_chunk_size",
]

STATE_NAME = "rl.json"
"""The RL state of a checkpoint (in ``step-N/engine/``, listed in its manifest)."""
_STATE_FORMAT = "harts-rl-state/1"
_OLD_STATE = "rl.pt"  # step-N/rl.pt: the RL state before rl.json


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


class OnlineSource:
    """RL's data source: ``config``'s task (or ``task``), its forks and sampler, over the rollout
    engine ``rollout_factory(engine)`` made by :meth:`attach` (default: the transformers backend).
    A text task without a tokenizer gets the model folder's (:func:`~harts_runtime.rl.text.bind_tokenizer`)
    before the step's size is checked. With ``config.max_staleness > 0``, ``OnlineSource(config)``
    is the asynchronous source (:class:`harts_runtime.rl.async_source.AsyncSource`)."""

    def __new__(cls, config: RLConfig, **kw):
        if cls is OnlineSource and config.max_staleness > 0:
            from harts_runtime.rl.async_source import AsyncSource

            return object.__new__(AsyncSource)
        return super().__new__(cls)

    def __init__(self, config: RLConfig, *, task=None):
        self.config = config
        self.task = task or make_task(config.task, **config.task_args)
        self.tokenizer = bind_tokenizer(self.task, config.model)
        config.check_task(self.task)  # the tree's size, before any work
        self.forks = dict(config.forks if config.forks is not None else self.task.default_forks)
        self.sampler = TreeSampler(
            self.task,
            self.forks,
            config.prompts,
            config.temperature,
            config.seed,
            max_step_tokens=config.max_step_tokens,
        )
        self.rollout: RolloutEngine | None = None
        self.trained_chunk_size: int | None = None
        """The chunk size the engine trains at (set by who builds the engine; in the records)."""
        self.episodes_dir: Path | None = None
        """Where ``dump_episodes`` writes ``episodes/step-N.*`` (the run folder)."""
        self.last_leaves: list[Leaf] = []
        """The step's sampled leaves (before group filtering)."""
        self.last_advantages: list[list[float]] = []
        """Per trained leaf, the advantage of each action token."""
        self.last_output = None
        self._trained: list[Leaf] = []
        self._filtered = 0
        self._rollouts: Rollouts | None = None
        self._plan: list[list[int]] = []
        self._times = (0.0, 0.0)
        self._sync = (0.0, 0.0)
        self.evaluate: Callable[[int], dict] | None = None
        """``evaluate(step) -> record`` every ``eval_every`` steps (:mod:`harts_runtime.rl.evaluate`)."""

    def chunk_size(self) -> int:
        """The chunk size for the task's trees (:func:`tree_chunk_size`)."""
        return tree_chunk_size(self.task, self.config.device)

    def attach(self, engine, rollout_factory=None) -> None:
        """Make the rollout engine of ``engine`` (it holds the trainer's weights from then on)."""
        if rollout_factory is None:
            from harts_runtime.rl.transformers_backend import TransformersRollout

            rollout_factory = TransformersRollout.from_engine
        self.rollout = rollout_factory(engine)

    # ------------------------------------------------------------------ the job loop's source
    def rollouts(self, engine, leaves: list[Leaf], old_logprobs=None):
        """The :class:`~harts_runtime.rollouts.Rollouts` of ``leaves``: per-token advantages of the
        config's estimator (kept in :attr:`last_advantages`), loss mask on the action tokens, old
        log-probs (``old_logprobs`` [P], or the sampler's)."""
        from harts_runtime.rollouts import Rollouts

        adv = advantages(self.config.advantage, leaves, self.forks, self.config.gamma)
        self.last_advantages = [list(a) for a in adv]
        kw: dict[str, Any] = dict(
            advantages=[lf.per_token(a) for lf, a in zip(leaves, adv)],
            loss_mask=[lf.loss_mask() for lf in leaves],
            vocab_size=engine.vocab_size,
        )
        if old_logprobs is None:
            kw["old_logprobs"] = [np.minimum(lf.per_token(), 0.0) for lf in leaves]
        ro = Rollouts.from_lists([lf.tokens for lf in leaves], **kw)
        if old_logprobs is not None:
            assert ro.loss_mask is not None  # given above
            ro.old_logprobs = torch.where(
                ro.loss_mask, old_logprobs.float(), torch.zeros_like(old_logprobs.float())
            )
            ro.check(engine.vocab_size)
        return ro

    def _filter(self, leaves: list[Leaf]) -> list[Leaf]:
        """``leaves`` without the prompts whose leaves all earned one reward (``filter_groups``)."""
        self._filtered = 0
        if not self.config.filter_groups:
            return leaves
        by: dict[int, list[float]] = {}
        for lf in leaves:
            by.setdefault(lf.prompt, []).append(lf.reward)
        flat = {p for p, r in by.items() if max(r) == min(r)}
        self._filtered = len(flat)
        return [lf for lf in leaves if lf.prompt not in flat]

    def next_step(self, engine):
        """The step's :class:`~harts_runtime.rollouts.Rollouts`, or None when group filtering left
        no prompt (:meth:`updates` then trains nothing)."""
        from harts_runtime.rollouts import Rollouts

        t0 = time.perf_counter()
        leaves = self.sampler.sample(self.rollout)
        t1 = time.perf_counter()
        self.last_leaves = leaves
        trained = self._filter(leaves)
        self._trained = trained
        self._rollouts = None
        self.last_advantages = []
        if trained:
            old = None
            if self.config.recompute_logprobs:
                old = engine.logprobs(Rollouts.from_lists([lf.tokens for lf in trained]))
            self._rollouts = self.rollouts(engine, trained, old)
        self._times = (t1 - t0, time.perf_counter() - t1)
        return self._rollouts

    def updates(self, batch) -> list:
        """The updates of a step's batch: ``ppo_epochs`` passes over ``mini_batches`` mini-batches
        (a prompt's tree whole in one; prompts in their sampled order, split as evenly as they go;
        at most one mini-batch per prompt), each one optimizer step; the old log-probs are the
        batch's, fixed from the rollout. None (everything filtered): no update."""
        self._plan = []
        if batch is None:
            return []
        prompts = list(dict.fromkeys(lf.prompt for lf in self._trained))
        parts = min(self.config.mini_batches, len(prompts))
        if parts == 1:
            self._plan = [list(range(len(self._trained)))] * self.config.ppo_epochs
            return [batch] * self.config.ppo_epochs
        group = {p: i * parts // len(prompts) for i, p in enumerate(prompts)}
        index: list[list[int]] = [[] for _ in range(parts)]
        for i, lf in enumerate(self._trained):
            index[group[lf.prompt]].append(i)
        fields = {
            name: batch.to_lists(getattr(batch, name), name)
            for name in ("advantages", "loss_mask", "old_logprobs")
        }
        minis = []
        for rows in index:
            minis.append(
                type(batch).from_lists(
                    [self._trained[i].tokens for i in rows],
                    **{name: [values[i] for i in rows] for name, values in fields.items()},
                )
            )
        self._plan = index * self.config.ppo_epochs
        return minis * self.config.ppo_epochs

    def _sync_atol(self, engine) -> float:
        if self.config.sync_atol is not None:
            return self.config.sync_atol
        return 2e-3 if next(engine.model.parameters()).dtype in (torch.float32, torch.float64) else 1.0

    def sync(self, engine) -> None:
        """Push the trainer's weights to the rollout engine."""
        assert self.rollout is not None  # attach() made it
        self.rollout.load_weights(engine.export_weights(names="transformers"))

    def after_step(self, engine, result, report) -> None:
        """The weight sync and its check (a stale policy raises
        :class:`~harts_runtime.rl.rollout_engine.SyncError`)."""
        t0 = time.perf_counter()
        self.sync(engine)
        diff = 0.0
        leaves = self.last_leaves
        if self.config.sync_sequences:
            assert self.rollout is not None  # attach() made it
            seqs = [lf.tokens for lf in leaves[:: max(1, len(leaves) // self.config.sync_sequences)]]
            diff = check_sync(
                engine, self.rollout, seqs[: self.config.sync_sequences], self._sync_atol(engine)
            )
        self._sync = (diff, time.perf_counter() - t0)

    def record(self, step: int, results: list, reports: list, seconds: dict) -> dict:
        """The step's record from its updates' results and optimizer reports (one each per update)."""
        leaves = self.last_leaves
        self.last_output = results[-1] if results else None
        rewards = np.array([lf.reward for lf in leaves])
        lengths = [sum(b - a for _, a, b in lf.segments) for lf in leaves]
        turns = sum(len(lf.truncated) for lf in leaves)
        generate, logprobs = self._times
        diff, sync = self._sync if results else (0.0, 0.0)
        one_pass = results[: max(1, len(results) // self.config.ppo_epochs)] if results else []
        rows = sum(int(r.metrics["rows"]) for r in one_pass)
        replay = sum(int(r.metrics["replay_tokens"]) for r in one_pass)
        semantic = sum(int(r.metrics["semantic_tokens"]) for r in one_pass)
        rec: dict[str, Any] = {
            "step": step,
            "reward_mean": float(rewards.mean()),
            "reward_min": float(rewards.min()),
            "reward_max": float(rewards.max()),
            "loss": _mean(float(r.loss) for r in results),
            "grad_norm": _mean(float(r.grad_norm) for r in reports),
            "lr": float(reports[-1].lr) if reports else None,
            "skipped": any(bool(r.skipped) for r in reports) if reports else True,
            "updates": len(results),
            "filtered_groups": self._filtered,
            "leaves": len(leaves),
            "tokens": int(sum(len(lf.tokens) for lf in leaves)),
            "response_length_mean": float(np.mean(lengths)),
            "truncated_share": sum(map(sum, (lf.truncated for lf in leaves))) / turns if turns else 0.0,
            "semantic_tokens": semantic,
            "rows": rows,
            "replay_rows": replay,
            "compression": semantic / rows if rows else None,
            "chunk_size": self.trained_chunk_size,
            "compression_with_replay": semantic / max(1, rows + replay) if rows else None,
            "sampler_drift": self._drift(results[0]) if results else None,
            "sync_diff": diff,
        }
        for key in sorted(
            {k for r in results for k in r.metrics if k.startswith(("objective/", "loss_fn/"))}
        ):
            rec[key] = _mean(float(r.metrics[key]) for r in results if key in r.metrics)
        rec.update(
            generate_seconds=generate,
            logprobs_seconds=logprobs,
            train_seconds=seconds["train"],
            sync_seconds=sync,
            step_seconds=seconds["step"],
        )
        if self.config.dump_episodes and self.episodes_dir is not None:
            from harts_runtime.rl.episodes import write_episodes

            adv = self.last_advantages
            kept = {id(lf): a for lf, a in zip(self._trained, adv)}
            per_leaf = [kept.get(id(lf), [0.0] * n) for lf, n in zip(leaves, lengths)]
            write_episodes(
                self.episodes_dir, step, leaves, per_leaf, self.tokenizer, prompts=self.config.dump_episodes
            )
        if self.evaluate is not None and self.config.eval_every and step % self.config.eval_every == 0:
            rec.update(self.evaluate(step))
        return rec

    def _drift(self, result) -> float:
        """The largest gap between the trainer's and the sampler's log-probs of the first update's
        action tokens (on the weights that sampled them)."""
        rows = self._plan[0] if self._plan else range(len(self._trained))
        chosen = [self._trained[i] for i in rows]
        sample_lp = torch.tensor([v for lf in chosen for v in lf.action_logprobs], dtype=torch.float64)
        if not len(sample_lp):
            return 0.0
        mask = torch.tensor([m for lf in chosen for m in lf.loss_mask()[1:]], dtype=torch.bool)
        return float((result.logprobs[mask].double() - sample_lp).abs().max())

    def line(self, rec: dict, steps: int) -> str:
        """The step's progress line."""
        evaluation = f" eval {rec['eval_reward_mean']:.3f}" if "eval_reward_mean" in rec else ""
        if not rec["updates"]:
            return (
                f"step {rec['step']}/{steps} reward {rec['reward_mean']:.3f}: skipped, all "
                f"{rec['filtered_groups']} prompts' leaves earned one reward (filter_groups){evaluation}"
            )
        text = (
            f"step {rec['step']}/{steps} reward {rec['reward_mean']:.3f} loss {rec['loss']:+.4f} "
            f"rows {rec['rows']} (replay {rec['replay_rows']}, semantic {rec['semantic_tokens']}) "
            f"gen {rec['generate_seconds']:.2f}s logprobs {rec['logprobs_seconds']:.2f}s "
            f"train {rec['train_seconds']:.2f}s sync {rec['sync_seconds']:.2f}s"
        )
        if rec["filtered_groups"]:
            text += f" filtered {rec['filtered_groups']}"
        return text + evaluation

    # ------------------------------------------------------------------ its state in a checkpoint
    def state_files(self, step: int) -> dict[str, str]:
        """``rl.json``: the sampler's state after step ``step`` (a checkpoint's RL state)."""
        sampler = self.sampler.state_dict()
        state = {
            "format": _STATE_FORMAT,
            "step": step,
            "sampler": {
                "generator": base64.b64encode(sampler["generator"].numpy().tobytes()).decode("ascii"),
                "env_rng": _plain(sampler["env_rng"]),
            },
        }
        return {STATE_NAME: json.dumps(state, indent=1, sort_keys=True) + "\n"}

    def saved(self, folder: Path) -> None:
        (Path(folder) / _OLD_STATE).unlink(missing_ok=True)  # an older version's, for this step

    def load_state(
        self, engine, folder: Path, engine_dir: Path, listed: set, extra: dict, n: int, log
    ) -> None:
        """Restore the sampler from the checkpoint ``folder`` (step ``n``), its steps checked."""
        if STATE_NAME in listed:
            state_file = engine_dir / STATE_NAME
            generator, env_rng, step = read_state(state_file)
            if extra.get("rl_step") != step:
                raise InvalidInputError(
                    STATE_NAME,
                    f"{state_file} holds step {step}, its engine checkpoint rl_step {extra.get('rl_step')!r}",
                )
        elif (folder / _OLD_STATE).is_file():
            state_file = folder / _OLD_STATE
            generator, env_rng, step = _read_old_state(state_file)
            log(f"{state_file}: saved before RL states were checksummed; read unverified")
        else:
            raise InvalidInputError(
                STATE_NAME,
                f"{folder / 'engine' / STATE_NAME} is missing (no RL state in the checkpoint {folder})",
            )
        if step != n:
            raise InvalidInputError(
                state_file.name,
                f"{state_file} holds step {step}, the checkpoint is step-{n} (an RL state from another step)",
            )
        try:
            self.sampler.load_state_dict({"generator": generator, "env_rng": env_rng})
        except (TypeError, ValueError, KeyError, RuntimeError) as e:
            raise InvalidInputError(
                state_file.name,
                f"{state_file} holds no sampler state ({type(e).__name__}: {' '.join(str(e).split())})",
            ) from None

    def resumed(self, engine) -> None:
        """After a checkpoint loaded: the rollout engine gets its weights."""
        self.sync(engine)


def _mean(values) -> float | None:
    v = list(values)
    return float(sum(v) / len(v)) if v else None


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


def read_state(path: Path):
    """``(generator state, environment RNG state, step)`` of an ``rl.json``."""
    state = read_json(path, STATE_NAME, "the RL state")
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


def _read_old_state(path: Path):
    from harts_runtime.parallel.safe_load import load_weights_only

    state = load_weights_only(path)
    try:
        step = state["step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step {step!r} is not an integer")
        return state["sampler"]["generator"], state["sampler"]["env_rng"], step
    except (KeyError, TypeError) as e:
        raise InvalidInputError(path.name, f"{path} is not an RL state ({type(e).__name__}: {e})") from None


# ---------------------------------------------------------------------------- harts-rl's job
def _rl_config(rl: dict, path: Path) -> RLConfig:
    try:
        return RLConfig(**rl)
    except (TypeError, InvalidInputError) as e:
        raise InvalidInputError(RUN_NAME, f"{path}: {' '.join(str(e).split())}") from None


def _normalize(record: dict, path: Path) -> dict:
    """A run record with its settings' defaults filled in (an older ``run.json`` lacks newer keys)."""
    return dict(record, rl=_rl_config(dict(record["rl"]), path).to_dict())


def _engine_config(options: dict, steps: int):
    """The engine's config of the run's options; a decaying schedule without ``total_steps`` ends at
    the run's ``steps`` (a resumed run's new total: :func:`harts_runtime.job_config.resolve_total_steps`,
    the rule ``harts-train`` follows)."""
    from harts_runtime.engine import EngineConfig
    from harts_runtime.loss.objectives import PolicyLossConfig

    options = dict(options)
    loss = PolicyLossConfig(**options.pop("loss_config"))
    objective = options.pop("objective")
    total = resolve_total_steps(options.get("total_steps"), steps, options.get("lr_schedule", "constant"))
    if total is not None:
        options["total_steps"] = total
    return EngineConfig(objective=objective, loss_config=loss, **options)


class RLRun(JobRun):
    """One RL run in ``out_dir``: the :class:`OnlineSource` of ``config`` trained on an engine built
    for it, in its run folder (:class:`~harts_runtime.trainer.run_folder.JobRun`: ``run.json``,
    checkpoints, resume). ``engine_options``: flat :class:`EngineConfig` options (``lr``,
    ``capacity``, ``mode``, ...); the objective is GRPO without a KL term unless ``loss_config``
    (a dict of :class:`PolicyLossConfig` fields) says otherwise. ``task``: a
    :class:`~harts_runtime.rl.environment.Task` instead of the config's; the run records its
    class (:func:`~harts_runtime.rl.tasks.task_identity`), which a resume loads again.
    ``rollout_factory(engine)``: the rollout engine (default: the transformers backend)."""

    def __init__(
        self, config: RLConfig, engine_options: dict, out_dir, *, task=None, rollout_factory=None, log=None
    ):
        from harts_runtime.engine import HartsEngine

        self.config = config
        opts = dict(engine_options)
        opts.setdefault("objective", "grpo")
        opts.setdefault("loss_config", dict(ONLINE_LOSS))
        self.engine_options = opts
        torch.manual_seed(config.seed)
        source = OnlineSource(config, task=task)
        self.task, self.forks, self.sampler = source.task, source.forks, source.sampler
        job = JobConfig(model={"chunk_size": config.chunk_size})
        self.chunk_size = job.resolve(config.device, "online", chunk_size=source.chunk_size).chunk_size
        source.trained_chunk_size = self.chunk_size
        model = config.model if config.model is not None else config.flavor
        layers: dict[str, Any] = {} if config.layers is None else {"num_layers": config.layers}
        engine = HartsEngine.build(
            model,
            _engine_config(opts, config.steps),
            device=config.device,
            chunk_size=self.chunk_size,
            **layers,
        )
        source.attach(engine, rollout_factory)
        source.episodes_dir = Path(out_dir)
        record = {"rl": config.to_dict(), "engine": opts, "task": task_identity(source.task)}
        super().__init__(
            engine,
            source,
            out_dir,
            record,
            steps=config.steps,
            save_every=config.save_every,
            keep_last=config.keep_last,
            normalize=_normalize,
            log=log,
        )
        if config.eval_every:
            from harts_runtime.rl.evaluate import Evaluation

            source.evaluate = Evaluation(config, source)
        self.rollout = source.rollout

    @property
    def last_leaves(self):
        return self.source.last_leaves

    @property
    def last_output(self):
        return self.source.last_output

    def rollouts(self, leaves, old_logprobs=None):
        """The :class:`~harts_runtime.rollouts.Rollouts` of ``leaves`` (:meth:`OnlineSource.rollouts`)."""
        return self.source.rollouts(self.engine, leaves, old_logprobs)

    _read_state = staticmethod(read_state)

    @classmethod
    def resume(  # type: ignore[override]
        cls,
        out_dir,
        *,
        steps: int | None = None,
        task=None,
        rollout_factory=None,
        log=None,
        fallback: bool = False,
    ) -> RLRun:
        """The run of ``out_dir`` at its newest complete checkpoint (``steps``: a new total;
        ``fallback``: skip checkpoints that do not load, :meth:`JobRun.load_latest`). Its task is the
        class ``run.json`` records (a custom class loaded by name, :func:`make_task`); a ``task``
        given instead is used as it is (a note says so where its class differs); a recorded class
        that no longer loads, or loads as another, is refused naming ``task``."""
        record = read_run(out_dir)
        rl = dict(record["rl"])
        if steps is not None:
            rl["steps"] = steps
        config = _rl_config(rl, Path(out_dir) / RUN_NAME)
        recorded = record.get("task", config.task)
        if not isinstance(recorded, str):
            raise InvalidInputError(
                RUN_NAME, f"{Path(out_dir) / RUN_NAME}: task must be a string, got {recorded!r}"
            )
        if task is None:
            try:
                task = make_task(recorded, **config.task_args)
            except InvalidInputError as e:
                raise InvalidInputError(
                    "task", f"the run in {out_dir} trained {recorded!r}, which does not load now ({e})"
                ) from None
            if task_identity(task) != recorded:
                raise InvalidInputError(
                    "task",
                    f"the run in {out_dir} trained {recorded!r}, which loads as {task_identity(task)!r} now",
                )
        elif task_identity(task) != recorded and log is not None:
            log(f"task: the run trained {recorded!r}; resuming with the given {task_identity(task)!r}")
        run = cls(config, record["engine"], out_dir, task=task, rollout_factory=rollout_factory, log=log)
        run.record["task"] = recorded
        run.load_latest(fallback=fallback)
        return run
