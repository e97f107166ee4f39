"""The compact-vs-trajectory demos and the synthetic step they train on (:func:`synthetic_step`).

* :func:`model_demo`: what ``harts-planner demo`` ends with, seconds on a CPU: one step of the tiny
  ``debug`` model on a few synthetic rollout trees, compact and trajectory-wise, printing what is true
  on any device (rows executed, work compression, equal losses) and the GPU speedup *measured* on an
  H200 (``harts_planner.measured``); no CPU timings (the CPU runs reference kernels).
* :func:`train_demo`: ``harts-train --mode both``, steps of any flavor and preset with timings.

Both executions train identical copies of one model, each an engine of its own
(:meth:`harts_runtime.engine.HartsEngine.build`, the step loop every caller runs), so every step
of the compact and the trajectory execution starts from the same weights and the two loss curves
can be compared step by step: they agree to float rounding (the same math).
"""

from __future__ import annotations

import json
import sys
import time
from typing import TextIO

import torch
from tqdm import tqdm

from harts_runtime.engine import EngineConfig, HartsEngine
from harts_runtime.errors import InvalidInputError
from harts_runtime.job_config import CAPACITY_DEFAULTS, LR_DEFAULTS
from harts_runtime.models import model_config
from harts_runtime.options import MODES
from harts_runtime.recompute import recompute_enabled
from harts_runtime.step_inputs import StepInputs
from harts_runtime.train import StepResult
from harts_runtime.trainer.data import synthetic_step
from harts_runtime.trainer.job import train_one

__all__ = ["DEMO_TREES", "model_demo", "synthetic_step", "train_demo", "train_modes"]

#: The model demo's batch: about 24 trajectories of the ``small`` preset's shape with shorter turns,
#: capped at 512 tokens (seed 0: 25 trajectories in 5 trees, S = 10,711 tokens, C = 2,956), so that a
#: step of the ``debug`` model takes seconds on a CPU while its microbatch still forks, hands KDA
#: states over and replays.
DEMO_TREES = dict(
    trees=(1, 8),
    trajectories=(24, 24),
    prompt_len=(200, 400),
    tool_len=(20, 200),
    turn_len=(5, 60),
    fork_min_depth=2,
    fork_prob=0.45,
    max_trajectory_tokens=512,
)


def _line(i: int, mode: str, r: StepResult) -> str:
    return (
        f"step {i} {mode:<10} tokens={r.semantic_tokens:,} rows={r.rows:,} "
        f"compression={r.compression:.2f}x microbatches={r.num_microbatches} calls={r.num_calls} "
        f"replay={r.replay_tokens:,} plan={r.plan_seconds * 1e3:.1f}ms "
        f"fbg={r.fbg_seconds:.2f}s loss={r.loss:.6f}"
    )


def train_modes(
    modes,
    *,
    flavor,
    layers,
    preset,
    steps,
    seed,
    max_len,
    device,
    capacity,
    recompute,
    objective,
    lr,
    json_lines,
    out,
    model_path=None,
    keep=(),
) -> list[dict]:
    """Train one model copy per mode in ``modes`` for ``steps`` steps on :func:`synthetic_step`,
    printing one line (or with ``json_lines`` one JSON object) per step and mode to ``out``, plus the
    ``|loss difference|`` line when both modes run. ``flavor`` / ``capacity`` None: the device's
    defaults (``debug`` and 4,096 on CPU, ``ling-tiny`` and 65,536 on CUDA). ``model_path``: a
    transformers checkpoint folder (:func:`harts_runtime.hf.load_pretrained`), used instead of
    ``flavor``. ``keep``: op regions kept instead of recomputed (with ``recompute``;
    :func:`harts_runtime.recompute.apply_recompute`).
    Returns one dict per step, as :func:`train_demo`."""
    dev = torch.device(device)
    cpu = dev.type == "cpu"
    if model_path is not None:
        if layers is not None:
            raise InvalidInputError("layers", "a checkpoint folder keeps all its layers")
        source, flavor, shape = model_path, str(model_path), {}
    else:
        flavor = flavor or ("debug" if cpu else "ling-tiny")
        source, shape = flavor, {"num_layers": layers}
    capacity = capacity or CAPACITY_DEFAULTS[dev.type]
    out = sys.stdout if out is None else out
    # One engine per mode on identical weights (module docstring); AdamW as torch's default.
    engines = {}
    for mode in modes:
        cfg = EngineConfig(
            mode=mode,
            capacity=capacity,
            recompute=recompute,
            keep=tuple(keep),
            lr=lr,
            weight_decay=0.01,
            max_grad_norm=None,
            objective=objective,
        )
        torch.manual_seed(seed)
        engines[mode] = HartsEngine.build(source, cfg, device=dev, freeze=False, **shape)
    model = engines[modes[0]].model
    mcfg = model.config
    t = time.perf_counter()
    step = synthetic_step(preset, seed, mcfg.vocab_size, max_len, objective)
    b = step.batch
    print(
        f"batch: preset={preset} seed={seed} trajectories={b.num_trajectories} S={b.semantic_tokens:,} "
        f"C={b.compact_tokens:,} S/C={b.compression:.2f} ({time.perf_counter() - t:.2f}s)",
        file=sys.stderr,
    )
    print(
        f"model: {flavor} layers={mcfg.num_layers} params={sum(p.numel() for p in model.parameters()):,} "
        f"dtype={mcfg.dtype} device={dev}",
        file=sys.stderr,
    )
    results = []
    for i in range(steps):
        row: dict = {"step": i}
        for mode in modes:
            with StepProgress(f"step {i} {mode}", quiet=json_lines) as progress:
                r = _engine_step(engines[mode], step, progress, i)
            row[mode] = r.to_dict()
            print(json.dumps(dict(r.to_dict(), step=i)) if json_lines else _line(i, mode, r), file=out)
        if len(modes) == 2:
            row["abs_loss_diff"] = abs(row["compact"]["loss"] - row["trajectory"]["loss"])
            if not json_lines:
                print(f"step {i} |loss(compact) - loss(trajectory)| = {row['abs_loss_diff']:.3e}", file=out)
        results.append(row)
    return results


