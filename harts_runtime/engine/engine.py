"""The training engine: :class:`HartsEngine` (its inputs, plan and step loop, and the doors to the
other jobs: the model's build in :mod:`~harts_runtime.engine.load`, the step's metrics in
:mod:`~harts_runtime.engine.metrics`, the optimizer step in :mod:`~harts_runtime.engine.optimizer_step`,
checkpoints in :mod:`~harts_runtime.engine.checkpoint`, the weights stream in
:mod:`~harts_runtime.engine.weights`) and what its methods return (:class:`EngineOutput`,
:class:`StepReport`)."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from harts_runtime.engine.checkpoint import load_engine, save_engine
from harts_runtime.engine.config import EngineConfig
from harts_runtime.engine.metrics import step_metrics
from harts_runtime.engine.optimizer_step import StepReport, grad_norm, optimizer_step
from harts_runtime.engine.planning import microbatch_call_plan, plan_step
from harts_runtime.engine.trajectory_plan import TrajectoryPlan
from harts_runtime.errors import InvalidInputError
from harts_runtime.loss.functions import LossFn, zero_loss_fn
from harts_runtime.loss.objectives import PolicyLossConfig
from harts_runtime.microbatch import make_microbatch, run_microbatch
from harts_runtime.rollouts import Rollouts
from harts_runtime.step_inputs import StepInputs

if TYPE_CHECKING:
    from harts_runtime.models import HybridModel, ModelConfig
    from harts_runtime.parallel.context import RowMap
    from harts_runtime.parallel.dims import ParallelMesh

__all__ = ["EngineOutput", "HartsEngine", "StepReport"]


@dataclass
class EngineOutput:
    """What :meth:`HartsEngine.forward_backward` returns (equal on every rank)."""

    loss: float
    """The step loss (objective + MoE router loss), summed over the step's microbatches."""
    logprobs: torch.Tensor
    """float32 [P] (float64 for a float64 model): current log-probs of every target, in the caller's per-target order (cpu)."""
    metrics: dict = field(default_factory=dict)


