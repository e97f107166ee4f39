"""A transformers checkpoint folder as a model, in one process or sharded over a mesh: the one
function that both parallelizes and reads (``harts_runtime.load_pretrained``).

Each floor does one job: :mod:`harts_runtime.hf` only reads (it never imports
:mod:`harts_runtime.parallel`), :mod:`harts_runtime.parallel` only shards (it never imports
:mod:`harts_runtime.hf`); here, above both, a sharded load checks the folder
(:func:`harts_runtime.hf.sharded.open_sliced`), makes the model on the meta device, parallelizes
it, allocates it, and then has hf read each rank's slices into it, told where this rank's block of
each DTensor lies by :func:`harts_runtime.parallel.checkpoint.local_box`.
:meth:`HartsEngine.build <harts_runtime.engine.HartsEngine.build>` loads through this function.
"""

from __future__ import annotations

import torch

from harts_runtime.errors import InvalidInputError

__all__ = ["load_pretrained"]


def _device(mesh, device) -> torch.device:
    """Where a sharded model is allocated: ``device``, or the mesh's (the current CUDA device)."""
    if device is not None:
        return torch.device(device)
    if mesh.dense.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.dense.device_type)


def load_pretrained(path, dtype=None, device=None, *, mesh=None, parallelize=None, **overrides):
    """A :class:`~harts_runtime.models.HybridModel` with the weights of the checkpoint folder ``path``.

    ``dtype``: a ``torch.dtype`` or name (None: the config's ``dtype`` when it is float32 /
    bfloat16 / float64, else float32). ``device``: where the weights go (None: ``"cpu"``, or with
    a CUDA ``mesh`` the current CUDA device). ``overrides``: :class:`ModelConfig` execution fields
    (``chunk_size``, ``attn_backend``, ``kda_backend``, ``lm_head_rows``, ...). The model is
    returned in training mode; ``model.hf_config`` keeps the checkpoint's config dict so that
    :func:`~harts_runtime.hf.save_pretrained` writes its other fields (token ids, ...) back.
    Without a mesh this is :func:`harts_runtime.hf.load_pretrained`.

    ``mesh``: a :class:`harts_runtime.parallel.ParallelMesh`: the model is made on the meta
    device, parallelized on it (``harts_runtime.parallel.parallelize(model, mesh,
    **parallelize)``), allocated, and each rank reads only its shards' slices
    (:mod:`harts_runtime.hf.sharded`); collective, every rank calls it with the same arguments.
    The result equals loading the folder in one process and parallelizing that model.

    Raises :class:`InvalidInputError` naming the config field, tensor or file
    (:mod:`harts_runtime.hf.folder`'s checks, on every rank before anything is allocated; the
    memory check takes the model's bytes over the mesh's ranks), ``device``, or ``parallelize``
    (given without a mesh); when any rank's read fails every rank raises.
    """
    if mesh is None:
        if parallelize is not None:
            raise InvalidInputError("parallelize", "needs a mesh")
        from harts_runtime.hf import load_pretrained as read_pretrained

        return read_pretrained(path, dtype=dtype, device=device, **overrides)
    from harts_runtime.hf.sharded import open_sliced
    from harts_runtime.models.hybrid.model import HybridModel
    from harts_runtime.parallel.checkpoint import local_box
    from harts_runtime.parallel.parallelize import parallelize as parallelize_model

    target = _device(mesh, device)
    with open_sliced(path, dtype=dtype, device=target, shards=mesh.dense.size(), **overrides) as ckpt:
        model = HybridModel(ckpt.config, device="meta")
        parallelize_model(model, mesh, **(parallelize or {}))
        model.to_empty(device=target)
        return ckpt.read_into(model, local_box)
