"""verl backend ``"harts"``: a verl 0.9.1 :class:`~verl.workers.engine.BaseEngine` on
:class:`harts_runtime.engine.HartsEngine`.

Importing this module registers :class:`VerlHartsEngine` with verl's ``EngineRegistry`` as backend
``"harts"`` for ``model_type="language_model"`` on ``cuda`` and ``cpu``. A verl run selects it with
``actor_rollout_ref.actor._target_=harts_runtime.integrations.verl.HartsActorConfig`` (strategy
``harts``, engine options under ``harts``) and ``actor_rollout_ref.model.external_lib=
harts_runtime.integrations.verl``; ``examples/verl/`` has the whole override file.

What a step does (:meth:`VerlHartsEngine.forward_backward_batch`)
----------------------------------------------------------------
verl balances the batch over DP ranks and dispatches each rank its share before an engine sees it,
which separates trajectories that share a prefix. The backend undoes that first:

1. **Gather.** Every tensor field of the rank's ``TensorDict`` (``input_ids`` and the other jagged
   tensors, ``responses``, ``response_mask``, ``old_log_probs``, ``advantages``, ...) is
   all-gathered over the DP group, rows in DP-rank order: every rank holds the whole step.
2. **Plan the whole step.** :meth:`HartsEngine.forward_backward` ingests the token ids (HARTS
   finds the prefix trees), plans microbatches at the capacity T and assigns them to DP replicas
   (no tree is split across ranks unless it alone exceeds T); each rank runs its replica's.
3. **verl's own loss per HARTS microbatch** (:class:`VerlLoss`). For a microbatch HARTS chose,
   the rows of its trajectories are selected from the gathered step and the log-probs are handed
   to verl's ``loss_function(model_output, data, dp_group)`` exactly as verl's FSDP engine hands
   them: ``model_output["log_probs"]`` jagged ``[k, L_i]`` over prompt + response, position ``t``
   holding ``log p(token t+1 | tokens <= t)`` (the last position is unused by verl and holds 0).
   The microbatch's ``data`` carries verl's *global* denominators, ``batch_num_tokens`` (the step's
   ``loss_mask`` tokens, as verl's engine all-reduces them) and ``global_batch_size`` (verl's, or
   the step's sequences with a response token), with ``dp_size = 1``: verl's ``agg_loss`` then
   returns the microbatch's share of the step loss, the shares add up to the step loss in any
   grouping, and FSDP2's *summed* gradients (HARTS divides by 1, where verl's FSDP averages and
   multiplies every loss by ``dp_size``) are the gradients of verl's per-trajectory computation.
4. **Route back.** The engine returns every target's log-prob on every rank; each rank returns
   the rows it was dispatched, in verl's order.

Metrics keep verl's names: the loss function's metrics (``actor/pg_loss``, ``actor/pg_clipfrac``,
``actor/ppo_kl``, ...) combined over every microbatch of every rank by their own aggregation (a
``SUM`` metric is the step's sum, a ``MEAN`` the mean over microbatches) and returned as one value
per rank, so verl's ``Metric.aggregate_dp`` keeps them; ``grad_norm`` and ``lr`` from the optimizer;
HARTS's own under ``harts/`` (rows, compression, microbatches, planner and F/B/Grad seconds).

Entropy (``calculate_entropy``) is computed for forward-only calls (verl's old-log-prob pass asks
for it, for its ``actor/entropy`` metric): the full-vocabulary entropy of each compact row, once
per row, from the final hidden rows and the LM-head weight, mapped to the targets like the
log-probs. An entropy *loss* (``actor.entropy_coeff != 0``, or ``calculate_entropy`` in training)
needs a gradient through it, which the fused head does not provide: that is refused with
:class:`~harts_runtime.errors.InvalidInputError` naming the field. So are a sampling temperature
other than 1, multimodal (3-D) jagged inputs, ``calculate_sum_pi_squared``, top-k distillation,
router replay, and verl's parameter / optimizer offload (use ``harts.cpu_offload``).

Parameters the checkpoint's transformers family has no tensor for (its adapter's ``zero_only``)
are frozen at load (:func:`freeze_unexportable`), so every later weight export still succeeds.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorData, NonTensorStack
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.config import FSDPActorConfig
from verl.workers.config.engine import EngineConfig as VerlEngineConfig
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry

from harts_runtime.engine import EngineConfig, EngineOutput, HartsEngine
from harts_runtime.errors import InvalidInputError
from harts_runtime.loss.functions import MicrobatchInputs
from harts_runtime.loss.objectives import PolicyLossConfig
from harts_runtime.rollouts import Rollouts

__all__ = [
    "HartsActorConfig",
    "HartsEngineConfig",
    "VerlHartsEngine",
    "VerlLoss",
    "gather_rows",
    "harts_logprobs_to_verl",
    "step_denominators",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- configs
@dataclass
class HartsEngineConfig(VerlEngineConfig):
    """verl engine config of the ``harts`` backend (``actor.harts`` / ``ref.harts``); verl's common
    fields (``forward_only``, ``seed``, ...) plus HARTS's. ``dtype`` (verl's, default bfloat16) is
    the compute dtype under FSDP2 over ``model_dtype`` masters; ``"float32"`` computes in float32."""

    strategy: str = "harts"
    capacity: int = 65_536
    """T: compact rows per microbatch (the planner's capacity; verl's micro-batch settings are ignored)."""
    microbatch_cost: int = 0
    """The planner's fixed cost of a microbatch in compact tokens, in [0, capacity]
    (:attr:`harts_runtime.engine.EngineConfig.microbatch_cost`)."""
    mode: str = "compact"
    """``compact`` (HARTS) or ``trajectory`` (the trajectory-wise baseline, same loss)."""
    model_dtype: str = "float32"
    """dtype the checkpoint is loaded in (FSDP2's masters)."""
    chunk_size: int = 64
    """KDA / GDN chunk size (does not change the math)."""
    recompute: bool = False
    keep: tuple = ()
    """Kept regions under recomputation: ``attention``, ``linear_attention``."""
    tp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    sequence_parallel: bool = False
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy (CUDA only); verl's ``param_offload`` / ``optimizer_offload`` are refused."""

    def __post_init__(self):
        super().__post_init__()
        if self.strategy != "harts":
            raise InvalidInputError(
                "strategy", f"the harts engine config needs strategy 'harts', got {self.strategy!r}"
            )
        if self.mode not in ("compact", "trajectory"):
            raise InvalidInputError("harts.mode", f"choose compact or trajectory, got {self.mode!r}")
        if not (isinstance(self.capacity, int) and self.capacity > 0):
            raise InvalidInputError("harts.capacity", f"must be a positive integer, got {self.capacity!r}")


@dataclass
class HartsActorConfig(FSDPActorConfig):
    """verl actor (or reference) config whose engine is :class:`HartsEngineConfig` (``harts``).
    A subclass of verl's ``FSDPActorConfig``, so verl's default ``dp`` actor / ref YAML keys are
    accepted as they are (the FSDP-only ones are ignored); select it with ``_target_``
    (``examples/verl/``)."""

    strategy: str = "harts"
    harts: HartsEngineConfig = field(default_factory=HartsEngineConfig)

    def __post_init__(self):
        if self.strategy != "harts":
            raise InvalidInputError(
                "actor.strategy", f"HartsActorConfig runs strategy 'harts', got {self.strategy!r}"
            )
        super().__post_init__()
        if not isinstance(self.harts, HartsEngineConfig):
            self.harts = HartsEngineConfig(**dict(self.harts))
        self.engine = self.harts
        if self.entropy_coeff:
            raise InvalidInputError(
                "actor.entropy_coeff",
                f"an entropy loss ({self.entropy_coeff}) needs its gradient, which the harts backend's fused "
                "LM head does not compute; set it to 0",
            )


# ---------------------------------------------------------------------------------- the step
def _group_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_padded(t: torch.Tensor, n: int, n_max: int, group, dev) -> list[torch.Tensor]:
    """All-gather ``t`` (first dimension ``n`` here, ``n_max`` at most) over ``group``; returns each
    rank's tensor padded to ``n_max`` rows."""
    buf = t.new_zeros((n_max, *t.shape[1:]), device=dev)
    buf[:n] = t.to(dev)
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, buf, group=group)
    return [o.cpu() for o in out]


