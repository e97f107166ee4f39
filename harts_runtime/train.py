"""One RL train step over a rollout batch, compact (HARTS) or trajectory-wise (baseline).

Both executions run the same model, the same per-token objective and the same step metadata:

* ``mode="compact"`` (HARTS): ``harts_planner.plan_step`` -> per microbatch ``plan_calls`` ->
  :func:`compact_microbatch` (physical rows, KDA rounds, ancestor-KV views, multiplicities) ->
  model forward on compact rows -> mapped log-probs in original batch order -> unchanged
  GRPO/PPO loss -> backward;
* ``mode="trajectory"`` (baseline): every root-to-leaf trajectory expanded and packed as ordinary
  varlen sequences into microbatches of at most ``capacity`` rows (:func:`pack_trajectories`),
  the same modules with trivial plans (:func:`trajectory_microbatch`), the same loss.

Loss-normalisation contract (what data parallelism builds on)
-------------------------------------------------------------
The step loss is ``L = L_policy + L_router``. Every denominator is a *step-level* constant,
computed once from the whole step's metadata in :class:`StepInputs` (``loss_weights``):

* ``L_policy = sum_t w_t * l_t`` over all non-terminal semantic positions ``t`` of the step, where
  ``l_t`` is the per-token clipped surrogate plus ``kl_coef`` times the KL estimate and
  ``w_t`` the aggregation weight of ``loss_agg_mode`` (``token-mean``: ``m_t / sum(m)``;
  ``seq-mean-token-mean``: ``m_t / (n_i * #active trajectories)``; ``seq-mean-token-sum``:
  ``m_t / N``; ``seq-mean-token-sum-norm``: ``m_t / norm``; ``sum``: ``m_t``). This equals the
  unchanged :func:`harts_runtime.objectives.policy_loss` on the whole step (tested).
* ``L_router = sum over microbatches (S_mb / S) * router_mb``, ``router_mb`` the MoE layers'
  multiplicity-weighted ``aux_coef * aux + z_coef * z`` of the microbatch, ``S_mb`` its semantic
  tokens and ``S`` the step's. The z-loss part is then exactly the step-level token mean; the
  load-balancing part, as in Megatron, is per microbatch and depends on microbatch membership.

:func:`run_microbatch` returns the microbatch's share of ``L`` and backpropagates it, so summing
contributions (and gradients) over the step's microbatches, in any order and any grouping over
processes, gives exactly the single-process step loss and gradients (up to float summation order).

Timing (Section 5.3): ``plan_seconds`` is planner time (``plan_step`` and every ``plan_calls``);
``fbg_seconds`` is the F/B/Grad interval once plans exist (layout materialisation, forward,
log-probs, loss, backward; no optimizer update); ``core_seconds = plan_seconds + fbg_seconds``.

Command line: ``harts-train`` / ``python -m harts_runtime.train`` (see :func:`main`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.profiler

from harts_runtime.kda import KDAExecutionPlan
from harts_runtime.model import HybridModel, ModelConfig, RowLayout, lm_chunks, model_config
from harts_runtime.objectives import AGG_MODES, PolicyLossConfig, grpo_advantages, per_token, policy_loss
from harts_runtime.views import Branches, TreeOrder, build_views

__all__ = [
    "MODES",
    "Microbatch",
    "StepInputs",
    "StepInputsError",
    "StepResult",
    "compact_microbatch",
    "forward_microbatch",
    "loss_weights",
    "main",
    "pack_trajectories",
    "run_microbatch",
    "step_logprobs",
    "train_step",
    "trajectory_microbatch",
]

MODES = ("compact", "trajectory")


class StepInputsError(ValueError):
    """Bad step inputs or train-step arguments; ``.field`` names the offending field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


