"""Training checkpoints of parallelized models on ``torch.distributed.checkpoint`` (DCP).

:func:`save_checkpoint` / :func:`load_checkpoint` save and restore the model's weights and buffers
and the optimizer's state (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq`` and its param groups)
with DCP: ``get_state_dict`` -> ``dcp.save`` (every rank writes its own shards) and
``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``. DCP records each tensor's global shape
and the global offsets of every saved shard, and every parameter keeps its unparallelized name
(:func:`harts_runtime.parallel.parallelize`), so a checkpoint loads under any other parallel
configuration and world size, or into an unparallelized model in one process (no process group
needed). A small JSON-able ``extra`` dict (step counter, data position, ...) is stored alongside
in ``harts.json``, which rank 0 writes.

The folder holds DCP's ``.metadata`` and ``__<rank>_<i>.distcp`` files and ``harts.json``. Before
any tensor is read, :func:`load_checkpoint` compares DCP's metadata with the model: a missing
folder, a tensor the checkpoint lacks or has with another shape (another model config), a tensor
of the checkpoint the model lacks, or an optimizer to restore from a checkpoint without optimizer
state raise :class:`~harts_runtime.errors.InvalidInputError` whose ``.field`` names the path, the
tensor or ``optimizer``, identically on every rank.

Hugging Face folders (read shard by shard, written collectively) are :mod:`harts_runtime.hf`; it
uses :func:`local_box` (this rank's block of a DTensor) from here, and nothing here imports it.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from harts_runtime.errors import InvalidInputError

__all__ = ["EXTRA_NAME", "load_checkpoint", "local_box", "save_checkpoint"]

EXTRA_NAME = "harts.json"
"""The file of a training checkpoint holding ``extra`` (and what was saved)."""
_FORMAT = "harts-dcp-1"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when there is no process group: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _state(model, optimizer):
    """``{"model": ..., ["optim": ...]}`` from DCP's ``get_state_dict`` (the optimizer state
    initialised when it is still empty)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(path, model, optimizer=None, *, extra: dict | None = None) -> None:
    """Save ``model``'s state dict (and ``optimizer``'s) to the folder ``path`` with DCP.

    Collective when torch.distributed is initialised: every rank calls it with its shards; rank 0
    also writes ``extra`` (a JSON-serialisable dict, e.g. ``{"step": 100}``) to ``harts.json``.
    Returns once the whole checkpoint is on disk. Loadable by :func:`load_checkpoint` under any
    parallel configuration. Raises :class:`InvalidInputError` (``extra``) for a value JSON cannot
    store, before anything is written.
    """
    import torch.distributed.checkpoint as dcp

    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise InvalidInputError("extra", f"must be a dict, got {type(extra).__name__}")
    try:
        record = json.dumps(
            {"format": _FORMAT, "optimizer": optimizer is not None, "extra": extra}, indent=2, sort_keys=True
        )
    except (TypeError, ValueError) as e:
        raise InvalidInputError("extra", f"is not JSON-serialisable ({e})") from None
    distributed = _distributed()
    with _single_process_quiet():
        dcp.save(_state(model, optimizer), checkpoint_id=str(path), no_dist=not distributed)
    if not distributed or dist.get_rank() == 0:
        (Path(path) / EXTRA_NAME).write_text(record + "\n")
    if distributed:
        dist.barrier()


def _check_checkpoint(path: Path, model_sd: dict, optimizer: bool) -> dict:
    """Compare DCP's metadata of ``path`` with the model's state dict (global shapes); returns the
    ``harts.json`` record."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (path / ".metadata").is_file():
        what = "does not exist" if not path.exists() else "is not a DCP checkpoint (no .metadata)"
        raise InvalidInputError("path", f"{path} {what}")
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    record = {}
    if (path / EXTRA_NAME).is_file():
        record = json.loads((path / EXTRA_NAME).read_text())
    if optimizer and not any(k.startswith("optim.") for k in saved):
        raise InvalidInputError("optimizer", f"the checkpoint {path} has no optimizer state")
    for k, v in model_sd.items():
        meta = saved.get("model." + k)
        if meta is None:
            raise InvalidInputError(k, f"missing from the checkpoint {path} (another model config?)")
        if torch.is_tensor(v):
            if not isinstance(meta, TensorStorageMetadata):
                raise InvalidInputError(k, f"is not a tensor in the checkpoint {path}")
            if tuple(meta.size) != tuple(v.shape):
                raise InvalidInputError(
                    k, f"shape {tuple(meta.size)} in the checkpoint != {tuple(v.shape)} of this model"
                )
    ours = {"model." + k for k in model_sd}
    extra = sorted(k for k in saved if k.startswith("model.") and k not in ours)
    if extra:
        raise InvalidInputError(
            extra[0][len("model.") :],
            f"in the checkpoint {path} but not a tensor of this model ({len(extra)} such)",
        )
    return record


def load_checkpoint(path, model, optimizer=None) -> dict:
    """Load a :func:`save_checkpoint` folder into ``model`` (and ``optimizer``), in place; returns
    the saved ``extra`` dict.

    ``model`` may be parallelized in any configuration (collective then: every rank calls it) or
    a plain model in one process; ``optimizer`` must be of the saved kind over ``model``'s
    parameters (its hyperparameters are restored too). Raises :class:`InvalidInputError` naming the
    path, tensor or ``optimizer`` (module docstring) before anything is loaded.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    path = Path(path)
    record = _check_checkpoint(path, get_model_state_dict(model), optimizer is not None)
    state = _state(model, optimizer)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return dict(record.get("extra") or {})


# -------------------------------------------------------------------------------------- local boxes
def local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[tuple[int, int], ...]]:
    """``(local tensor, box)``: this rank's part of ``t`` and its ``[start, stop)`` per dimension in
    the global tensor (a plain tensor is all of itself)."""
    if not isinstance(t, DTensor):
        return t, tuple((0, s) for s in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    if tuple(local.shape) != tuple(shape):  # a placement the offsets helper does not describe
        raise InvalidInputError("placements", f"{t.placements}: local shape {tuple(local.shape)} != {shape}")
    return local, tuple((o, o + s) for o, s in zip(offset, shape))