def gather_rows(data: TensorDict, group) -> tuple[TensorDict, int]:
    """The whole step: every rank's rows of ``data`` concatenated in DP-rank order, and where this
    rank's rows start. Tensor fields (dense ``[b, ...]`` and jagged ``[b, j]``) are all-gathered,
    per-sample non-tensor lists as objects; scalar metadata stays this rank's (verl sets it alike on
    every rank). Fields must agree across ranks in dtype and trailing shape (one-line
    :class:`InvalidInputError` naming the field otherwise). Without a group (or one rank) ``data``
    itself. Collective over ``group``."""
    if group is None or dist.get_world_size(group) == 1:
        return data, 0
    b = data.batch_size[0]
    meta: dict[str, Any] = {"b": b, "fields": {}}
    local = {}
    for key in data.keys():
        v = data.get(key)
        if isinstance(v, NonTensorStack):
            meta["fields"][key] = ("stack", list(v.tolist()))
        elif isinstance(v, NonTensorData):
            continue
        elif isinstance(v, torch.Tensor) and v.is_nested:
            if v.dim() != 2:
                raise InvalidInputError(
                    f"data[{key!r}]",
                    f"jagged fields must be [b, j] (got {v.dim()} dimensions; multimodal inputs are not supported)",
                )
            vals, off = v.values(), v.offsets()
            meta["fields"][key] = ("nested", str(vals.dtype), int(vals.shape[0]))
            local[key] = (vals, off.diff())
        elif isinstance(v, torch.Tensor):
            meta["fields"][key] = ("dense", str(v.dtype), tuple(v.shape[1:]))
            local[key] = v
    metas: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(metas, meta, group=group)
    rank = dist.get_rank(group)
    start = sum(m["b"] for m in metas[:rank])
    sizes = [m["b"] for m in metas]
    b_max = max(sizes)
    dev = _group_device(group)
    out: dict[str, Any] = {}
    for r, m in enumerate(metas):
        if set(m["fields"]) != set(meta["fields"]):
            diff = sorted(set(m["fields"]) ^ set(meta["fields"]))
            raise InvalidInputError(f"data[{diff[0]!r}]", f"present on only one of DP ranks {r} and {rank}")
    # one order on every rank (a TensorDict's key order is not: the collectives must pair up)
    for key in sorted(meta["fields"]):
        info = meta["fields"][key]
        for r, m in enumerate(metas):
            other = m["fields"].get(key)
            if other is None or other[0] != info[0] or (info[0] != "stack" and other[:2] != info[:2]):
                raise InvalidInputError(
                    f"data[{key!r}]", f"rank {r} holds it as {other}, rank {rank} as {info}"
                )
            if info[0] == "dense" and other[2] != info[2]:
                raise InvalidInputError(
                    f"data[{key!r}]",
                    f"trailing shapes differ over DP ranks: {other[2]} (rank {r}) vs {info[2]}",
                )
        if info[0] == "stack":
            out[key] = [x for m in metas for x in m["fields"][key][1]]
        elif info[0] == "dense":
            parts = _gather_padded(local[key], b, b_max, group, dev)
            out[key] = torch.cat([p[:n] for p, n in zip(parts, sizes)])
        else:
            vals, lens = local[key]
            nnz = [m["fields"][key][2] for m in metas]
            vparts = _gather_padded(vals, int(vals.shape[0]), max(nnz), group, dev)
            lparts = _gather_padded(lens, b, b_max, group, dev)
            values = torch.cat([p[:n] for p, n in zip(vparts, nnz)])
            lengths = torch.cat([p[:n] for p, n in zip(lparts, sizes)])
            offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
            out[key] = torch.nested.nested_tensor_from_jagged(values, offsets)
    step = TensorDict({k: v for k, v in out.items() if not isinstance(v, list)}, batch_size=[sum(sizes)])
    for k, v in out.items():
        if isinstance(v, list):
            tu.assign_non_tensor_stack(step, k, v)
    for key in data.keys():
        v = data.get(key)
        if isinstance(v, NonTensorData) and not isinstance(v, NonTensorStack):
            step[key] = v
    return step, start


