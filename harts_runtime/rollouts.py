"""Rollouts in the shapes RL frameworks hold them, and HARTS's per-token layout (:class:`Rollouts`).

A step is N flat trajectories of token ids (prompt and response together, as generated) and
per-token RL fields. HARTS's per-token layout has one entry per *target*: the ``L_i - 1`` positions
``0 .. L_i - 2`` of trajectory ``i``, entry ``t`` scoring token ``t + 1`` given tokens ``0 .. t``
(``P = S - N`` entries in all, trajectory by trajectory: the order of
:class:`~harts_runtime.step_inputs.StepInputs` and of every log-prob HARTS returns).

RL frameworks align per-token fields with the *token* they score instead: the log-prob at position
``t`` is that of token ``t`` (verl's ``old_log_probs`` / ``response_mask``, TRL's ``per_token_logps``).
The converters map between the two: HARTS entry ``t - 1`` is the caller's position ``t``, and the
caller's position 0 (no context, nothing scores it) has no entry. Three input shapes:

* lists (:meth:`Rollouts.from_lists`): token ids per trajectory, fields per trajectory either
  per target (``L_i - 1`` values) or per token (``L_i`` values, the first ignored), or one scalar
  per trajectory (GRPO's advantage);
* padded ``[B, L]`` tensors with an ``attention_mask`` (:meth:`Rollouts.from_padded`): each row's
  tokens are the contiguous run where the mask is 1 (left and right padding alike), fields
  token-aligned in the same ``[B, L]`` frame;
* jagged tensors (:meth:`Rollouts.from_jagged`): ``torch.nested`` tensors (jagged layout) or lists
  of 1-D tensors, one row per trajectory, fields token-aligned.

and back: :meth:`Rollouts.to_lists`, :meth:`Rollouts.to_padded`, :meth:`Rollouts.to_jagged` turn a
HARTS per-target tensor ``[P]`` (e.g. the engine's log-probs) into the caller's shape, token-aligned
(position 0, and padding, get ``fill``).

Asynchronous RL adds, per target, ``behaviour_logprobs`` (the rollout engine's log-prob of the token,
for importance correction: :mod:`harts_runtime.loss.correction`) and ``weight_versions`` (the weight
version that sampled it; -1 for tokens no policy sampled, such as prompts and tool output), and, per
*token*, ``routes`` (int ``[S, M, k]``: the experts the rollout engine routed each token to in each
of the model's M MoE layers, -1 where not known; routing replay, :mod:`harts_runtime.ops.router`).
All three are optional; the compact rows do not depend on them. ``routes`` come per token in every
input shape (lists: ``[L_i, M, k]`` per trajectory; padded: ``[B, L, M, k]``; jagged: rows of
``[L_i, M, k]``): token 0 is routed too.

Which trajectories share prefixes is found by HARTS's own ingestion of the token ids; callers never
describe trees. Every constructor validates (:meth:`Rollouts.check`): one-line
:class:`~harts_runtime.errors.InvalidInputError` naming the field, its row and the limit, before any
work — non-finite advantages or log-probs, positive log-probs, token ids outside ``[0, vocab)``, a
loss mask that is not boolean (or 0 / 1), shapes that do not match. The per-field checks of the
caller's values are :mod:`harts_runtime.rollout_checks`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.rollout_checks import _cat_routes, _check_mask, _group_ids, _int_tokens, _unbind
from harts_runtime.token_range import TOKEN_LIMIT, check_token_range

__all__ = ["FIELDS", "Rollouts"]

FIELDS = ("advantages", "loss_mask", "old_logprobs", "ref_logprobs", "behaviour_logprobs", "weight_versions")
"""The per-token fields a :class:`Rollouts` carries (HARTS layout, ``[P]``)."""
_INT_FIELDS = ("weight_versions",)


@dataclass
class Rollouts:
    """A step's trajectories and per-token fields in HARTS's per-target layout (module docstring).

    ``tokens`` int64 [S] and ``offsets`` int64 [N + 1] (trajectory ``i`` is
    ``tokens[offsets[i]:offsets[i + 1]]``); every field [P] (``P = S - N``) or None;
    ``group_ids`` int64 [N] (GRPO groups; metadata) or None. Constructed through the ``from_*``
    methods (or directly, then :meth:`check`).
    """

    tokens: np.ndarray
    offsets: np.ndarray
    advantages: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None
    weight_versions: torch.Tensor | None = None
    routes: torch.Tensor | None = None
    """int32 [S, M, k] per token (not per target), or None."""

    # ------------------------------------------------------------------ shape
    @property
    def num_trajectories(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_targets(self) -> int:
        """P = S - N."""
        return int(self.offsets[-1]) - self.num_trajectories

    @property
    def target_offsets(self) -> np.ndarray:
        """int64 [N + 1]: trajectory ``i`` owns per-target entries ``[o[i], o[i + 1])``."""
        return self.offsets - np.arange(len(self.offsets), dtype=np.int64)

    # ------------------------------------------------------------------ checks
    def check(self, vocab_size: int | None = None) -> Rollouts:
        """Validate in place (fields become float32 / bool tensors); returns ``self``. Raises
        :class:`InvalidInputError` naming the field (and entry) for: offsets that do not tile the
        tokens, an empty trajectory, token ids outside ``[0, vocab_size)``, a field of the wrong
        size, a non-finite advantage or log-prob, a log-prob above 0, a loss mask that is not
        boolean or 0 / 1, a weight version that is not an integer >= -1, routes that are not
        integers [S, M, k] >= -1, group ids of the wrong size."""
        self.tokens = _int_tokens(self.tokens, "tokens")
        off = np.asarray(self.offsets, dtype=np.int64)
        if off.ndim != 1 or len(off) < 2 or off[0] != 0 or off[-1] != len(self.tokens):
            raise InvalidInputError(
                "offsets", f"must run from 0 to the {len(self.tokens)} tokens with at least one trajectory"
            )
        lengths = np.diff(off)
        if (lengths < 1).any():
            i = int(np.nonzero(lengths < 1)[0][0])
            raise InvalidInputError(f"trajectories[{i}]", "is empty (a trajectory needs at least one token)")
        self.offsets = off
        check_token_range(self.tokens, off, vocab_size, "tokens")
        p = self.num_targets
        for name in FIELDS:
            t = getattr(self, name)
            if t is None:
                continue
            t = torch.as_tensor(t)
            if t.dim() != 1 or t.numel() != p:
                raise InvalidInputError(
                    name, f"expected {p} per-target entries (P = S - N), got {tuple(t.shape)}"
                )
            if name == "loss_mask":
                setattr(self, name, _check_mask(t, name))
                continue
            if name in _INT_FIELDS:
                setattr(self, name, self._check_versions(t, name))
                continue
            if t.is_complex() or t.dtype == torch.bool:
                raise InvalidInputError(name, f"must be real numbers, got dtype {t.dtype}")
            f = t.float()  # what the step computes in: a float64 1e39 is inf there
            bad = ~torch.isfinite(f)
            if name != "advantages":
                bad = bad | (f > 0)
            if bool(bad.any()):
                k = int(bad.nonzero()[0, 0])
                i = int(np.searchsorted(self.target_offsets, k, side="right") - 1)
                what = "a log-prob is finite and <= 0" if name != "advantages" else "advantages are finite"
                x = float(t[k])
                extra = (
                    " (not finite in float32)" if math.isfinite(x) and not math.isfinite(float(f[k])) else ""
                )
                raise InvalidInputError(
                    f"{name}[{i}][{k - int(self.target_offsets[i])}]", f"{what}, got {x}{extra}"
                )
            setattr(self, name, f)
        if self.group_ids is not None:
            self.group_ids = _group_ids(self.group_ids, self.num_trajectories)
        if self.routes is not None:
            from harts_runtime.ops.router import check_routes

            try:
                self.routes = check_routes(self.routes, len(self.tokens))
            except InvalidInputError as e:  # name the trajectory and token, not the flat index
                if "][" not in e.field:
                    raise
                s, layer = (int(x) for x in e.field[len("routes[") : -1].split("]["))
                i = int(np.searchsorted(self.offsets, s, side="right") - 1)
                msg = str(e).split(": ", 1)[1]
                raise InvalidInputError(f"routes[{i}][{s - int(self.offsets[i])}][{layer}]", msg) from None
        return self

    def _check_versions(self, t: torch.Tensor, name: str) -> torch.Tensor:
        if t.is_floating_point():
            whole = torch.isfinite(t) & (t == torch.round(t))
            if not bool(whole.all()):
                k = int((~whole).nonzero()[0, 0])
                self._bad(name, k, f"an integer >= -1 (-1: none), got {float(t[k])}")
        elif t.is_complex() or t.dtype == torch.bool:
            raise InvalidInputError(name, f"must be integers, got dtype {t.dtype}")
        t = t.long()
        if bool((t < -1).any()):
            k = int((t < -1).nonzero()[0, 0])
            self._bad(name, k, f"an integer >= -1 (-1: none), got {int(t[k])}")
        return t

    def _bad(self, name: str, k: int, what: str):
        i = int(np.searchsorted(self.target_offsets, k, side="right") - 1)
        raise InvalidInputError(f"{name}[{i}][{k - int(self.target_offsets[i])}]", f"must be {what}")

    # ------------------------------------------------------------------ in
    @classmethod
    def from_lists(
        cls,
        token_ids: Sequence[Sequence[int]],
        *,
        advantages=None,
        loss_mask=None,
        old_logprobs=None,
        ref_logprobs=None,
        group_ids=None,
        vocab_size: int | None = None,
        behaviour_logprobs=None,
        weight_versions=None,
        routes=None,
    ) -> Rollouts:
        """From per-trajectory lists. Each field is, per trajectory, ``L_i - 1`` values (per target),
        ``L_i`` values (per token: the first is dropped) or one scalar (every target of the
        trajectory); or the whole field None."""
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence) or not len(token_ids):
            raise InvalidInputError("token_ids", "must be a non-empty list of token-id lists")
        lengths = [len(t) for t in token_ids]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = (
            np.concatenate([_int_tokens(t, f"token_ids[{i}]") for i, t in enumerate(token_ids)])
            if offsets[-1]
            else np.zeros(0, np.int64)
        )
        fields = {}
        for name, values in zip(
            FIELDS, (advantages, loss_mask, old_logprobs, ref_logprobs, behaviour_logprobs, weight_versions)
        ):
            if values is None:
                continue
            if len(values) != len(lengths):
                raise InvalidInputError(name, f"expected {len(lengths)} trajectories, got {len(values)}")
            parts = []
            for i, (v, n) in enumerate(zip(values, lengths)):
                try:
                    a = np.asarray(v, dtype=np.float64 if name not in ("loss_mask", *_INT_FIELDS) else None)
                except (TypeError, ValueError):  # complex numbers, strings, ragged lists
                    raise InvalidInputError(f"{name}[{i}]", "expected real numbers") from None
                if a.ndim == 0:
                    a = np.full(max(n - 1, 0), a.item())
                elif len(a) == n and n > 0:
                    a = a[1:]
                elif len(a) != n - 1:
                    raise InvalidInputError(
                        f"{name}[{i}]",
                        f"expected {n - 1} (per target) or {n} (per token) values, got {len(a)}",
                    )
                parts.append(a)
            fields[name] = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0))
        if routes is not None:
            if len(routes) != len(lengths):
                raise InvalidInputError("routes", f"expected {len(lengths)} trajectories, got {len(routes)}")
            fields["routes"] = _cat_routes([np.asarray(r) for r in routes], lengths)
        return cls(tokens, offsets, group_ids=group_ids, **fields).check(vocab_size)

    @classmethod
    def from_padded(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        advantages=None,
        loss_mask=None,
        old_logprobs=None,
        ref_logprobs=None,
        group_ids=None,
        vocab_size: int | None = None,
        behaviour_logprobs=None,
        weight_versions=None,
        routes=None,
    ) -> Rollouts:
        """From padded ``[B, L]`` tensors: row ``b``'s tokens are the contiguous run where
        ``attention_mask`` is 1; fields are ``[B, L]``, token-aligned (position ``t`` scores token
        ``t``), read on the same run (its first position dropped)."""
        ids = torch.as_tensor(input_ids)
        am = torch.as_tensor(attention_mask)
        if ids.dim() != 2 or am.shape != ids.shape:
            raise InvalidInputError(
                "attention_mask",
                f"input_ids and attention_mask must be [B, L] alike, got {tuple(ids.shape)} and {tuple(am.shape)}",
            )
        am = _check_mask(am.reshape(-1), "attention_mask").view(am.shape).cpu()
        spans = []
        for b in range(ids.shape[0]):
            on = am[b].nonzero().flatten()
            if on.numel() == 0:
                raise InvalidInputError(f"attention_mask[{b}]", "has no token")
            lo, hi = int(on[0]), int(on[-1]) + 1
            if hi - lo != on.numel():
                raise InvalidInputError(f"attention_mask[{b}]", "its tokens must be one contiguous run")
            spans.append((lo, hi))
        ids_cpu = ids.cpu()
        rows = [ids_cpu[b, lo:hi].numpy() for b, (lo, hi) in enumerate(spans)]
        fields = {}
        for name, values in zip(
            FIELDS, (advantages, loss_mask, old_logprobs, ref_logprobs, behaviour_logprobs, weight_versions)
        ):
            if values is None:
                continue
            v = torch.as_tensor(values).cpu()
            if v.shape != ids.shape:
                raise InvalidInputError(
                    name, f"must be [B, L] = {tuple(ids.shape)} like input_ids, got {tuple(v.shape)}"
                )
            fields[name] = [v[b, lo + 1 : hi] for b, (lo, hi) in enumerate(spans)]
        if routes is not None:
            r = torch.as_tensor(routes).cpu()
            if r.dim() != 4 or tuple(r.shape[:2]) != tuple(ids.shape):
                raise InvalidInputError(
                    "routes", f"must be [B, L, M, k] with [B, L] = {tuple(ids.shape)}, got {tuple(r.shape)}"
                )
            fields["routes"] = _cat_routes([r[b, lo:hi] for b, (lo, hi) in enumerate(spans)], None)
        return cls._from_rows(rows, fields, group_ids, vocab_size)

    @classmethod
    def from_jagged(
        cls,
        input_ids,
        *,
        advantages=None,
        loss_mask=None,
        old_logprobs=None,
        ref_logprobs=None,
        group_ids=None,
        vocab_size: int | None = None,
        behaviour_logprobs=None,
        weight_versions=None,
        routes=None,
    ) -> Rollouts:
        """From jagged rows: ``torch.nested`` tensors (jagged layout) or lists of 1-D tensors, one
        row per trajectory; fields token-aligned row by row (each row's first value dropped)."""
        rows = [r.cpu().numpy() for r in _unbind(input_ids, "input_ids")]
        fields = {}
        for name, values in zip(
            FIELDS, (advantages, loss_mask, old_logprobs, ref_logprobs, behaviour_logprobs, weight_versions)
        ):
            if values is None:
                continue
            vs = _unbind(values, name)
            if len(vs) != len(rows):
                raise InvalidInputError(name, f"expected {len(rows)} rows, got {len(vs)}")
            for i, (v, r) in enumerate(zip(vs, rows)):
                if v.numel() != len(r):
                    raise InvalidInputError(
                        f"{name}[{i}]", f"expected {len(r)} token-aligned values, got {v.numel()}"
                    )
            fields[name] = [v.cpu()[1:] for v in vs]
        if routes is not None:
            rs = list(routes.unbind()) if isinstance(routes, torch.Tensor) and routes.is_nested else routes
            if not isinstance(rs, (list, tuple)) or len(rs) != len(rows):
                raise InvalidInputError("routes", f"expected {len(rows)} rows of [L_i, M, k] expert ids")
            fields["routes"] = _cat_routes([torch.as_tensor(r).cpu() for r in rs], [len(r) for r in rows])
        return cls._from_rows(rows, fields, group_ids, vocab_size)

    @classmethod
    def _from_rows(cls, rows, fields, group_ids, vocab_size) -> Rollouts:
        if not rows:
            raise InvalidInputError("input_ids", "has no rows")
        lengths = [len(r) for r in rows]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate([_int_tokens(r, f"input_ids[{i}]") for i, r in enumerate(rows)])
        flat = {
            k: v if k == "routes" else torch.cat([torch.as_tensor(x).reshape(-1) for x in v])
            for k, v in fields.items()
        }
        return cls(tokens, offsets, group_ids=group_ids, **flat).check(vocab_size)

    # ------------------------------------------------------------------ out
    def _per_target(self, values: torch.Tensor, field: str) -> torch.Tensor:
        v = torch.as_tensor(values)
        if v.dim() != 1 or v.numel() != self.num_targets:
            raise InvalidInputError(
                field, f"expected {self.num_targets} per-target entries, got {tuple(v.shape)}"
            )
        return v

    def to_lists(self, values: torch.Tensor, field: str = "values") -> list[list[float]]:
        """Per-target ``values`` [P] as one list of ``L_i - 1`` values per trajectory."""
        v = self._per_target(values, field).detach().cpu().tolist()
        o = self.target_offsets
        return [v[o[i] : o[i + 1]] for i in range(self.num_trajectories)]

    def to_jagged(self, values: torch.Tensor, fill: float = 0.0, field: str = "values") -> torch.Tensor:
        """Per-target ``values`` [P] as a jagged ``torch.nested`` tensor of ``L_i`` token-aligned
        values per trajectory (position 0 holds ``fill``)."""
        v = self._per_target(values, field)
        o = self.target_offsets
        rows = [torch.cat([v.new_full((1,), fill), v[o[i] : o[i + 1]]]) for i in range(self.num_trajectories)]
        return torch.nested.nested_tensor(rows, layout=torch.jagged)

    def to_padded(
        self, values: torch.Tensor, attention_mask: torch.Tensor, fill: float = 0.0, field: str = "values"
    ) -> torch.Tensor:
        """Per-target ``values`` [P] in the ``[B, L]`` frame of ``attention_mask`` (the one these
        rollouts came from), token-aligned; padding and each row's first position hold ``fill``."""
        v = self._per_target(values, field)
        am = torch.as_tensor(attention_mask).bool()
        if am.shape[0] != self.num_trajectories:
            raise InvalidInputError(
                "attention_mask", f"expected {self.num_trajectories} rows, got {am.shape[0]}"
            )
        out = v.new_full(tuple(am.shape), fill)
        o = self.target_offsets
        for b in range(am.shape[0]):
            on = am[b].nonzero().flatten()
            lo = int(on[0])
            n = int(o[b + 1] - o[b])
            out[b, lo + 1 : lo + 1 + n] = v[o[b] : o[b + 1]]
        return out

    # ------------------------------------------------------------------ HARTS
    def batch(self):
        """The ``harts_planner.RolloutBatch`` of the token ids (HARTS's ingestion finds the trees).
        Token ids are int32 there: one at or above 2^31 (or below 0) raises
        :class:`InvalidInputError` naming it, never wrapped (2^32 + 5 is not read as 5)."""
        from harts_planner.batch import RolloutBatch

        check_token_range(np.asarray(self.tokens), np.asarray(self.offsets), None, "tokens")
        return RolloutBatch.from_arrays(self.tokens.astype(np.int32), self.offsets)

    def checked_step_inputs(self, vocab_size: int, objective: str = "grpo", loss_config=None):
        """:meth:`check` against the model's vocabulary, then :meth:`step_inputs` of the checked
        fields without checking them again: a step's one check of its rollouts (the engine's,
        :meth:`HartsEngine.step_inputs <harts_runtime.engine.HartsEngine.step_inputs>`). The
        :class:`~harts_runtime.step_inputs.StepInputs` records its fields as checked; one edited in
        place through torch afterwards is checked again when the engine next takes it."""
        from harts_planner.batch import RolloutBatch

        self.check(vocab_size)
        if vocab_size > TOKEN_LIMIT:  # the int32 range is not implied by the vocabulary's
            batch = self.batch()
        else:
            batch = RolloutBatch.from_arrays(self.tokens.astype(np.int32), self.offsets)
        return self._step_inputs(objective, loss_config, batch, vocab_size)

    def step_inputs(self, objective: str = "grpo", loss_config=None, batch=None):
        """A :class:`~harts_runtime.step_inputs.StepInputs` of these rollouts (missing fields: zero
        advantages, all-ones mask, old log-probs 0, no reference), checked as it is built."""
        return self._step_inputs(objective, loss_config, batch, None)

    def _step_inputs(self, objective, loss_config, batch, checked_vocab):
        from harts_runtime.step_inputs import StepInputs

        p = self.num_targets
        zeros = torch.zeros(p)
        return StepInputs(
            batch if batch is not None else self.batch(),
            self.advantages if self.advantages is not None else zeros,
            self.loss_mask if self.loss_mask is not None else torch.ones(p, dtype=torch.bool),
            self.old_logprobs if self.old_logprobs is not None else zeros,
            self.ref_logprobs,
            self.group_ids,
            objective,
            loss_config,
            behaviour_logprobs=self.behaviour_logprobs,
            weight_versions=self.weight_versions,
            routes=self.routes,
            _checked_vocab=checked_vocab,
        )
