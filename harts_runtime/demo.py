"""The compact-vs-trajectory demo (:func:`train_demo`, what ``harts-planner demo`` ends with and
``harts-train --mode both`` runs) and the synthetic step it trains on (:func:`synthetic_step`).

Both executions train identical copies of one model, each with its own optimizer, so every step
of the compact and the trajectory execution starts from the same weights and the two loss curves
can be compared step by step: they agree to float rounding (the same math).
"""

from __future__ import annotations

import copy
import json
import sys
import time
from typing import TextIO

import torch
from tqdm import tqdm

from harts_planner import RolloutBatch, synth
from harts_runtime.errors import InvalidInputError
from harts_runtime.layout.rows import MODES
from harts_runtime.models import HybridModel, model_config
from harts_runtime.recompute import apply_recompute
from harts_runtime.step_inputs import StepInputs
from harts_runtime.train import StepResult, train_step

__all__ = ["synthetic_step", "train_demo", "train_modes"]


def synthetic_step(
    preset: str, seed: int, vocab: int, max_len: int | None = None, objective: str = "grpo"
) -> StepInputs:
    """:class:`StepInputs` of a ``harts_planner.synth`` preset (tokens in ``[0, vocab)``,
    trajectories capped at ``max_len`` tokens) with synthetic GRPO/PPO metadata."""
    over = {"vocab_size": vocab}
    if max_len is not None:
        over["max_trajectory_tokens"] = max_len
    sb = synth.generate(preset, seed, **over)
    batch = RolloutBatch.from_arrays(sb.tokens, sb.offsets, sb.tree_ids)
    return StepInputs.synthetic(batch, seed, objective, vocab_size=vocab)


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
    loaded = None
    if model_path is not None:
        if layers is not None:
            raise InvalidInputError("layers", "a checkpoint folder keeps all its layers")
        from harts_runtime.hf import load_pretrained

        loaded = load_pretrained(model_path, device=dev)
        cfg, flavor = loaded.config, str(model_path)
    else:
        flavor = flavor or ("debug" if cpu else "ling-tiny")
        cfg = model_config(flavor, layers)
    capacity = capacity or (4096 if cpu else 65_536)
    out = sys.stdout if out is None else out
    torch.manual_seed(seed)
    t = time.perf_counter()
    step = synthetic_step(preset, seed, cfg.vocab_size, max_len, objective)
    b = step.batch
    print(
        f"batch: preset={preset} seed={seed} trajectories={b.num_trajectories} S={b.semantic_tokens:,} "
        f"C={b.compact_tokens:,} S/C={b.compression:.2f} ({time.perf_counter() - t:.2f}s)",
        file=sys.stderr,
    )
    model = apply_recompute(
        loaded if loaded is not None else HybridModel(cfg, device=dev),
        recompute,
        keep=keep if recompute else (),
    )
    print(
        f"model: {flavor} layers={cfg.num_layers} params={sum(p.numel() for p in model.parameters()):,} "
        f"dtype={cfg.dtype} device={dev}",
        file=sys.stderr,
    )
    # Several modes: identical copies of the model, each with its own optimizer (module docstring).
    models = {m: (model if k == 0 else copy.deepcopy(model)) for k, m in enumerate(modes)}
    opts = {m: torch.optim.AdamW(models[m].parameters(), lr=lr) for m in modes}
    results = []
    for i in range(steps):
        row: dict = {"step": i}
        for mode in modes:
            # disable=None: a bar on a terminal only (not in logs or pipes)
            bar_off = True if json_lines else None
            with tqdm(desc=f"step {i} {mode[:4]}", unit="mb", disable=bar_off, leave=False) as bar:

                def progress(done, total, bar=bar):
                    bar.total = total
                    bar.update(done - bar.n)

                r = train_step(
                    models[mode], opts[mode], step, None, mode, capacity=capacity, progress=progress
                )
            row[mode] = r.to_dict()
            print(json.dumps(dict(r.to_dict(), step=i)) if json_lines else _line(i, mode, r), file=out)
        if len(modes) == 2:
            row["abs_loss_diff"] = abs(row["compact"]["loss"] - row["trajectory"]["loss"])
            if not json_lines:
                print(f"step {i} |loss(compact) - loss(trajectory)| = {row['abs_loss_diff']:.3e}", file=out)
        results.append(row)
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
    lr: float = 1e-3,
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
