"""Reading a transformers checkpoint folder into a model someone else has sharded, each rank its slices.

This module only reads: the model is made on the meta device, parallelized and allocated by the
caller (:func:`harts_runtime.engine.load.load_pretrained` with a ``mesh``, which
:meth:`HartsEngine.build <harts_runtime.engine.HartsEngine.build>` uses), between the folder's
checks and the read::

    with open_sliced(path, device=target, shards=mesh.dense.size()) as ckpt:   # checked, headers open
        model = HybridModel(ckpt.config, device="meta")
        parallelize(model, mesh)                                              # the caller's
        model.to_empty(device=target)
        ckpt.read_into(model, local_box)                                      # each rank its slices

:meth:`SlicedCheckpoint.read_into` fills the local part of every parameter: ``local_box(t)`` says
which (``(local tensor, its [start, stop) box per dimension in the global tensor)``; for a DTensor
the caller passes :func:`harts_runtime.parallel.checkpoint.local_box`, what DCP uses; the default
is the whole tensor), the family's state-dict adapter which blocks of HF tensors our tensor is made
of (:meth:`~harts_runtime.models.state_dict_adapter.HFStateDictAdapter.pieces`: a row block of a
concatenated ``conv1d`` / ``in_proj_qkv``, half of a ``gate_up_proj``, one per-expert tensor, ...),
and the safetensors files only the slices of those blocks that fall in the box
(``safe_open(...).get_slice(name)[...]``). A rank thus reads each of its rows once and nothing
else; under expert parallelism (or FSDP over the expert dimension) it opens no other rank's
experts' tensors. The result equals loading the folder in one process and parallelizing that
model. The folder's checks are :mod:`harts_runtime.hf.folder`'s, on every rank, before anything is
allocated. Writing a folder from a sharded model is :func:`harts_runtime.hf.save_pretrained`
(collective).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from harts_runtime.errors import InvalidInputError
from harts_runtime.hf.folder import (
    check_finite,
    kept_tensors,
    open_folder,
    reading,
    scan_headers,
    weight_files,
)

__all__ = ["SlicedCheckpoint", "open_sliced", "whole_box"]


def whole_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[tuple[int, int], ...]]:
    """``(t, its whole box)``: the ``local_box`` of an unsharded tensor."""
    return t, tuple((0, s) for s in t.shape)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class SlicedCheckpoint:
    """A checked checkpoint folder with its files' headers open (:func:`open_sliced`): the model
    config to build, and :meth:`read_into` a model built from it."""

    def __init__(self, path: Path, hf_config: dict, config, adapter, files, sources: dict, device):
        self.path, self.hf_config, self.config, self.adapter = path, hf_config, config, adapter
        self._files, self._sources, self._device = files, sources, device
        self._extra = adapter.extra_ours()

    def read_into(self, model, local_box: Callable = whole_box):
        """Fill every parameter and buffer of ``model`` (made from :attr:`config`, allocated, on any
        parallel layout) with this rank's slices; returns the model, with ``config``, ``hf_config``
        and ``hf_kept`` set as :func:`harts_runtime.load_pretrained` sets them. ``local_box(t) ->
        (local tensor, box)``: the part of ``t`` this rank holds (:func:`whole_box` for plain
        tensors). Collective when torch.distributed is initialised: each slice read is checked to be
        finite, and when any rank's read fails every rank raises (its own error, or one naming the
        folder), so that no rank goes on into a collective the others never reach."""
        failure = None  # a rank's own slices may hold what the others' do not: agreed on below
        try:
            _read_slices(model, self._sources, self._extra, local_box)
        except InvalidInputError as e:
            failure = e
        _agree(failure, self._device, self.path)
        model.config = self.config
        model.hf_config = self.hf_config
        model.hf_kept = kept_tensors(self._files, self.adapter)  # MTP layers: save_pretrained writes them
        return model


@contextlib.contextmanager
def open_sliced(path, *, dtype=None, device=None, shards: int = 1, **overrides) -> Iterator[SlicedCheckpoint]:
    """The checkpoint folder ``path`` opened for :meth:`SlicedCheckpoint.read_into` (module
    docstring). ``dtype``, ``overrides``: as :func:`harts_runtime.load_pretrained`; ``device``:
    where the model will be allocated; ``shards``: over how many ranks it is sharded (the memory
    check takes the model's bytes over them, a lower bound of one rank's share, against the
    device's). The checks of the folder (unknown, misshapen, duplicate and missing tensors,
    unsupported config fields, memory) run before the context is entered and raise
    :class:`InvalidInputError` naming the tensor or field (and the file). The files' handles close
    when the context exits."""
    device = torch.device("cpu" if device is None else device)
    path, hf_config, _, cfg, adapter = open_folder(path, dtype, overrides, device=device, shards=shards)
    files = weight_files(path)
    extra = adapter.extra_ours()
    with contextlib.ExitStack() as stack:
        sources: dict[str, list] = {}  # our name -> [(piece, file handle, file)]
        for name, (fh, f) in scan_headers(files, adapter, stack).items():  # headers only
            for p in adapter.pieces(name):
                sources.setdefault(p.ours, []).append((p, fh, f))
        for k, shape in adapter.our_shapes.items():
            slots = {p.slot for p, _, _ in sources.get(k, ())}
            if k not in extra and None not in slots and slots != set(range(shape[0] if shape else 0)):
                raise InvalidInputError(k, "not written by any checkpoint tensor")
        yield SlicedCheckpoint(path, hf_config, cfg, adapter, files, sources, device)


def _agree(failure, device, path) -> None:
    """Every rank raises when any rank's read failed (its own error, or one naming the folder),
    so that no rank goes on into a collective the others never reach. One all-reduce."""
    flag = torch.tensor([0.0 if failure is None else 1.0])
    if _distributed():
        if dist.get_backend() == "nccl":
            flag = flag.to(device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if float(flag.item()):
        raise InvalidInputError("path", f"another rank found a bad tensor in {path} (its error names it)")


def _read_slices(model, sources: dict, extra: dict, local_box: Callable) -> None:
    """Each parameter's local part from its checkpoint slices (the others' experts never opened)."""
    with torch.no_grad():
        for k, t in model.state_dict(keep_vars=True).items():
            local, box = local_box(t)
            if local.numel() == 0:
                continue
            if k in extra:
                local.copy_(extra[k][tuple(slice(a, b) for a, b in box)])
                continue
            for p, fh, f in sources[k]:
                into, free = local, box
                if p.slot is not None:
                    if not box[0][0] <= p.slot < box[0][1]:
                        continue  # another rank's expert: never opened
                    into, free = local[p.slot - box[0][0]], box[1:]
                with reading(f, p.hf):
                    part = fh.get_slice(p.hf)[p.hf_index(free)]
                check_finite(p.hf, part, f)
                into.copy_(p.to_ours(part))
