"""Loading a transformers checkpoint folder into a :class:`~harts_runtime.models.HybridModel`.

:func:`load_pretrained` reads a folder (``config.json`` plus ``model.safetensors``, or shards listed
in ``model.safetensors.index.json``) of one of the families of :mod:`harts_runtime.models`. The
folder is checked first (:mod:`harts_runtime.hf.folder`: config, sizes, memory, every header),
then the model is built on the meta device, allocated uninitialised on the target device (no
random init), and each tensor is read one at a time (``safetensors.safe_open``), checked finite and
copied into its parameter (cast to the model dtype, moved to the device), so the weights are never
held twice. Both spellings of the tensors load: the checkpoint one (per-expert tensors, which
:func:`~harts_runtime.hf.save_pretrained` and the released checkpoints use) and the in-memory one of
the transformers model's ``state_dict()``. This package only reads: into a sharded model (made
on the meta device and parallelized by the caller first) :mod:`harts_runtime.hf.sharded` reads
each rank's slices, which ``harts_runtime.load_pretrained(path, mesh=...)``
(:func:`harts_runtime.engine.load.load_pretrained`) does.
"""

from __future__ import annotations

import contextlib

import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.hf.folder import (
    check_finite,
    kept_tensors,
    open_folder,
    reading,
    scan_headers,
    weight_files,
)

__all__ = ["load_pretrained"]


def _check_device(device) -> torch.device:
    """``device`` as a ``torch.device`` that this process can allocate on; InvalidInputError
    (``device``) for a malformed name or a CUDA device without CUDA (torch raises an
    ``AssertionError`` only once the first tensor is allocated)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidInputError(
            "device", f"{device!r} is not a device name (cpu, cuda, cuda:1, ...)"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidInputError("device", f"{device!r}: CUDA is not available in this process")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidInputError(
                "device", f"{device!r}: this process sees {torch.cuda.device_count()} CUDA device(s)"
            )
    return dev


def load_pretrained(path, dtype=None, device=None, **overrides):
    """A :class:`HybridModel` with the weights of the checkpoint folder ``path``, in this process.

    ``dtype``: a ``torch.dtype`` or name (None: the config's ``dtype`` when it is float32 /
    bfloat16 / float64, else float32). ``device``: where the weights go (None: ``"cpu"``).
    ``overrides``: :class:`ModelConfig` execution fields (``chunk_size``, ``attn_backend``,
    ``kda_backend``, ``lm_head_rows``, ...). The model is returned in training mode
    (``nn.Module``'s default); ``model.hf_config`` keeps the checkpoint's config dict so that
    :func:`save_pretrained` writes its other fields (token ids, ...) back. A sharded load (each
    rank its slices of a parallelized model) is ``harts_runtime.load_pretrained(path, mesh=...)``.

    Raises :class:`InvalidInputError` naming the config field, tensor or file, and the file
    (:mod:`harts_runtime.hf.folder`), or ``device`` (malformed, or CUDA without CUDA): a folder
    that is not a readable checkpoint (JSON nested too deeply, a non-finite number), unsupported
    options, a model that does not fit the device (checked before anything is allocated), unknown,
    missing, misshapen, non-floating-point or non-finite tensors; ``mesh`` / ``parallelize``
    (this package does not parallelize: the call above does).
    """
    for name in ("mesh", "parallelize"):
        if name in overrides:
            raise InvalidInputError(
                name,
                "harts_runtime.hf reads into one process's model; a sharded load is "
                "harts_runtime.load_pretrained(path, mesh=..., parallelize=...)",
            )
    from harts_runtime.models.hybrid.model import HybridModel

    device = _check_device("cpu" if device is None else device)
    path, hf_config, _, cfg, adapter = open_folder(path, dtype, overrides, device=device)
    files = weight_files(path)
    with contextlib.ExitStack() as stack:
        tensors = scan_headers(files, adapter, stack)  # before anything is allocated
        # built on the meta device and allocated uninitialised: every tensor is written below
        # ("auto" attention is resolved per call, on the device the rows are on)
        model = HybridModel(cfg, device="meta").to_empty(device=device)
        model.config = cfg
        targets = model.state_dict(keep_vars=True)
        written: dict[str, set] = {}
        with torch.no_grad():
            for k, v in adapter.extra_ours().items():
                targets[k].copy_(v)
                written[k] = {None}
            for name, (fh, f) in tensors.items():
                with reading(f, name):
                    tensor = fh.get_tensor(name)
                check_finite(name, tensor, f)
                for ours, slot, part in adapter.convert_slots(name, tensor):
                    (targets[ours] if slot is None else targets[ours][slot]).copy_(part)
                    written.setdefault(ours, set()).add(slot)
                del tensor
    for k, t in targets.items():  # the adapter's table covers every tensor; checked, not assumed
        w = written.get(k, set())
        if None not in w and len(w) != t.shape[0]:
            raise InvalidInputError(k, "not written by any checkpoint tensor")
    model.hf_config = hf_config
    model.hf_kept = kept_tensors(files, adapter)  # not run (MTP layers); save_pretrained writes them back
    return model
