"""The online data source of the job loop (:class:`OnlineSource`): the RL tree sampler over a
rollout engine, the advantages, and after each optimizer step the weight sync and its check.

``next_step(engine)``: the tree sampler's leaves from the rollout engine; their old log-probs
recomputed by the trainer (a forward-only step, unless ``recompute_logprobs`` is off: the sampler's
then); the :class:`~harts_runtime.rollouts.Rollouts` of the leaves with the estimator's per-token
advantages (:func:`harts_runtime.rl.advantages.advantages`). ``after_step``: the weights pushed to the
rollout engine and :func:`~harts_runtime.rl.rollout_engine.check_sync`. ``record``: the step's
rewards, losses, rows and timings (``generate`` / ``logprobs`` / ``train`` / ``sync`` seconds).
The job loop that runs it is :func:`harts_runtime.trainer.job.run_job`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from harts_runtime.rl.advantages import advantages
from harts_runtime.rl.config import RLConfig
from harts_runtime.rl.rollout_engine import RolloutEngine, check_sync
from harts_runtime.rl.sampler import Leaf, TreeSampler
from harts_runtime.rl.tasks import make_task

if TYPE_CHECKING:
    from harts_runtime.rollouts import Rollouts

__all__ = ["OnlineSource", "tree_chunk_size"]


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
    engine ``rollout_factory(engine)`` made by :meth:`attach` (default: the transformers backend)."""

    def __init__(self, config: RLConfig, *, task=None):
        self.config = config
        self.task = task or make_task(config.task, **config.task_args)
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
        self.last_leaves: list[Leaf] = []
        self.last_output = None
        self._rollouts: Rollouts | None = None
        self._times = (0.0, 0.0)
        self._sync = (0.0, 0.0)

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
        config's estimator, loss mask on the action tokens, old log-probs (``old_logprobs`` [P], or
        the sampler's)."""
        from harts_runtime.rollouts import Rollouts

        adv = advantages(self.config.advantage, leaves, self.forks)
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

    def next_step(self, engine):
        from harts_runtime.rollouts import Rollouts

        t0 = time.perf_counter()
        leaves = self.sampler.sample(self.rollout)
        t1 = time.perf_counter()
        old = None
        if self.config.recompute_logprobs:
            old = engine.logprobs(Rollouts.from_lists([lf.tokens for lf in leaves]))
        t2 = time.perf_counter()
        self.last_leaves = leaves
        self._rollouts = self.rollouts(engine, leaves, old)
        self._times = (t1 - t0, t2 - t1)
        return self._rollouts

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

    def record(self, step: int, result, report, seconds: dict) -> dict:
        leaves, ro = self.last_leaves, self._rollouts
        assert ro is not None  # next_step() made them
        self.last_output = result
        rewards = np.array([lf.reward for lf in leaves])
        m = result.metrics
        mask = ro.loss_mask
        sample_lp = torch.tensor([v for lf in leaves for v in lf.action_logprobs], dtype=torch.float64)
        generate, logprobs = self._times
        diff, sync = self._sync
        return {
            "step": step,
            "reward_mean": float(rewards.mean()),
            "reward_min": float(rewards.min()),
            "reward_max": float(rewards.max()),
            "loss": float(result.loss),
            "grad_norm": float(report.grad_norm),
            "lr": float(report.lr),
            "skipped": bool(report.skipped),
            "leaves": len(leaves),
            "tokens": int(sum(len(lf.tokens) for lf in leaves)),
            "semantic_tokens": int(m["semantic_tokens"]),
            "rows": int(m["rows"]),
            "replay_rows": int(m["replay_tokens"]),
            "compression": float(m["compression"]),
            "chunk_size": self.trained_chunk_size,
            "compression_with_replay": int(m["semantic_tokens"])
            / max(1, int(m["rows"]) + int(m["replay_tokens"])),
            "sampler_drift": float((result.logprobs[mask].double() - sample_lp).abs().max())
            if len(sample_lp)
            else 0.0,
            "sync_diff": diff,
            "generate_seconds": generate,
            "logprobs_seconds": logprobs,
            "train_seconds": seconds["train"],
            "sync_seconds": sync,
            "step_seconds": seconds["step"],
        }
