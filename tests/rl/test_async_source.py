"""Asynchronous RL (:mod:`harts_runtime.rl.async_source`): ``max_staleness = 0`` through the
sampler thread equals the synchronous :class:`OnlineSource` record for record and weight for weight;
``K >= 1`` stays within its version window, tags each token with the version that sampled it,
reproduces itself from the seed, and a run stopped after step 2 and resumed equals the
uninterrupted one; a sampler failure is one error naming the step (no hang)."""

from __future__ import annotations

import time

import pytest
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl import RLConfig
from harts_runtime.rl.async_source import AsyncSource, SamplerError, switch_turn
from harts_runtime.rl.run import RLRun
from harts_runtime.rl.source import OnlineSource

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(flavor="qwen3.5-tiny", prompts=2, forks={0: 2, 1: 2}, sync_sequences=1, seed=5)
TIMED = (
    "generate_seconds", "logprobs_seconds", "train_seconds", "sync_seconds", "step_seconds", "wait_seconds",
    "sampler_wait_seconds",
)  # fmt: skip
WAIT = 120.0


def _run(tmp_path, name, source_cls=None, **cfg):
    """An RLRun of ``SMALL`` (+ ``cfg``); ``source_cls``: its source replaced by a fresh one of that
    class (same RNG use on both sides of a comparison)."""
    config = RLConfig(**{**SMALL, **cfg})
    run = RLRun(config, {"lr": 1e-2}, tmp_path / name)
    if source_cls is not None:
        src = source_cls(config)
        src.trained_chunk_size = run.source.trained_chunk_size
        src.rollout = run.source.rollout  # the run's rollout engine (the engine's weights)
        run.source = src
    if isinstance(run.source, AsyncSource):
        run.source.timeout = WAIT
    return run


def _steps(run, k: int) -> list[dict]:
    try:
        return [run.run_step() for _ in range(k)]
    finally:
        if isinstance(run.source, AsyncSource):
            run.source.close()


def _weights(run) -> dict:
    return {k: v.detach().clone() for k, v in run.engine.model.state_dict().items()}


def _same(a: list[dict], b: list[dict], skip=TIMED) -> None:
    for ra, rb in zip(a, b, strict=True):
        for key in ra.keys() & rb.keys():
            if key not in skip:
                assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])


def test_zero_staleness_equals_the_synchronous_loop(tmp_path):
    """K = 0 through the sampler thread: every record entry (losses, rewards, grad norms, rows,
    sync diffs) and every weight equal the synchronous loop's after 3 steps of token-set."""
    sync = _run(tmp_path, "sync", OnlineSource, steps=3)
    asyn = _run(tmp_path, "async", AsyncSource, steps=3)
    assert type(sync.source) is OnlineSource and type(asyn.source) is AsyncSource
    a, b = _steps(sync, 3), _steps(asyn, 3)
    _same(a, b)
    assert {"loss", "reward_mean", "grad_norm", "sync_diff"} <= a[0].keys() & b[0].keys()
    assert [r["staleness_max"] for r in b] == [0, 0, 0]
    assert [r["version_min"] for r in b] == [0, 1, 2] and "mismatch/lag0/k3" in b[0]
    wa, wb = _weights(sync), _weights(asyn)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_window_versions_reproducible_and_resumed_exactly(tmp_path):
    """K = 1, 4 steps: each batch holds versions n - 2 and n - 1 (the switch after turn 0; the
    first turn's tokens the older), lags at most 1; a second run from the seed gives the same
    records; a run stopped after step 2 (checkpoint) and resumed gives the same steps 3 and 4."""
    a = _run(tmp_path, "a", steps=4, max_staleness=1)
    assert type(a.source) is AsyncSource  # OnlineSource(config) picks it
    ra = _steps(a, 4)
    assert [(r["version_min"], r["version_max"]) for r in ra] == [(0, 0), (0, 1), (1, 2), (2, 3)]
    assert max(r["staleness_max"] for r in ra) == 1 and "mismatch/lag1/k3" in ra[2]
    for lf in a.source.last_leaves:  # batch 4: turn 0 at version 2; turn 1 at 3 but its first token
        v = a.source._versions[id(lf)]  # (drawn from the logits turn 0's last token left, version 2)
        (_, s0, e0), (_, s1, e1) = lf.segments
        assert set(v[s0:e0]) == {2} and v[s1] == 2 and set(v[s1 + 1 : e1]) == {3}
        assert set(v[:s0] + v[e0:s1] + v[e1:]) <= {-1}
    b = _run(tmp_path, "b", steps=4, max_staleness=1)
    b.source.rollout = _Jittery(b.source.rollout)  # the sampler thread's timing shuffled
    _same(ra, _steps(b, 4))

    c = _run(tmp_path, "c", steps=4, max_staleness=1)
    _same(ra[:2], [c.run_step() for _ in range(2)])
    c.write_run()
    c.save()
    c.source.close()
    d = RLRun.resume(tmp_path / "c")
    assert d.step == 2 and isinstance(d.source, AsyncSource)
    d.source.timeout = WAIT
    _same(ra[2:], _steps(d, 2), skip=TIMED)
    wa, wd = _weights(a), _weights(d)
    assert all(torch.equal(wa[k], wd[k]) for k in wa)


