"""The RL state a checkpoint carries (``step-N/engine/rl.json``: the step, the sampler's
``torch.Generator`` and the environment's numpy RNG states, as JSON) and its reader; a run saved
before ``rl.json`` existed has ``step-N/rl.pt``, read by :func:`_read_old_state`."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.trainer_state import read_json

__all__ = ["STATE_NAME", "read_state"]

STATE_NAME = "rl.json"
"""The RL state of a checkpoint (in ``step-N/engine/``, listed in its manifest)."""
_STATE_FORMAT = "harts-rl-state/1"
_OLD_STATE = "rl.pt"  # step-N/rl.pt: the RL state before rl.json


def _plain(obj):
    """A numpy bit generator's state as JSON values (arrays as lists)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return {"ndarray": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def _unplain(obj):
    if isinstance(obj, dict):
        if set(obj) == {"ndarray", "dtype"}:
            return np.asarray(obj["ndarray"], dtype=np.dtype(obj["dtype"]))
        return {k: _unplain(v) for k, v in obj.items()}
    return obj


def read_state(path: Path):
    """``(generator state, environment RNG state, step)`` of an ``rl.json``."""
    state = read_json(path, STATE_NAME, "the RL state")
    try:
        if state["format"] != _STATE_FORMAT:
            raise ValueError(f"format {state['format']!r}, expected {_STATE_FORMAT!r}")
        step = state["step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step {step!r} is not an integer")
        raw = base64.b64decode(state["sampler"]["generator"], validate=True)
        generator = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        env_rng = _unplain(state["sampler"]["env_rng"])
        if not isinstance(env_rng, dict):
            raise TypeError("sampler.env_rng is not a table")
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidInputError(
            STATE_NAME, f"{path} is not an RL state ({type(e).__name__}: {' '.join(str(e).split())})"
        ) from None
    return generator, env_rng, step


def _read_old_state(path: Path):
    from harts_runtime.parallel.safe_load import load_weights_only

    state = load_weights_only(path)
    try:
        step = state["step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step {step!r} is not an integer")
        return state["sampler"]["generator"], state["sampler"]["env_rng"], step
    except (KeyError, TypeError) as e:
        raise InvalidInputError(path.name, f"{path} is not an RL state ({type(e).__name__}: {e})") from None
