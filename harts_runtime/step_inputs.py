"""A rollout batch plus the per-token RL metadata of one train step (:class:`StepInputs`).

Per-token tensors have one entry per *non-terminal* semantic position (``P = S - N``) in original
batch order: the positions ``0 .. len_i - 2`` of trajectory 0, then trajectory 1, ...; entry ``t``
scores the next token. The step-level aggregation weights of the loss (``weights``: the
denominators of ``loss_agg_mode`` computed once over the whole step) are what makes microbatch
contributions add up to the whole-step loss (see :mod:`harts_runtime.train`).
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field

import numpy as np
import torch

from harts_planner.batch import RolloutBatch
from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.views import TreeOrder
from harts_runtime.loss.objectives import PolicyLossConfig, aggregation_weights, grpo_advantages, per_token
from harts_runtime.token_range import check_token_range

__all__ = ["StepInputs", "default_loss_config"]

_FIELDS = ("advantages", "loss_mask", "old_logprobs", "ref_logprobs", "behaviour_logprobs", "weight_versions")
"""The per-token fields, [P] each."""
_OPTIONAL = ("ref_logprobs", "behaviour_logprobs", "weight_versions")
_LOGPROB_FIELDS = ("advantages", "old_logprobs", "ref_logprobs", "behaviour_logprobs")
"""The floating-point ones (advantages finite; log-probs finite and <= 0)."""
_BATCH_CACHE = ("tokens_checked", "row_token", "tree", "fields_seen")
"""Cache entries derived from the batch alone (kept when a per-token field changes)."""


def _same(a, b) -> bool:
    """Whether two :meth:`StepInputs._fields_seen` records are of the same tensors at the same
    versions (None: unknown, never the same)."""
    if a is None or b is None:
        return False
    return all(x is y and u == v for (x, u), (y, v) in zip(a, b))


def default_loss_config(objective: str) -> PolicyLossConfig:
    """The policy-loss configuration of ``objective`` when none is given: GRPO with a k3 KL
    penalty of 0.001 and ``seq-mean-token-mean``; PPO with dual clip 3 and ``token-mean``."""
    if objective == "grpo":
        return PolicyLossConfig(kl_coef=0.001, loss_agg_mode="seq-mean-token-mean")
    if objective == "ppo":
        return PolicyLossConfig(clip_ratio_c=3.0, loss_agg_mode="token-mean")
    raise InvalidInputError("objective", f"choose grpo or ppo, got {objective!r}")


@dataclass
class StepInputs:
    """A rollout batch plus per-token RL metadata, in original batch order.

    Per-token tensors have one entry per *non-terminal* semantic position (``P = S - N``): the
    positions ``0 .. len_i - 2`` of trajectory 0, then trajectory 1, ... (the order of
    :func:`harts_runtime.loss.logprobs.targets_from_batch`); entry ``t`` scores the next token.
    """

    batch: RolloutBatch
    """The step's rollout batch (a ``harts_planner.RolloutBatch``)."""
    advantages: torch.Tensor
    """float32 [P] per-token advantages (GRPO: the trajectory's group-relative advantage)."""
    loss_mask: torch.Tensor
    """bool or float [P] action / loss mask."""
    old_logprobs: torch.Tensor
    """float32 [P] rollout-policy log-probs."""
    ref_logprobs: torch.Tensor | None = None
    """float32 [P] reference-policy log-probs (needed when the KL coefficient is non-zero)."""
    group_ids: torch.Tensor | None = None
    """int64 [N] GRPO group of each trajectory (metadata; the advantages are already per token)."""
    objective: str = "grpo"
    """``grpo`` or ``ppo``: the default :class:`PolicyLossConfig` when ``loss_config`` is None."""
    loss_config: PolicyLossConfig | None = None
    """Clip, KL and ``loss_agg_mode`` (None: the objective's defaults)."""
    behaviour_logprobs: torch.Tensor | None = None
    """float32 [P] the rollout engine's log-probs (importance correction,
    :mod:`harts_runtime.loss.correction`), or None."""
    weight_versions: torch.Tensor | None = None
    """int64 [P] the weight version that sampled each target (-1: none), or None."""
    routes: torch.Tensor | None = None
    """int [S, M, k] per *token* the experts the rollout engine routed it to in each of the M MoE
    layers (-1: not known), for routing replay (:mod:`harts_runtime.ops.router`), or None."""
    _cache: dict = field(default_factory=dict, repr=False)
    _checked_vocab: InitVar[int | None] = None
    """Given only by :meth:`Rollouts.checked_step_inputs
    <harts_runtime.rollouts.Rollouts.checked_step_inputs>`, whose :meth:`~harts_runtime.rollouts.Rollouts.check`
    just ran the same checks on these fields and tokens (against this vocabulary size): they are
    recorded as checked instead of checked again (one check per step)."""

    def __post_init__(self, _checked_vocab: int | None = None):
        b = self.batch
        if not isinstance(b, RolloutBatch):
            raise InvalidInputError("batch", f"must be a harts_planner.RolloutBatch, got {type(b).__name__}")
        if not b.has_tokens:
            raise InvalidInputError(
                "batch", "needs its tokens (a RolloutBatch built from a SegmentTree has none)"
            )
        n = b.num_trajectories
        if _checked_vocab is None:
            self.check_values()
        else:  # checked by Rollouts.check a moment ago: recorded, not checked again
            self._cache["fields_seen"] = self._fields_seen()
            self._cache["tokens_checked"] = _checked_vocab
        if self.group_ids is not None and self.group_ids.numel() != n:
            raise InvalidInputError("group_ids", f"expected {n} entries, got {self.group_ids.numel()}")
        if self.objective not in ("grpo", "ppo"):
            raise InvalidInputError("objective", f"choose grpo or ppo, got {self.objective!r}")
        if self.config.kl_coef and self.ref_logprobs is None:
            raise InvalidInputError("ref_logprobs", "required when kl_coef != 0")
        if self.config.is_correction != "none" and self.behaviour_logprobs is None:
            raise InvalidInputError(
                "behaviour_logprobs", f"required by is_correction={self.config.is_correction!r}"
            )
        if self.routes is not None and _checked_vocab is None:
            from harts_runtime.ops.router import check_routes

            self.routes = check_routes(self.routes, b.semantic_tokens)

    def check_values(self) -> None:
        """Refuse per-token fields that would silently poison a step, before any work; the step
        loop calls it once per step, since the fields are plain tensors that can be edited in place
        after construction (``step.advantages[3] = float("nan")``).

        Raises :class:`InvalidInputError` naming the field (and, for a bad value, its trajectory
        and position): a field that is not a 1-D tensor of ``P = S - N`` entries (``advantages``,
        ``loss_mask``, ``old_logprobs`` required; ``ref_logprobs`` optional), a non-finite
        advantage, a log-prob that is not finite or above 0 (one NaN advantage turned every
        parameter NaN after one step; old log-probs of -inf gave a loss of 3.7e7), a float64 value
        beyond float32's range (the step computes in float32: 1e39 is inf), a loss mask that
        is not boolean or 0 / 1. O(P) elementwise work and one host read per field (a device sync
        when the fields live on a GPU). A field replaced or edited in place since the last check
        also drops what was derived from it (:attr:`weights`, the device copies)."""
        p = self.num_targets
        for name in _FIELDS:
            t = getattr(self, name)
            if t is None:
                if name in _OPTIONAL:
                    continue
                raise InvalidInputError(name, f"required: a 1-D tensor of P = S - N = {p} entries")
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != p:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InvalidInputError(
                    name, f"expected a 1-D tensor of P = S - N = {p} entries, got {shape}"
                )
        v = self.weight_versions
        if v is not None:
            if v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
                raise InvalidInputError("weight_versions", f"must be integers, got dtype {v.dtype}")
            if bool((v < -1).any()):
                cu = self.cu_seqlens.numpy()
                k = int((v < -1).nonzero()[0, 0])
                i = int(np.searchsorted(cu, k, side="right") - 1)
                raise InvalidInputError(
                    f"weight_versions[{i}][{k - int(cu[i])}]", f"must be >= -1 (-1: none), got {int(v[k])}"
                )
        for name in _LOGPROB_FIELDS:
            t = getattr(self, name)
            if t is None:
                continue
            if not t.is_floating_point():
                raise InvalidInputError(name, f"must be a floating-point tensor, got {t.dtype}")
            bad = ~torch.isfinite(t)
            wide = torch.finfo(t.dtype).max > torch.finfo(torch.float32).max
            if wide:  # float64: the step computes in float32, where 1e39 is inf
                bad |= t.abs() > torch.finfo(torch.float32).max
            if name != "advantages":
                bad |= t > 0
            if bool(bad.any()):
                cu = self.cu_seqlens.numpy()
                k = int(bad.nonzero()[0, 0])
                i = int(np.searchsorted(cu, k, side="right") - 1)
                what = (
                    "advantages must be finite"
                    if name == "advantages"
                    else "log-probs must be finite and <= 0"
                )
                x = float(t[k])
                f32 = torch.finfo(torch.float32).max
                extra = " (not finite in float32)" if wide and math.isfinite(x) and abs(x) > f32 else ""
                raise InvalidInputError(f"{name}[{i}][{k - int(cu[i])}]", f"{what}, got {x}{extra}")
        m = self.loss_mask
        if m.dtype != torch.bool:
            if m.is_complex() or not bool(((m == 0) | (m == 1)).all()):
                raise InvalidInputError("loss_mask", f"must be boolean or 0 / 1 (dtype {m.dtype})")
        seen = self._fields_seen()
        if self._cache.get("fields_seen") is not None and not _same(self._cache["fields_seen"], seen):
            for key in [k for k in self._cache if k not in _BATCH_CACHE]:
                del self._cache[key]
        self._cache["fields_seen"] = seen

    def _fields_seen(self):
        """``(tensor, version)`` of each per-token field: it changes when a field is replaced or
        edited in place through torch (its version counter); None where a tensor keeps no counter
        (inference-mode tensors). Writes that bypass torch (``.numpy()``, ``.data``) go unseen."""
        out = []
        for name in _FIELDS:
            t = getattr(self, name)
            try:
                out.append((t, None if t is None else t._version))
            except RuntimeError:
                return None
        return tuple(out)

    def _check_values_if_changed(self) -> None:
        """:meth:`check_values` unless no field was replaced or edited in place since the last
        check (O(1) then)."""
        seen = self._cache.get("fields_seen")
        if seen is None or not _same(seen, self._fields_seen()):
            self.check_values()

    def check_tokens(self, vocab_size: int) -> None:
        """:class:`InvalidInputError` naming the first token id outside ``[0, vocab_size)`` (the
        model's vocabulary), before it reaches an embedding as a raw IndexError; once per step (the
        engine calls it, :meth:`harts_runtime.engine.HartsEngine.step_inputs`; the microbatches below
        check nothing). It also re-runs :meth:`check_values` when a field was replaced or edited in
        place through torch since the last check (O(1) otherwise)."""
        self._check_values_if_changed()
        if self._cache.get("tokens_checked") == vocab_size:
            return
        tokens = np.asarray(self.batch.tokens, dtype=np.int64)
        check_token_range(tokens, np.asarray(self.batch.offsets, dtype=np.int64), vocab_size, "tokens")
        self._cache["tokens_checked"] = vocab_size

    # ------------------------------------------------------------------ derived (cached)
    @property
    def config(self) -> PolicyLossConfig:
        """The effective policy-loss config."""
        if self.loss_config is not None:
            return self.loss_config
        return default_loss_config(self.objective)

    @property
    def num_targets(self) -> int:
        """P."""
        return self.batch.semantic_tokens - self.batch.num_trajectories

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int64 [N + 1]: trajectory i owns per-token entries ``[cu[i], cu[i + 1])``."""
        off = np.asarray(self.batch.offsets, dtype=np.int64)
        return torch.from_numpy(off - np.arange(len(off), dtype=np.int64))

    @property
    def weights(self) -> torch.Tensor:
        """float32 [P] step-level aggregation weights (float64
        :func:`~harts_runtime.loss.objectives.aggregation_weights` of the whole step, rounded once)."""
        if "weights" not in self._cache:
            cfg = self.config
            self._cache["weights"] = aggregation_weights(
                self.loss_mask.cpu(), self.cu_seqlens, cfg.loss_agg_mode, cfg.loss_norm
            ).float()
        return self._cache["weights"]

    @property
    def weight_total(self) -> float:
        """The sum of :attr:`weights` over the step."""
        if "weight_total" not in self._cache:
            self._cache["weight_total"] = float(self.weights.double().sum())
        return self._cache["weight_total"]

    @property
    def mask_total(self) -> float:
        """The step's loss-masked targets (the denominator of its token means)."""
        if "mask_total" not in self._cache:
            self._cache["mask_total"] = float((self.loss_mask != 0).sum())
        return self._cache["mask_total"]

    def _host(self, name: str, make):
        if name not in self._cache:
            self._cache[name] = make()
        return self._cache[name]

    @property
    def row_token(self) -> np.ndarray:
        """int64 [C]: the token of every batch compact row."""

        def make():
            out = np.empty(self.batch.compact_tokens, dtype=np.int64)
            out[np.asarray(self.batch.compact_map, dtype=np.int64)] = np.asarray(
                self.batch.tokens, dtype=np.int64
            )
            return out

        return self._host("row_token", make)

    @property
    def tree(self) -> TreeOrder:
        """Preorder coordinates of the batch rows (ancestor test for tree-mask backends)."""
        return self._host("tree", lambda: TreeOrder.from_batch(self.batch))

    def device_metadata(self, device) -> dict:
        """advantages, old/ref log-probs and weights on ``device`` (moved once per device)."""
        key = ("meta", str(device))
        if key not in self._cache:
            mv = lambda t: None if t is None else t.to(device=device, dtype=torch.float32)
            self._cache[key] = {
                "advantages": mv(self.advantages),
                "old_logprobs": mv(self.old_logprobs),
                "ref_logprobs": mv(self.ref_logprobs),
                "behaviour_logprobs": mv(self.behaviour_logprobs),
                "weights": mv(self.weights),
                "weight_versions": None if self.weight_versions is None else self.weight_versions.to(device),
            }
        return self._cache[key]

    def device_mask(self, device) -> torch.Tensor:
        """The loss mask as bool on ``device`` (moved once per device)."""
        key = ("mask", str(device))
        if key not in self._cache:
            self._cache[key] = self.loss_mask.to(device=device).bool()
        return self._cache[key]

    @classmethod
    def synthetic(
        cls,
        batch,
        seed: int = 0,
        objective: str = "grpo",
        mask_prob: float = 0.8,
        old_logprobs: torch.Tensor | None = None,
        vocab_size: int | None = None,
    ) -> StepInputs:
        """Random RL metadata for a batch: rewards per trajectory, GRPO advantages over tree groups,
        a Bernoulli loss mask, old log-probs near ``-log V`` (or the given ones), reference log-probs
        near the old ones."""
        rng = np.random.default_rng(seed)
        n = batch.num_trajectories
        p = batch.semantic_tokens - n
        groups = torch.from_numpy(np.asarray(batch.component, dtype=np.int64))
        rewards = torch.from_numpy(rng.standard_normal(n)).float()
        off = np.asarray(batch.offsets, dtype=np.int64)
        cu = torch.from_numpy(off - np.arange(len(off), dtype=np.int64))
        adv = per_token(grpo_advantages(rewards, groups), cu).float()
        mask = torch.from_numpy(rng.random(p) < mask_prob)
        base = -float(np.log(vocab_size or 1000))
        old = (
            old_logprobs
            if old_logprobs is not None
            else torch.from_numpy(base + 0.1 * rng.standard_normal(p)).float()
        )
        ref = old + torch.from_numpy(0.05 * rng.standard_normal(p)).float()
        return cls(batch, adv, mask, old.float(), ref, groups, objective)
