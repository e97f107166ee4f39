"""Hugging Face checkpoint folders <-> :class:`~harts_runtime.models.hybrid.model.HybridModel`.

:func:`load_pretrained` reads a transformers checkpoint folder (``config.json`` plus
``model.safetensors``, or shards listed in ``model.safetensors.index.json``) into our model;
:func:`save_pretrained` writes one that ``transformers.AutoModelForCausalLM.from_pretrained``
loads. The family is ``config.json``'s ``model_type`` (:data:`FAMILIES`): Kimi-Linear
(:mod:`harts_runtime.models.kimi_linear`), Qwen3-Next (:mod:`harts_runtime.models.qwen3_next`) and
Qwen3.5-MoE text (:mod:`harts_runtime.models.qwen3_5_moe`; of a vision-language ``qwen3_5_moe``
folder the text model, the vision tower and MTP head skipped); those modules hold the config and
tensor maps. Needs the ``hf`` extra (``safetensors``; transformers
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

__all__ = ["FAMILIES", "load_pretrained", "save_pretrained"]

FAMILIES = ("kimi_linear", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
"""``config.json`` ``model_type`` values :func:`load_pretrained` reads (``qwen3_5_moe``: its text part)."""


def _family(model_type: str):
    """model_type -> (from_hf_config, to_hf_config, adapter class)."""
    if model_type == "kimi_linear":
        from harts_runtime.models import kimi_linear as m

        return m.from_hf_config, m.to_hf_config, m.KimiLinearStateDictAdapter
    if model_type == "qwen3_next":
        from harts_runtime.models import qwen3_next as m

        return m.from_hf_config, m.to_hf_config, m.QwenStateDictAdapter
    if model_type in ("qwen3_5_moe_text", "qwen3_5_moe"):
        from harts_runtime.models import qwen3_5_moe as m

        return m.from_hf_config, m.to_hf_config, m.Qwen35MoeStateDictAdapter
    raise InvalidInputError("model_type", f"{model_type!r}; supported: {', '.join(FAMILIES)}")


def _infer_model_type(cfg) -> str:
    """The family of a model built without a checkpoint config: its mixers decide."""
    if any(m in ("kda", "mla") for m in cfg.mixers):
        return "kimi_linear"
    if "gdn" in cfg.mixers and cfg.gdn_projection == "split":
        return "qwen3_5_moe_text"
    return "qwen3_next"


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

    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        raise InvalidInputError("path", f"{path} has no {CONFIG_NAME}")
    hf_config = json.loads((path / CONFIG_NAME).read_text())
    model_type = hf_config.get("model_type", "kimi_linear")
    from_hf_config, _, adapter_cls = _family(model_type)
    cfg = from_hf_config(hf_config, dtype=_dtype_name(dtype), **overrides)
    adapter = (
        adapter_cls(cfg, prefix="model.language_model.") if model_type == "qwen3_5_moe" else adapter_cls(cfg)
    )
    ignored = getattr(adapter, "ignored", lambda name: False)
    files = _weight_files(path)
    # built on the meta device and allocated uninitialised: every tensor is written below
    # ("auto" attention is resolved per call, on the device the rows are on)
    model = HybridModel(cfg, device="meta").to_empty(device=device)
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
                    if ignored(name):  # outside the text model (vision tower, MTP head)
                        continue
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


def save_pretrained(model, path, model_type: str | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` of a :class:`HybridModel` to ``path`` (created
    if needed), loadable by ``transformers.AutoModelForCausalLM.from_pretrained``.

    ``model_type``: the family to write (``kimi_linear``, ``qwen3_next`` or ``qwen3_5_moe_text``;
    None: the loaded checkpoint's, a ``qwen3_5_moe`` one written as its text model, else the one
    the mixers imply: KDA/MLA Kimi-Linear, split-projection GDN Qwen3.5-MoE, else Qwen3-Next).

    Raises :class:`InvalidInputError` naming the :class:`ModelConfig` field or tensor that the
    family cannot express (Kimi-Linear: GQA layers, MLA with RoPE, softmax routing, a non-zero KDA
    output-gate bias, ...; Qwen: other mixers, sigmoid routing, an ungated shared expert, ...).
    """
    from safetensors.torch import save_file

    cfg = model.config
    base = getattr(model, "hf_config", None)
    if model_type is None:
        model_type = (base or {}).get("model_type") or _infer_model_type(cfg)
        model_type = "qwen3_5_moe_text" if model_type == "qwen3_5_moe" else model_type
    if model_type == "qwen3_5_moe":
        raise InvalidInputError(
            "model_type", "qwen3_5_moe (vision-language) is not written; use qwen3_5_moe_text"
        )
    _, to_hf_config, adapter_cls = _family(model_type)
    if model_type == "kimi_linear":  # Qwen-only options Kimi-Linear's config cannot carry
        for name in ("zero_centered_norms", "shared_expert_gate"):
            if getattr(cfg, name):
                raise InvalidInputError(name, "True has no Kimi-Linear equivalent")
    hf_config = to_hf_config(cfg, base=base)
    adapter = adapter_cls(cfg)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tensors = {k: v.to("cpu").contiguous() for k, v in adapter.to_checkpoint(state).items()}
    os.makedirs(path, exist_ok=True)
    path = Path(path)
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    (path / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