# ------------------------------------------------------------------------------ step inputs
def _expand_ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(lo[i], hi[i])`` (int64), without a Python loop."""
    lo = np.asarray(lo, dtype=np.int64)
    lengths = np.asarray(hi, dtype=np.int64) - lo
    total = int(lengths.sum())
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return np.arange(total, dtype=np.int64) - np.repeat(starts - lo, lengths)


def loss_weights(
    mask: torch.Tensor, cu_seqlens: torch.Tensor, mode: str, norm: float | None = None
) -> torch.Tensor:
    """Step-level aggregation weights ``w`` [P] with ``aggregate(l, mask, cu, mode) == sum(w * l)``."""
    m = mask.to(torch.float64)
    cu = cu_seqlens.long()
    if mode == "token-mean":
        return m / m.sum().clamp_min(1.0)
    if mode == "sum":
        return m
    if mode == "seq-mean-token-sum-norm":
        return m / (float(cu.diff().max()) if norm is None else float(norm))
    n = cu.numel() - 1
    if mode == "seq-mean-token-sum":
        return m / max(n, 1)
    if mode == "seq-mean-token-mean":
        seq = torch.repeat_interleave(torch.arange(n), cu.diff())
        count = torch.zeros(n, dtype=torch.float64).index_add(0, seq, m)
        active = int((count > 0).sum())
        return torch.where(count[seq] > 0, m / count[seq].clamp_min(1.0) / max(active, 1), 0.0)
    raise StepInputsError("loss_agg_mode", f"unknown {mode!r}; choose one of {AGG_MODES}")


@dataclass
class StepInputs:
    """A rollout batch plus per-token RL metadata, in original batch order.

    Per-token tensors have one entry per *non-terminal* semantic position (``P = S - N``): the
    positions ``0 .. len_i - 2`` of trajectory 0, then trajectory 1, ... (the order of
    :func:`harts_runtime.logprobs.targets_from_batch`); entry ``t`` scores the next token.
    """

    batch: object
    """harts_planner.RolloutBatch."""
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
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        b = self.batch
        if not hasattr(b, "compact_map") or not hasattr(b, "segment_row_begin"):
            raise StepInputsError("batch", f"must be a harts_planner.RolloutBatch, got {type(b).__name__}")
        n = b.num_trajectories
        p = b.semantic_tokens - n
        for name in ("advantages", "loss_mask", "old_logprobs", "ref_logprobs"):
            t = getattr(self, name)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != p:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise StepInputsError(name, f"expected a 1-D tensor of P = S - N = {p} entries, got {shape}")
        if self.group_ids is not None and self.group_ids.numel() != n:
            raise StepInputsError("group_ids", f"expected {n} entries, got {self.group_ids.numel()}")
        if self.objective not in ("grpo", "ppo"):
            raise StepInputsError("objective", f"choose grpo or ppo, got {self.objective!r}")
        if self.config.kl_coef and self.ref_logprobs is None:
            raise StepInputsError("ref_logprobs", "required when kl_coef != 0")

    # ------------------------------------------------------------------ derived (cached)
    @property
    def config(self) -> PolicyLossConfig:
        """The effective policy-loss config."""
        if self.loss_config is not None:
            return self.loss_config
        if self.objective == "grpo":
            return PolicyLossConfig(kl_coef=0.001, loss_agg_mode="seq-mean-token-mean")
        return PolicyLossConfig(clip_ratio_c=3.0, loss_agg_mode="token-mean")

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
        """float32 [P] step-level aggregation weights (:func:`loss_weights`), computed once."""
        if "weights" not in self._cache:
            cfg = self.config
            self._cache["weights"] = loss_weights(
                self.loss_mask.cpu(), self.cu_seqlens, cfg.loss_agg_mode, cfg.loss_norm
            ).float()
        return self._cache["weights"]

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
                "weights": mv(self.weights),
            }
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


# ------------------------------------------------------------------------------ microbatches
@dataclass
class Microbatch:
    """One microbatch ready to run: its rows and its slice of the step's per-token entries."""

    mode: str
    trajectories: np.ndarray  # [k] trajectory ids
    layout: RowLayout  # rows on the device
    row_index: torch.Tensor  # [P_mb] row of each target
    labels: torch.Tensor  # [P_mb] next token
    target_index: torch.Tensor  # [P_mb] index into the step's per-token tensors
    lm_order: torch.Tensor  # [P_mb] targets sorted by row (LM-head chunks)
    lm_bounds: list  # target range of every LM-head row chunk
    cu_local: torch.Tensor  # [k + 1] per-token boundaries of the microbatch (int64)
    semantic_tokens: int  # S_mb
    stats: dict

    @property
    def num_rows(self) -> int:
        return self.layout.num_rows


