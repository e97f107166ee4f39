"""The trained policy as a transformers checkpoint folder (:func:`export_hf`), for both commands:
``harts-train --export DIR`` and ``harts-rl --export-hf DIR``. The weights and ``config.json`` are
:func:`harts_runtime.hf.save_pretrained`'s (``transformers.AutoModelForCausalLM.from_pretrained``
loads the folder); a run trained from a checkpoint folder gets that folder's tokenizer files too."""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["TOKENIZER_FILES", "export_hf"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
"""The files of a checkpoint folder copied beside the exported weights (those it has)."""


def export_hf(engine, folder, model_folder=None) -> Path:
    """Write ``engine``'s model to ``folder`` (collective under torch.distributed: every rank calls
    it); with ``model_folder`` (the checkpoint the run started from) its tokenizer files too.
    Returns the folder."""
    from harts_runtime.hf import save_pretrained

    save_pretrained(engine.model, folder)
    if model_folder is not None:
        for name in TOKENIZER_FILES:
            src = Path(model_folder) / name
            if src.is_file() and not (Path(folder) / name).exists():
                shutil.copyfile(src, Path(folder) / name)
    return Path(folder)
