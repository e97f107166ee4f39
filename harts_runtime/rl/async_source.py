"""Asynchronous RL's data source (:class:`AsyncSource`): a sampler thread generates the batches of
steps ``n + 1 .. n + K`` on the rollout engine while the trainer trains step ``n``
(``K = RLConfig.max_staleness``), with partial rollouts continued across a weight sync.

**Versions.** Version ``v`` is the trainer's weights after ``v`` steps of the run; step ``n`` trains
its batch at version ``n - 1``. A token's version is the one whose forward pass gave the logits it
was sampled from, tagged with the engine's optimizer steps at that version
(:attr:`HartsEngine.step <harts_runtime.engine.HartsEngine.step>`, what the mismatch metrics'
lags count against; equal to ``v`` unless a step was skipped). Each token carries its version and the
rollout engine's log-prob into :class:`~harts_runtime.rollouts.Rollouts` (``weight_versions``,
``behaviour_logprobs``; ``-1`` and 0 on the tokens no policy sampled), so that
``PolicyLossConfig.is_correction`` corrects by them and the engine reports the mismatch per lag.

**The schedule** is a function of ``n``, ``K`` and the task's turns ``T`` alone, never of which
thread runs first, so a run is reproducible from its seed:

* batch ``n`` starts at version ``s(n) = max(v0, n - 1 - K)`` (``v0``: the version the source
  started at, 0 or a resumed run's step), waiting until the trainer has published it;
* with ``K >= 1``, ``T >= 2`` and ``n - K > v0``, the sampler takes version ``n - K`` at the turn
  boundary after turn ``ceil(T / 2) - 1``, *before* that boundary's observations are fed, waiting
  for it if the trainer has not published it yet (a partial rollout: the cache the old weights left
  is kept, as vLLM's ``keep`` does; the first action token of a branch whose observation is empty
  was drawn from the old weights' logits and carries the old version);
* so batch ``n`` holds versions ``n - 1 - K`` and ``n - K`` (lag ``K`` and ``K - 1`` when trained),
  and a batch older than ``K`` versions is never trained: the sampler blocks instead.

``K = 0`` samples batch ``n`` entirely at version ``n - 1`` after step ``n - 1``'s sync: today's
synchronous loop (:class:`~harts_runtime.rl.source.OnlineSource`), record for record
(``tests/rl/test_async_source.py``). ``K = 1`` overlaps the first ``ceil(T / 2)`` turns of batch
``n + 1`` with step ``n`` (the later turns wait for step ``n``'s weights); ``K >= 2`` overlaps whole
batches.

**Weights** are handed over, never loaded under the sampler's feet: ``after_step`` publishes a copy
of the trainer's weights (:meth:`HartsEngine.weights(names="transformers")
<harts_runtime.engine.HartsEngine.weights>`, bucket by bucket; up to ``K + 2`` copies held) and only the
sampler thread loads them into the rollout engine, at its schedule's points. With
``sync_sequences``, the trainer's log-probs of the last batch's sequences are published with the
weights, the sampler compares the rollout engine's after loading them
(:class:`~harts_runtime.rl.rollout_engine.SyncError` as in the synchronous loop), and ``after_step``
waits for that check (so each record holds its own version's ``sync_diff``; the sampler reaches
version ``n`` without any later step of the trainer).

**The end of a run and resume.** The sampler samples up to step ``steps + K`` (the batches a longer
resumed run would have had in flight). :meth:`checkpoint_state` (after step ``N``) waits for batches
``N + 1 .. N + K`` (which need versions up to ``N`` only) and returns them with the sampler's RNG
states after batch ``N + K``; :meth:`restore` puts them back, and the sampler regenerates batch
``N + K + 1`` on from those states at version ``N`` on: the resumed run's steps equal the
uninterrupted run's.

**Errors.** A failure in the sampler thread is raised in the trainer's next wait as one error naming
the step (:class:`SamplerError`; an :class:`~harts_runtime.errors.InvalidInputError` or a
:class:`~harts_runtime.rl.rollout_engine.SyncError` keeps its class). Every wait polls the thread's
liveness; ``timeout`` bounds each wait; :meth:`close` stops and joins the thread (bounded; also at
interpreter exit, where a daemon thread inside a torch op would abort the process).

The per-token versions (the switch boundary, the versioned frontier, in-flight leaf records) live in
:mod:`harts_runtime.rl.async_versions`.
"""

from __future__ import annotations