@pytest.mark.slow
def test_mini_batches_and_filtered_steps_carry_versions(tmp_path):
    """K = 2 with two mini-batches and group filtering: every mini-batch trained carries the
    behaviour log-probs and versions; a step that filtering left without an update still publishes
    its version (the sampler does not wait for it forever)."""
    run = _run(tmp_path, "m", steps=4, max_staleness=2, mini_batches=2)
    seen = []
    fb = run.engine.forward_backward

    def spy(batch, **kw):
        if not kw.get("forward_only"):  # (engine.logprobs: the old log-probs and the sync check)
            seen.append((batch.behaviour_logprobs is not None, batch.weight_versions is not None))
        return fb(batch, **kw)

    run.engine.forward_backward = spy
    recs = _steps(run, 4)
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and seen and all(a and b for a, b in seen)
    assert sum(r["updates"] for r in recs) == len(seen) == 8
    # one prompt: step 3 of seed 5 has every leaf at one reward, filtered away (no update)
    recs = _steps(_run(tmp_path, "f", steps=4, max_staleness=2, prompts=1, filter_groups=True), 4)
    assert [r["updates"] for r in recs] == [1, 1, 0, 1]


def test_switch_point_and_schedule():
    assert switch_turn(1) is None and switch_turn(2) == 0 and switch_turn(3) == 1 and switch_turn(4) == 1
    src = AsyncSource(RLConfig(**{**SMALL, "max_staleness": 2}))
    assert [src.start_version(n) for n in range(1, 6)] == [0, 0, 0, 1, 2]
    assert [src.switch_version(n) for n in range(1, 6)] == [None, None, 1, 2, 3]
    zero = AsyncSource(RLConfig(**SMALL))
    assert [zero.start_version(n) for n in (1, 2, 3)] == [0, 1, 2]
    assert zero.switch_version(3) is None


class _Jittery:
    """A rollout engine whose frontiers sleep a random while before each turn's sampling."""

    def __init__(self, inner):
        import random

        self.inner, self.vocab_size, self.rng = inner, inner.vocab_size, random.Random()

    def load_weights(self, pairs):
        self.inner.load_weights(pairs)

    def logprobs(self, seqs):
        return self.inner.logprobs(seqs)

    def open(self, prompts):
        frontier, rng = self.inner.open(prompts), self.rng

        class Slow:
            tokens = frontier.tokens

            def sample(self, *a, **k):
                time.sleep(rng.uniform(0.0, 0.3))
                return frontier.sample(*a, **k)

            def extend(self, rows):
                return frontier.extend(rows)

            def fork(self, index):
                frontier.fork(index)
                Slow.tokens = frontier.tokens

        return Slow()


class _Broken:
    """A rollout engine whose frontier fails on the second batch's sampling."""

    def __init__(self, inner, error=None):
        self.inner, self.vocab_size, self.opened = inner, inner.vocab_size, 0
        self.error = error or RuntimeError("engine lost")

    def load_weights(self, pairs):
        self.inner.load_weights(pairs)

    def logprobs(self, seqs):
        return self.inner.logprobs(seqs)

    def open(self, prompts):
        self.opened += 1
        if self.opened == 2:
            raise self.error
        return self.inner.open(prompts)


def test_sampler_failure_is_one_error_naming_the_step(tmp_path):
    run = _run(tmp_path, "x", steps=3, max_staleness=1)
    run.source.rollout = _Broken(run.source.rollout)
    with pytest.raises(SamplerError, match=r"step 2: the sampler thread failed: RuntimeError: engine lost"):
        _steps(run, 3)
    assert not run.source._thread.is_alive()
    run = _run(tmp_path, "y", AsyncSource, steps=3)
    bad = InvalidInputError("observation[1]", "an observation is a list of token ids, got int")
    run.source.rollout = _Broken(run.source.rollout, bad)
    with pytest.raises(InvalidInputError, match=r"^observation\[1\]: step 2 \(sampler thread\): an obs"):
        _steps(run, 3)


def test_bad_settings_name_the_key():
    with pytest.raises(InvalidInputError, match="max_staleness: must be an integer in \\[0, 64\\]"):
        RLConfig(**SMALL, max_staleness=65)
    with pytest.raises(InvalidInputError, match="eval_every"):
        AsyncSource(RLConfig(**SMALL, max_staleness=1, eval_every=2))
    src = AsyncSource(RLConfig(**SMALL, max_staleness=2))
    with pytest.raises(InvalidInputError, match=r"in_flight: max_staleness 2 after step 3 needs batches"):
        src.restore(3, [{"step": 4}])