class HartsEngine:
    """Model, optimizer (AdamW), LR schedule, gradient clipping and planner of one training job.

    Build one with :meth:`build` (a checkpoint folder, a flavor or a model config; with ``dims``
    sharded over a device mesh), or wrap a model you made, or a model config
    (``HartsEngine(model, config, mesh=mesh)``): it goes through the same path as :meth:`build`'s
    sources (:func:`harts_runtime.engine.load.build_model`: parallelized there unless it already
    is); the engine itself only wires the model to its optimizer. Every rank constructs the engine
    alike and calls every method in the same order (the collectives need it). ``optimizer``: use
    this optimizer instead of an AdamW built from ``config.optimizer``.
    """

    def __init__(
        self,
        model: HybridModel | ModelConfig,
        config: EngineConfig | None = None,
        *,
        mesh: ParallelMesh | None = None,
        optimizer=None,
    ):
        from harts_runtime.engine.load import build_model

        config = config or EngineConfig()
        built, _ = build_model(model, config, mesh)  # the one path every source takes
        self._wire(built, config, mesh, optimizer)

    def _wire(self, model: HybridModel, config: EngineConfig, mesh: ParallelMesh | None, optimizer) -> None:
        """The engine around a model built for it: routing replay switched on when asked, the
        optimizer (``optimizer`` or an AdamW of ``config.optimizer``) and the LR schedule."""
        self.config = cfg = config
        self.model, self.mesh = model, mesh
        if cfg.routing_replay:
            from harts_runtime.layers.moe import enable_routing_replay

            if not enable_routing_replay(model):
                raise InvalidInputError("routing_replay", "the model has no MoE layer to replay routes in")
        opt = cfg.optimizer
        self.optimizer = optimizer or torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        self.scheduler = (
            None
            if opt.lr_schedule == "external"
            else torch.optim.lr_scheduler.LambdaLR(self.optimizer, opt.lr_factor)
        )
        self.frozen: list[str] = []
        """Parameters frozen because the model's transformers family cannot carry them (:meth:`build`)."""
        self.step = 0
        self._planner = None
        self.model.train()

    @classmethod
    def build(
        cls,
        source,
        config: EngineConfig | None = None,
        dims=None,
        *,
        mesh=None,
        dtype: str | None = None,
        device=None,
        freeze: bool | None = None,
        **overrides,
    ) -> HartsEngine:
        """The one way a training job gets its model: source -> model -> ``parallelize`` -> each rank
        reads its slices -> one freezing rule -> optimizer.

        ``source``: a transformers checkpoint folder (``str`` / ``Path``), a flavor name
        (:data:`harts_runtime.models.FLAVORS`, random weights), a
        :class:`~harts_runtime.models.ModelConfig` or a model already made. ``dims``: None for one
        process, or a :class:`~harts_runtime.parallel.ParallelDims` whose mesh is built here
        (torch.distributed initialised by the caller; ``mesh=`` passes one built already). The
        model is built and parallelized by :func:`harts_runtime.engine.load.build_model`: a
        checkpoint is read straight into the sharded model (the model is made on the meta device,
        parallelized, and each rank reads only its slices). ``freeze`` (default: for checkpoint
        sources) freezes the parameters the transformers family cannot carry
        (:func:`harts_runtime.hf.freeze_family_constants`), named in :attr:`frozen`. ``overrides``:
        model-config fields (``chunk_size=16``, ``num_layers=2`` for a flavor)."""
        from harts_runtime.engine.load import build_model

        config = config or EngineConfig()
        if mesh is None and dims is not None:
            mesh = dims.build_mesh(torch.device(device).type if device is not None else None)
        model, frozen = build_model(
            source, config, mesh, dtype=dtype, device=device, freeze=freeze, **overrides
        )
        engine = cls.__new__(cls)
        engine._wire(model, config, mesh, None)
        engine.frozen = frozen
        return engine

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def dp(self) -> int:
        return 1 if self.mesh is None else self.mesh.dims.dp

    @property
    def cp(self) -> int:
        """C, the context-parallel degree: a microbatch holds up to ``C x capacity`` rows."""
        return 1 if self.mesh is None else self.mesh.dims.cp

    @property
    def planner(self):
        """The :class:`harts_planner.Planner` of ``config.planner``: in-process, or a sidecar."""
        if self._planner is None:
            from harts_planner import Planner

            self._planner = Planner(self.config.planner)
        return self._planner

    # ------------------------------------------------------------------ inputs
    def step_inputs(self, rollouts, *, objective: bool = True) -> StepInputs:
        """A :class:`StepInputs` of ``rollouts`` (a :class:`Rollouts` or a :class:`StepInputs`), its
        token ids checked against the model's vocabulary and its values checked: the step's one
        check (the microbatches below check nothing). A :class:`StepInputs` is checked again each
        time it comes in (its fields may have been edited in place since, even through ``.numpy()``);
        a :class:`Rollouts` once, by :meth:`Rollouts.check` (:meth:`Rollouts.checked_step_inputs`:
        its step is built without checking the same values again).
        ``objective=False`` (a forward-only step without a loss): the rollouts need none of the
        objective's fields (no ``ref_logprobs`` under a KL penalty)."""
        if isinstance(rollouts, StepInputs):
            step = rollouts
            step.check_values()
        elif isinstance(rollouts, Rollouts):
            loss_config = self.config.loss_config if objective else PolicyLossConfig()
            step = rollouts.checked_step_inputs(self.vocab_size, self.config.objective, loss_config)
        else:
            raise InvalidInputError(
                "rollouts", f"expected Rollouts or StepInputs, got {type(rollouts).__name__}"
            )
        step.check_tokens(self.vocab_size)
        return step

    def plan(self, step: StepInputs, step_plan=None):
        """``(plan, call_plans, plan_seconds)``: the step plan (its microbatches on DP replicas and
        slots; for the trajectory baseline a plan-like packing of expanded trajectories;
        ``step_plan`` when given), the call plan of each microbatch this rank runs (keyed by its
        first trajectory), and the planner's time for both."""
        from harts_runtime.parallel.data import rank_schedule

        t0 = time.perf_counter()
        cfg = self.model.config
        ex = self.config.execution
        calls = {}
        if ex.mode == "compact":
            plan = step_plan or plan_step(
                cfg,
                step,
                self.dp,
                ex.capacity,
                planner=self.planner,
                cp_size=self.cp,
                microbatch_cost=ex.microbatch_cost,
            )
            for traj in rank_schedule(plan, self.mesh):
                calls[int(traj[0])] = microbatch_call_plan(cfg, step, traj, planner=self.planner)
        else:
            plan = TrajectoryPlan(step, ex.capacity * self.cp, self.dp)
        return plan, calls, time.perf_counter() - t0

    # ------------------------------------------------------------------ step
    def forward_backward(
        self,
        rollouts,
        loss_fn: LossFn | None = None,
        *,
        forward_only: bool = False,
        keep_hidden=None,
        progress=None,
        plan=None,
    ) -> EngineOutput:
        """Run the step's microbatches (this rank's replica's, slot by slot) forward and, unless
        ``forward_only``, backward, accumulating gradients; returns the step loss, the log-probs of
        every target in the caller's order, and metrics. This is the step loop every caller runs
        (``harts-train``, the verl backend, :func:`harts_runtime.train.train_step`, the benchmarks).

        ``loss_fn``: ``loss_fn(logprobs, inputs) -> loss`` or ``(loss, metrics)`` with step-level
        denominators (:mod:`harts_runtime.loss.functions`; None: the built-in GRPO / PPO; a
        forward-only step computes none). ``keep_hidden``: a hook called with each non-empty
        microbatch's result dict, which then also holds its final normed hidden rows (``hidden``,
        detached) with ``row_index`` (the row of each target), ``target_index`` and ``logprobs``
        (e.g. the verl backend's entropy). ``progress(done, total)``: called after each slot.
        ``plan``: a step plan made beforehand (compact mode; the call plans are still made here).
        A forward-only step runs the model in eval mode (its MoE expert-load counts are not added
        to those the next :meth:`optimizer_step` uses) and leaves the train / eval mode as it was;
        without a ``loss_fn`` it needs none of the objective's fields (no ``ref_logprobs``).
        A step's values are checked when it runs (an in-place NaN in its advantages is refused).
        Metrics: the step's sums, the loss function's (``loss_fn/*``: summed shares), the objective's
        statistics over the whole step (``objective/*``, :mod:`harts_runtime.loss.statistics`: clip
        fraction, response length, advantage mean / std, KL with reference log-probs, entropy when
        the step's config asks for it; a scoring pass, forward-only without a ``loss_fn``, computes
        no entropy) and the rollout mismatch (``mismatch/*``)."""
        from harts_runtime.parallel.data import run_replica_step

        step = self.step_inputs(rollouts, objective=not (forward_only and loss_fn is None))  # checked
        scoring = forward_only and loss_fn is None  # log-probs only: no objective, no entropy
        entropy = step.config.wants_entropy and not scoring
        if entropy and self.mesh is not None:
            raise InvalidInputError(
                "entropy_coef", "the entropy (bonus or entropy_metric) runs in one process only (no mesh)"
            )
        plan, calls, plan_s = self.plan(step, plan)
        ex = self.config.execution
        dev = self.model.device
        lp_dtype = torch.float64 if self.model.config.dtype == "float64" else torch.float32
        lp_all = torch.zeros(step.num_targets, dtype=lp_dtype, device=dev)
        ent_all = torch.zeros_like(lp_all) if entropy else None
        sums = defaultdict(float)
        sums["trajectory_fallbacks"] = 0.0  # every rank sums the same names over DP
        metric_sums = defaultdict(float)
        loss_fn = zero_loss_fn if (forward_only and loss_fn is None) else loss_fn
        slots = _slot_count(plan, self.mesh)

        def microbatch(slot, traj):
            call_plan = calls.get(int(traj[0])) if len(traj) else None
            mode = ex.mode
            # under CP by state passing (cp_mode states / auto) every microbatch runs compact: the
            # split and the local call plans are built from its call plan
            compact = ex.compact_always or getattr(self.model, "_harts_cp_layout", None) is not None
            if call_plan is not None and not compact and _no_fewer_rows(call_plan, step, traj, ex):
                mode, call_plan = "trajectory", None  # short trees: the same math on fewer rows
                sums["trajectory_fallbacks"] += 1
            mb = make_microbatch(self.model, step, traj, mode, call_plan)
            with torch.set_grad_enabled(not forward_only):
                loss, st = run_microbatch(
                    self.model,
                    step,
                    mode=mode,
                    microbatch=mb,
                    loss_fn=loss_fn,
                    backward=not forward_only,
                    no_replay=ex.no_replay,
                    return_hidden=keep_hidden is not None and len(traj) > 0,
                    entropy=entropy,
                )
            lp_all[st["target_index"].to(dev)] = st["logprobs"].to(lp_dtype)
            if ent_all is not None and "entropy" in st:
                ent_all[st["target_index"].to(dev)] = st["entropy"].to(lp_dtype)
            for k in ("policy_loss", "router_loss"):
                sums[k] += float(st[k])
            for k in ("rows", "semantic_tokens", "replay_tokens", "num_calls"):
                sums[k] += st[k]
            for k, v in st.items():  # cp_mode's choice: microbatches that ran block i by state passing
                if k.startswith("cp_states/"):
                    sums[k] += v
            for k, v in st["metrics"].items():
                metric_sums[k] += float(v)
            sums["microbatches"] += bool(len(traj))
            if keep_hidden is not None and len(traj):
                if self.cp > 1:  # every row's hidden state, not only this CP rank's rows
                    from harts_runtime.parallel.context import gather_cp

                    assert self.mesh is not None  # cp > 1 only with a mesh
                    row_map = cast("RowMap", self.model._harts_cp_rows)  # set by apply_cp_rows
                    held = row_map.get(mb.layout.num_rows)
                    st["hidden"] = gather_cp(st["hidden"], self.mesh.cp, held)
                keep_hidden(st)
            if progress is not None:
                progress(slot + 1, slots)
            return loss

        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        was_training = self.model.training
        if forward_only:  # no MoE expert-load counts for the next optimizer_step's bias update
            self.model.eval()
        try:
            with torch.set_grad_enabled(not forward_only):
                result = run_replica_step(plan, self.mesh, microbatch)
        finally:
            self.model.train(was_training)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        fbg_s = time.perf_counter() - t0
        for k, v in metric_sums.items():  # the loss function's metrics are step shares: summed
            sums[f"loss_fn/{k}"] = v
        if self.mesh is not None and self.dp > 1:
            lp_all = self._sum_over_dp(lp_all)
            if ent_all is not None:
                ent_all = self._sum_over_dp(ent_all)
            keys = sorted(sums)  # the same names on every rank (a padding microbatch reports them too)
            vec = self._sum_over_dp(torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=dev))
            sums = dict(zip(keys, vec.tolist()))
        total = result.loss
        metrics = step_metrics(step, sums, lp_all, ent_all, self.step, plan_s, fbg_s, result)
        return EngineOutput(total, lp_all.cpu(), metrics)

    def _sum_over_dp(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        assert self.mesh is not None  # summed over DP only with a mesh
        dist.all_reduce(t, group=self.mesh.dp.get_group())
        return t

    def logprobs(self, rollouts) -> torch.Tensor:
        """Current log-probs of every target of ``rollouts``, float32 [P] in the caller's order."""
        with torch.no_grad():
            return self.forward_backward(rollouts, forward_only=True).logprobs

    def reference_policy(self):
        """A frozen copy of the model as it is now, scoring through this engine's step path
        (:class:`~harts_runtime.engine.reference.ReferencePolicy`: ``ref.logprobs(rollouts)``,
        ``ref.attach(rollouts)`` for a KL term); one more copy of the weights in memory."""
        from harts_runtime.engine.reference import ReferencePolicy

        return ReferencePolicy(self)

    # ------------------------------------------------------------------ optimizer
    def grad_norm(self) -> float:
        """The global L2 norm of the accumulated gradients over every rank's shards
        (:func:`harts_runtime.engine.optimizer_step.grad_norm`)."""
        return grad_norm(self.model)

    def optimizer_step(self) -> StepReport:
        """Clip, step the optimizer and the LR schedule (none under ``lr_schedule="external"``),
        update the MoE expert biases (their multiplicity-weighted counts summed over ranks first),
        zero the gradients. When the gradient norm is not finite the step is skipped, the gradients
        dropped, and the report says so (:func:`harts_runtime.engine.optimizer_step.optimizer_step`)."""
        report = optimizer_step(
            self.model,
            self.optimizer,
            self.scheduler,
            self.mesh,
            self.config.optimizer.max_grad_norm,
            self.step,
        )
        self.step = report.step
        return report

    # ------------------------------------------------------------------ checkpoints
    def save(self, path, *, files: dict | None = None, extra: dict | None = None) -> None:
        """Model, optimizer, schedule position, step and each rank's RNG state under ``path`` (DCP;
        every rank calls it), with ``files`` (``{name: str | bytes}``, e.g. a trainer's record)
        written by rank 0 into the same folder and ``extra`` (JSON-able; e.g. the caller's own step
        counter) added to the record :meth:`load` returns. Written whole or not at all: staged beside
        ``path`` and renamed into place when complete, with a manifest of SHA-256 checksums
        (:func:`harts_runtime.parallel.checkpoint.save_checkpoint`), so a kill at any point leaves
        the previous checkpoint or the new one; a full disk raises :class:`InvalidInputError`
        naming the file and leaves ``path`` as it was. An existing ``path`` is replaced only when it
        is a HARTS checkpoint (by its manifest's content); any other non-empty folder or a file is
        refused, naming it, before anything is written. Loadable by :meth:`load` under another
        parallel configuration. Each rank's RNG state is ``rng-<rank>.pt``: tensors and numbers
        only, read back with ``torch.load(weights_only=True)``."""
        save_engine(self, path, files=files, extra=extra)

    def load(self, path) -> dict:
        """Restore what :meth:`save` wrote (under any parallel configuration); returns the extra
        record. A rank without its own saved RNG state takes rank 0's. Nothing read runs code
        (DCP's metadata through a restricted unpickler, the RNG state with ``weights_only=True``;
        :mod:`harts_runtime.parallel.safe_load`)."""
        return load_engine(self, path)

    def save_pretrained(self, path, model_type: str | None = None) -> None:
        """Write the model as a transformers checkpoint folder (:func:`harts_runtime.hf.save_pretrained`;
        collective under a mesh)."""
        from harts_runtime.hf import save_pretrained

        save_pretrained(self.model, path, model_type=model_type)

    def export_weights(self, model_type: str | None = None, *, names: str = "checkpoint"):
        """``(name, tensor)`` pairs, one tensor at a time (:func:`harts_runtime.hf.export_weights`;
        every rank iterates under a mesh). ``names="checkpoint"``: a checkpoint folder's spelling
        (vLLM / SGLang ``load_weights``); ``names="transformers"``: a transformers model's in-memory
        names and fused shapes (the adapter's in-memory table, assembled from our tensors), for
        ``model.load_state_dict(dict(pairs), strict=True)``."""
        from harts_runtime.hf import export_weights

        if names not in ("checkpoint", "transformers"):
            raise InvalidInputError("names", f"choose 'checkpoint' or 'transformers', got {names!r}")
        return export_weights(self.model, model_type, memory=names == "transformers")

    def weight_manifest(self, names: str = "transformers", model_type: str | None = None):
        """The weights a rollout engine loads: name, dtype, full shape, layer group and holding
        ranks of each, in stream order (:func:`harts_runtime.engine.weights.weight_manifest`)."""
        from harts_runtime.engine.weights import weight_manifest

        return weight_manifest(self.model, names, model_type)

    def weights(
        self, names: str = "transformers", bucket_bytes: int = 1 << 30, model_type: str | None = None
    ):
        """Full tensors in manifest order, one bucket of at most ``bucket_bytes`` at a time, each
        rank gathering one bucket's parameters at a time (collective under a mesh: every rank
        iterates) (:func:`harts_runtime.engine.weights.weights`)."""
        from harts_runtime.engine.weights import weights

        return weights(self.model, names, bucket_bytes, model_type)


def _no_fewer_rows(call_plan, step: StepInputs, traj, ex) -> bool:
    """Whether a compact microbatch would execute at least as many rows (its compact rows plus the
    linear-attention replay rows) as its trajectories expanded: short trees that share little."""
    compact = int(call_plan.compact_tokens) + (0 if ex.no_replay else int(call_plan.replay_tokens))
    expanded = int(np.asarray(step.batch.lengths, dtype=np.int64)[np.asarray(traj, dtype=np.int64)].sum())
    return compact >= expanded


def _slot_count(plan, mesh) -> int:
    from harts_runtime.parallel.data import step_slots

    return step_slots(plan) if mesh is not None else sum(1 for m in plan.microbatches if len(m))
