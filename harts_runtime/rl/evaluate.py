"""The policy on held-out prompts (:class:`Evaluation`, ``eval_every``): every K steps, after the
weight sync, one greedy episode (the most likely token each time, no forks) per held-out prompt on
the rollout engine; the record gets their mean reward.

The held-out prompts are the task's, drawn from an environment RNG of their own (the run's seed
shifted by :data:`EVAL_SEED_SHIFT`), the same ones at every evaluation and apart from the training
stream (a task whose prompts come from its own state, not the RNG, gives what it gives). The
evaluation draws nothing from the training sampler's RNGs, so a run with evaluations trains the
same steps as one without.
"""

from __future__ import annotations

import time

import numpy as np

from harts_runtime.rl.config import RLConfig
from harts_runtime.rl.sampler import TreeSampler

__all__ = ["EVAL_SEED_SHIFT", "GREEDY_TEMPERATURE", "Evaluation"]

EVAL_SEED_SHIFT = 1_000_003
"""The held-out prompts' seed: the run's plus this (modulo 2^62)."""
GREEDY_TEMPERATURE = 1e-6
"""The sampling temperature of an evaluation: the most likely token (greedy decoding)."""


class Evaluation:
    """``evaluation(step) -> {"eval_reward_mean", "eval_reward_min", "eval_reward_max",
    "eval_seconds"}`` of ``config.eval_prompts`` held-out prompts on ``source``'s task and rollout
    engine."""

    def __init__(self, config: RLConfig, source):
        self.config, self.source = config, source
        self.seed = (config.seed + EVAL_SEED_SHIFT) % (1 << 62)

    def __call__(self, step: int) -> dict:
        t0 = time.perf_counter()
        sampler = TreeSampler(
            self.source.task,
            {},
            self.config.eval_prompts,
            GREEDY_TEMPERATURE,
            self.seed,
            max_step_tokens=self.config.max_step_tokens,
        )
        leaves = sampler.sample(self.source.rollout)
        rewards = np.array([lf.reward for lf in leaves])
        return {
            "eval_reward_mean": float(rewards.mean()),
            "eval_reward_min": float(rewards.min()),
            "eval_reward_max": float(rewards.max()),
            "eval_seconds": time.perf_counter() - t0,
        }
