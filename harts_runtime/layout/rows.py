"""Rows of one microbatch: what every layer reads (:class:`RowLayout`) and what the loss reads
(:class:`Microbatch`), for both executions of the train step.

* compact (HARTS, :func:`compact_microbatch`): the rows are the compact physical rows of the
  microbatch's call plan (any :class:`~harts_runtime.layout.contract.CallLayoutArrays`); KDA runs
  the plan's rounds, full attention reads ancestor-KV views with one branch per packed sequence,
  and each row carries its multiplicity (the semantic positions that share it);
* trajectory (baseline, :func:`trajectory_microbatch`): the microbatch's trajectories expanded and
  packed back to back (rows = semantic positions); one KDA call from zero states, attention views
  without ancestors, multiplicities 1.

Everything is built on the host (numpy) in O(C + S + |KV|) and moved to the device once
(:meth:`RowLayout.to`); all layers and their recomputation share it.

Targets: every non-terminal semantic position ``t`` of the microbatch's trajectories scores the
next token. :func:`microbatch_targets` gives, in the order of the microbatch's trajectories, the row
that scores it, its label and its index into the step's per-token tensors (original batch order:
trajectory ``i`` owns ``[offsets[i] - i, offsets[i + 1] - i - 1)``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.contract import CallLayoutArrays, check_call_layout
from harts_runtime.layout.kda_plan import KDAExecutionPlan
from harts_runtime.layout.views import AttentionViews, Branches, TreeOrder, build_views, expand_ranges

if TYPE_CHECKING:
    from harts_planner.batch import RolloutBatch

__all__ = [
    "MODES",
    "Microbatch",
    "RowLayout",
    "RowShape",
    "StepRows",
    "compact_layout",
    "compact_microbatch",
    "lm_chunks",
    "microbatch_targets",
    "pack_trajectories",
    "trajectory_layout",
    "trajectory_microbatch",
]


class RowShape(Protocol):
    """The model-config fields the rows are built for (a
    :class:`~harts_runtime.models.hybrid.args.ModelConfig` has them; this package imports no model
    code): the KDA chunk size, the causal-convolution width and the rows per LM-head chunk."""

    chunk_size: int
    conv_size: int
    lm_head_rows: int


class StepRows(Protocol):
    """What the microbatch builders read of a step (a :class:`harts_runtime.step_inputs.StepInputs`
    has it; this package does not import it): the ``harts_planner.RolloutBatch``, its
    :class:`TreeOrder` and the token of every batch compact row (int64 [C_batch])."""

    @property
    def batch(self) -> RolloutBatch: ...

    @property
    def tree(self) -> TreeOrder: ...

    @property
    def row_token(self) -> np.ndarray: ...


MODES = ("compact", "trajectory")
"""The two executions of a microbatch."""


@dataclass
class RowLayout:
    """Everything the layers need about one microbatch's ``N`` rows (compact physical rows, or
    expanded trajectory rows); every mixer and FFN is called as ``forward(x [N, D], layout)``.

    A layer reads only the fields it needs (KDA: ``kda``, ``no_replay``; attention: ``views``,
    ``positions``; MoE: ``multiplicity``), so a layout for one layer may leave the others None;
    :meth:`need` raises a clear error for a missing one.
    """

    num_rows: int
    """N."""
    input_ids: torch.Tensor | None = None
    """int64 [N]: token of each row (the embedding's input)."""
    positions: torch.Tensor | None = None
    """int64 [N]: absolute trajectory position of each row (RoPE)."""
    multiplicity: torch.Tensor | None = None
    """float32 [N]: semantic positions per row (MoE statistics); None weights every row once."""
    kda: KDAExecutionPlan | None = None
    """KDA rounds (trivial: one packed call) and convolution windows."""
    views: AttentionViews | None = None
    """Full-attention Q / ancestor-KV views."""
    no_replay: bool = False
    """Run KDA's no-replay schedule (the Section 5.4 ablation) instead of the replay rounds."""
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("input_ids", "positions", "multiplicity"):
            t = getattr(self, name)
            if t is not None and t.numel() != self.num_rows:
                raise InvalidInputError(f"layout.{name}", f"needs {self.num_rows} entries, got {t.numel()}")
        if self.kda is not None and self.kda.num_rows != self.num_rows:
            raise InvalidInputError(
                "layout.kda", f"plans {self.kda.num_rows} rows, the layout has {self.num_rows}"
            )
        if self.views is not None and self.views.num_rows != self.num_rows:
            raise InvalidInputError(
                "layout.views", f"index {self.views.num_rows} rows, the layout has {self.num_rows}"
            )

    def need(self, name: str):
        """The field ``name``; raises :class:`InvalidInputError` (``field="layout.<name>"``) if it is None."""
        value = getattr(self, name)
        if value is None:
            raise InvalidInputError(
                f"layout.{name}", f"required by this layer; this {self.num_rows}-row layout has none"
            )
        return value

    def replace(self, **changes) -> RowLayout:
        """A copy with some fields changed (tensors shared), e.g. ``replace(no_replay=True)``."""
        return dataclasses.replace(self, **changes)

    def to(self, device) -> RowLayout:
        """The same layout with every tensor on ``device`` (non-blocking copies)."""
        mv = lambda t: None if t is None else t.to(device, non_blocking=True)
        return RowLayout(
            self.num_rows,
            mv(self.input_ids),
            mv(self.positions),
            mv(self.multiplicity),
            None if self.kda is None else self.kda.to(device),
            None if self.views is None else self.views.to(device),
            self.no_replay,
            dict(self.info),
        )


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


def lm_chunks(row_index: np.ndarray, num_rows: int, rows_per_chunk: int):
    """Host precomputation for the chunked LM-head log-probs
    (:func:`harts_runtime.loss.logprobs.lm_head_logprobs`): targets sorted by row and the target
    range of every row chunk. Returns ``(order int64 Tensor [P], bounds list[int])``; O(P log P)."""
    row_index = np.asarray(row_index, dtype=np.int64)
    order = np.argsort(row_index, kind="stable")
    edges = np.arange(0, num_rows + rows_per_chunk, rows_per_chunk)
    bounds = np.searchsorted(row_index[order], edges, side="left").tolist()
    return torch.from_numpy(order), bounds


def microbatch_targets(batch, traj: np.ndarray, row_of_semantic: np.ndarray):
    """Targets of the trajectories ``traj`` of a ``harts_planner.RolloutBatch``, in ``traj`` order.

    ``row_of_semantic`` [S_mb]: the row of every semantic position of the microbatch (trajectory by
    trajectory). Returns ``(glob [S_mb] batch semantic index, local_off [k + 1], row_index [P_mb],
    labels [P_mb], target_index [P_mb], cu_local [k + 1])``, all int64; O(S_mb).
    """
    off = np.asarray(batch.offsets, dtype=np.int64)
    lengths = off[traj + 1] - off[traj]
    glob = expand_ranges(off[traj], off[traj + 1])  # [S_mb] batch semantic index
    local_off = np.zeros(len(traj) + 1, dtype=np.int64)
    np.cumsum(lengths, out=local_off[1:])
    keep = np.ones(len(glob), dtype=bool)
    keep[local_off[1:] - 1] = False  # terminal positions
    tokens = np.asarray(batch.tokens, dtype=np.int64)
    traj_rep = np.repeat(traj.astype(np.int64), lengths)
    row_index = row_of_semantic[keep]
    labels = tokens[glob[keep] + 1]
    target_index = glob[keep] - traj_rep[keep]  # offsets[i] + p - i
    cu_local = local_off - np.arange(len(local_off), dtype=np.int64)
    return glob, local_off, row_index, labels, target_index, cu_local


def compact_layout(
    batch, call_plan: CallLayoutArrays, *, tree: TreeOrder | None = None, row_token: np.ndarray | None = None
) -> RowLayout:
    """The compact physical rows of one microbatch, on the host.

    Parameters
    ----------
    batch : harts_planner.RolloutBatch
        The step's batch (tokens, ``row_parent``).
    call_plan : CallLayoutArrays
        The microbatch's call plan (e.g. ``harts_planner.plan_calls(batch, B, microbatch=...)``);
        only its layout is read.
    tree, row_token : optional
        The batch's :class:`TreeOrder` and token of every batch compact row (int64 [C_batch]), when
        the caller caches them across microbatches (computed here otherwise).

    Returns
    -------
    RowLayout
        Token and position of every physical row, multiplicities, ancestor-KV views with one
        branch per packed sequence (parents in physical numbering) and the KDA execution plan.
    """
    check_call_layout(call_plan)
    c = int(call_plan.compact_tokens)
    g = np.asarray(call_plan.physical_to_global, dtype=np.int64)  # [C] batch row
    r2g = np.asarray(call_plan.row_to_global, dtype=np.int64)  # increasing
    r2p = np.asarray(call_plan.row_to_physical, dtype=np.int64)
    gp = np.asarray(batch.row_parent, dtype=np.int64)[g]
    parent = np.where(gp < 0, -1, r2p[np.minimum(np.searchsorted(r2g, gp), c - 1)])
    if tree is None:
        tree = TreeOrder.from_batch(batch)
    if row_token is None:
        row_token = np.empty(int(batch.compact_tokens), dtype=np.int64)
        row_token[np.asarray(batch.compact_map, dtype=np.int64)] = np.asarray(batch.tokens, dtype=np.int64)
    sp = np.asarray(call_plan.sequence_physical_offsets, dtype=np.int64)
    views = build_views(
        parent, Branches(np.arange(c, dtype=np.int64), sp), TreeOrder(tree.pre[g], tree.end[g])
    )
    s2p = np.asarray(call_plan.semantic_to_physical, dtype=np.int64)
    return RowLayout(
        c,
        input_ids=torch.from_numpy(row_token[g]),
        positions=torch.from_numpy(np.asarray(call_plan.position_ids, dtype=np.int64)),
        multiplicity=torch.from_numpy(np.bincount(s2p, minlength=c).astype(np.float32)),
        kda=KDAExecutionPlan.from_call_plan(call_plan),
        views=views,
    )


def trajectory_layout(batch, trajectories, chunk_size: int, conv_width: int) -> RowLayout:
    """The baseline's rows: the trajectories expanded and packed back to back (rows = semantic
    positions, trajectory order as given), one KDA call from zero states, attention views without
    ancestors, multiplicities 1. On the host; O(S_mb * w)."""
    traj = np.asarray(trajectories, dtype=np.int64)
    off = np.asarray(batch.offsets, dtype=np.int64)
    lengths = off[traj + 1] - off[traj]
    s = int(lengths.sum())
    local_row = np.arange(s, dtype=np.int64)
    local_off = np.zeros(len(traj) + 1, dtype=np.int64)
    np.cumsum(lengths, out=local_off[1:])
    starts = np.repeat(local_off[:-1], lengths)
    parent = np.where(local_row == starts, -1, local_row - 1)
    tree = TreeOrder(local_row, np.repeat(local_off[1:], lengths))
    tokens = np.asarray(batch.tokens, dtype=np.int64)
    return RowLayout(
        s,
        input_ids=torch.from_numpy(tokens[expand_ranges(off[traj], off[traj + 1])]),
        positions=torch.from_numpy(local_row - starts),
        multiplicity=torch.ones(s, dtype=torch.float32),
        kda=KDAExecutionPlan.trivial(local_off, chunk_size, conv_width),
        views=build_views(parent, Branches(local_row, local_off), tree),
    )


def _finish(mode, traj, layout, targets, s_mb, stats, cfg: RowShape, device) -> Microbatch:
    _, _, row_index, labels, target_index, cu_local = targets
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


def compact_microbatch(
    step: StepRows, call_plan: CallLayoutArrays, cfg: RowShape, device="cpu"
) -> Microbatch:
    """Materialise a microbatch's compact physical rows from its call plan's layout.

    Builds (host, numpy; then one move to ``device``): :func:`compact_layout` and the mapped
    targets. Raises :class:`InvalidInputError` when the plan's chunk size or convolution width is
    not the model's (``field="call_plan.chunk_size"`` / ``"call_plan.conv_width"``) or a layout
    field is missing.
    """
    check_call_layout(call_plan)
    if int(call_plan.chunk_size) != cfg.chunk_size:
        raise InvalidInputError(
            "call_plan.chunk_size", f"{call_plan.chunk_size} != the model's chunk_size {cfg.chunk_size}"
        )
    if int(call_plan.conv_width) != cfg.conv_size:
        raise InvalidInputError(
            "call_plan.conv_width", f"{call_plan.conv_width} != the model's conv_size {cfg.conv_size}"
        )
    layout = compact_layout(step.batch, call_plan, tree=step.tree, row_token=step.row_token)
    traj = np.asarray(call_plan.trajectories, dtype=np.int64)
    s2p = np.asarray(call_plan.semantic_to_physical, dtype=np.int64)
    targets = microbatch_targets(step.batch, traj, s2p)
    s_mb = len(targets[0])
    assert layout.views is not None  # compact_layout builds them
    stats = {
        "rows": layout.num_rows,
        "semantic_tokens": s_mb,
        "replay_tokens": int(call_plan.replay_tokens),
        "num_calls": int(call_plan.num_calls),
        "sequences": int(call_plan.num_sequences),
        "kv_len": int(layout.views.kv_index.numel()),
    }
    return _finish("compact", traj, layout, targets, s_mb, stats, cfg, device)


def trajectory_microbatch(step: StepRows, trajectories, cfg: RowShape, device="cpu") -> Microbatch:
    """The baseline's microbatch: :func:`trajectory_layout` and its targets, on ``device``."""
    traj = np.asarray(trajectories, dtype=np.int64)
    layout = trajectory_layout(step.batch, traj, cfg.chunk_size, cfg.conv_size)
    s = layout.num_rows
    targets = microbatch_targets(step.batch, traj, np.arange(s, dtype=np.int64))
    stats = {
        "rows": s,
        "semantic_tokens": s,
        "replay_tokens": 0,
        "num_calls": 1,
        "sequences": len(traj),
        "kv_len": s,
    }
    return _finish("trajectory", traj, layout, targets, s, stats, cfg, device)


def pack_trajectories(lengths, capacity: int) -> list[np.ndarray]:
    """The baseline's packing: first-fit decreasing of whole trajectories into microbatches of at
    most ``capacity`` rows. Returns trajectory ids per microbatch (ascending ids inside each).
    Raises :class:`InvalidInputError` (``field="trajectories[j]"``) for a trajectory longer than
    ``capacity``. O(n * bins)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and int(lengths.max()) > capacity:
        j = int(np.argmax(lengths))
        raise InvalidInputError(f"trajectories[{j}]", f"length {int(lengths[j])} exceeds capacity {capacity}")
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
