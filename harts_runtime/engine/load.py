"""How a training job's model is made: every source (a transformers checkpoint folder, a flavor
name, a :class:`~harts_runtime.models.ModelConfig`, or a model the caller made) is built and
parallelized here, by one path (:func:`build_model`), which
:meth:`HartsEngine.build <harts_runtime.engine.HartsEngine.build>` and the engine's constructor both
take; the engine only wires the model it gets to its optimizer.

Each floor does one job: :mod:`harts_runtime.hf` only reads (it never imports
:mod:`harts_runtime.parallel`), :mod:`harts_runtime.parallel` only shards (it never imports
:mod:`harts_runtime.hf`); here, above both, a sharded load checks the folder
(:func:`harts_runtime.hf.sharded.open_sliced`), makes the model on the meta device, parallelizes
it, allocates it, and then has hf read each rank's slices into it, told where this rank's block of
each DTensor lies by :func:`harts_runtime.parallel.checkpoint.local_box`
(:func:`load_pretrained`). A flavor's or a config's random weights are drawn in full on one device
and then parallelized (:func:`prepare_model`), so that every rank holds the slices of the same
weights one process would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from harts_runtime.errors import InvalidInputError

if TYPE_CHECKING:
    from harts_runtime.models import HybridModel

__all__ = ["build_model", "load_pretrained", "prepare_model"]


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


def prepare_model(model, config, mesh=None):
    """``model`` made ready for a job of ``config`` (an
    :class:`~harts_runtime.engine.EngineConfig`), in place; returns it. With a ``mesh``: parallelized
    (:func:`harts_runtime.parallel.parallelize` with ``config.parallelize_options()``, which applies
    the recomputation too) unless it is already; without: block recomputation turned on when
    ``config.recompute`` (:func:`harts_runtime.recompute.apply_recompute`, ``keep=config.keep``).
    The one place a job's model is parallelized."""
    if mesh is not None:
        if getattr(model, "_harts_parallel", None) is None:
            from harts_runtime.parallel.parallelize import parallelize as parallelize_model

            parallelize_model(model, mesh, **config.parallelize_options())
    elif config.recompute:
        from harts_runtime.recompute import apply_recompute

        apply_recompute(model, keep=config.keep)
    return model


def build_model(
    source, config, mesh=None, *, dtype=None, device=None, freeze=None, **overrides
) -> tuple[HybridModel, list[str]]:
    """``(model, frozen)``: the :class:`~harts_runtime.models.HybridModel` of ``source``, built and
    parallelized for a job of ``config`` (an :class:`~harts_runtime.engine.EngineConfig`) over
    ``mesh`` (None: one process), and the names of the parameters frozen.

    ``source``: a transformers checkpoint folder (``str`` / ``Path``; with a mesh made on the meta
    device, parallelized, then each rank reads only its slices: :func:`load_pretrained`), a flavor
    name (:data:`harts_runtime.models.FLAVORS`, random weights), a
    :class:`~harts_runtime.models.ModelConfig`, or a ``HybridModel`` already made (taken as it is,
    then :func:`prepare_model`). ``dtype``, ``device`` and ``overrides`` (model-config fields:
    ``chunk_size=16``, ``num_layers=2`` for a flavor) apply to the sources that are not a model.
    ``freeze`` (default: for checkpoint folders) freezes the parameters the transformers family
    cannot carry (:func:`harts_runtime.hf.freeze_family_constants`). Raises
    :class:`InvalidInputError` naming ``source`` for anything else, or the argument given with a
    model it cannot apply to."""
    from pathlib import Path

    from harts_runtime.models import HybridModel, ModelConfig, model_config

    checkpoint = isinstance(source, (str, Path)) and Path(source).is_dir()
    if checkpoint:  # with a mesh: made on meta, parallelized, then each rank reads its slices
        kw = {} if mesh is None else dict(mesh=mesh, parallelize=config.parallelize_options())
        model = load_pretrained(source, dtype=dtype, device=device, **kw, **overrides)
    elif isinstance(source, HybridModel):
        given = [k for k, v in (("dtype", dtype), ("device", device)) if v is not None] + list(overrides)
        if given:
            raise InvalidInputError(
                given[0], "applies to a folder, a flavor or a ModelConfig, not a model made"
            )
        model = source
    else:
        if isinstance(source, ModelConfig):
            cfg = source.replace(**overrides) if overrides else source
        elif isinstance(source, str):
            layers = overrides.pop("num_layers", None)
            cfg = model_config(source, layers, **overrides)
        else:
            raise InvalidInputError(
                "source",
                f"expected a checkpoint folder, a flavor name, a ModelConfig or a HybridModel, got {source!r}",
            )
        if dtype is not None:
            cfg = cfg.replace(dtype=dtype)
        model = HybridModel(cfg, device=device)
    prepare_model(model, config, mesh)
    frozen: list[str] = []
    if freeze if freeze is not None else checkpoint:
        from harts_runtime.hf import freeze_family_constants

        frozen = freeze_family_constants(model)
    return model, frozen