def rollouts_of(step: TensorDict, vocab_size: int | None = None) -> Rollouts:
    """The step's token ids (``input_ids``, jagged: prompt + response of each sequence) as
    :class:`Rollouts` (no fields: verl's loss reads its own)."""
    ids = step.get("input_ids", None)
    if not (isinstance(ids, torch.Tensor) and ids.is_nested):
        raise InvalidInputError(
            "data['input_ids']", "the harts backend needs verl's no-padding (jagged) input_ids"
        )
    tokens = ids.values().cpu().numpy().astype(np.int64, copy=False)
    offsets = ids.offsets().cpu().numpy().astype(np.int64)
    return Rollouts(tokens, offsets).check(vocab_size)


def step_denominators(step: TensorDict) -> tuple[int | None, int | None]:
    """verl's global loss denominators of the whole step: ``batch_num_tokens`` (the ``loss_mask``
    tokens, as verl's engine all-reduces them) and ``global_batch_size`` (verl's when it set one,
    else the sequences with at least one response token, what ``agg_loss`` counts on one batch)."""
    mask = step.get("loss_mask", None)
    if mask is None:
        mask = step.get("response_mask", None)
    tokens = None
    if isinstance(mask, torch.Tensor):
        tokens = int((mask.values() if mask.is_nested else mask).sum())
    gbs = tu.get_non_tensor_data(step, "global_batch_size", None)
    if gbs is None:
        rm = step.get("response_mask", None)
        if isinstance(rm, torch.Tensor) and not rm.is_nested:
            gbs = int((rm.sum(-1) > 0).sum())
    return tokens, gbs