def _targets(step: StepInputs, traj: np.ndarray, row_of_semantic: np.ndarray):
    """Targets of the microbatch's trajectories (in ``traj`` order): row, label, step index."""
    off = np.asarray(step.batch.offsets, dtype=np.int64)
    lengths = off[traj + 1] - off[traj]
    glob = _expand_ranges(off[traj], off[traj + 1])  # [S_mb] batch semantic index
    local_off = np.zeros(len(traj) + 1, dtype=np.int64)
    np.cumsum(lengths, out=local_off[1:])
    keep = np.ones(len(glob), dtype=bool)
    keep[local_off[1:] - 1] = False  # terminal positions
    tokens = np.asarray(step.batch.tokens, dtype=np.int64)
    traj_rep = np.repeat(traj.astype(np.int64), lengths)
    row_index = row_of_semantic[keep]
    labels = tokens[glob[keep] + 1]
    target_index = glob[keep] - traj_rep[keep]  # offsets[i] + p - i
    cu_local = local_off - np.arange(len(local_off), dtype=np.int64)
    return glob, local_off, row_index, labels, target_index, cu_local


def _finish(mode, step, traj, layout, row_index, labels, target_index, cu_local, s_mb, stats, cfg, device):
    order, bounds = lm_chunks(row_index, layout.num_rows, cfg.lm_head_rows)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device, non_blocking=True)
    return Microbatch(
        mode,
        traj,
        layout.to(device),
        t(row_index),
        t(labels),
        t(target_index),
        order.to(device, non_blocking=True),
        bounds,
        torch.from_numpy(cu_local),
        s_mb,
        stats,
    )


def compact_microbatch(step: StepInputs, call_plan, cfg: ModelConfig, device="cpu") -> Microbatch:
    """Materialise a microbatch's compact physical rows from its ``harts_planner.CallPlan``.

    Builds (host, numpy; then one move to ``device``): the token and position of every physical
    row, the parent row in physical numbering, ancestor-KV views with one branch per packed
    sequence, the KDA execution plan, per-row multiplicities and the mapped targets.
    """
    if call_plan.chunk_size != cfg.chunk_size or call_plan.conv_width != cfg.conv_size:
        raise StepInputsError(
            "call_plan",
            f"chunk/conv {call_plan.chunk_size}/{call_plan.conv_width} != model "
            f"{cfg.chunk_size}/{cfg.conv_size}",
        )
    batch = step.batch
    c = int(call_plan.compact_tokens)
    g = np.asarray(call_plan.physical_to_global, dtype=np.int64)  # [C] batch row
    r2g = np.asarray(call_plan.row_to_global, dtype=np.int64)  # increasing
    r2p = np.asarray(call_plan.row_to_physical, dtype=np.int64)
    gp = np.asarray(batch.row_parent, dtype=np.int64)[g]
    parent = np.where(gp < 0, -1, r2p[np.minimum(np.searchsorted(r2g, gp), c - 1)])
    tree = TreeOrder(step.tree.pre[g], step.tree.end[g])
    sp = np.asarray(call_plan.sequence_physical_offsets, dtype=np.int64)
    views = build_views(parent, Branches(np.arange(c, dtype=np.int64), sp), tree)
    kda = KDAExecutionPlan.from_call_plan(call_plan)
    traj = np.asarray(call_plan.trajectories, dtype=np.int64)
    s2p = np.asarray(call_plan.semantic_to_physical, dtype=np.int64)
    glob, _, row_index, labels, target_index, cu_local = _targets(step, traj, s2p)
    mult = np.bincount(s2p, minlength=c).astype(np.float32)
    layout = RowLayout(
        torch.from_numpy(step.row_token[g]),
        torch.from_numpy(np.asarray(call_plan.position_ids, dtype=np.int64)),
        torch.from_numpy(mult),
        kda,
        views,
    )
    stats = {
        "rows": c,
        "semantic_tokens": len(glob),
        "replay_tokens": int(call_plan.replay_tokens),
        "num_calls": int(call_plan.num_calls),
        "sequences": int(call_plan.num_sequences),
        "kv_len": int(views.kv_index.numel()),
    }
    return _finish(
        "compact",
        step,
        traj,
        layout,
        row_index,
        labels,
        target_index,
        cu_local,
        len(glob),
        stats,
        cfg,
        device,
    )


