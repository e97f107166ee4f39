"""Reading a checkpoint runs no code from it.

A pickle can call any function while it is read, so a crafted checkpoint folder (with a consistent
manifest: the manifest guards against damage, not against its author) could run code on load.
Every pickle a HARTS load reads goes through a reader that admits only the types it expects:

- DCP's ``.metadata`` (a pickle of :mod:`torch.distributed.checkpoint.metadata` dataclasses):
  :func:`read_dcp_metadata`, and :class:`SafeFileSystemReader` (DCP's ``FileSystemReader`` with its
  ``read_metadata`` through the same restricted unpickler) for ``dcp.load``. The unpickler admits
  the classes defined in :mod:`torch.distributed.checkpoint.metadata`, DCP's ``_StorageInfo``,
  ``torch.Size``, torch dtypes and layouts, ``pathlib`` paths and ``set`` / ``frozenset`` /
  ``OrderedDict``; anything else (``os.system``, ``builtins.eval``, ...) is refused before it is
  called, as one :class:`~harts_runtime.errors.InvalidInputError` naming the file.
- DCP's non-tensor items (the optimizer's param groups: floats, tuples, strings) are ``torch.save``
  pickles read by DCP's planner with ``weights_only=False``: :class:`SafeLoadPlanner` reads them
  with ``weights_only=True``. DCP reads tensors with ``weights_only=True`` itself.
- Our own small state files (an engine's ``rng-N.pt``): :func:`load_weights_only`, ``torch.load``
  with ``weights_only=True`` (tensors, numbers, strings and containers; numpy arrays only where a
  caller admits them, for files written before they held tensors only).
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

from harts_runtime.errors import InvalidInputError

__all__ = [
    "METADATA_NAME",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "load_weights_only",
    "numpy_array_globals",
    "read_dcp_metadata",
]

METADATA_NAME = ".metadata"
"""DCP's metadata file of a checkpoint folder."""


def _one_line(text, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------ DCP metadata
def _metadata_globals() -> dict[tuple[str, str], object]:
    """``(module, name) -> object``: every global a DCP ``.metadata`` pickle may name."""
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as meta

    ok: dict[tuple[str, str], object] = {}
    for name, obj in vars(meta).items():
        if isinstance(obj, type) and obj.__module__ == meta.__name__:
            ok[(meta.__name__, name)] = obj
    ok[(fs.__name__, "_StorageInfo")] = fs._StorageInfo
    ok[("torch", "Size")] = torch.Size
    for name, obj in vars(torch).items():
        if isinstance(obj, torch.dtype):
            ok[("torch", name)] = obj
    ok[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a name -> layout table
    for cls in (pathlib.Path, pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        ok[("pathlib", cls.__name__)] = cls
    ok[("builtins", "set")] = set
    ok[("builtins", "frozenset")] = frozenset
    ok[("collections", "OrderedDict")] = collections.OrderedDict
    return ok


_ALLOWED: dict[tuple[str, str], object] | None = None


class _Refused(pickle.UnpicklingError):
    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.what = f"{module}.{name}"


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler whose globals are DCP's metadata types only (no ``persistent_load``: a pickle
    asking for one is refused by :mod:`pickle` itself)."""

    def find_class(self, module, name):
        global _ALLOWED
        if _ALLOWED is None:
            _ALLOWED = _metadata_globals()
        obj = _ALLOWED.get((module, name))
        if obj is None:
            raise _Refused(module, name)
        return obj


def _unpickle_metadata(stream, file: Path):
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(stream).load()
    except _Refused as e:
        raise InvalidInputError(
            METADATA_NAME,
            f"{file} names {e.what}, which is not a DCP metadata type: refused without running it "
            "(a crafted or foreign checkpoint)",
        ) from None
    except Exception as e:  # a damaged pickle: anything  # noqa: BLE001
        raise InvalidInputError(
            METADATA_NAME, f"{file} is unreadable ({type(e).__name__}: {_one_line(e)})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise InvalidInputError(
            METADATA_NAME, f"{file} holds a {type(metadata).__name__}, not DCP's Metadata"
        )
    return metadata


def read_dcp_metadata(folder):
    """DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` of a checkpoint folder, read
    through the restricted unpickler (module docstring); :class:`InvalidInputError` (``.metadata``)
    for a file that names another global, is damaged or cannot be read."""
    file = Path(folder) / METADATA_NAME
    try:
        with open(file, "rb") as f:
            return _unpickle_metadata(f, file)
    except OSError as e:
        raise InvalidInputError(METADATA_NAME, f"{file} cannot be read ({e.strerror or e})") from None


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``read_metadata`` runs the restricted unpickler (the rest,
    tensor reads included, is DCP's)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _unpickle_metadata(stream, Path(path))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` reading non-tensor items with ``torch.load(weights_only=True)``
    (DCP's own reads them with ``weights_only=False``). ``reader``: the storage reader of the load,
    so that a refused item names its file."""

    def __init__(self, reader: FileSystemReader | None = None, **kwargs):
        super().__init__(**kwargs)
        self.reader = reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # refused global or a damaged item  # noqa: BLE001
            info = getattr(self.reader, "storage_data", {}).get(read_item.storage_index)
            rel = getattr(info, "relative_path", None)
            where = Path(self.reader.path) / rel if rel and self.reader is not None else None
            why = _one_line(str(e).split("WeightsUnpickler error:")[-1], 160)
            raise InvalidInputError(
                rel or fqn,
                f"{where or 'the checkpoint'}: its item {fqn} holds more than plain values: refused "
                f"without running it ({type(e).__name__}: {why})",
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


# ------------------------------------------------------------------------------ small state files
def numpy_array_globals() -> list:
    """The globals a pickled numpy array of numbers needs (for :func:`load_weights_only`'s
    ``allow``): ``ndarray``, ``dtype``, the numeric dtype classes and ``_reconstruct`` (under its
    numpy 1 and numpy 2 names)."""
    import numpy as np

    core: Any = getattr(np, "_core", None) or np.core  # numpy 2: _core (its stubs drop core.multiarray)
    rebuild = core.multiarray._reconstruct
    out = [rebuild, (rebuild, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype]
    numeric = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
    numeric += (np.float16, np.float32, np.float64, np.complex64, np.complex128)
    out += sorted({type(np.dtype(t)) for t in numeric}, key=lambda c: c.__name__)
    return out


def load_weights_only(file, *, allow=()):
    """``torch.load(file, weights_only=True)`` (``allow``: extra safe globals); a file that needs any
    other global, is damaged or cannot be read is one :class:`InvalidInputError` naming it."""
    file = Path(file)
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        text = _one_line(str(e).split("WeightsUnpickler error:")[-1], 160)
        raise InvalidInputError(
            file.name, f"{file} holds more than tensors and plain values: refused without running it ({text})"
        ) from None
    except OSError as e:
        raise InvalidInputError(file.name, f"{file} cannot be read ({e.strerror or e})") from None
    except Exception as e:  # a damaged file: anything  # noqa: BLE001
        raise InvalidInputError(file.name, f"{file} is unreadable ({type(e).__name__})") from None