class _Step:
    """The demos' data source of the job loop (:func:`harts_runtime.trainer.job.train_one`): the
    same step every time, a :class:`StepResult` per step, the microbatches' ``progress`` shown."""

    def __init__(self, step: StepInputs, engine: HartsEngine, progress=None):
        self.step, self.engine, self.progress = step, engine, progress

    def next_step(self, engine):
        return self.step

    def record(self, step: int, result, report, seconds: dict) -> StepResult:
        m = result.metrics
        optimizer = max(0.0, seconds["train"] - float(m["plan_seconds"]) - float(m["fbg_seconds"]))
        return StepResult.of(result, self.engine.config.mode, recompute_enabled(self.engine.model), optimizer)


def _engine_step(engine: HartsEngine, step: StepInputs, progress=None, i: int = 0) -> StepResult:
    """Step ``i`` of ``engine`` on ``step`` through the job loop, as a :class:`StepResult`."""
    return train_one(engine, _Step(step, engine, progress), i + 1)


class StepProgress:
    """Progress of one train step's microbatches on stderr: a tqdm bar on a terminal; elsewhere (a log,
    a pipe) a plain line ``label: microbatch 3/12 (25%), 40.2 s`` at most every ``every`` seconds and
    after the last microbatch, so a log shows a long step moving. ``quiet``: nothing. Use as a context
    manager; the object is the ``progress(done, total)`` callback of :func:`train_step`."""

    def __init__(self, label: str, *, quiet: bool = False, every: float = 10.0, stream=None):
        self.label, self.every = label, every
        self.stream = sys.stderr if stream is None else stream
        self.quiet = quiet
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = None
        self.start = self.last = time.perf_counter()

    def __enter__(self) -> StepProgress:
        if not self.quiet and self.tty:
            self.bar = tqdm(desc=self.label, unit="mb", leave=False, file=self.stream)
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

    def __call__(self, done: int, total: int) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.total = total
            self.bar.update(done - self.bar.n)
            return
        now = time.perf_counter()
        if done >= total or now - self.last >= self.every:
            self.last = now
            print(
                f"{self.label}: microbatch {done}/{total} ({done / max(total, 1):.0%}), {now - self.start:.1f} s",
                file=self.stream,
                flush=True,
            )


def model_demo(
    preset: str = "demo",
    steps: int = 1,
    seed: int = 0,
    out: TextIO | None = None,
    capacity: int = CAPACITY_DEFAULTS["cpu"],
) -> list[dict]:
    """One or more optimizer steps of the ``debug`` model on CPU, compact and trajectory-wise from the
    same weights, on :data:`DEMO_TREES` (``preset="demo"``) or the ``tiny`` preset.

    Prints to ``out`` (default stdout) per step and mode the rows executed, microbatches, KDA calls,
    replay and loss, the ``|loss(compact) - loss(trajectory)|`` line, the work compression (rows and
    ideal, :func:`harts_runtime.flops.work_compression`) and the GPU speedup measured on an H200
    (:data:`harts_planner.measured.GPU_HEADLINE`, labelled with its source). It prints no CPU timings:
    the CPU runs the PyTorch reference kernels, so their times say nothing about the GPU path.
    Returns one dict per step as :func:`train_demo`, plus ``"work"`` (the work-compression dict)."""
    if preset not in ("demo", "tiny"):
        raise InvalidInputError("preset", f"choose demo or tiny, got {preset!r}")
    # One intra-op thread: the debug model's tensors are tiny, so a thread team only adds
    # contention (on a busy 2-core machine two threads make a step about 30x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _model_demo(preset, steps, seed, sys.stdout if out is None else out, capacity)
    finally:
        torch.set_num_threads(threads)