def trajectory_microbatch(step: StepInputs, trajectories, cfg: ModelConfig, device="cpu") -> Microbatch:
    """The baseline's microbatch: the trajectories expanded and packed back to back (rows =
    semantic positions), one KDA call from zero states, attention views without ancestors."""
    traj = np.asarray(trajectories, dtype=np.int64)
    off = np.asarray(step.batch.offsets, dtype=np.int64)
    lengths = off[traj + 1] - off[traj]
    s = int(lengths.sum())
    local_row = np.arange(s, dtype=np.int64)
    glob, local_off, row_index, labels, target_index, cu_local = _targets(step, traj, local_row)
    starts = np.repeat(local_off[:-1], lengths)
    parent = np.where(local_row == starts, -1, local_row - 1)
    tree = TreeOrder(local_row, np.repeat(local_off[1:], lengths))
    views = build_views(parent, Branches(local_row, local_off), tree)
    kda = KDAExecutionPlan.trivial(local_off, cfg.chunk_size, cfg.conv_size)
    tokens = np.asarray(step.batch.tokens, dtype=np.int64)
    layout = RowLayout(
        torch.from_numpy(tokens[glob]),
        torch.from_numpy(local_row - starts),
        torch.ones(s, dtype=torch.float32),
        kda,
        views,
    )
    stats = {
        "rows": s,
        "semantic_tokens": s,
        "replay_tokens": 0,
        "num_calls": 1,
        "sequences": len(traj),
        "kv_len": s,
    }
    return _finish(
        "trajectory", step, traj, layout, row_index, labels, target_index, cu_local, s, stats, cfg, device
    )


