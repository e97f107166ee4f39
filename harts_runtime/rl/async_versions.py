"""Per-token weight versions of asynchronous RL (:mod:`harts_runtime.rl.async_source`): the turn
boundary at which a batch takes its newer version (:func:`switch_turn`), the rollout engine's
frontier as the sampler thread drives it (each token's version, the switch at the boundary), and the
records of in-flight leaves with their versions (checkpoints)."""

from __future__ import annotations

import dataclasses
import math

import torch

from harts_runtime.rl.sampler import Leaf

__all__ = ["switch_turn"]


def switch_turn(turns: int) -> int | None:
    """The turn boundary (after this turn) at which a batch takes its newer version: after turn
    ``ceil(turns / 2) - 1``; None for a task of one turn (no boundary: one version a batch)."""
    return None if turns < 2 else math.ceil(turns / 2) - 1


class _VersionedFrontier:
    """A rollout engine's frontier as the sampler thread drives it: tracks each token's version
    and takes the newer weights at the switch boundary (``boundary(i)`` before the observations
    after turn ``i`` are fed)."""

    def __init__(self, inner, current, boundary):
        self.inner, self._current, self._boundary = inner, current, boundary
        self.versions = [[-1] * len(row) for row in inner.tokens]
        v = current()
        self.next_version = [v] * len(inner.tokens)
        """Per branch: the version whose forward gave its next token's logits."""
        self._turn = 0

    @property
    def tokens(self):
        return self.inner.tokens

    def sample(self, n, generator, temperature=1.0, stop=()):
        starts = [len(row) for row in self.inner.tokens]
        if stop:
            lp = self.inner.sample(n, generator, temperature, stop=stop)
        else:
            lp = self.inner.sample(n, generator, temperature)
        v = self._current()
        for b, row in enumerate(self.inner.tokens):
            m = len(row) - starts[b]
            if m > 0:
                self.versions[b].extend([self.next_version[b]] + [v] * (m - 1))
            if n > 0:
                self.next_version[b] = v
        return lp

    def extend(self, rows):
        self._boundary(self._turn)
        self._turn += 1
        self.inner.extend(rows)
        v = self._current()
        for b, r in enumerate(rows):
            self.versions[b].extend([-1] * len(r))
            if len(r):
                self.next_version[b] = v

    def fork(self, index):
        self.inner.fork(index)
        self.versions = [list(self.versions[int(i)]) for i in index]
        self.next_version = [self.next_version[int(i)] for i in index]

    def routes(self):
        return self.inner.routes() if hasattr(self.inner, "routes") else None


class _VersionedRollout:
    """What the tree sampler sees: the rollout engine whose frontiers are versioned."""

    def __init__(self, rollout, current, boundary):
        self.rollout, self.vocab_size = rollout, rollout.vocab_size
        self._current, self._boundary = current, boundary
        self.frontier: _VersionedFrontier | None = None

    def open(self, prompts):
        self.frontier = _VersionedFrontier(self.rollout.open(prompts), self._current, self._boundary)
        return self.frontier


def _leaf_record(lf: Leaf, versions: list[int]) -> dict:
    d = dataclasses.asdict(lf)
    d["path"] = list(lf.path)
    d["segments"] = [list(s) for s in lf.segments]
    d["versions"] = list(versions)
    d["routes"] = None if lf.routes is None else lf.routes.tolist()
    return d


def _leaf_of(d: dict) -> tuple[Leaf, list[int]]:
    lf = Leaf(
        int(d["prompt"]),
        [int(t) for t in d["tokens"]],
        tuple(int(i) for i in d["path"]),
        [(int(s[0]), int(s[1]), int(s[2])) for s in d["segments"]],
        [float(x) for x in d["action_logprobs"]],
        float(d["reward"]),
        None if d["turn_rewards"] is None else [float(x) for x in d["turn_rewards"]],
        [bool(x) for x in d["truncated"]],
        None if d.get("routes") is None else torch.tensor(d["routes"], dtype=torch.long),
    )
    versions = [int(v) for v in d["versions"]]
    if len(versions) != len(lf.tokens):
        raise ValueError(f"{len(versions)} versions for {len(lf.tokens)} tokens")
    return lf, versions
