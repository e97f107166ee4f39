"""The rollout engine's interface (:class:`RolloutEngine`, :class:`Frontier`) and the weight-sync
check (:func:`check_sync`).

A rollout engine samples the policy's actions and takes the trainer's weights after each optimizer
step. It holds live *branches* (token sequences being extended) in a :class:`Frontier`: the sampler
appends sampled action tokens (:meth:`Frontier.sample`), appends observation tokens the environment
returns (:meth:`Frontier.extend`), and forks branches (:meth:`Frontier.fork`: a branch repeated ``k``
times shares its prefix, and its prefix state, with its copies). Branches are ragged: prompts and
observations may differ in length, and with stop tokens each branch's action ends at its own
length. The built-in backend is
:class:`harts_runtime.rl.transformers_backend.TransformersRollout` (CPU or GPU). A vLLM backend
implements the same four methods: ``load_weights`` through vLLM's own weight-update API (the
checkpoint-spelled pairs of :meth:`HartsEngine.weights(names="checkpoint") <harts_runtime.engine.HartsEngine.weights>`),
``logprobs`` with ``prompt_logprobs``, and a frontier over vLLM requests whose prefix cache sees the
forks' sharing (and, for routing replay, :meth:`Frontier.routes` from the routed experts vLLM
returns).

After each sync, :func:`check_sync` compares the rollout engine's log-probs of a few sampled
sequences with the trainer's (:meth:`HartsEngine.logprobs`): a sync that left a weight out, or
loaded it under the wrong name, raises :class:`SyncError` instead of training on a stale policy.
On an MoE model the two sides' routers can pick different experts for a token at a near-tie
(float rounding), which moves that token's log-prob by far more than ``atol``: with the trainer's
routing replay on and the rollout engine reporting the routes it scored with
(:attr:`RolloutEngine.scored_routes`), the trainer scores with those routes and the comparison is
exact; otherwise :func:`judge_sync` ignores up to :data:`FLIP_FRACTION` of the tokens beyond
``atol`` (an isolated near-tie flips a handful of tokens, a weight left out moves a layer's or an
expert's whole share of them).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "FLIP_FRACTION",
    "Frontier",
    "RolloutEngine",
    "SyncError",
    "check_sync",
    "is_routed",
    "judge_sync",
    "own_routes_rollouts",
]


class SyncError(RuntimeError):
    """The rollout engine's log-probs differ from the trainer's after a weight sync."""


class Frontier(ABC):
    """Live branches of a rollout engine; ``tokens[i]`` is branch ``i``'s sequence so far."""

    tokens: list[list[int]]

    @abstractmethod
    def sample(
        self, n: int, generator: torch.Generator, temperature: float = 1.0, stop: Sequence[int] = ()
    ) -> torch.Tensor:
        """Sample ``n`` tokens on every branch (appended to :attr:`tokens`); returns their log-probs
        under the sampling distribution, float32 ``[branches, n]``. With ``stop`` (token ids), a
        branch stops right after sampling one of them (it is appended: the action's last token),
        so it gets from 1 to ``n`` tokens; its row's log-probs past its end are 0. The sampler
        passes ``stop`` only when the task has stop tokens (an engine without the keyword serves
        the tasks without them)."""

    @abstractmethod
    def extend(self, rows: Sequence[Sequence[int]]) -> None:
        """Append ``rows[i]`` (observation tokens; possibly empty; lengths may differ) to branch
        ``i``."""

    @abstractmethod
    def fork(self, index: Sequence[int]) -> None:
        """Keep branches ``index`` in that order (repeats fork a branch: its copies share its prefix)."""

    def routes(self) -> list[torch.Tensor] | None:
        """Per branch, the MoE experts the engine ran each of its tokens through so far: int
        ``[len(tokens[i]), M, k]`` (``M`` MoE layers in model order, ``k`` experts per token; -1
        where not known), prompt and observation tokens included; what the trainer replays with
        ``routing_replay`` on. None (the default): the engine does not report routes (a dense
        model, or a backend without them)."""
        return None


class RolloutEngine(ABC):
    """Samples the policy and takes its weights in memory."""

    vocab_size: int

    @abstractmethod
    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take the trainer's weights (``(name, tensor)`` pairs, every weight once; the sources
        pass the bucketed stream of :meth:`HartsEngine.weights <harts_runtime.engine.HartsEngine.weights>`
        flattened, so a tensor is valid only until the next one is drawn: copy it)."""

    scored_routes: list[torch.Tensor] | None = None
    """Optional (read with ``getattr``: an engine may not have it): per sequence of the last
    :meth:`logprobs` call, the MoE experts that scoring ran each token through, int64
    ``[L, M, k]`` (as :meth:`Frontier.routes`); None for a dense model or an engine that does not
    report them. :func:`check_sync` replays them on the trainer."""

    @abstractmethod
    def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per sequence, the float64 log-probs of tokens ``1 .. L-1`` given the tokens before them."""

    @abstractmethod
    def open(self, prompts: Sequence[Sequence[int]]) -> Frontier:
        """A frontier of one branch per prompt (non-empty; lengths may differ)."""


