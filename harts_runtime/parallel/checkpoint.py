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

The folder holds DCP's ``.metadata`` and ``__<rank>_<i>.distcp`` files, ``harts.json``, any small
files the caller adds, and ``manifest.json`` (every file's size and SHA-256). It is written whole or
not at all (:mod:`harts_runtime.parallel.checkpoint_folder`: staged beside the target, renamed into
place when complete). Before any tensor is read, :func:`load_checkpoint` verifies the files against
the manifest and compares DCP's metadata with the model: a missing folder, a missing, truncated or
altered file, a tensor the checkpoint lacks or has with another shape (another model config), a
tensor of the checkpoint the model lacks, or an optimizer to restore from a checkpoint without
optimizer state raise :class:`~harts_runtime.errors.InvalidInputError` whose ``.field`` names the
path, the file, the tensor or ``optimizer``, identically on every rank. Nothing read runs code:
DCP's ``.metadata`` pickle goes through an unpickler that admits only DCP's metadata types, and its
non-tensor items are read with ``weights_only=True`` (:mod:`harts_runtime.parallel.safe_load`); a
crafted file is refused naming it.

Hugging Face folders (read shard by shard, written collectively) are :mod:`harts_runtime.hf`, which
never imports this package: a sharded load (:func:`harts_runtime.engine.load.load_pretrained`)
hands it :func:`local_box` (this rank's block of a DTensor).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from harts_runtime.errors import InvalidInputError
from harts_runtime.parallel.checkpoint_folder import (
    MANIFEST_NAME,
    as_input_error,
    loadable_folder,
    staged_folder,
    verify_folder,
)

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


def _state(model, optimizer) -> dict[str, Any]:
    """``{"model": ..., ["optim": ...]}`` from DCP's ``get_state_dict`` (the optimizer state
    initialised when it is still empty)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _file_names(files, what: str) -> dict:
    files = dict(files or {})
    for n, v in files.items():
        if not isinstance(n, str) or "/" in n or n in ("", ".", "..", EXTRA_NAME, MANIFEST_NAME, ".metadata"):
            raise InvalidInputError(what, f"{n!r} is not a file name a checkpoint can hold")
        if n.endswith(".distcp"):
            raise InvalidInputError(what, f"{n!r}: .distcp names are DCP's")
        if not isinstance(v, (str, bytes)):
            raise InvalidInputError(what, f"{n!r}: expected str or bytes, got {type(v).__name__}")
    return files


def save_checkpoint(
    path, model, optimizer=None, *, extra: dict | None = None, files=None, rank_files=None
) -> None:
    """Save ``model``'s state dict (and ``optimizer``'s) to the folder ``path`` with DCP.

    Collective when torch.distributed is initialised: every rank calls it with its shards; rank 0
    also writes ``extra`` (a JSON-serialisable dict, e.g. ``{"step": 100}``) to ``harts.json`` and
    the small ``files`` (``{name: str | bytes}``), every rank its own ``rank_files``. Written whole
    or not at all (:func:`harts_runtime.parallel.checkpoint_folder.staged_folder`: a staging folder
    renamed into place, a manifest of every file's SHA-256): a kill at any point leaves ``path`` the
    previous checkpoint or the new one, a full disk raises :class:`InvalidInputError` naming the
    file and leaves nothing behind. Returns once the whole checkpoint is on disk. Loadable by
    :func:`load_checkpoint` under any parallel configuration. Raises :class:`InvalidInputError`
    (``extra``, ``files``, ``path``) for a value JSON cannot store, a bad file name, or a ``path``
    that is a file or a non-empty folder other than a checkpoint, before anything is written.
    """
    import torch.distributed.checkpoint as dcp

    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise InvalidInputError("extra", f"must be a dict, got {type(extra).__name__}")
    try:
        record = json.dumps(
            {
                "format": _FORMAT,
                "optimizer": optimizer is not None,
                "extra": extra,
                "manifest": MANIFEST_NAME,
            },
            indent=2,
            sort_keys=True,
        )
    except (TypeError, ValueError) as e:
        raise InvalidInputError("extra", f"is not JSON-serialisable ({e})") from None
    files = _file_names(files, "files")
    rank_files = _file_names(rank_files, "rank_files")
    distributed = _distributed()
    lead = not distributed or dist.get_rank() == 0
    state = _state(model, optimizer)
    with staged_folder(path) as staging:
        with _single_process_quiet():
            # torch documents dcp.save / dcp.load; its __init__ re-exports them without __all__.
            dcp.save(state, checkpoint_id=str(staging), no_dist=not distributed)  # pyright: ignore[reportPrivateImportUsage]
        own = dict(rank_files)
        if lead:
            own[EXTRA_NAME] = record + "\n"
            own.update(files)
        for n, v in own.items():
            (staging / n).write_bytes(v.encode() if isinstance(v, str) else v)


def _one_line(e, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_record(path: Path) -> dict:
    f = path / EXTRA_NAME
    if not f.is_file():
        return {}
    try:
        record = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidInputError(EXTRA_NAME, f"{f} is unreadable or damaged ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("extra", {}), dict):
        raise InvalidInputError(EXTRA_NAME, f"{f} is not a checkpoint record")
    return record


def _check_storage(path: Path, metadata) -> None:
    """Every DCP data file the metadata names exists and holds the bytes it points at."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    for rel in sorted(ends):
        f = path / rel
        if not f.is_file():
            raise InvalidInputError(rel, f"missing from the checkpoint {path} (named in its .metadata)")
        size = f.stat().st_size
        if size < ends[rel]:
            raise InvalidInputError(rel, f"{f} is truncated: {size} bytes, the checkpoint needs {ends[rel]}")


def _check_checkpoint(path: Path, model_sd: dict, optimizer: bool) -> dict:
    """Verify the files of ``path`` (its manifest, when it has one: sizes and SHA-256) and compare
    DCP's metadata with the model's state dict (global shapes); returns the ``harts.json`` record."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from harts_runtime.parallel.safe_load import read_dcp_metadata

    if not (path / ".metadata").is_file():
        what = "does not exist" if not path.exists() else "is not a DCP checkpoint (no .metadata)"
        if path.is_dir() and (path / MANIFEST_NAME).is_file():
            raise InvalidInputError(".metadata", f"missing from the checkpoint {path}")
        raise InvalidInputError("path", f"{path} {what}")
    record = _read_record(path)
    verify_folder(path, required=bool(record.get("manifest")))
    metadata = read_dcp_metadata(path)
    _check_storage(path, metadata)
    saved = metadata.state_dict_metadata
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
    parameters (its hyperparameters are restored too). Before anything is loaded, every file of the
    checkpoint's manifest is verified (size and SHA-256) and every data file DCP's metadata names
    must hold its bytes; a bad file, tensor or ``optimizer`` raises :class:`InvalidInputError`
    naming it (module docstring), and so does a read that fails anyway (torch's
    ``CheckpointException`` never escapes).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    from harts_runtime.parallel.safe_load import SafeFileSystemReader, SafeLoadPlanner

    path = loadable_folder(path)
    record = _check_checkpoint(path, get_model_state_dict(model), optimizer is not None)
    state = _state(model, optimizer)
    try:
        with _single_process_quiet():
            reader = SafeFileSystemReader(str(path))
            # torch documents dcp.save / dcp.load; its __init__ re-exports them without __all__.
            dcp.load(  # pyright: ignore[reportPrivateImportUsage]
                state, storage_reader=reader, planner=SafeLoadPlanner(reader), no_dist=not _distributed()
            )
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        err = as_input_error(e, path, f"loading the checkpoint {path}")
        if err is None:
            failures = getattr(e, "failures", None)
            root = failures and next(iter(failures.values()))
            root = root[0] if isinstance(root, tuple) else (root or e)
            err = InvalidInputError(
                "path", f"cannot load the checkpoint {path}: {type(root).__name__}: {_one_line(root)}"
            )
        raise err from None
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
