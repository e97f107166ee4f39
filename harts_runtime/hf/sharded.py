"""Reading a transformers checkpoint folder straight into a parallelized model, each rank its slices.

:func:`load_pretrained_sharded` (also ``harts_runtime.load_pretrained(path, mesh=mesh)``) builds
the model on the meta device, parallelizes it (:func:`harts_runtime.parallel.parallelize`),
allocates it (``to_empty``), and each rank then fills its local shard of every parameter: from the
DTensor's placements its global box (:func:`harts_runtime.parallel.checkpoint.local_box`, what DCP
uses), from the family's state-dict adapter the blocks of HF tensors our tensor is made of
(:meth:`~harts_runtime.models.state_dict_adapter.HFStateDictAdapter.pieces`: a row block of a
concatenated ``conv1d`` / ``in_proj_qkv``, half of a ``gate_up_proj``, one per-expert tensor, ...),
and from the safetensors files only the slices of those blocks that fall in the box
(``safe_open(...).get_slice(name)[...]``). A rank thus reads each of its rows once and nothing
else; under expert parallelism (or FSDP over the expert dimension) it opens no other rank's
experts' tensors. The result equals loading the folder in one process and parallelizing that
model. The folder's checks are :mod:`harts_runtime.hf.folder`'s, on every rank, before any tensor
is read. Writing a folder from a sharded model is :func:`harts_runtime.hf.save_pretrained`
(collective).
"""

from __future__ import annotations

import contextlib

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

__all__ = ["load_pretrained_sharded"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _device(mesh, device):
    if device is not None:
        return torch.device(device)
    if mesh.dense.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.dense.device_type)


def load_pretrained_sharded(path, mesh, *, dtype=None, device=None, parallelize=None, **overrides):
    """A :class:`~harts_runtime.models.HybridModel` of the transformers folder ``path``,
    parallelized on ``mesh`` (a :class:`~harts_runtime.parallel.ParallelMesh`) with
    ``parallelize(model, mesh, **parallelize)``, each rank reading only its shards' slices (module
    docstring). Collective: every rank calls it with the same arguments.

    ``dtype``, ``overrides``: as :func:`harts_runtime.load_pretrained`; ``device``: None for the
    mesh's device (the current CUDA device, or the CPU). The checks of the folder (unknown,
    misshapen, duplicate and missing tensors, unsupported config fields) run on every rank before
    any tensor is read and raise :class:`InvalidInputError` naming the tensor or field (and the
    file), as :func:`harts_runtime.load_pretrained`'s; the memory check takes the model's bytes
    over the mesh's ranks (a lower bound of one rank's share) against the target device's; each
    slice read is checked to be finite, and when any rank's read fails every rank raises.
    """
    from harts_runtime.models.hybrid.model import HybridModel
    from harts_runtime.parallel.parallelize import parallelize as parallelize_model

    target = _device(mesh, device)
    path, hf_config, _, cfg, adapter = open_folder(
        path, dtype, overrides, device=target, shards=mesh.dense.size()
    )
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

        model = HybridModel(cfg, device="meta")
        parallelize_model(model, mesh, **(parallelize or {}))
        model.to_empty(device=target)
        failure = None  # a rank's own slices may hold what the others' do not: agreed on below
        try:
            _read_slices(model, sources, extra)
        except InvalidInputError as e:
            failure = e
        _agree(failure, target, path)
    model.config = cfg
    model.hf_config = hf_config
    model.hf_kept = kept_tensors(files, adapter)  # not run (MTP layers); save_pretrained writes them back
    return model


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


def _read_slices(model, sources: dict, extra: dict) -> None:
    """Each parameter's local part from its checkpoint slices (the others' experts never opened)."""
    from harts_runtime.parallel.checkpoint import local_box

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
