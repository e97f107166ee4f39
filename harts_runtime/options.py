"""Every option of a HARTS training job, declared once: what runs (:class:`ExecutionOptions`) and how
the weights move (:class:`OptimizerOptions`).

Each field is declared here with its default, its help text and its check; nothing else re-declares
it. :class:`~harts_runtime.engine.EngineConfig` composes the two, the verl backend's config composes
them (``actor.harts``), and ``harts-train`` generates its flags from them (:func:`option_fields`), so
a bad value is refused by the same check under every door, named after the field (``keep``), or
after the flag (``--keep``) on the command line. Importing this module needs no torch.

::

    ExecutionOptions(capacity=32_768, recompute=True, keep=("attention",))
    OptimizerOptions(lr=1e-6, lr_schedule="cosine", total_steps=100)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from harts_runtime.errors import InvalidInputError
from harts_runtime.regions import KEEPABLE

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_CHUNK_SIZE",
    "CP_MODES",
    "DTYPES",
    "KEEPABLE",
    "MODES",
    "SCHEDULES",
    "ExecutionOptions",
    "OptimizerOptions",
    "option_fields",
]

# The runtime's defaults of two planner settings, equal to the planner's own (harts_planner.call_plan
# and step_plan; tests/runtime/test_options_defaults.py pins them): declared here so that the layers
# and models, which read them, import no planner.
DEFAULT_CHUNK_SIZE = 64
"""The linear-attention chunk size B when none is given."""
DEFAULT_CAPACITY = 65_536
"""T: the compact rows of a microbatch on a GPU when none is given."""

CP_MODES = ("heads", "states", "auto")
"""How context parallelism runs each mixer: ``heads`` (head-parallel: every mixer's input rows
gathered, C capped by the heads), ``states`` (state passing on the planner's split: C past the head
count), ``auto`` (per layer and microbatch, the faster by the counted-bytes model; ``states`` where
the heads do not divide)."""
MODES = ("compact", "trajectory")
"""``compact``: HARTS; ``trajectory``: the trajectory-wise baseline (the same model and loss)."""
DTYPES = ("float32", "bfloat16", "float16")
SCHEDULES = ("constant", "linear", "cosine", "external")
"""LR schedules after warm-up; ``external``: the caller sets the learning rate (verl's scheduler)."""


def _opt(default: Any, help: str, **cli: Any) -> Any:
    """A field with its help text (and, in ``cli``, what its generated flag needs: ``choices``,
    ``metavar``)."""
    metadata = {"help": help, **cli}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def _integer(v, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise InvalidInputError(name, f"must be an integer {bound}, got {v!r}")
    return v


def _number(v, name: str, *, lo: float | None = None, hi: float | None = None, positive=False) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (not positive or v > 0) and (lo is None or v >= lo) and (hi is None or v <= hi)
    if not ok:
        what = "a positive finite number" if positive else "a finite number"
        if lo is not None or hi is not None:
            what += f" in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise InvalidInputError(name, f"must be {what}, got {v!r}")
    return float(v)


def _choice(v, name: str, choices) -> str:
    if v not in choices:
        raise InvalidInputError(name, f"unknown {v!r}; choose one of {tuple(choices)}")
    return v


def _boolean(v, name: str) -> bool:
    if not isinstance(v, bool):
        raise InvalidInputError(name, f"must be true or false, got {v!r}")
    return v


@dataclass(kw_only=True, frozen=True)
class ExecutionOptions:
    """How a step executes: planning, rows per microbatch, recomputation, FSDP2 dtypes, offload.
    None of them changes the training math (compact equals trajectory-wise); ``routing_replay``
    chooses which MoE experts run (the rollout engine's), in both executions alike."""

    capacity: int = _opt(
        DEFAULT_CAPACITY, "T: compact rows per microbatch (the planner's capacity)", metavar="T"
    )
    microbatch_cost: int = _opt(
        0,
        "the planner's fixed cost of a microbatch in compact tokens, in [0, capacity] (0: the paper's "
        "selection; benchmarks/train_eval.py's microbatches section fits it for a model and GPU)",
        metavar="TOKENS",
    )
    mode: str = _opt(
        "compact", "compact (HARTS) or trajectory (the trajectory-wise baseline, same loss)", choices=MODES
    )
    planner: str | None = _opt(
        None,
        "where steps are planned: none for this process, or a harts-planner serve sidecar's host:port",
        metavar="HOST:PORT",
    )
    recompute: bool = _opt(False, "full-block activation recomputation")
    keep: tuple[str, ...] = _opt(
        (),
        "with recompute: regions whose activations are kept instead of recomputed ('attention': the "
        "attention cores, a third of their cost, ~1.4 GB per MLA layer of a 65,536-row ling-tiny "
        "microbatch; 'linear_attention': the KDA / Gated DeltaNet rounds, ~1.9 GB per KDA layer there)",
        choices=KEEPABLE,
        metavar="REGIONS",
    )
    no_replay: bool = _opt(False, "KDA without replay rows (the paper's Section 5.4 ablation schedule)")
    compact_always: bool = _opt(
        False,
        "run every microbatch compact, even one whose compact rows plus replay rows are no fewer than its "
        "trajectories' rows (default: such a microbatch, of short trees that share little, runs "
        "trajectory-wise: the same math on fewer rows)",
    )
    param_dtype: str | None = _opt(
        None, "FSDP2 compute dtype under a mesh (default: the weights')", choices=DTYPES
    )
    reduce_dtype: str | None = _opt(
        None, "FSDP2 gradient reduction dtype (default: param_dtype's)", choices=DTYPES
    )
    cpu_offload: bool = _opt(False, "FSDP2 CPU offload of weights, gradients and optimizer state (CUDA)")
    cp_mode: str = _opt(
        "auto",
        "with cp > 1: heads (every mixer head-parallel, C capped by the head count), states (state "
        "passing on the planner's split, any C) or auto (per layer and microbatch by the counted-bytes "
        "model; the choice is in the step's metrics as cp_states/blocks.<i>)",
        choices=CP_MODES,
    )
    routing_replay: bool = _opt(
        False,
        "MoE routing replay: every MoE layer runs the experts the rollout engine chose for each token "
        "(the rollouts' routes; a shared prefix token takes the first trajectory's, disagreements "
        "counted as routing_replay/conflicts), the router trained through their gates",
    )

    def __post_init__(self):
        _integer(self.capacity, "capacity", 1)
        _integer(self.microbatch_cost, "microbatch_cost", 0, self.capacity)
        _choice(self.mode, "mode", MODES)
        if self.planner is not None and (not isinstance(self.planner, str) or not self.planner.strip()):
            raise InvalidInputError(
                "planner", f"must be host:port of a sidecar or None, got {self.planner!r}"
            )
        _boolean(self.recompute, "recompute")
        keep = (self.keep,) if isinstance(self.keep, str) else tuple(self.keep or ())
        bad = sorted(set(keep) - set(KEEPABLE))
        if bad:
            raise InvalidInputError("keep", f"unknown regions {bad}; choose from {list(KEEPABLE)}")
        if keep and not self.recompute:
            raise InvalidInputError("keep", "needs recompute (it names what recomputation keeps)")
        object.__setattr__(self, "keep", tuple(sorted(set(keep))))
        _boolean(self.no_replay, "no_replay")
        _boolean(self.compact_always, "compact_always")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) is not None:
                _choice(getattr(self, name), name, DTYPES)
        _boolean(self.cpu_offload, "cpu_offload")
        _choice(self.cp_mode, "cp_mode", CP_MODES)
        _boolean(self.routing_replay, "routing_replay")

    def parallelize_options(self) -> dict:
        """The keywords of :func:`harts_runtime.parallel.parallelize` these options ask for."""
        import torch

        return dict(
            recompute=self.recompute,
            keep=self.keep,
            param_dtype=None if self.param_dtype is None else getattr(torch, self.param_dtype),
            reduce_dtype=None if self.reduce_dtype is None else getattr(torch, self.reduce_dtype),
            cpu_offload=self.cpu_offload,
            cp_mode=self.cp_mode,
        )


@dataclass(kw_only=True, frozen=True)
class OptimizerOptions:
    """AdamW, its learning-rate schedule and gradient clipping."""

    lr: float = _opt(1e-6, "peak learning rate (AdamW)")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    betas: tuple[float, float] = _opt((0.9, 0.999), "AdamW betas")
    eps: float = _opt(1e-8, "AdamW epsilon")
    warmup_steps: int = _opt(0, "linear warm-up from 0 to lr over this many optimizer steps", metavar="N")
    lr_schedule: str = _opt(
        "constant",
        "after warm-up: constant, linear or cosine decay to min_lr_ratio * lr at total_steps, or external "
        "(the caller sets the learning rate)",
        choices=SCHEDULES,
    )
    total_steps: int | None = _opt(None, "where linear / cosine decay ends (needed by both)", metavar="N")
    min_lr_ratio: float = _opt(0.0, "decay floor as a fraction of lr")
    max_grad_norm: float | None = _opt(
        1.0, "clip the global gradient norm to this (None: no clipping; the norm is reported anyway)"
    )

    def __post_init__(self):
        _number(self.lr, "lr", positive=True)
        _number(self.eps, "eps", positive=True)
        _number(self.weight_decay, "weight_decay", lo=0.0)
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise InvalidInputError("betas", f"must be two numbers in [0, 1), got {self.betas!r}")
        for i, b in enumerate(self.betas):
            _number(b, f"betas[{i}]", lo=0.0, hi=1.0)
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        _integer(self.warmup_steps, "warmup_steps", 0)
        _choice(self.lr_schedule, "lr_schedule", SCHEDULES)
        if self.total_steps is not None:
            _integer(self.total_steps, "total_steps", 1)
        if self.lr_schedule in ("linear", "cosine") and self.total_steps is None:
            raise InvalidInputError(
                "total_steps", f"a positive integer is needed by lr_schedule={self.lr_schedule!r}"
            )
        _number(self.min_lr_ratio, "min_lr_ratio", lo=0.0, hi=1.0)
        if self.max_grad_norm is not None:
            _number(self.max_grad_norm, "max_grad_norm", positive=True)

    def lr_factor(self, step: int) -> float:
        """The learning-rate multiplier after ``step`` optimizer steps (1 under ``external``)."""
        if self.lr_schedule == "external":
            return 1.0
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.lr_schedule == "constant":
            return 1.0
        assert self.total_steps is not None  # __post_init__: linear and cosine need it
        span = max(1, self.total_steps - self.warmup_steps)
        frac = min(1.0, (step - self.warmup_steps) / span)
        decay = 1.0 - frac if self.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


def option_fields(cls) -> list[dataclasses.Field]:
    """The declared fields of an options class, each with ``metadata["help"]`` (and ``choices`` /
    ``metavar`` where a flag needs them): what ``harts-train`` generates its flags from."""
    return list(dataclasses.fields(cls))
