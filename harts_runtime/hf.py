"""Hugging Face checkpoint folders <-> :class:`~harts_runtime.models.hybrid.model.HybridModel`.

:func:`load_pretrained` reads a transformers Kimi-Linear folder (``config.json`` plus
``model.safetensors``, or shards listed in ``model.safetensors.index.json``) into our model;
:func:`save_pretrained` writes one that ``transformers.AutoModelForCausalLM.from_pretrained``
loads as ``KimiLinearForCausalLM``. The config and tensor maps are
:mod:`harts_runtime.models.kimi_linear`. Needs the ``hf`` extra (``safetensors``; transformers
only to run the checkpoint on the HF side).

Loading builds the model on the meta device, allocates it uninitialised on the target device
(no random init), then reads one tensor at a time (``safetensors.safe_open``) and copies it into
its parameter (cast to the model dtype, moved to the device), so the weights are never held twice. Both spellings of the tensors load (the checkpoint one, per-expert ``w1/w2/w3`` under
``block_sparse_moe``, which ``save_pretrained`` and the released checkpoints use, and the
in-memory one of ``KimiLinearForCausalLM.state_dict()``); saving writes the checkpoint spelling. Single-process models only: a TP/EP-sharded model must be gathered
first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from harts_runtime.errors import InvalidInputError

__all__ = ["load_pretrained", "save_pretrained"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def _dtype_name(dtype) -> str | None:
    if dtype is None or isinstance(dtype, str):
        return dtype
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    raise InvalidInputError("dtype", f"expected a torch.dtype or a name, got {dtype!r}")


def _weight_files(path: Path) -> list[Path]:
    if (path / INDEX_NAME).is_file():
        index = json.loads((path / INDEX_NAME).read_text())
        files = sorted(set(index.get("weight_map", {}).values()))
        if not files:
            raise InvalidInputError(INDEX_NAME, "has an empty weight_map")
        return [path / f for f in files]
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    raise InvalidInputError("path", f"{path} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")


def load_pretrained(path, dtype=None, device="cpu", **overrides):
    """A :class:`HybridModel` with the weights of the Kimi-Linear checkpoint folder ``path``.

    ``dtype``: a ``torch.dtype`` or name (None: the config's ``dtype`` when it is float32 /
    bfloat16 / float64, else float32). ``overrides``: :class:`ModelConfig` execution fields
    (``chunk_size``, ``attn_backend``, ``kda_backend``, ``lm_head_rows``, ...). The model is
    returned in training mode (``nn.Module``'s default); ``model.hf_config`` keeps the checkpoint's
    config dict so that :func:`save_pretrained` writes its other fields (token ids, ...) back.

    Raises :class:`InvalidInputError` naming the config field or tensor: unsupported options,
    unknown, missing or misshapen tensors.
    """
    from safetensors import safe_open

    from harts_runtime.models.hybrid.model import HybridModel
    from harts_runtime.models.kimi_linear import KimiLinearStateDictAdapter, from_hf_config

    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        raise InvalidInputError("path", f"{path} has no {CONFIG_NAME}")
    hf_config = json.loads((path / CONFIG_NAME).read_text())
    if hf_config.get("model_type", "kimi_linear") != "kimi_linear":
        raise InvalidInputError("model_type", f"{hf_config['model_type']!r}; only kimi_linear is supported")
    cfg = from_hf_config(hf_config, dtype=_dtype_name(dtype), **overrides)
    adapter = KimiLinearStateDictAdapter(cfg)
    files = _weight_files(path)
    # built on the meta device and allocated uninitialised: every tensor is written below
    # (the attention backend HybridModel would pick for the target device, not for meta)
    build = cfg
    if cfg.attn_backend == "auto":
        build = cfg.replace(attn_backend="varlen" if torch.device(device).type == "cuda" else "reference")
    model = HybridModel(build, device="meta").to_empty(device=device)
    model.config = cfg
    targets = model.state_dict(keep_vars=True)
    written: dict[str, set] = {}
    seen = set()
    with torch.no_grad():
        for k, v in adapter.extra_ours().items():
            targets[k].copy_(v)
            written[k] = {None}
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for name in fh.keys():
                    if name in seen:
                        raise InvalidInputError(name, f"appears twice (again in {f.name})")
                    for ours, slot, tensor in adapter.convert_slots(name, fh.get_tensor(name)):
                        (targets[ours] if slot is None else targets[ours][slot]).copy_(tensor)
                        written.setdefault(ours, set()).add(slot)
                    seen.add(name)
    missing = adapter.missing(seen)
    if missing:
        raise InvalidInputError(missing[0], f"missing from the checkpoint ({len(missing)} tensors missing)")
    for k, t in targets.items():  # the adapter's table covers every tensor; checked, not assumed
        w = written.get(k, set())
        if None not in w and len(w) != t.shape[0]:
            raise InvalidInputError(k, "not written by any checkpoint tensor")
    model.hf_config = hf_config
    return model


def save_pretrained(model, path) -> None:
    """Write ``config.json`` and ``model.safetensors`` of a Kimi-Linear :class:`HybridModel` to ``path``
    (created if needed), loadable by ``transformers.AutoModelForCausalLM.from_pretrained``.

    Raises :class:`InvalidInputError` naming the :class:`ModelConfig` field or tensor that
    Kimi-Linear cannot express (GQA layers, MLA with RoPE, softmax routing, a non-zero KDA
    output-gate bias, ...).
    """
    from safetensors.torch import save_file

    from harts_runtime.models.kimi_linear import KimiLinearStateDictAdapter, to_hf_config

    cfg = model.config
    hf_config = to_hf_config(cfg, base=getattr(model, "hf_config", None))
    adapter = KimiLinearStateDictAdapter(cfg)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tensors = {k: v.to("cpu").contiguous() for k, v in adapter.to_checkpoint(state).items()}
    os.makedirs(path, exist_ok=True)
    path = Path(path)
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    (path / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