def harts_logprobs_to_verl(values: torch.Tensor, lengths, fill: float = 0.0) -> torch.Tensor:
    """HARTS per-target values ``[P]`` (trajectory ``i`` owns ``L_i - 1`` consecutive entries) as
    verl's jagged ``[k, L_i]`` model output: position ``t`` holds entry ``t`` (the value scoring
    token ``t + 1``), the last position ``fill``. Differentiable in ``values``."""
    lengths = torch.as_tensor(np.asarray(lengths), dtype=torch.int64)
    k = len(lengths)
    p = int(values.numel())
    if p != int(lengths.sum()) - k:
        raise InvalidInputError("values", f"expected {int(lengths.sum()) - k} per-target entries, got {p}")
    shift = torch.repeat_interleave(torch.arange(k), lengths - 1)
    idx = (torch.arange(p) + shift).to(values.device)
    flat = values.new_full((p + k,), fill).index_copy(0, idx, values)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(values.device)
    return torch.nested.nested_tensor_from_jagged(flat, offsets)


class VerlLoss:
    """A verl ``loss_function(model_output, data, dp_group) -> (loss, metrics)`` as a HARTS loss
    function (:mod:`harts_runtime.loss.functions`) over the gathered ``step``: for each microbatch
    HARTS runs, the rows of its trajectories with verl's global denominators (module docstring,
    step 3), the log-probs in verl's jagged layout; verl's metrics are kept per microbatch
    (:meth:`metrics`), the engine gets the loss alone."""

    def __init__(self, loss_function: Callable, step: TensorDict, *, dp_group=None):
        self.loss_function = loss_function
        self.dp_group = dp_group
        tokens, gbs = step_denominators(step)
        self.step = step = step.copy()  # shallow: the caller's TensorDict keeps its own metadata
        tu.assign_non_tensor(step, dp_size=1, batch_num_tokens=tokens, global_batch_size=gbs)
        ids = step.get("input_ids")
        self.lengths = ids.offsets().diff().cpu()
        self.records: list[dict] = []

    def microbatch_data(self, trajectories) -> TensorDict:
        """The gathered step's rows ``trajectories`` (with the step-level metadata)."""
        idx = torch.as_tensor(np.asarray(trajectories, dtype=np.int64))
        return tu.index_select_tensor_dict(self.step, idx)

    def __call__(self, logprobs: torch.Tensor, inputs: MicrobatchInputs):
        traj = inputs.trajectories.cpu()
        if traj.numel() == 0:
            return logprobs.sum()
        data = self.microbatch_data(traj).to(logprobs.device)
        model_output = {"log_probs": harts_logprobs_to_verl(logprobs, self.lengths[traj])}
        out = self.loss_function(model_output=model_output, data=data, dp_group=self.dp_group)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        self.records.append(dict(metrics or {}))
        return loss

    def metrics(self, group=None) -> dict:
        """verl's metrics of every microbatch of every rank, each :class:`Metric` combined by its
        aggregation into one value (same on every rank), plain values kept as this rank's list.
        Collective over ``group`` when it has more than one rank."""
        records = self.records
        if group is not None and dist.get_world_size(group) > 1:
            every: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, [_plain_record(r) for r in records], group=group)
            gathered = [r for rank_records in every for r in rank_records]
        else:
            gathered = [_plain_record(r) for r in records]
        values: dict = defaultdict(list)
        kinds: dict = {}
        for r in gathered:
            for k, (agg, vs) in r.items():
                if agg is not None:
                    kinds[k] = agg
                    values[k].extend(vs)
        out: dict = {}
        for k, agg in kinds.items():
            out[k] = Metric(aggregation=agg, value=float(Metric._aggregate(values[k], AggregationType(agg))))
        for r in records:
            for k, v in _plain_record(r).items():
                if v[0] is None:
                    out.setdefault(k, []).extend(v[1])
        return out


