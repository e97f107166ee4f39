"""Hugging Face checkpoint folders <-> :class:`~harts_runtime.models.hybrid.model.HybridModel`.

:func:`load_pretrained` reads a transformers checkpoint folder (``config.json`` plus
``model.safetensors``, or shards listed in ``model.safetensors.index.json``) into our model;
:func:`save_pretrained` writes one that ``transformers.AutoModelForCausalLM.from_pretrained``
loads; :func:`export_weights` streams its tensors for a rollout engine. The family is
``config.json``'s ``model_type``, looked up in :mod:`harts_runtime.models.registry`: Kimi-Linear,
Qwen3-Next and Qwen3.5-MoE text (of a vision-language ``qwen3_5_moe`` folder the text model, the
vision tower and MTP head skipped); each family holds its config and tensor maps. Needs the ``hf``
extra (``safetensors``; transformers only to run the checkpoint on the HF side).

One job per module:

=====================================  ============================================================
:mod:`harts_runtime.hf.folder`         reading a folder: ``config.json``, weight files, headers;
                                       size, memory, dtype and finiteness checks (one named
                                       :class:`~harts_runtime.errors.InvalidInputError` each)
:mod:`harts_runtime.hf.load`           :func:`load_pretrained` in one process
:mod:`harts_runtime.hf.sharded`        :func:`open_sliced`: a checked folder read into a model the
                                       caller made and parallelized, each rank only its slices
:mod:`harts_runtime.hf.save`           :func:`save_pretrained`, :func:`export_weights` (collective
                                       on a parallelized model), the shard writer
:mod:`harts_runtime.hf.freeze`         :func:`freeze_family_constants`: the parameters the family
                                       has no tensor for
=====================================  ============================================================

:mod:`harts_runtime.hf` only reads and writes folders: it never imports :mod:`harts_runtime.parallel`
(nor the reverse; both import-linter contracts). A sharded load, ``harts_runtime.load_pretrained(path,
mesh=...)``, is :func:`harts_runtime.engine.load.load_pretrained`: it parallelizes the model made on the
meta device, then this package reads each rank's slices into it. Training checkpoints (sharded
weights and optimizer state) are :func:`harts_runtime.parallel.checkpoint.save_checkpoint` /
``load_checkpoint``.
"""

from harts_runtime.hf.folder import (
    CONFIG_NAME,
    INDEX_NAME,
    WEIGHTS_NAME,
    available_bytes,
    human_bytes,
    model_bytes,
    read_config,
)
from harts_runtime.hf.freeze import freeze_family_constants
from harts_runtime.hf.load import load_pretrained
from harts_runtime.hf.save import MAX_SHARD_BYTES, export_weights, save_pretrained, save_setup
from harts_runtime.hf.sharded import SlicedCheckpoint, open_sliced

# Earlier private names still imported by trainer.py and integrations/verl.py (to move to the
# public ones above: freeze_family_constants, read_config, available_bytes, human_bytes).
_available_bytes = available_bytes
_human = human_bytes
_read_config = read_config
_save_setup = save_setup

__all__ = [
    "CONFIG_NAME",
    "INDEX_NAME",
    "MAX_SHARD_BYTES",
    "SlicedCheckpoint",
    "WEIGHTS_NAME",
    "available_bytes",
    "export_weights",
    "freeze_family_constants",
    "human_bytes",
    "load_pretrained",
    "model_bytes",
    "open_sliced",
    "read_config",
    "save_pretrained",
    "save_setup",
]