def _model_demo(preset: str, steps: int, seed: int, out: TextIO, capacity: int) -> list[dict]:
    from harts_planner import measured
    from harts_runtime.flops import work_compression
    from harts_runtime.train import plan_microbatches

    # The debug flavor's 16-row LM-head chunks exercise chunking in the tests; here they would only
    # add Python-level steps (the chunking never changes the math).
    cfg = model_config("debug", lm_head_rows=4096)
    shape = DEMO_TREES if preset == "demo" else {}
    step = synthetic_step("small" if preset == "demo" else "tiny", seed, cfg.vocab_size, **shape)
    b = step.batch
    engines = {}
    for mode in MODES:
        torch.manual_seed(seed)
        engines[mode] = HartsEngine.build(
            cfg,
            EngineConfig(
                mode=mode, capacity=capacity, lr=LR_DEFAULTS["flavor"], weight_decay=0.01, max_grad_norm=None
            ),
        )
    params = sum(p.numel() for p in engines["compact"].model.parameters())
    _, plans, _ = plan_microbatches(step, "compact", capacity, cfg)
    work = work_compression(cfg, b.lengths, [p.position_ids for p in plans])
    print(
        f"HARTS demo, model step: the debug hybrid model (KDA + MLA + GQA, dense + MoE; {params:,} "
        f"parameters) on {b.num_trajectories} trajectories of {len(b.segment_roots)} synthetic rollout trees "
        f"(S = {b.semantic_tokens:,} tokens), compact and trajectory-wise from the same weights",
        file=out,
    )
    results = []
    for i in range(steps):
        row: dict = {"step": i}
        for mode in MODES:
            with StepProgress(f"step {i} {mode}") as progress:
                r = _engine_step(engines[mode], step, progress, i)
            row[mode] = r.to_dict()
            extra = (
                f" (S/C = {r.compression:.2f}x), {r.num_calls} KDA calls, replay {r.replay_tokens:,} tokens"
                if mode == "compact"
                else ""
            )
            print(
                f"  step {i} {mode:<10} rows executed {r.rows:>7,} in {r.num_microbatches} "
                f"microbatch{'es' if r.num_microbatches != 1 else ''}{extra}, loss {r.loss:.6f}",
                file=out,
            )
        row["abs_loss_diff"] = abs(row["compact"]["loss"] - row["trajectory"]["loss"])
        print(f"  step {i} |loss(compact) - loss(trajectory)| = {row['abs_loss_diff']:.3e}", file=out)
        results.append(dict(row, work=work))
    h = measured.GPU_HEADLINE
    print(
        f"  work: compact executes {work['compact_rows'] / work['trajectory_rows']:.1%} of the rows; ideal "
        f"work compression (model FLOPs with attention) {work['ideal_work_compression']:.2f}x\n"
        f"  measured on a GPU ({h['device']}, {h['date']}, {h['source']}): the 24-layer ling-tiny trains one "
        f"swe-like microbatch ({h['trajectories']} trajectories, S = {h['semantic_tokens']:,}, "
        f"C = {h['compact_rows']:,}) {h['speedup']:.2f}x faster compact than trajectory-wise (F/B/Grad "
        f"{h['compact_seconds']:.2f} s vs {h['trajectory_seconds']:.2f} s; ideal work compression "
        f"{h['ideal']:.2f}x)\n"
        "  (no CPU times: on a CPU the model runs PyTorch reference kernels, whose speed says nothing "
        "about the GPU path; harts-train --mode both times any flavor)",
        file=out,
    )
    return results


def train_demo(
    preset: str = "small",
    steps: int = 2,
    seed: int = 0,
    max_len: int | None = 1024,
    device: str = "cpu",
    out: TextIO | None = None,
    *,
    flavor: str | None = "debug",
    layers: int | None = None,
    capacity: int | None = None,
    recompute: bool = False,
    objective: str = "grpo",
    lr: float = LR_DEFAULTS["flavor"],
    model_path=None,
    keep: tuple = (),
) -> list[dict]:
    """Train the ``flavor`` model (``debug``: the tiny CPU model) ``steps`` optimizer steps compact
    and trajectory-wise side by side from the same weights, on the synthetic ``preset`` batch
    (``harts_planner.synth``, trajectories capped at ``max_len`` tokens; GRPO metadata from ``seed``).

    Prints to ``out`` (default stdout) one line per step and mode (tokens, rows, compression,
    microbatches, KDA calls, replay, plan and F/B/Grad time, loss) and one
    ``|loss(compact) - loss(trajectory)|`` line per step; the batch and model summaries go to
    stderr. ``flavor`` None: ``debug`` on CPU, ``ling-tiny`` on CUDA; ``max_len`` None: the preset's
    lengths; ``capacity``: rows per microbatch (default 4,096 on CPU, 65,536 on CUDA).

    Returns one dict per step: ``{"step": i, "compact": StepResult.to_dict(), "trajectory": ...,
    "abs_loss_diff": float}``.
    """
    return train_modes(
        MODES,
        flavor=flavor,
        layers=layers,
        preset=preset,
        steps=steps,
        seed=seed,
        max_len=max_len,
        device=device,
        capacity=capacity,
        recompute=recompute,
        objective=objective,
        lr=lr,
        json_lines=False,
        out=out,
        model_path=model_path,
        keep=keep,
    )
