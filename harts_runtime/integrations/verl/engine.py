"""verl backend ``"harts"``: a verl 0.9.1 :class:`~verl.workers.engine.BaseEngine` on
:class:`harts_runtime.engine.HartsEngine` (:class:`VerlHartsEngine`).

Importing this module (or the package :mod:`harts_runtime.integrations.verl`) registers
:class:`VerlHartsEngine` with verl's ``EngineRegistry`` as backend ``"harts"`` for
``model_type="language_model"`` on ``cuda`` and ``cpu``. A verl run selects it with
``actor_rollout_ref.actor._target_=harts_runtime.integrations.verl.HartsActorConfig`` (strategy
``harts``, engine options under ``harts``: :mod:`~harts_runtime.integrations.verl.config`) and
``actor_rollout_ref.model.external_lib=harts_runtime.integrations.verl``; ``examples/verl/`` has the
whole override file.

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

The engine is built by :meth:`HartsEngine.build <harts_runtime.engine.HartsEngine.build>`, which
freezes the parameters the checkpoint's transformers family has no tensor for (names in
:attr:`VerlHartsEngine.frozen`), so every later weight export still succeeds. Its learning rate is
verl's: the engine runs ``OptimizerOptions(lr_schedule="external")`` and verl's scheduler
(:meth:`VerlHartsEngine.lr_scheduler_step`) sets it.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry

from harts_runtime.engine import EngineConfig, EngineOutput, HartsEngine
from harts_runtime.errors import InvalidInputError
from harts_runtime.integrations.verl.config import HartsEngineConfig, dtype_name
from harts_runtime.integrations.verl.data import gather_rows, harts_logprobs_to_verl, rollouts_of
from harts_runtime.integrations.verl.loss import VerlLoss, full_weight, row_entropy
from harts_runtime.loss.functions import zero_loss_fn
from harts_runtime.loss.objectives import PolicyLossConfig
from harts_runtime.options import OptimizerOptions
from harts_runtime.rollouts import Rollouts

__all__ = ["VerlHartsEngine"]

logger = logging.getLogger(__name__)


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
    optimizer_config=..., checkpoint_config=...)``; :meth:`initialize` builds it from the checkpoint
    (``model_config.local_path`` or ``path``) with :meth:`HartsEngine.build`, over a FSDP2 mesh of
    the whole world when ``torch.distributed`` is initialised (``harts.tp``, ``harts.cp``,
    ``harts.ep``, ``harts.dp_replicate``; the rest is ``dp_shard``). Under ``harts.cp`` the ranks of
    a CP group are one DP rank to verl (the same data, the same rows back)."""

    def __init__(self, model_config, engine_config, optimizer_config=None, checkpoint_config=None, **_):
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.engine: HartsEngine | None = None
        self.mesh = None
        self.frozen: list[str] = []
        self.lr_scheduler = None
        self.mode = None
        self.last_output: EngineOutput | None = None

    # ------------------------------------------------------------------ build
    def initialize(self):
        """Build the engine (:meth:`HartsEngine.build`): the checkpoint in ``harts.model_dtype`` at
        ``harts.chunk_size``, over the world's mesh when ``torch.distributed`` is initialised, the
        execution options of ``harts``, AdamW from verl's ``optim`` with verl's LR schedule."""
        ec = self.engine_config
        if not isinstance(ec, HartsEngineConfig):
            raise InvalidInputError(
                "engine_config", f"the harts backend needs a HartsEngineConfig, got {type(ec).__name__}"
            )
        for flag in ("param_offload", "optimizer_offload"):
            if getattr(ec, flag, False):
                raise InvalidInputError(
                    flag, "verl's offload is not supported by the harts backend; use harts.cpu_offload"
                )
        path = getattr(self.model_config, "local_path", None) or self.model_config.path
        cfg = EngineConfig(
            execution=ec.execution,
            optimizer=_optimizer_options(self.optimizer_config),
            loss_config=PolicyLossConfig(),  # unused: verl's loss replaces HARTS's objective
        )
        dims = None
        if dist.is_initialized():
            from harts_runtime.parallel.dims import ParallelDims

            dims = ParallelDims.from_world(
                dist.get_world_size(),
                tp=ec.tp,
                cp=ec.cp,
                ep=ec.ep,
                dp_replicate=ec.dp_replicate,
                sequence_parallel=ec.sequence_parallel,
            )
        self.engine = HartsEngine.build(
            path,
            cfg,
            dims,
            dtype=dtype_name(ec.model_dtype),  # verl's configs are frozen: named here
            device=_device(),
            chunk_size=ec.chunk_size,
        )
        self.mesh = self.engine.mesh
        self.frozen = self.engine.frozen
        self.lr_scheduler = _verl_scheduler(self.engine.optimizer, self.optimizer_config)

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
        coords = None if self.mesh is None else self.mesh.coords
        return coords is None or (coords["tp"] == 0 and coords.get("cp", 0) == 0)

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
            loss_fn = zero_loss_fn  # no objective (verl scoring): zero, log-probs kept
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

    def _forward_with_entropy(self, rollouts: Rollouts, loss_fn) -> tuple[EngineOutput, torch.Tensor]:
        """Forward only, with the entropy of every target: :meth:`HartsEngine.forward_backward`'s
        ``keep_hidden`` hook computes it from each microbatch's final hidden rows
        (:func:`row_entropy`, once per compact row, the LM head gathered whole); each DP replica
        fills its own targets and the vector is summed over the DP group. Returns
        ``(EngineOutput, entropy float32 [P] cpu)``."""
        eng = self.engine
        if self.mesh is not None and self.mesh.dims.sequence_parallel:
            raise InvalidInputError("calculate_entropy", "entropy is not computed under sequence parallelism")
        dev = eng.model.device
        weight = full_weight(eng.model.lm_head.weight)
        ent = torch.zeros(rollouts.num_targets, dtype=torch.float32, device=dev)
        chunk = eng.model.config.lm_head_rows

        def keep_hidden(st: dict) -> None:
            ti = st["target_index"].to(dev)
            if ti.numel():
                ent[ti] = row_entropy(st["hidden"], weight, chunk)[st["row_index"].to(dev)]

        out = eng.forward_backward(rollouts, loss_fn, forward_only=True, keep_hidden=keep_hidden)
        if self.mesh is not None and self.mesh.dims.dp > 1:
            dist.all_reduce(ent, group=self.mesh.dp.get_group())
        return out, ent.cpu()

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
            self.engine.save_pretrained(Path(local_path) / "huggingface")
        if dist.is_initialized():
            dist.barrier()

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        """Restore :meth:`save_checkpoint` (under any world size); returns its extra record."""
        extra = self.engine.load(local_path)
        sched = Path(local_path) / "verl_lr_scheduler.pt"
        if sched.exists():
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))
            for g, lr in zip(self.engine.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
                g["lr"] = lr
        return extra


def _optimizer_options(opt) -> OptimizerOptions:
    """AdamW as verl's ``optim`` sets it (``lr``, ``weight_decay``, ``betas``, ``clip_grad``), the
    learning rate left to verl's scheduler (``lr_schedule="external"``)."""
    if opt is None:
        return OptimizerOptions(lr_schedule="external", max_grad_norm=None)
    return OptimizerOptions(
        lr=float(opt.lr),
        weight_decay=float(getattr(opt, "weight_decay", 0.0)),
        betas=tuple(getattr(opt, "betas", (0.9, 0.999))),
        max_grad_norm=_clip(opt),
        lr_schedule="external",
    )


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