import atexit
import base64
import dataclasses
import json
import threading
import time
import weakref
from pathlib import Path

import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl.async_versions import _leaf_of, _leaf_record, _VersionedRollout, switch_turn
from harts_runtime.rl.config import RLConfig
from harts_runtime.rl.rollout_engine import SyncError, is_routed, judge_sync, own_routes_rollouts
from harts_runtime.rl.sampler import Leaf
from harts_runtime.rl.source import OnlineSource

__all__ = ["AsyncSource", "SamplerError", "switch_turn"]

_FORMAT = "harts-async-rl/1"
_POLL = 0.05


class SamplerError(RuntimeError):
    """The sampler thread failed (its step named), or stopped, or a wait for it timed out."""


class _ClosedError(Exception):
    """The source is closing: the sampler thread leaves its wait."""


def _close_at_exit(ref) -> None:
    """Stop a source's sampler thread before the interpreter finalizes (a daemon thread inside a
    torch op at exit aborts the process)."""
    src = ref()
    if src is not None:
        src.close(10.0)


@dataclasses.dataclass
class _Snapshot:
    tag: int
    pairs: list
    check_seqs: list
    check_ref: torch.Tensor | None
    atol: float


@dataclasses.dataclass
class _Batch:
    leaves: list[Leaf]
    versions: list[list[int]]
    """Per leaf, per token: the version tag that sampled it (-1: prompt and observation tokens)."""
    generate: float
    """Seconds the sampler spent on the batch, its waits for weights left out."""
    waited: float
    """Seconds the sampler waited for weights inside the batch (its switch)."""


def _sampler_state(sampler) -> dict:
    return sampler.state_dict()


