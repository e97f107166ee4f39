"""Activation recomputation: the runtime's one switch (:func:`apply_recompute`).

Full-block recomputation with ``torch.utils.checkpoint`` (non-reentrant): every block (a module
with ``.mixer`` and ``.ffn`` children, e.g. ``HybridModel.blocks[i]``) is wrapped so that its
forward runs without keeping activations and is re-run in backward. A KDA mixer re-executes the
same rounds from the fixed plan; the MoE expert-load counts are accumulated outside the blocks
(``HybridModel.forward_hidden``), so a recomputed block does not count twice. The wrapper only
acts while grad is enabled (evaluation runs the blocks plainly). The block is not wrapped in
another module: its ``forward`` is routed through the checkpoint, so parameter names, state dicts
and distributed checkpoints are the same with and without recomputation, and module hooks (FSDP2's
all-gathers) still run around the recomputed forward.

Selective recomputation: ``keep`` names op regions (:data:`harts_runtime.ops.keep.KEEPABLE`)
whose activations are kept instead of recomputed (:mod:`harts_runtime.ops.keep`). ``("attention",)``
keeps every full-attention core: its forward (a third of its cost) is not run again, for the
memory of its packed inputs, output and softmax statistics (about 1.4 GB per MLA layer of a
65,536-row ling-tiny microbatch). ``"linear_attention"`` keeps every KDA / Gated DeltaNet layer's
rounds (the chunk kernels with their gathers and state handoffs; the token-wise projections,
convolutions and norms are still recomputed) for the memory of the packed q, k, v, the fp32 gate
cumsum and the two intra-chunk matrices, plus the region's output: at most 1.9 GB per KDA layer
of the same microbatch (P = 65.6k packed rows, 16 heads of 128: 3 x 268 MB + 537 MB + 2 x 134 MB,
and 268 MB; measured, about 1.6 GB per layer of peak memory). The default keeps nothing
(full-block recomputation).

In a recomputed block (outside kept regions) saves are transient
(:func:`harts_runtime.ops.keep.saves_are_transient`): the KDA / Gated DeltaNet chunk core then
saves its WY factors and chunk states for backward instead of recomputing them there (fla's
``disable_recompute``; about 1.9 GB more while one 65,536-row ling-tiny KDA layer's backward runs,
one scan and one WY pass less per round; ``save_intermediates=False`` turns it off). A kept
``"linear_attention"`` region saves what fla's core saves by default, so its backward still
recomputes those two.

The train step, the CLI (``harts-train --recompute``) and ``harts_runtime.parallel.parallelize``
(``recompute=True``) all use this function; no layer or step has a flag of its own.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harts_runtime.ops.keep import KeptRegions, checked_keep, recomputed

__all__ = ["apply_recompute", "recompute_enabled"]


class _Recompute:
    """A block's recomputation options; ``__call__`` is the block's forward while recomputation is
    on (an instance attribute over the class's forward)."""

    def __init__(self, block: nn.Module, keep: frozenset[str], save_intermediates: bool):
        self.forward = block.forward  # the block's own forward, bound
        self.keep, self.save_intermediates = keep, save_intermediates

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        save = self.save_intermediates  # ops.keep.saves_are_transient inside the block
        if not self.keep:
            return checkpoint(recomputed, save, self.forward, *args, use_reentrant=False, **kwargs)
        frame = KeptRegions(self.keep)  # one per call: the forward fills it, the recomputation reads it
        return checkpoint(recomputed, save, frame.run, self.forward, *args, use_reentrant=False, **kwargs)


def _is_block(m: nn.Module) -> bool:
    return hasattr(m, "mixer") and hasattr(m, "ffn")


def apply_recompute(
    model: nn.Module, enabled: bool = True, keep: Iterable[str] = (), save_intermediates: bool = True
) -> nn.Module:
    """Turn block recomputation on or off for every block (a module with ``.mixer`` and ``.ffn``),
    in place; returns ``model``.

    ``keep``: op regions that keep their activations instead of being recomputed (names of
    :data:`~harts_runtime.ops.keep.KEEPABLE`; empty: full-block recomputation).
    ``save_intermediates``: in a block's recomputation, ops save what their own backward would
    recompute (:func:`~harts_runtime.ops.keep.saves_are_transient`; the KDA / GDN cores: about
    1.9 GB per 65,536-row ling-tiny layer until that block's backward); False keeps the lower
    peak. Calling again on a recomputing model sets the new options on its blocks. Idempotent;
    O(number of modules).
    """
    keep = checked_keep(keep)
    for block in model.modules():
        if not _is_block(block):
            continue
        current = block.__dict__.get("forward")
        if isinstance(current, _Recompute):
            if enabled:
                current.keep, current.save_intermediates = keep, save_intermediates
            else:
                orig = current.forward
                if getattr(orig, "__self__", None) is block and orig.__func__ is type(block).forward:
                    del block.forward  # back to the class's forward
                else:
                    block.forward = orig
        elif enabled:
            block.forward = _Recompute(block, keep, save_intermediates)
    return model


def recompute_enabled(model: nn.Module) -> bool:
    """Whether any block of ``model`` recomputes its activations (:func:`apply_recompute`)."""
    return any(isinstance(m.__dict__.get("forward"), _Recompute) for m in model.modules())
