"""Activation recomputation: the runtime's one switch (:func:`apply_recompute`).

Full-block recomputation with ``torch.utils.checkpoint`` (non-reentrant): every block (a module
with ``.mixer`` and ``.ffn`` children, e.g. ``HybridModel.blocks[i]``) is wrapped so that its
forward runs without keeping activations and is re-run in backward. A KDA mixer re-executes the
same rounds from the fixed plan; the MoE expert-load counts are accumulated outside the blocks
(``HybridModel.forward_hidden``), so a recomputed block does not count twice. The wrapper only
acts while grad is enabled (evaluation runs the blocks plainly). Parameter names gain a
``.block.`` component (``blocks.0.block.mixer...``) while wrapped.

The train step, the CLI (``harts-train --recompute``) and ``harts_runtime.parallel.parallelize``
(``recompute=True``) all use this function; no layer or step has a flag of its own.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_recompute", "recompute_enabled"]


class _Checkpointed(nn.Module):
    """Wraps a block: forward under ``torch.utils.checkpoint`` while grad is enabled."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")  # absent while copying / unpickling
            if not modules or "block" not in modules:
                raise
            return getattr(modules["block"], name)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)
        return self.block(*args, **kwargs)


def _is_block(m: nn.Module) -> bool:
    return hasattr(m, "mixer") and hasattr(m, "ffn") and not isinstance(m, _Checkpointed)


def apply_recompute(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Turn full-block recomputation on (wrap every block) or off (unwrap), in place; returns
    ``model``. Idempotent; O(number of modules)."""
    for parent in list(model.modules()):
        if isinstance(parent, _Checkpointed):
            continue
        for name, child in list(parent.named_children()):
            if enabled and _is_block(child):
                new = _Checkpointed(child)
            elif not enabled and isinstance(child, _Checkpointed):
                new = child.block
            else:
                continue
            if isinstance(parent, nn.ModuleList):
                parent[int(name)] = new
            else:
                setattr(parent, name, new)
    return model


def recompute_enabled(model: nn.Module) -> bool:
    """Whether any block of ``model`` is wrapped by :func:`apply_recompute`."""
    return any(isinstance(m, _Checkpointed) for m in model.modules())
