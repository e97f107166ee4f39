"""A training engine RL frameworks can call (:class:`HartsEngine`): framework-neutral, one object
that owns the model, its optimizer, LR schedule and gradient clipping, and the planner.

::

    engine = HartsEngine.from_pretrained("Qwen3.5-...", EngineConfig(lr=1e-6), mesh=mesh)
    rollouts = Rollouts.from_padded(input_ids, attention_mask, advantages=adv, loss_mask=mask,
                                    old_logprobs=old, vocab_size=engine.vocab_size)
    out = engine.forward_backward(rollouts, loss_fn)   # loss_fn(logprobs, inputs) -> loss
    report = engine.optimizer_step()                   # grad norm; a non-finite step is skipped
    lp = rollouts.to_padded(engine.logprobs(rollouts), attention_mask)
    engine.save("ckpt/step-10"); engine.load("ckpt/step-10")
    for name, tensor in engine.export_weights(): ...   # vLLM / SGLang weight sync

A step is every trajectory of the step on every rank (as a step plan needs): HARTS's ingestion finds
the prefix trees, :func:`harts_planner.plan_step` packs them into microbatches and, with a mesh,
assigns them to DP replicas and slots (no tree is ever split across ranks); each rank runs its
replica's microbatches (:func:`harts_runtime.parallel.run_replica_step`) and the log-probs come back
in the caller's per-target order on every rank. ``loss_fn`` sees the log-probs of one microbatch and
its per-target fields (:mod:`harts_runtime.loss.functions`); it must use step-level denominators
(``inputs.weights``), which makes the sum over microbatches the step loss in any grouping.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from harts_runtime.errors import InvalidInputError
from harts_runtime.loss.functions import LossFn
from harts_runtime.loss.objectives import PolicyLossConfig
from harts_runtime.rollouts import Rollouts
from harts_runtime.step_inputs import StepInputs

__all__ = ["EngineConfig", "EngineOutput", "HartsEngine", "StepReport"]

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(kw_only=True)
class EngineConfig:
    """Optimizer, schedule, clipping and execution options of a :class:`HartsEngine`."""

    lr: float = 1e-6
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    """Linear warm-up from 0 to ``lr`` over this many optimizer steps."""
    lr_schedule: str = "constant"
    """After warm-up: ``constant``, ``linear`` or ``cosine`` decay to ``min_lr_ratio * lr`` at
    ``total_steps``."""
    total_steps: int | None = None
    """Needed by ``linear`` and ``cosine``."""
    min_lr_ratio: float = 0.0
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (None: no clipping; the norm is reported anyway)."""
    capacity: int = 65_536
    """T: compact rows per microbatch (the planner's capacity)."""
    microbatch_cost: int = 0
    """The planner's ``microbatch_cost``: a microbatch's fixed time in compact tokens, in [0,
    capacity] (0: the paper's selection). ``benchmarks/train_eval.py``'s ``microbatches`` section fits
    it for a model and GPU (about 8,400 for the 24-layer ``ling-tiny`` on an H200)."""
    mode: str = "compact"
    """``compact`` (HARTS) or ``trajectory`` (the trajectory-wise baseline, for comparisons)."""
    objective: str = "grpo"
    """The built-in objective when ``forward_backward`` gets no ``loss_fn``: ``grpo`` or ``ppo``."""
    loss_config: PolicyLossConfig | None = None
    """Clip, KL and aggregation of the built-in objective (None: the objective's defaults)."""
    recompute: bool = False
    keep: tuple[str, ...] = ()
    """Kept regions under recomputation (``attention``, ``linear_attention``)."""
    param_dtype: str | None = None
    """FSDP2 compute dtype with a mesh (e.g. ``"bfloat16"`` over float32 masters)."""
    reduce_dtype: str | None = None
    cpu_offload: bool = False

    def __post_init__(self):
        for name in ("lr", "eps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise InvalidInputError(name, f"must be a positive finite number, got {v!r}")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise InvalidInputError("weight_decay", f"must be >= 0, got {self.weight_decay!r}")
        if self.lr_schedule not in SCHEDULES:
            raise InvalidInputError("lr_schedule", f"unknown {self.lr_schedule!r}; choose one of {SCHEDULES}")
        if self.lr_schedule != "constant" and not (
            isinstance(self.total_steps, int) and self.total_steps > 0
        ):
            raise InvalidInputError(
                "total_steps", f"a positive integer is needed by lr_schedule={self.lr_schedule!r}"
            )
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise InvalidInputError("warmup_steps", f"must be an integer >= 0, got {self.warmup_steps!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise InvalidInputError("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.max_grad_norm is not None and not (
            self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)
        ):
            raise InvalidInputError("max_grad_norm", f"must be positive or None, got {self.max_grad_norm!r}")
        if not (isinstance(self.capacity, int) and self.capacity > 0):
            raise InvalidInputError("capacity", f"must be a positive integer, got {self.capacity!r}")
        if not (isinstance(self.microbatch_cost, int) and 0 <= self.microbatch_cost <= self.capacity):
            raise InvalidInputError(
                "microbatch_cost",
                f"must be an integer in [0, capacity = {self.capacity}], got {self.microbatch_cost!r}",
            )
        if self.mode not in ("compact", "trajectory"):
            raise InvalidInputError("mode", f"choose compact or trajectory, got {self.mode!r}")
        if self.objective not in ("grpo", "ppo"):
            raise InvalidInputError("objective", f"choose grpo or ppo, got {self.objective!r}")

    def parallelize_options(self) -> dict:
        """The ``parallelize`` keywords this config asks for (``load_pretrained(..., parallelize=)``)."""
        return dict(
            recompute=self.recompute,
            keep=self.keep,
            param_dtype=_dtype(self.param_dtype),
            reduce_dtype=_dtype(self.reduce_dtype),
            cpu_offload=self.cpu_offload,
        )

    def lr_factor(self, step: int) -> float:
        """The learning-rate multiplier after ``step`` optimizer steps."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.lr_schedule == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        frac = min(1.0, (step - self.warmup_steps) / span)
        decay = 1.0 - frac if self.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


@dataclass
class EngineOutput:
    """What :meth:`HartsEngine.forward_backward` returns (equal on every rank)."""

    loss: float
    """The step loss (objective + MoE router loss), summed over the step's microbatches."""
    logprobs: torch.Tensor
    """float32 [P]: current log-probs of every target, in the caller's per-target order (cpu)."""
    metrics: dict = field(default_factory=dict)


@dataclass
class StepReport:
    """What :meth:`HartsEngine.optimizer_step` did."""

    step: int
    """Optimizer steps taken so far (not counting skipped ones)."""
    grad_norm: float
    """The global gradient norm before clipping (over every rank's shards)."""
    lr: float
    skipped: bool = False
    reason: str = ""


def _dtype(name):
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in ("float32", "bfloat16", "float16"):
        raise InvalidInputError("param_dtype", f"unknown dtype {name!r}")
    return getattr(torch, name)


class HartsEngine:
    """Model, optimizer (AdamW), LR schedule, gradient clipping and planner of one training job.

    ``model``: a :class:`~harts_runtime.models.HybridModel` (e.g. from
    :func:`harts_runtime.load_pretrained`); with ``mesh`` (``ParallelDims(...).build_mesh()``) it is
    parallelized here unless it already is. Every rank constructs the engine with the same model and
    calls every method in the same order (the collectives need it).
    """

    def __init__(self, model: nn.Module, config: EngineConfig | None = None, *, mesh=None):
        from harts_runtime.recompute import apply_recompute

        self.config = cfg = config or EngineConfig()
        self.model, self.mesh = model, mesh
        if mesh is not None and getattr(model, "_harts_parallel", None) is None:
            from harts_runtime.parallel import parallelize

            parallelize(model, mesh, **cfg.parallelize_options())
        elif mesh is None and cfg.recompute:
            apply_recompute(model, keep=cfg.keep)
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, cfg.lr_factor)
        self.step = 0
        self.model.train()

    @classmethod
    def from_pretrained(
        cls, path, config: EngineConfig | None = None, *, mesh=None, dtype=None, device=None, **overrides
    ):
        """Load a transformers checkpoint folder (:func:`harts_runtime.load_pretrained`; with a mesh
        straight into the sharded model, each rank reading its slices) and build the engine."""
        from harts_runtime.hf import load_pretrained

        cfg = config or EngineConfig()
        if mesh is None:
            model = load_pretrained(path, dtype=dtype, device=device, **overrides)
        else:
            model = load_pretrained(
                path,
                dtype=dtype,
                device=device,
                mesh=mesh,
                parallelize=cfg.parallelize_options(),
                **overrides,
            )
        return cls(model, cfg, mesh=mesh)

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def dp(self) -> int:
        return 1 if self.mesh is None else self.mesh.dims.dp

    # ------------------------------------------------------------------ inputs
    def step_inputs(self, rollouts) -> StepInputs:
        """A :class:`StepInputs` of ``rollouts`` (a :class:`Rollouts` or a :class:`StepInputs`), its
        token ids checked against the model's vocabulary."""
        if isinstance(rollouts, StepInputs):
            step = rollouts
        elif isinstance(rollouts, Rollouts):
            rollouts.check(self.vocab_size)
            step = rollouts.step_inputs(self.config.objective, self.config.loss_config)
        else:
            raise InvalidInputError(
                "rollouts", f"expected Rollouts or StepInputs, got {type(rollouts).__name__}"
            )
        step.check_tokens(self.vocab_size)
        return step

    def _plan(self, step: StepInputs):
        """``(plan, plan_seconds)``: the step plan (its microbatches on DP replicas and slots), or for
        the trajectory baseline a plan-like packing of expanded trajectories."""
        import harts_planner as hp

        t0 = time.perf_counter()
        cfg = self.model.config
        if self.config.mode == "compact":
            plan = hp.plan_step(
                step.batch,
                self.dp,
                self.config.capacity,
                cfg.chunk_size,
                microbatch_cost=self.config.microbatch_cost,
            )
        else:
            plan = _TrajectoryPlan(step, self.config.capacity, self.dp)
        return plan, time.perf_counter() - t0

    # ------------------------------------------------------------------ step
    def forward_backward(
        self, rollouts, loss_fn: LossFn | None = None, *, forward_only: bool = False
    ) -> EngineOutput:
        """Run the step's microbatches (this rank's replica's, slot by slot) forward and, unless
        ``forward_only``, backward, accumulating gradients; returns the step loss, the log-probs of
        every target in the caller's order, and metrics. ``loss_fn``: ``loss_fn(logprobs, inputs)
        -> loss`` or ``(loss, metrics)`` with step-level denominators
        (:mod:`harts_runtime.loss.functions`; None: the built-in GRPO / PPO)."""
        from harts_runtime.train import run_microbatch

        step = self.step_inputs(rollouts)
        plan, plan_s = self._plan(step)
        mode = self.config.mode
        dev = self.model.device
        lp_all = torch.zeros(step.num_targets, dtype=torch.float32, device=dev)
        sums = defaultdict(float)
        metric_sums = defaultdict(float)

        def microbatch(slot, traj):
            with torch.set_grad_enabled(not forward_only):
                loss, st = run_microbatch(
                    self.model, step, traj, mode, loss_fn=loss_fn, backward=not forward_only
                )
            lp_all[st["target_index"].to(dev)] = st["logprobs"].float()
            for k in ("policy_loss", "router_loss"):
                sums[k] += float(st[k])
            for k in ("rows", "semantic_tokens", "replay_tokens", "num_calls"):
                sums[k] += st[k]
            for k, v in st["metrics"].items():
                metric_sums[k] += float(v)
            sums["microbatches"] += bool(len(traj))
            return loss

        t0 = time.perf_counter()
        if self.mesh is None:
            total = 0.0
            for j, traj in enumerate(plan.microbatches):
                total += float(microbatch(j, np.asarray(traj, dtype=np.int64)))
        else:
            from harts_runtime.parallel import run_replica_step

            total = run_replica_step(plan, self.mesh, microbatch).loss
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        fbg_s = time.perf_counter() - t0
        for k, v in metric_sums.items():  # the loss function's metrics are step shares: summed
            sums[f"loss_fn/{k}"] = v
        if self.mesh is not None and self.dp > 1:
            lp_all = self._sum_over_dp(lp_all)
            keys = sorted(sums)  # the same names on every rank (a padding microbatch reports them too)
            vec = self._sum_over_dp(torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=dev))
            sums = dict(zip(keys, vec.tolist()))
        metrics = {
            "loss": total,
            "policy_loss": sums["policy_loss"],
            "router_loss": sums["router_loss"],
            "semantic_tokens": step.batch.semantic_tokens,
            "rows": int(sums["rows"]),
            "compression": step.batch.semantic_tokens / max(1, sums["rows"]),
            "replay_tokens": int(sums["replay_tokens"]),
            "kda_calls": int(sums["num_calls"]),
            "microbatches": int(sums["microbatches"]),
            "plan_seconds": plan_s,
            "fbg_seconds": fbg_s,
        }
        metrics.update({k: v for k, v in sums.items() if k.startswith("loss_fn/")})
        return EngineOutput(total, lp_all.cpu(), metrics)

    def _sum_over_dp(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t, group=self.mesh.dp.get_group())
        return t

    @torch.no_grad()
    def logprobs(self, rollouts) -> torch.Tensor:
        """Current log-probs of every target of ``rollouts``, float32 [P] in the caller's order."""
        return self.forward_backward(rollouts, forward_only=True).logprobs

    # ------------------------------------------------------------------ optimizer
    def grad_norm(self) -> float:
        """The global L2 norm of the accumulated gradients over every rank's shards (DTensor
        gradients are grouped by mesh: dense and expert parameters live on different meshes)."""
        from torch.distributed.tensor import DTensor

        groups: dict = defaultdict(list)
        for p in self.model.parameters():
            if p.grad is not None:
                g = p.grad
                groups[id(g.device_mesh) if isinstance(g, DTensor) else None].append(g)
        sq = 0.0
        for gs in groups.values():
            n = torch.nn.utils.get_total_norm(gs, 2.0, error_if_nonfinite=False, foreach=True)
            if isinstance(n, DTensor):
                n = n.full_tensor()
            sq += float(n) ** 2
        return math.sqrt(sq)

    def optimizer_step(self) -> StepReport:
        """Clip, step the optimizer and the LR schedule, update the MoE expert biases (their
        multiplicity-weighted counts summed over ranks first), zero the gradients. When the gradient
        norm is not finite the step is skipped, the gradients dropped, and the report says so."""
        norm = self.grad_norm()
        lr = self.optimizer.param_groups[0]["lr"]
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            for m in self.model.modules():
                if hasattr(m, "local_tokens_per_expert"):
                    m.local_tokens_per_expert.zero_()
            return StepReport(self.step, norm, lr, True, f"non-finite gradient norm {norm}; step skipped")
        if self.config.max_grad_norm is not None and norm > self.config.max_grad_norm:
            coef = self.config.max_grad_norm / (norm + 1e-6)
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)
        self.optimizer.step()
        self.scheduler.step()
        if self.mesh is not None:
            from harts_runtime.parallel import sync_expert_load

            sync_expert_load(self.model, self.mesh)
        self.model.update_expert_bias()
        for (
            moe
        ) in self.model.moe_layers():  # per-step counts (update_expert_bias resets them only with a bias)
            moe.local_tokens_per_expert.zero_()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return StepReport(self.step, norm, lr)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path) -> None:
        """Model, optimizer, schedule position, step and each rank's RNG state under ``path`` (DCP;
        every rank calls it). Loadable by :meth:`load` under another parallel configuration."""
        from harts_runtime.parallel.checkpoint import save_checkpoint

        extra = {"engine_step": self.step, "config": _jsonable(dataclasses.asdict(self.config))}
        save_checkpoint(path, self.model, self.optimizer, extra=extra)
        rank = _rank()
        torch.save(_rng_state(), Path(path) / f"rng-{rank}.pt")
        _barrier()

    def load(self, path) -> dict:
        """Restore what :meth:`save` wrote (under any parallel configuration); returns the extra
        record. A rank without its own saved RNG state takes rank 0's."""
        from harts_runtime.parallel.checkpoint import load_checkpoint

        extra = load_checkpoint(path, self.model, self.optimizer)
        if "engine_step" not in extra:
            raise InvalidInputError(
                "path", f"{path} is a checkpoint without an engine step (not saved by HartsEngine.save)"
            )
        self.step = int(extra["engine_step"])
        self.scheduler.last_epoch = self.step
        for g, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            g["lr"] = base * self.config.lr_factor(self.step)
        own = Path(path) / f"rng-{_rank()}.pt"
        rng = own if own.exists() else Path(path) / "rng-0.pt"
        if rng.exists():
            _set_rng_state(torch.load(rng, weights_only=False))
        return extra

    def export_weights(self, model_type: str | None = None):
        """``(transformers name, tensor)`` pairs, one tensor at a time (:func:`harts_runtime.hf.export_weights`;
        every rank iterates under a mesh)."""
        from harts_runtime.hf import export_weights

        return export_weights(self.model, model_type)


class _TrajectoryPlan:
    """The trajectory-wise baseline as a plan-like object: first-fit-decreasing packs of expanded
    trajectories at the capacity, dealt to replicas round-robin by size."""

    def __init__(self, step: StepInputs, capacity: int, dp: int):
        from harts_runtime.layout.rows import pack_trajectories

        lengths = np.asarray(step.batch.lengths, dtype=np.int64)
        packs = sorted(pack_trajectories(lengths, capacity), key=lambda p: -int(lengths[p].sum()))
        self.microbatches = packs
        self.dp_size = dp
        self.replica = np.arange(len(packs)) % dp
        self.slot = np.arange(len(packs)) // dp


def _jsonable(d: dict) -> dict:
    return {
        k: (list(v) if isinstance(v, tuple) else v)
        for k, v in d.items()
        if not isinstance(v, PolicyLossConfig)
    }


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict:
    out = {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