def pack_trajectories(lengths, capacity: int) -> list[np.ndarray]:
    """The baseline's packing: first-fit decreasing of whole trajectories into microbatches of at
    most ``capacity`` rows. Returns trajectory ids per microbatch (ascending ids inside each)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and int(lengths.max()) > capacity:
        j = int(np.argmax(lengths))
        raise StepInputsError(f"trajectories[{j}]", f"length {int(lengths[j])} exceeds capacity {capacity}")
    order = np.argsort(-lengths, kind="stable")
    remaining = np.zeros(0, dtype=np.int64)
    members: list[list[int]] = []
    for i in order.tolist():
        fits = np.nonzero(remaining >= lengths[i])[0]
        if fits.size:
            b = int(fits[0])
        else:
            b = len(members)
            remaining = np.append(remaining, capacity)
            members.append([])
        remaining[b] -= lengths[i]
        members[b].append(i)
    return [np.sort(np.asarray(m, dtype=np.int64)) for m in members]


def _make_microbatch(model, step, traj_indices, mode, call_plan=None) -> Microbatch:
    with torch.profiler.record_function("harts.layout"):
        return _make_microbatch_impl(model, step, traj_indices, mode, call_plan)


def _make_microbatch_impl(model, step, traj_indices, mode, call_plan=None) -> Microbatch:
    cfg = model.config
    if mode == "compact":
        if call_plan is None:
            from harts_planner import plan_calls

            call_plan = plan_calls(
                step.batch, cfg.chunk_size, trajectories=np.asarray(traj_indices), conv_width=cfg.conv_size
            )
        return compact_microbatch(step, call_plan, cfg, model.device)
    if mode == "trajectory":
        return trajectory_microbatch(step, traj_indices, cfg, model.device)
    raise StepInputsError("mode", f"unknown {mode!r}; choose one of {MODES}")


# ------------------------------------------------------------------------------ the step
def forward_microbatch(
    model: HybridModel, mb: Microbatch, *, recompute: bool = False, no_replay: bool = False
):
    """Forward of one microbatch: ``(hidden [N, D], logprobs float32 [P_mb], router_loss)``."""
    hidden, router = model.forward_hidden(mb.layout, recompute=recompute, no_replay=no_replay)
    lp = model.logprobs(hidden, mb.row_index, mb.labels, (mb.lm_order, mb.lm_bounds))
    return hidden, lp, router


def run_microbatch(
    model: HybridModel,
    step: StepInputs,
    traj_indices=None,
    mode: str = "compact",
    recompute: bool = False,
    *,
    call_plan=None,
    microbatch: Microbatch | None = None,
    no_replay: bool = False,
    backward: bool = True,
    return_hidden: bool = False,
):
    """Forward and backward of one microbatch; returns ``(loss_contribution, stats)``.

    Parameters
    ----------
    traj_indices : array_like of int
        The microbatch's trajectory ids (ignored when ``microbatch`` is given).
    mode : ``"compact"`` or ``"trajectory"``
    recompute : bool
        Full-layer activation recomputation.
    call_plan : harts_planner.CallPlan, optional
        Precomputed plan of these trajectories (compact mode; planned here when None).
    microbatch : Microbatch, optional
        A prebuilt microbatch (from :func:`compact_microbatch` / :func:`trajectory_microbatch`).
    backward : bool
        Backpropagate the contribution (gradients accumulate into ``.grad``).
    return_hidden : bool
        Also return the final normed hidden rows (detached) as ``stats["hidden"]`` with
        ``stats["row_index"]`` (evaluation).

    Returns
    -------
    loss_contribution : Tensor, float32 scalar, detached
        This microbatch's share of the step loss under the step-level normalisation of the module
        docstring; contributions of a step's microbatches sum to the step loss.
    stats : dict
        ``policy_loss``, ``router_loss`` (contributions), ``rows``, ``semantic_tokens``,
        ``replay_tokens``, ``num_calls``, ``logprobs`` (detached [P_mb]) and ``target_index``
        ([P_mb], into the step's per-token tensors).
    """
    if mode not in MODES:
        raise StepInputsError("mode", f"unknown {mode!r}; choose one of {MODES}")
    mb = (
        microbatch if microbatch is not None else _make_microbatch(model, step, traj_indices, mode, call_plan)
    )
    meta = step.device_metadata(model.device)
    hidden, lp, router = forward_microbatch(model, mb, recompute=recompute, no_replay=no_replay)
    ti = mb.target_index
    ref = meta["ref_logprobs"]
    cfg = dataclasses.replace(step.config, loss_agg_mode="sum", loss_norm=None)
    pol, _ = policy_loss(
        lp,
        meta["old_logprobs"][ti],
        meta["advantages"][ti],
        meta["weights"][ti],
        mb.cu_local.to(lp.device),
        cfg,
        None if ref is None else ref[ti],
    )
    rl = router * (mb.semantic_tokens / step.batch.semantic_tokens)
    loss = pol + rl
    if backward:
        loss.backward()
    stats = dict(
        mb.stats, policy_loss=pol.detach(), router_loss=rl.detach(), logprobs=lp.detach(), target_index=ti
    )
    if return_hidden:
        stats.update(hidden=hidden.detach(), row_index=mb.row_index, labels=mb.labels)
    return loss.detach(), stats


@dataclass
class StepResult:
    """What one :func:`train_step` did and how long it took."""

    loss: float
    policy_loss: float
    router_loss: float
    mode: str
    recompute: bool
    num_microbatches: int
    semantic_tokens: int
    rows: int
    """Non-replay rows executed (compact rows summed over microbatches; S for the baseline)."""
    replay_tokens: int
    num_calls: int
    """KDA packed calls per KDA layer, summed over microbatches."""
    plan_seconds: float
    fbg_seconds: float
    optimizer_seconds: float

    @property
    def compression(self) -> float:
        """Non-replay row compression ``S / rows``."""
        return self.semantic_tokens / max(self.rows, 1)

    @property
    def core_seconds(self) -> float:
        return self.plan_seconds + self.fbg_seconds

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(compression=self.compression, core_seconds=self.core_seconds)
        return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plan_microbatches(step: StepInputs, mode: str, capacity: int, cfg: ModelConfig, step_plan=None):
    """The step's microbatches: ``(list of trajectory-id arrays, list of CallPlan or None, seconds)``.
    Compact: ``plan_step`` (D = 1) and every ``plan_calls`` (timed: planner time). Trajectory:
    :func:`pack_trajectories` (not planner time; seconds reported as 0)."""
    if mode == "trajectory":
        lengths = np.asarray(step.batch.lengths, dtype=np.int64)
        return pack_trajectories(lengths, capacity), [None] * 0, 0.0
    if mode != "compact":
        raise StepInputsError("mode", f"unknown {mode!r}; choose one of {MODES}")
    from harts_planner import plan_calls, plan_step

    t0 = time.perf_counter()
    if step_plan is None:
        step_plan = plan_step(step.batch, 1, capacity, cfg.chunk_size)
    mbs = [np.asarray(m, dtype=np.int64) for m in step_plan.microbatches]
    plans = [plan_calls(step.batch, cfg.chunk_size, trajectories=m, conv_width=cfg.conv_size) for m in mbs]
    return mbs, plans, time.perf_counter() - t0


def train_step(
    model: HybridModel,
    optimizer,
    step: StepInputs,
    step_plan=None,
    mode: str = "compact",
    recompute: bool = False,
    *,
    capacity: int = 65_536,
    no_replay: bool = False,
    progress=None,
) -> StepResult:
    """One optimizer step over the whole batch.

    ``zero_grad`` -> plan (compact: ``step_plan`` or ``plan_step(batch, 1, capacity)``, then
    ``plan_calls`` per microbatch; trajectory: first-fit-decreasing packing at ``capacity``) ->
    for each microbatch :func:`run_microbatch` -> ``optimizer.step()`` (skipped when ``optimizer``
    is None) -> MoE expert-bias update. ``progress(done, total)`` is called after each microbatch.
    """
    dev = model.device
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    mbs, plans, plan_s = plan_microbatches(step, mode, capacity, model.config, step_plan)
    _sync(dev)
    t0 = time.perf_counter()
    total = torch.zeros((), device=dev)
    pol = torch.zeros((), device=dev)
    rl = torch.zeros((), device=dev)
    rows = replay = calls = 0
    for i, traj in enumerate(mbs):
        mb = _make_microbatch(model, step, traj, mode, plans[i] if plans else None)
        loss, st = run_microbatch(
            model, step, mode=mode, recompute=recompute, microbatch=mb, no_replay=no_replay
        )
        total += loss
        pol += st["policy_loss"]
        rl += st["router_loss"]
        rows += st["rows"]
        replay += st["replay_tokens"]
        calls += st["num_calls"]
        if progress is not None:
            progress(i + 1, len(mbs))
    _sync(dev)
    fbg = time.perf_counter() - t0
    t1 = time.perf_counter()
    if optimizer is not None:
        optimizer.step()
        model.update_expert_bias()
    _sync(dev)
    return StepResult(
        float(total),
        float(pol),
        float(rl),
        mode,
        recompute,
        len(mbs),
        step.batch.semantic_tokens,
        rows,
        replay,
        calls,
        plan_s,
        fbg,
        time.perf_counter() - t1,
    )


@torch.no_grad()
def step_logprobs(
    model: HybridModel,
    step: StepInputs,
    mode: str = "compact",
    capacity: int = 65_536,
    no_replay: bool = False,
) -> torch.Tensor:
    """Current log-probs of every target of the step, float32 [P] in original batch order (no grad)."""
    mbs, plans, _ = plan_microbatches(step, mode, capacity, model.config)
    out = torch.empty(
        step.num_targets,
        device=model.device,
        dtype=torch.float64 if model.config.dtype == "float64" else torch.float32,
    )
    for i, traj in enumerate(mbs):
        mb = _make_microbatch(model, step, traj, mode, plans[i] if plans else None)
        _, lp, _ = forward_microbatch(model, mb, no_replay=no_replay)
        out[mb.target_index] = lp
    return out


# ------------------------------------------------------------------------------ command line
def _synthetic_step(preset: str, seed: int, vocab: int, max_len: int | None, objective: str) -> StepInputs:
    from harts_planner import RolloutBatch, synth

    over = {"vocab_size": vocab}
    if max_len is not None:
        over["max_trajectory_tokens"] = max_len
    sb = synth.generate(preset, seed, **over)
    batch = RolloutBatch.from_arrays(sb.tokens, sb.offsets, sb.tree_ids)
    return StepInputs.synthetic(batch, seed, objective, vocab_size=vocab)


def main(argv=None) -> int:
    """``harts-train``: train steps on a synthetic rollout batch and print one line per step."""
    from harts_planner._progress import Progress

    ap = argparse.ArgumentParser(prog="harts-train", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--flavor", default=None, help="model flavor: debug (CPU default) or ling-tiny (CUDA default)"
    )
    ap.add_argument(
        "--layers", type=int, default=None, help="keep the first N layers of the flavor's pattern"
    )
    ap.add_argument(
        "--preset", default="small", help="harts_planner.synth preset (tiny, small, medium, swe-like)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="cap trajectory length (default: 1024 on CPU, the preset's on CUDA)",
    )
    ap.add_argument("--mode", choices=MODES + ("both",), default="compact")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--capacity", type=int, default=None, help="T: rows per microbatch (CPU 4096, CUDA 65536)"
    )
    ap.add_argument("--recompute", action="store_true", help="full-layer activation recomputation")
    ap.add_argument("--objective", choices=("grpo", "ppo"), default="grpo")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", action="store_true", help="print one JSON object per step instead")
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    cpu = dev.type == "cpu"
    flavor = args.flavor or ("debug" if cpu else "ling-tiny")
    cfg = model_config(flavor, args.layers)
    max_len = args.max_len if args.max_len is not None else (1024 if cpu else None)
    capacity = args.capacity or (4096 if cpu else 65_536)
    torch.manual_seed(args.seed)
    t = time.perf_counter()
    step = _synthetic_step(args.preset, args.seed, cfg.vocab_size, max_len, args.objective)
    b = step.batch
    print(
        f"batch: preset={args.preset} seed={args.seed} trajectories={b.num_trajectories} S={b.semantic_tokens:,} "
        f"C={b.compact_tokens:,} S/C={b.compression:.2f} ({time.perf_counter() - t:.2f}s)",
        file=sys.stderr,
    )
    model = HybridModel(cfg, device=dev)
    print(
        f"model: {flavor} layers={cfg.num_layers} params={sum(p.numel() for p in model.parameters()):,} "
        f"dtype={cfg.dtype} device={dev}",
        file=sys.stderr,
    )
    modes = MODES if args.mode == "both" else (args.mode,)
    # "both": two identical copies of the model, each with its own optimizer, so that every step
    # of the compact and the trajectory execution starts from the same weights and the two loss
    # curves can be compared step by step (they agree to float rounding: the same math).
    models = {m: (model if k == 0 else copy.deepcopy(model)) for k, m in enumerate(modes)}
    opts = {m: torch.optim.AdamW(models[m].parameters(), lr=args.lr) for m in modes}
    for i in range(args.steps):
        losses = {}
        for mode in modes:
            bar = Progress(f"step {i} {mode[:4]}", enabled=not args.json)
            r = train_step(
                models[mode], opts[mode], step, None, mode, args.recompute, capacity=capacity, progress=bar
            )
            bar.close()
            losses[mode] = r.loss
            if args.json:
                print(json.dumps(dict(r.to_dict(), step=i)))
            else:
                print(
                    f"step {i} {mode:<10} tokens={r.semantic_tokens:,} rows={r.rows:,} "
                    f"compression={r.compression:.2f}x microbatches={r.num_microbatches} calls={r.num_calls} "
                    f"replay={r.replay_tokens:,} plan={r.plan_seconds * 1e3:.1f}ms "
                    f"fbg={r.fbg_seconds:.2f}s loss={r.loss:.6f}"
                )
        if len(losses) == 2 and not args.json:
            print(
                f"step {i} |loss(compact) - loss(trajectory)| = {abs(losses['compact'] - losses['trajectory']):.3e}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