def _plain_record(metrics: dict) -> dict:
    """``{name: (aggregation or None, [floats])}``: a metrics dict without verl objects (picklable)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, Metric):
            out[k] = (v.aggregation.value, [float(x) for x in v.values])
        elif isinstance(v, (list, tuple)):
            out[k] = (None, [float(x) for x in v])
        else:
            out[k] = (None, [float(v)])
    return out


# ---------------------------------------------------------------------------------- entropy
def _full_weight(w: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (w.full_tensor() if isinstance(w, DTensor) else w).detach()


@torch.no_grad()
def row_entropy(hidden: torch.Tensor, weight: torch.Tensor, rows: int = 2048) -> torch.Tensor:
    """Full-vocabulary entropy ``lse(z) - sum softmax(z) z`` of every row ``z = hidden @ W^T``,
    float32 ``[N]``, ``rows`` rows at a time (temporaries ``[rows, V]`` float32)."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    w = weight.float()
    for a in range(0, hidden.shape[0], rows):
        z = hidden[a : a + rows].float() @ w.T
        lse = torch.logsumexp(z, -1)
        out[a : a + rows] = lse - (torch.softmax(z, -1) * z).sum(-1)
    return out


# ---------------------------------------------------------------------------------- the engine
class _VerlSchedule:
    """What :class:`HartsEngine` steps after each optimizer step: nothing. verl steps its own LR
    schedule once per training step (:meth:`VerlHartsEngine.lr_scheduler_step`)."""

    def __init__(self, inner):
        self.inner = inner
        self.base_lrs = list(inner.base_lrs)
        self.last_epoch = 0

    def step(self):
        pass


class _ModeCtx(BaseEngineCtx):
    def __enter__(self):
        super().__enter__()
        model = self.engine.engine.model
        model.train(self.mode == "train")

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self.mode == "train" and (self.zero_grad_on_exit or exc_type is not None):
            self.engine.optimizer_zero_grad()
        super().__exit__(exc_type, exc_val, exc_tb)


