"""A training engine's checkpoint (:func:`save_engine`, :func:`load_engine`): model, optimizer,
schedule position, step and each rank's RNG state, written whole or not at all by
:func:`harts_runtime.parallel.checkpoint.save_checkpoint`, and read back under any parallel
configuration. :meth:`HartsEngine.save <harts_runtime.engine.HartsEngine.save>` and
:meth:`~harts_runtime.engine.HartsEngine.load` call these."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch

from harts_runtime.engine import process_state
from harts_runtime.errors import InvalidInputError

__all__ = ["load_engine", "read_rng", "rng_record", "save_engine"]


def save_engine(engine, path, *, files: dict | None = None, extra: dict | None = None) -> None:
    """:meth:`HartsEngine.save <harts_runtime.engine.HartsEngine.save>` of ``engine`` (what is
    written, and how, is said there)."""
    import io

    from harts_runtime.parallel.checkpoint import save_checkpoint

    if not isinstance(extra, (dict, type(None))):
        raise InvalidInputError("extra", f"must be a dict, got {type(extra).__name__}")
    record = dict(extra or {})
    for k in ("engine_step", "config"):
        if k in record:
            raise InvalidInputError(f"extra.{k}", "is the engine's own key")
    record.update(engine_step=engine.step, config=engine.config.to_dict())
    rng = io.BytesIO()
    torch.save(rng_record(process_state.rng_state()), rng)
    rank_files = {f"rng-{process_state.rank()}.pt": rng.getvalue()}
    save_checkpoint(path, engine.model, engine.optimizer, extra=record, files=files, rank_files=rank_files)


def load_engine(engine, path) -> dict:
    """:meth:`HartsEngine.load <harts_runtime.engine.HartsEngine.load>` of ``engine``: what
    :func:`save_engine` wrote, restored; the extra record returned."""
    from harts_runtime.parallel.checkpoint import load_checkpoint

    extra = load_checkpoint(path, engine.model, engine.optimizer)
    if "engine_step" not in extra:
        raise InvalidInputError(
            "path", f"{path} is a checkpoint without an engine step (not saved by HartsEngine.save)"
        )
    engine.step = int(extra["engine_step"])
    if engine.scheduler is not None:
        engine.scheduler.last_epoch = engine.step
        for g, base in zip(engine.optimizer.param_groups, engine.scheduler.base_lrs):
            g["lr"] = base * engine.config.lr_factor(engine.step)
    from harts_runtime.parallel.checkpoint_folder import loadable_folder

    folder = loadable_folder(path)
    own = folder / f"rng-{process_state.rank()}.pt"
    rng = own if own.exists() else folder / "rng-0.pt"
    if rng.exists():
        process_state.set_rng_state(read_rng(rng))
    return extra


def rng_record(state: dict) -> dict:
    """An RNG state (:func:`process_state.rng_state`) as tensors and numbers only (numpy's legacy
    ``(name, keys, pos, has_gauss, cached_gaussian)`` with its keys as an int64 tensor), so that
    ``torch.load(weights_only=True)`` reads it back."""
    name, keys, pos, has_gauss, cached = state["numpy"]
    out = {
        "format": "harts-rng-1",
        "torch": state["torch"],
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if "cuda" in state:
        out["cuda"] = list(state["cuda"])
    return out


def read_rng(file) -> dict:
    """The RNG state in ``file`` (``rng-N.pt``; one written before it held tensors only has numpy
    arrays, admitted as arrays of numbers), checked; :class:`InvalidInputError` naming the file."""
    from harts_runtime.parallel.safe_load import load_weights_only, numpy_array_globals

    rec = load_weights_only(file, allow=numpy_array_globals())
    try:
        state: dict[str, Any] = {"torch": rec["torch"]}
        npy = rec["numpy"]
        if isinstance(npy, dict):
            keys = npy["keys"].numpy() if torch.is_tensor(npy["keys"]) else np.asarray(npy["keys"])
            npy = (npy["name"], keys.astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
        if not torch.is_tensor(state["torch"]) or state["torch"].dtype != torch.uint8:
            raise TypeError("torch: not a uint8 tensor")
        state["numpy"] = tuple(npy)
        if "cuda" in rec:
            state["cuda"] = list(rec["cuda"])
        # numpy types the state as an exact 5-tuple; this one is as read, and set_state checks it.
        np.random.RandomState().set_state(cast(Any, state["numpy"]))  # checks it before it is applied
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise InvalidInputError(file.name, f"{file} is not an RNG state ({type(e).__name__}: {e})") from None
    return state