def _replay_layers(engine):
    """The MoE layers of ``engine``'s model while its routing replay is on, else None."""
    return getattr(getattr(engine, "model", None), "_harts_routing_replay", None)


def own_routes_rollouts(engine, sequences: Sequence[Sequence[int]]):
    """The :class:`~harts_runtime.rollouts.Rollouts` of ``sequences`` for a forward in which
    every MoE layer routes by its own router: with ``engine``'s routing replay on, routes of -1
    (the router's own top-k) for every token; otherwise none."""
    from harts_runtime.rollouts import Rollouts

    seqs = [list(s) for s in sequences]
    layers = _replay_layers(engine)
    if not layers:
        return Rollouts.from_lists(seqs)
    m, k = len(layers), int(layers[0].config.top_k)
    return Rollouts.from_lists(seqs, routes=[torch.full((len(s), m, k), -1, dtype=torch.long) for s in seqs])


FLIP_FRACTION = 0.02
"""The share of the sampled tokens (at least one) :func:`judge_sync` lets differ by more than
``atol`` on an MoE model whose two sides route by their own routers (router near-tie flips)."""


def is_routed(engine) -> bool:
    """Whether the trainer ``engine``'s model has MoE layers (its tokens are routed)."""
    from harts_runtime.layers.moe import CompactMoE

    model = getattr(engine, "model", None)
    return model is not None and any(isinstance(m, CompactMoE) for m in model.modules())


def judge_sync(
    ours: torch.Tensor, theirs: torch.Tensor, n_sequences: int, atol: float, flips: bool = False
) -> tuple[float, int]:
    """Judge the trainer's log-probs ``ours`` against the rollout engine's ``theirs`` (flat, one
    per scored token). Returns ``(diff, ignored)``: the largest absolute difference over the tokens
    judged and how many tokens beyond ``atol`` were ignored. ``flips``: the two sides may route a
    token to different experts (an MoE model scored by each side's own router); then at most
    ``max(1, FLIP_FRACTION * tokens)`` tokens beyond ``atol`` are ignored (router near-ties;
    their count is logged at INFO). Raises :class:`SyncError` otherwise, and on any NaN."""
    d = (ours.double().cpu() - theirs.double().cpu()).abs()
    n = d.numel()
    nan = int(d.isnan().sum())
    if nan:
        raise SyncError(
            f"weight sync: NaN log-probs (trainer's or rollout engine's) on {nan} of {n} tokens of "
            f"{n_sequences} sampled sequences"
        )
    diff = float(d.max()) if n else 0.0
    if diff <= atol:
        return diff, 0
    bad = ~(d <= atol)
    n_bad = int(bad.sum())
    if not flips:
        raise SyncError(
            f"weight sync: the rollout engine's log-probs differ from the trainer's by {diff:.3g} "
            f"(> {atol:g}) on {n_bad} of {n} tokens of {n_sequences} sampled sequences: "
            f"a weight was not synced"
        )
    allowed = max(1, int(FLIP_FRACTION * n))
    if n_bad > allowed:
        raise SyncError(
            f"weight sync: the rollout engine's log-probs differ from the trainer's by more than "
            f"{atol:g} (up to {diff:.3g}) on {n_bad} of {n} tokens of {n_sequences} sampled "
            f"sequences, more than the {allowed} a router near-tie flips: a weight was likely not "
            f"synced (if these are MoE route flips, routing_replay makes the check exact)"
        )
    logger.info(
        "weight sync check: %d of %d tokens beyond atol %g ignored as MoE route flips "
        "(routing_replay makes the check exact)",
        n_bad,
        n,
        atol,
    )
    kept = d[~bad]
    return (float(kept.max()) if kept.numel() else 0.0), n_bad


def check_sync(
    engine, rollout: RolloutEngine, sequences: Sequence[Sequence[int]], atol: float = 2e-3
) -> float:
    """Compare ``rollout``'s log-probs of ``sequences`` with the trainer ``engine``'s; returns the
    largest absolute difference over the tokens judged, or raises :class:`SyncError` (float32 on
    both sides agrees to ~1e-6 on the tiny flavors; a weight left out moves it by orders more).

    Dense model: every token is judged. MoE model with the trainer's routing replay on and a
    rollout that reports :attr:`RolloutEngine.scored_routes`: the trainer scores with the routes
    the rollout scored with, and every token is judged. Otherwise (MoE, each side routed by its
    own router, :func:`own_routes_rollouts`): :func:`judge_sync` ignores up to
    :data:`FLIP_FRACTION` of the tokens beyond ``atol`` (router near-ties)."""
    from harts_runtime.rollouts import Rollouts

    seqs = [list(s) for s in sequences if len(s) > 1]
    if not seqs:
        return 0.0
    theirs = torch.cat(rollout.logprobs(seqs)).double()
    routes = getattr(rollout, "scored_routes", None)
    if _replay_layers(engine) and routes is not None:
        rollouts = Rollouts.from_lists(seqs, routes=[r.long().cpu() for r in routes])
        flips = False
    else:
        rollouts = own_routes_rollouts(engine, seqs)
        flips = is_routed(engine)
    ours = engine.logprobs(rollouts).double()
    return judge_sync(ours, theirs, len(seqs), atol, flips)[0]