@EngineRegistry.register(model_type="language_model", backend="harts", device=["cuda", "cpu"])
class VerlHartsEngine(BaseEngine):
    """verl's ``BaseEngine`` on :class:`HartsEngine` (module docstring). Built by verl's
    ``EngineRegistry.new(model_type, backend="harts", model_config=..., engine_config=...,
    optimizer_config=..., checkpoint_config=...)``; :meth:`initialize` loads the checkpoint
    (``model_config.local_path`` or ``path``) with :func:`harts_runtime.load_pretrained`, over a
    FSDP2 mesh of the whole world when ``torch.distributed`` is initialised (``harts.tp``,
    ``harts.ep``, ``harts.dp_replicate``; the rest is ``dp_shard``)."""

    def __init__(self, model_config, engine_config, optimizer_config=None, checkpoint_config=None, **_):
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.engine: HartsEngine | None = None
        self.mesh = None
        self.lr_scheduler = None
        self.mode = None
        self.last_output: EngineOutput | None = None

    # ------------------------------------------------------------------ build
    def _harts(self, name, default=None):
        return getattr(self.engine_config, name, default)

    def initialize(self):
        ec = self.engine_config
        for flag in ("param_offload", "optimizer_offload"):
            if getattr(ec, flag, False):
                raise InvalidInputError(
                    flag, "verl's offload is not supported by the harts backend; use harts.cpu_offload"
                )
        path = getattr(self.model_config, "local_path", None) or self.model_config.path
        opt = self.optimizer_config
        dtype = getattr(ec, "dtype", None)
        cfg = EngineConfig(
            lr=float(opt.lr) if opt is not None else 1e-6,
            weight_decay=float(getattr(opt, "weight_decay", 0.0)) if opt is not None else 0.0,
            betas=tuple(getattr(opt, "betas", (0.9, 0.999))) if opt is not None else (0.9, 0.999),
            max_grad_norm=_clip(opt),
            capacity=int(self._harts("capacity", 65_536)),
            microbatch_cost=int(self._harts("microbatch_cost", 0)),
            mode=self._harts("mode", "compact"),
            recompute=bool(self._harts("recompute", False)),
            keep=tuple(self._harts("keep", ()) or ()),
            param_dtype=None if dtype in (None, "float32", "fp32") else dtype,
            cpu_offload=bool(self._harts("cpu_offload", False)),
            loss_config=PolicyLossConfig(),  # unused: verl's loss replaces HARTS's objective
        )
        device = _device()
        mesh = None
        if dist.is_initialized():
            from harts_runtime.parallel import ParallelDims

            dims = ParallelDims.from_world(
                dist.get_world_size(),
                tp=int(self._harts("tp", 1)),
                ep=int(self._harts("ep", 1)),
                dp_replicate=int(self._harts("dp_replicate", 1)),
                sequence_parallel=bool(self._harts("sequence_parallel", False)),
            )
            mesh = dims.build_mesh()
        self.mesh = mesh
        from harts_runtime.hf import load_pretrained

        kw = {} if mesh is None else dict(mesh=mesh, parallelize=cfg.parallelize_options())
        model = load_pretrained(
            path,
            dtype=self._harts("model_dtype", "float32"),
            device=device,
            chunk_size=int(self._harts("chunk_size", 64)),
            **kw,
        )
        self.frozen = freeze_unexportable(model)
        self.engine = HartsEngine(model, cfg, mesh=mesh)
        self.lr_scheduler = _verl_scheduler(self.engine.optimizer, opt)
        self.engine.scheduler = _VerlSchedule(self.lr_scheduler)

    # ------------------------------------------------------------------ properties
    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def train_mode(self, **kwargs):
        return _ModeCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _ModeCtx(self, "eval", **kwargs)

    def get_data_parallel_rank(self):
        return 0 if self.mesh is None else self.mesh.replica

    def get_data_parallel_size(self):
        return 1 if self.mesh is None else self.mesh.dims.dp

    def get_data_parallel_group(self):
        return None if self.mesh is None else self.mesh.dp.get_group()

    def is_mp_src_rank_with_outputs(self):
        return self.mesh is None or self.mesh.coords["tp"] == 0

    # ------------------------------------------------------------------ step
    def forward_backward_batch(
        self, data: TensorDict, loss_function: Callable | None, forward_only=False
    ) -> dict:
        """The step (module docstring): gather over DP, plan the whole step, verl's loss per HARTS
        microbatch, this rank's rows back. Returns verl's engine output: ``model_output``
        (``log_probs`` and, when ``calculate_entropy``, ``entropy``: jagged ``[b, L_i]`` in this
        rank's order), ``loss`` (``[step loss]``, equal on every rank) and ``metrics``."""
        temperature = tu.get_non_tensor_data(data, "temperature", 1.0)
        if isinstance(temperature, torch.Tensor):
            bad = not bool((temperature == 1).all())
        else:
            bad = temperature is not None and float(temperature) != 1.0
        if bad:
            raise InvalidInputError(
                "temperature", "the harts backend scores at temperature 1 only (rollout.temperature=1.0)"
            )
        for flag, what in (
            ("calculate_sum_pi_squared", "sum of squared probabilities (full-vocabulary logits)"),
            ("distillation_use_topk", "top-k distillation (teacher logits)"),
            ("enable_routing_replay", "MoE router replay"),
        ):
            if tu.get_non_tensor_data(data, flag, False):
                raise InvalidInputError(flag, f"{what} is not supported by the harts backend")
        entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        if entropy and not forward_only:
            raise InvalidInputError(
                "calculate_entropy",
                "entropy in a training step needs its gradient, which the harts backend does not compute "
                "(set actor.entropy_coeff=0 and actor.calculate_entropy=False)",
            )
        group = self.get_data_parallel_group()
        step, start = gather_rows(data, group)
        rollouts = rollouts_of(step, self.engine.vocab_size)
        if loss_function is not None:
            loss_fn = VerlLoss(loss_function, step, dp_group=group)
        else:
            loss_fn = _no_loss
        ctx = torch.no_grad() if forward_only else nullcontext()
        with ctx:
            if entropy:
                out, ent = self._forward_with_entropy(rollouts, loss_fn)
            else:
                out = self.engine.forward_backward(rollouts, loss_fn, forward_only=forward_only)
                ent = None
        self.last_output = out
        b = data.batch_size[0]
        lengths = rollouts.lengths[start : start + b]
        t0 = int(rollouts.target_offsets[start])
        t1 = int(rollouts.target_offsets[start + b])
        model_output = {"log_probs": harts_logprobs_to_verl(out.logprobs[t0:t1], lengths)}
        if ent is not None:
            model_output["entropy"] = harts_logprobs_to_verl(ent[t0:t1], lengths)
        metrics = loss_fn.metrics(group) if isinstance(loss_fn, VerlLoss) else {}
        for k in ("rows", "semantic_tokens", "compression", "microbatches", "plan_seconds", "fbg_seconds"):
            if k in out.metrics:
                metrics[f"harts/{k}"] = [float(out.metrics[k])]
        return {"model_output": model_output, "loss": [float(out.loss)], "metrics": metrics}

    def _forward_with_entropy(self, rollouts: Rollouts, loss_fn):
        """Forward only: :meth:`HartsEngine.forward_backward`'s loop with the final hidden rows kept
        for the entropy (:func:`row_entropy`, once per compact row). Returns ``(EngineOutput,
        entropy float32 [P])``."""
        from harts_runtime.train import run_microbatch

        eng = self.engine
        if self.mesh is not None and self.mesh.dims.sequence_parallel:
            raise InvalidInputError("calculate_entropy", "entropy is not computed under sequence parallelism")
        step = eng.step_inputs(rollouts)
        plan, plan_s = eng._plan(step)
        dev = eng.model.device
        weight = _full_weight(eng.model.lm_head.weight)
        lp_all = torch.zeros(step.num_targets, dtype=torch.float32, device=dev)
        ent_all = torch.zeros_like(lp_all)
        rows = [0.0]

        def microbatch(slot, traj):
            loss, st = run_microbatch(
                eng.model, step, traj, eng.config.mode, loss_fn=loss_fn, backward=False, return_hidden=True
            )
            ti = st["target_index"].to(dev)
            lp_all[ti] = st["logprobs"].float()
            if ti.numel():
                ent_all[ti] = row_entropy(st["hidden"], weight, eng.model.config.lm_head_rows)[
                    st["row_index"].to(dev)
                ]
            rows[0] += st["rows"]
            return loss

        if self.mesh is None:
            total = sum(
                float(microbatch(j, np.asarray(t, dtype=np.int64))) for j, t in enumerate(plan.microbatches)
            )
        else:
            from harts_runtime.parallel import run_replica_step

            total = run_replica_step(plan, self.mesh, microbatch).loss
            if self.mesh.dims.dp > 1:
                g = self.mesh.dp.get_group()
                both = torch.stack([lp_all, ent_all])
                dist.all_reduce(both, group=g)
                lp_all, ent_all = both[0], both[1]
                r = torch.tensor(rows, dtype=torch.float64, device=dev)
                dist.all_reduce(r, group=g)
                rows = r.tolist()
        metrics = {
            "rows": int(rows[0]),
            "semantic_tokens": step.batch.semantic_tokens,
            "compression": step.batch.semantic_tokens / max(1, rows[0]),
            "plan_seconds": plan_s,
        }
        return EngineOutput(total, lp_all.cpu(), metrics), ent_all.cpu()

    # ------------------------------------------------------------------ optimizer
    def optimizer_zero_grad(self):
        self.engine.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self):
        """Clip to ``optim.clip_grad``, step AdamW (skipped, gradients dropped, when the norm is not
        finite), MoE expert-bias update; returns the gradient norm before clipping."""
        report = self.engine.optimizer_step()
        if report.skipped:
            logger.warning("harts: %s", report.reason)
        return report.grad_norm

    def lr_scheduler_step(self):
        self.lr_scheduler.step()
        return self.lr_scheduler.get_last_lr()[0]

    # ------------------------------------------------------------------ weights and checkpoints
    def get_per_tensor_param(self, **kwargs):
        """``((transformers name, tensor) generator, None)``: every rank iterates (collective under
        sharding). No LoRA."""
        return self.engine.export_weights(), None

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        if not (model or optimizer):
            return
        here = self.engine.model.device.type
        if str(device) not in (here, "device"):
            raise InvalidInputError(
                "device",
                f"the harts backend keeps its weights on {here}; use harts.cpu_offload for host offload",
            )

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """Model, optimizer, engine step and RNG (DCP, :meth:`HartsEngine.save`), verl's LR schedule
        and ``global_step``; with ``hf_model`` in ``checkpoint.save_contents`` also a transformers
        folder under ``huggingface/``. Collective."""
        if hdfs_path is not None:
            raise InvalidInputError("hdfs_path", "the harts backend saves to local paths only")
        self.engine.save(local_path)
        if _rank() == 0:
            torch.save(self.lr_scheduler.state_dict(), Path(local_path) / "verl_lr_scheduler.pt")
            (Path(local_path) / "verl_harts.json").write_text(json.dumps({"global_step": int(global_step)}))
        contents = getattr(self.checkpoint_config, "save_contents", None) or ()
        if "hf_model" in contents:
            from harts_runtime.hf import save_pretrained

            save_pretrained(self.engine.model, Path(local_path) / "huggingface")
        if dist.is_initialized():
            dist.barrier()

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        """Restore :meth:`save_checkpoint` (under any world size); returns its extra record."""
        extra = self.engine.load(local_path)
        sched = Path(local_path) / "verl_lr_scheduler.pt"
        if sched.exists():
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=False))
            for g, lr in zip(self.engine.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
                g["lr"] = lr
        return extra


def freeze_unexportable(model) -> list[str]:
    """Freeze the parameters the model's transformers family has no tensor for (its adapter's
    ``zero_only``, e.g. Kimi-Linear's KDA output-gate bias): the checkpoint holds them at zero, and
    once trained they could no longer be exported to the rollout engine (``get_per_tensor_param``)
    or saved. Returns their names."""
    from harts_runtime.hf import _save_setup

    try:
        _, adapter = _save_setup(model, None)
    except (InvalidInputError, KeyError, ValueError):
        return []
    suffixes = tuple(s for s, _ in adapter.zero_only)
    names = []
    for n, p in model.named_parameters():
        if suffixes and n.endswith(suffixes):
            p.requires_grad_(False)
            names.append(n)
    return names


def _no_loss(logprobs, inputs):
    return logprobs.sum() * 0.0


def _clip(opt) -> float | None:
    if opt is None:
        return None
    v = getattr(opt, "clip_grad", None)
    if v is None or not math.isfinite(float(v)) or float(v) <= 0:
        return None
    return float(v)


def _verl_scheduler(optimizer, opt):
    """verl's own LR schedule (constant or cosine with warm-up, as its FSDP engine builds it)."""
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    total = int(getattr(opt, "total_training_steps", -1) or -1) if opt is not None else -1
    warm = int(getattr(opt, "lr_warmup_steps", -1) or -1) if opt is not None else -1
    if warm <= 0 and opt is not None:
        warm = int(float(getattr(opt, "lr_warmup_steps_ratio", 0.0) or 0.0) * max(total, 0))
    warm = max(warm, 0)
    kind = getattr(opt, "lr_scheduler_type", "constant") if opt is not None else "constant"
    if kind == "constant":
        return get_constant_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=warm)
    if kind == "cosine":
        return get_cosine_schedule_with_warmup(
            optimizer=optimizer,
            num_warmup_steps=warm,
            num_training_steps=total,
            min_lr_ratio=float(getattr(opt, "min_lr_ratio", 0.0) or 0.0),
            num_cycles=float(getattr(opt, "num_cycles", 0.5)),
            zero_indexed_step=bool(getattr(opt, "zero_indexed_step", True)),
        )
    raise InvalidInputError("optim.lr_scheduler_type", f"{kind!r}: the harts backend runs constant or cosine")


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
