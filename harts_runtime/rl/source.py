"""The online data source of the job loop (:class:`OnlineSource`) and its state (``harts-rl``'s
job, which picks this source or the asynchronous one, is :class:`harts_runtime.rl.run.RLRun`).

``next_step(engine)``: the tree sampler's leaves from the rollout engine; the prompts whose leaves
all earned one reward dropped when ``filter_groups`` is on (their advantages are all zero: they
train nothing; counted in the record); their old log-probs recomputed by the trainer (a
forward-only step, unless ``recompute_logprobs`` is off: the sampler's then); the
:class:`~harts_runtime.rollouts.Rollouts` of the leaves with the estimator's per-token advantages
(:func:`harts_runtime.rl.advantages.advantages`, discounted by ``gamma``), and with a KL term
(the loss's ``kl_coef > 0``) the reference policy's log-probs (:attr:`OnlineSource.reference`: the
initial weights, frozen); with the engine's ``routing_replay`` the MoE experts the rollout engine
ran each token through (:attr:`Leaf.routes <harts_runtime.rl.sampler.Leaf.routes>`). ``updates(batch)``: the
batch trained ``ppo_epochs`` times in ``mini_batches`` optimizer steps each (a prompt's tree kept
whole in one mini-batch; the old log-probs stay the ones fixed from the rollout, so the clip acts
from the second update on); nothing when the filter left no prompt. ``after_step``: the weights
pushed to the rollout engine (the bucketed stream of :meth:`HartsEngine.weights
<harts_runtime.engine.HartsEngine.weights>`) and :func:`~harts_runtime.rl.rollout_engine.check_sync`. ``record``: the
step's rewards, losses (the updates' mean), rows (one pass over the batch), response lengths, the
objective's statistics and timings (``generate`` / ``logprobs`` / ``train`` / ``sync`` seconds);
with ``dump_episodes`` the step's first trees as text (:func:`harts_runtime.rl.episodes.write_episodes`)
in the run folder. ``state_files`` / ``load_state``: the RL state a checkpoint carries (``rl.json``:
the step, the sampler's ``torch.Generator`` and the environment's numpy RNG states), read as JSON
(a run saved before ``rl.json`` existed has ``step-N/rl.pt``, read with
``torch.load(weights_only=True)`` and step-checked, but not covered by a manifest); the state's
format and reader are :mod:`harts_runtime.rl.source_state`.
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
from harts_runtime.rl.advantages import advantages
from harts_runtime.rl.config import RLConfig
from harts_runtime.rl.rollout_engine import RolloutEngine, check_sync
from harts_runtime.rl.sampler import Leaf, TreeSampler
from harts_runtime.rl.source_state import (
    _OLD_STATE,
    _STATE_FORMAT,
    STATE_NAME,
    _plain,
    _read_old_state,
    read_state,
)
from harts_runtime.rl.tasks import make_task
from harts_runtime.rl.text import bind_tokenizer
from harts_runtime.trainer_state import RUN_NAME, latest_checkpoint, read_run

if TYPE_CHECKING:
    from harts_runtime.engine.reference import ReferencePolicy
    from harts_runtime.rollouts import Rollouts

__all__ = [
    "RUN_NAME",
    "STATE_NAME",
    "OnlineSource",
    "latest_checkpoint",
    "read_run",
    "read_state",
    "tree_chunk_size",
]


def _replays_routes(engine) -> bool:
    """Whether ``engine`` runs with ``routing_replay`` (its execution options)."""
    return bool(getattr(getattr(engine, "config", None), "routing_replay", False))


def _leaf_routes(leaves: list[Leaf]) -> list[torch.Tensor]:
    """The leaves' routes for ``Rollouts(routes=...)``; :class:`InvalidInputError` naming
    ``routing_replay`` when the rollout engine reported none."""
    out = []
    for lf in leaves:
        if lf.routes is None:
            raise InvalidInputError(
                "routing_replay",
                "is on but the rollout engine reported no MoE routes (a dense model, or a backend "
                "without Frontier.routes); turn routing_replay off",
            )
        out.append(lf.routes)
    return out


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
    before the step's size is checked. The synchronous source: ``config.max_staleness`` is
    :class:`harts_runtime.rl.async_source.AsyncSource`'s (:func:`harts_runtime.rl.run.make_source`
    picks the class)."""

    reference: ReferencePolicy | None = None
    """With a KL term: the reference policy (the engine's weights when :meth:`attach` ran)."""

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
        self.reference = None
        self.evaluate: Callable[[int], dict] | None = None
        """``evaluate(step) -> record`` every ``eval_every`` steps (:mod:`harts_runtime.rl.evaluate`)."""

    def chunk_size(self) -> int:
        """The chunk size for the task's trees (:func:`tree_chunk_size`)."""
        return tree_chunk_size(self.task, self.config.device)

    def attach(self, engine, rollout_factory=None) -> None:
        """Make the rollout engine of ``engine`` (it holds the trainer's weights from then on) and,
        when the engine's loss has a KL term (``kl_coef > 0``), the reference policy: a frozen copy
        of the engine's weights now (:class:`~harts_runtime.engine.reference.ReferencePolicy`).
        Attach before any step or checkpoint load: the weights are then the run's initial ones (a
        resumed run's engine is built from the same model source and seed before its checkpoint
        loads, so its reference is the uninterrupted run's). One process only: under a mesh a KL
        term is refused naming ``kl_coef``."""
        loss = getattr(engine.config, "loss_config", None)
        if loss is not None and loss.kl_coef > 0:
            if engine.mesh is not None:
                raise InvalidInputError(
                    "kl_coef",
                    f"{loss.kl_coef} needs a reference policy, which is copied in one process only "
                    "(no mesh); set kl_coef 0 or run without one",
                )
            from harts_runtime.engine.reference import ReferencePolicy

            self.reference = ReferencePolicy(engine)
        if rollout_factory is None:
            from harts_runtime.rl.transformers_backend import TransformersRollout

            rollout_factory = TransformersRollout.from_engine
        self.rollout = rollout_factory(engine)

    # ------------------------------------------------------------------ the job loop's source
    def rollouts(self, engine, leaves: list[Leaf], old_logprobs=None):
        """The :class:`~harts_runtime.rollouts.Rollouts` of ``leaves``: per-token advantages of the
        config's estimator (kept in :attr:`last_advantages`), loss mask on the action tokens, old
        log-probs (``old_logprobs`` [P], or the sampler's), and with a :attr:`reference` its
        log-probs (``ref_logprobs``)."""
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
        if _replays_routes(engine):
            kw["routes"] = _leaf_routes(leaves)
        ro = Rollouts.from_lists([lf.tokens for lf in leaves], **kw)
        if old_logprobs is not None:
            assert ro.loss_mask is not None  # given above
            ro.old_logprobs = torch.where(
                ro.loss_mask, old_logprobs.float(), torch.zeros_like(old_logprobs.float())
            )
            ro.check(engine.vocab_size)
        if self.reference is not None:
            self.reference.attach(ro)
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

        t0 = time.perf_counter()
        leaves = self.sampler.sample(self.rollout)
        t1 = time.perf_counter()
        self._rollouts = self._step_rollouts(engine, leaves)
        self._times = (t1 - t0, time.perf_counter() - t1)
        return self._rollouts

    def _step_rollouts(self, engine, leaves: list[Leaf]):
        """The rollouts of a step's sampled ``leaves`` after group filtering, with the old log-probs
        recomputed by the trainer when ``recompute_logprobs`` (None: no prompt left)."""
        from harts_runtime.rollouts import Rollouts

        self.last_leaves = leaves
        trained = self._filter(leaves)
        self._trained = trained
        self._rollouts = None
        self.last_advantages = []
        if not trained:
            return None
        old = None
        if self.config.recompute_logprobs:
            routes = _leaf_routes(trained) if _replays_routes(engine) else None
            old = engine.logprobs(Rollouts.from_lists([lf.tokens for lf in trained], routes=routes))
        return self.rollouts(engine, trained, old)

    def updates(self, batch) -> list:
        """The updates of a step's batch: ``ppo_epochs`` passes over ``mini_batches`` mini-batches
        (a prompt's tree whole in one; prompts in their sampled order, split as evenly as they go;
        at most one mini-batch per prompt), each one optimizer step; the old log-probs (and the
        reference's) are the batch's, fixed from the rollout. None (everything filtered): no update."""
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
            for name in ("advantages", "loss_mask", "old_logprobs", "ref_logprobs")
            if getattr(batch, name) is not None
        }
        minis = []
        for rows in index:
            extra = {}
            if batch.routes is not None:
                extra["routes"] = _leaf_routes([self._trained[i] for i in rows])
            minis.append(
                type(batch).from_lists(
                    [self._trained[i].tokens for i in rows],
                    **{name: [values[i] for i in rows] for name, values in fields.items()},
                    **extra,
                )
            )
        self._plan = index * self.config.ppo_epochs
        return minis * self.config.ppo_epochs

    @property
    def max_updates(self) -> int:
        """The most optimizer steps one step takes (``ppo_epochs x mini_batches``)."""
        return self.config.ppo_epochs * self.config.mini_batches

    def _sync_atol(self, engine) -> float:
        if self.config.sync_atol is not None:
            return self.config.sync_atol
        return 2e-3 if next(engine.model.parameters()).dtype in (torch.float32, torch.float64) else 1.0

    def sync(self, engine) -> None:
        """Push the trainer's weights to the rollout engine."""
        from harts_runtime.rl.transformers_backend import weight_pairs

        assert self.rollout is not None  # attach() made it
        self.rollout.load_weights(weight_pairs(engine))

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