class AsyncSource(OnlineSource):
    """RL's data source with sampling ``config.max_staleness`` versions ahead (module docstring).

    ``timeout``: the most seconds any one wait for the sampler thread may take (None: no bound;
    a dead thread is noticed either way)."""

    def __init__(self, config: RLConfig, *, task=None, timeout: float | None = None):
        super().__init__(config, task=task)
        self.max_staleness = config.max_staleness
        self.timeout = timeout
        self._switch = switch_turn(self.task.turns)
        self._cond = threading.Condition()
        self._snaps: dict[int, _Snapshot] = {}
        self._checks: dict[int, float] = {}
        self._ready: dict[int, _Batch] = {}
        self._rng_after: dict[int, dict] = {}
        self._error: tuple[int, BaseException] | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._done = 0
        """Steps trained (the trainer's version)."""
        self._v0 = 0
        self._first = 1
        """The first batch the sampler thread samples (later ones after a restore)."""
        self._loaded: int | None = None
        self._tag = 0
        self._versions: dict[int, list[int]] = {}
        self._engine = None
        self._routed = False
        """The trainer's model has MoE layers (the sync check tolerates router near-tie flips)."""
        self._batch_extra: dict = {}
        if config.eval_every:
            raise InvalidInputError(
                "eval_every",
                f"evaluations run on the rollout engine, which the sampler thread holds under "
                f"max_staleness = {config.max_staleness}: give eval_every = 0",
            )

    # ------------------------------------------------------------------ schedule
    def start_version(self, n: int) -> int:
        """The version batch ``n`` starts at."""
        return max(self._v0, n - 1 - self.max_staleness)

    def switch_version(self, n: int) -> int | None:
        """The version batch ``n`` takes at its switch boundary (None: no switch)."""
        v = n - self.max_staleness
        if self.max_staleness == 0 or self._switch is None or v <= self.start_version(n):
            return None
        return v

    @property
    def horizon(self) -> int:
        """The last batch the sampler samples: ``steps + K``."""
        return self.config.steps + self.max_staleness

    # ------------------------------------------------------------------ the sampler thread
    def _start(self, engine) -> None:
        self._routed = is_routed(engine)
        self._rng_after[self._first - 1] = _sampler_state(self.sampler)
        self._publish(self._done, engine.step, engine, [], None)
        self._thread = threading.Thread(target=self._main, name="harts-rl-sampler", daemon=True)
        self._thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    def _publish(self, version: int, tag: int, engine, seqs, ref) -> None:
        from harts_runtime.rl.transformers_backend import weight_pairs

        pairs = [(name, t.detach().clone()) for name, t in weight_pairs(engine)]
        snap = _Snapshot(tag, pairs, seqs, ref, self._sync_atol(engine))
        with self._cond:
            self._snaps[version] = snap
            self._cond.notify_all()

    def _wait_version(self, version: int) -> _Snapshot:
        with self._cond:
            while version not in self._snaps:
                if self._closing:
                    raise _ClosedError
                self._cond.wait(_POLL)
            return self._snaps[version]

    def _load(self, version: int) -> None:
        """(sampler thread) Load ``version`` into the rollout engine and check it."""
        if self._loaded == version:
            return
        snap = self._wait_version(version)
        rollout = self.rollout
        if rollout is None:
            raise SamplerError("the source has no rollout engine: attach() it first")
        rollout.load_weights(iter(snap.pairs))
        self._loaded, self._tag = version, snap.tag
        diff = 0.0
        if snap.check_seqs and snap.check_ref is not None:
            theirs = torch.cat(rollout.logprobs(snap.check_seqs)).double()
            # each side routed by its own router (the trainer scored before these routes existed)
            diff, _ = judge_sync(snap.check_ref, theirs, len(snap.check_seqs), snap.atol, self._routed)
        with self._cond:
            self._checks[version] = diff
            for v in [v for v in self._snaps if v < version]:
                del self._snaps[v]
            self._cond.notify_all()

    def _main(self) -> None:
        n = self._first
        try:
            while True:
                self._load(self.start_version(n))
                if n > self.horizon:
                    return
                waited = [0.0]
                target = self.switch_version(n)

                def boundary(i: int, target=target, waited=waited) -> None:
                    if self._closing:
                        raise _ClosedError
                    if target is not None and i == self._switch:
                        t = time.perf_counter()
                        self._load(target)
                        waited[0] += time.perf_counter() - t

                t0 = time.perf_counter()
                rollout = _VersionedRollout(self.rollout, lambda: self._tag, boundary)
                leaves = self.sampler.sample(rollout)
                seconds = time.perf_counter() - t0
                if rollout.frontier is None:
                    raise RuntimeError("the tree sampler opened no frontier")
                versions = rollout.frontier.versions
                if len(versions) != len(leaves) or any(
                    len(v) != len(lf.tokens) for v, lf in zip(versions, leaves)
                ):
                    raise RuntimeError("the versioned frontier lost track of the leaves' tokens")
                batch = _Batch(leaves, versions, seconds - waited[0], waited[0])
                with self._cond:
                    self._ready[n] = batch
                    self._rng_after[n] = _sampler_state(self.sampler)
                    self._cond.notify_all()
                n += 1
        except _ClosedError:
            return
        except BaseException as e:  # surfaced in the trainer (one error naming the step)
            with self._cond:
                self._error = (n, e)
                self._cond.notify_all()

    # ------------------------------------------------------------------ trainer-side waits
    def _raise_failure(self, error: tuple[int, BaseException]) -> None:
        n, e = error
        msg = " ".join(str(e).split())
        if isinstance(e, InvalidInputError):
            msg = msg[len(e.field) + 2 :] if msg.startswith(f"{e.field}: ") else msg
            raise InvalidInputError(e.field, f"step {n} (sampler thread): {msg}") from e
        if isinstance(e, SyncError):
            raise SyncError(f"step {n} (sampler thread): {msg}") from e
        raise SamplerError(f"step {n}: the sampler thread failed: {type(e).__name__}: {msg}") from e

    def _await(self, ready, what: str) -> None:
        t0 = time.perf_counter()
        with self._cond:
            while not ready():
                if self._error is not None:
                    self._raise_failure(self._error)
                if self._thread is None or not self._thread.is_alive():
                    raise SamplerError(f"the sampler thread stopped before {what}")
                if self.timeout is not None and time.perf_counter() - t0 > self.timeout:
                    raise SamplerError(f"waited over {self.timeout:g} s for {what}")
                self._cond.wait(_POLL)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the sampler thread and join it (at most ``timeout`` seconds; it is a daemon)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the job loop's source
    def _attach_versions(self, ro, leaves: list[Leaf]):
        """``ro`` (the Rollouts of ``leaves``) with their behaviour log-probs and versions."""
        from harts_runtime.rollouts import Rollouts

        versions = self._versions
        extra = Rollouts.from_lists(
            [lf.tokens for lf in leaves],
            behaviour_logprobs=[lf.per_token() for lf in leaves],
            weight_versions=[versions[id(lf)] for lf in leaves],
        )
        ro.behaviour_logprobs, ro.weight_versions = extra.behaviour_logprobs, extra.weight_versions
        return ro

    def next_step(self, engine):
        """Step ``n``'s batch from the sampler thread (waiting for it), as
        :meth:`OnlineSource.next_step <harts_runtime.rl.source.OnlineSource.next_step>` makes it,
        with each token's behaviour log-prob and version."""

        n = self._done + 1
        if n > self.horizon:
            raise SamplerError(
                f"step {n}: the sampler samples the run's steps ({self.config.steps}) and "
                f"max_staleness ({self.max_staleness}) more, not step {n}"
            )
        self._engine = engine
        if self._thread is None:
            self._start(engine)
        t0 = time.perf_counter()
        self._await(lambda: n in self._ready, f"the batch of step {n}")
        with self._cond:
            batch = self._ready.pop(n)
        t1 = time.perf_counter()
        leaves = batch.leaves
        self._versions = {id(lf): v for lf, v in zip(leaves, batch.versions)}
        rollouts = self._step_rollouts(engine, leaves)
        if rollouts is not None:
            self._rollouts = self._attach_versions(rollouts, self._trained)
        self._times = (batch.generate, time.perf_counter() - t1)
        sampled = [v for vs in batch.versions for v in vs if v >= 0]
        self._batch_extra = {
            "wait_seconds": t1 - t0,
            "sampler_wait_seconds": batch.waited,
            "version_min": min(sampled, default=-1),
            "version_max": max(sampled, default=-1),
            "staleness_max": engine.step - min(sampled, default=engine.step),
        }
        return self._rollouts

    def updates(self, batch) -> list:
        """:meth:`OnlineSource.updates <harts_runtime.rl.source.OnlineSource.updates>`, each
        mini-batch with its leaves' behaviour log-probs and versions."""
        parts = super().updates(batch)
        for part, rows in zip(parts, self._plan):
            if part is not batch:
                self._attach_versions(part, [self._trained[i] for i in rows])
        return parts

    def _published(self, engine) -> None:
        """Publish the version of the step just trained (``after_step``, or ``record`` for a step
        without an update: the weights unchanged); returns the sync check's ``(diff, seconds)``."""

        t0 = time.perf_counter()
        self._done += 1
        v = self._done
        seqs, ref = [], None
        leaves = self.last_leaves
        if self.config.sync_sequences:
            seqs = [lf.tokens for lf in leaves[:: max(1, len(leaves) // self.config.sync_sequences)]]
            seqs = [list(s) for s in seqs[: self.config.sync_sequences] if len(s) > 1]
            if seqs:
                ref = engine.logprobs(own_routes_rollouts(engine, seqs)).double()
        self._publish(v, engine.step, engine, seqs, ref)
        diff = 0.0
        if seqs:
            self._await(lambda: v in self._checks, f"the weight sync check of step {v}")
            with self._cond:
                diff = self._checks.pop(v)
        with self._cond:
            for k in [k for k in self._rng_after if k < v - 1]:
                del self._rng_after[k]
            for k in [k for k in self._checks if k < v]:
                del self._checks[k]
        self._sync = (diff, time.perf_counter() - t0)

    def after_step(self, engine, result, report) -> None:
        """Publish the weights of the step's version; with ``sync_sequences``, wait for the
        sampler's check of them (module docstring)."""
        self._published(engine)

    def sync(self, engine) -> None:
        """Nothing: the sampler thread loads the trainer's weights when it starts and after each
        step (refused once it runs: weights reach it through ``after_step``)."""
        if self._thread is not None:
            raise SamplerError("sync: the sampler thread runs; weights reach it through after_step")

    def record(self, step: int, results: list, reports: list, seconds: dict) -> dict:
        if self._done < step:  # no update (group filtering left nothing): the same weights again
            self._published(self._engine)
        rec = super().record(step, results, reports, seconds)
        rec.update(self._batch_extra)
        keys = sorted({k for r in results for k in r.metrics if k.startswith("mismatch/")})
        for key in keys:
            vals = [float(r.metrics[key]) for r in results if key in r.metrics]
            rec[key] = sum(vals) / len(vals)
        return rec

    # ------------------------------------------------------------------ save / resume
    def checkpoint_state(self) -> tuple[dict, list[dict]]:
        """After step ``N``: ``(sampler state, in-flight batches)``: the tree sampler's RNG states
        after batch ``N + K`` (:meth:`TreeSampler.state_dict
        <harts_runtime.rl.sampler.TreeSampler.state_dict>`'s form) and batches ``N + 1 .. N + K``
        as JSON records (their leaves with each token's version), waiting for them."""
        n, k = self._done, self.max_staleness
        if self._thread is None:
            if k and any(i not in self._ready for i in range(n + 1, n + k + 1)):
                raise SamplerError(f"checkpoint after step {n}: the sampler has not started")
            return _sampler_state(self.sampler), self._in_flight(n, k)
        last = n + k
        self._await(lambda: last in self._rng_after, f"the batches in flight after step {n}")
        with self._cond:
            return self._rng_after[last], self._in_flight(n, k)

    def _in_flight(self, n: int, k: int) -> list[dict]:
        out = []
        for i in range(n + 1, n + k + 1):
            b = self._ready[i]
            out.append(
                {
                    "step": i,
                    "leaves": [_leaf_record(lf, v) for lf, v in zip(b.leaves, b.versions)],
                    "generate_seconds": b.generate,
                    "sampler_wait_seconds": b.waited,
                }
            )
        return out

    def restore(self, step: int, in_flight: list[dict]) -> None:
        """Continue after step ``step`` (the engine's weights are its version): the in-flight
        batches of :meth:`checkpoint_state` (the tree sampler's RNG states set by the caller).
        Raises :class:`InvalidInputError` naming ``in_flight`` when they are not batches
        ``step + 1 .. step + K``."""
        if self._thread is not None:
            raise SamplerError("restore: the sampler thread has started")
        k = self.max_staleness
        if not isinstance(in_flight, list) or [
            b.get("step") if isinstance(b, dict) else None for b in in_flight
        ] != list(range(step + 1, step + k + 1)):
            got = (
                [b.get("step") if isinstance(b, dict) else b for b in in_flight]
                if isinstance(in_flight, list)
                else in_flight
            )
            raise InvalidInputError(
                "in_flight",
                f"max_staleness {k} after step {step} needs batches of steps "
                f"{list(range(step + 1, step + k + 1))}, the checkpoint holds {got!r}",
            )
        ready = {}
        try:
            for b in in_flight:
                pairs = [_leaf_of(d) for d in b["leaves"]]
                ready[b["step"]] = _Batch(
                    [p[0] for p in pairs],
                    [p[1] for p in pairs],
                    float(b.get("generate_seconds", 0.0)),
                    float(b.get("sampler_wait_seconds", 0.0)),
                )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidInputError(
                "in_flight", f"not a batch record ({type(e).__name__}: {' '.join(str(e).split())})"
            ) from None
        self._done = self._v0 = step
        self._first = step + k + 1
        self._ready = ready

    def state_files(self, step: int) -> dict[str, str]:
        """``rl.json`` (:meth:`OnlineSource.state_files
        <harts_runtime.rl.source.OnlineSource.state_files>`' format) with the sampler's RNG states
        after batch ``step + K`` and, under ``in_flight``, batches ``step + 1 .. step + K``."""
        from harts_runtime.rl.source import _STATE_FORMAT, STATE_NAME, _plain

        if step != self._done:
            raise SamplerError(f"checkpoint of step {step}: the source has trained {self._done} steps")
        sampler, in_flight = self.checkpoint_state()
        state = {
            "format": _STATE_FORMAT,
            "step": step,
            "sampler": {
                "generator": base64.b64encode(sampler["generator"].numpy().tobytes()).decode("ascii"),
                "env_rng": _plain(sampler["env_rng"]),
            },
            "max_staleness": self.max_staleness,
            "in_flight": in_flight,
        }
        return {STATE_NAME: json.dumps(state, indent=1, sort_keys=True) + "\n"}

    def load_state(self, engine, folder, engine_dir, listed, extra, n, log) -> None:
        """Restore the sampler's RNG states and the batches in flight of the checkpoint (step
        ``n``), checked: one :class:`InvalidInputError` naming ``rl.json`` when they are missing."""
        from harts_runtime.rl.source import STATE_NAME

        super().load_state(engine, folder, engine_dir, listed, extra, n, log)
        path = Path(engine_dir) / STATE_NAME
        try:
            state = json.loads(path.read_text())
            in_flight = state["in_flight"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidInputError(
                STATE_NAME,
                f"{path} holds no batches in flight (max_staleness = {self.max_staleness}): "
                f"{type(e).__name__}: {' '.join(str(e).split())}",
            ) from None
        try:
            self.restore(n, in_flight)
        except InvalidInputError as e:
            raise InvalidInputError(STATE_NAME, f"{path}: {e}") from None
