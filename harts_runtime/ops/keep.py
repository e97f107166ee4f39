"""Kept regions: ops whose activations survive full-block recomputation (selective recomputation).

:func:`harts_runtime.recompute.apply_recompute` re-runs every block forward during backward. For
an op that is expensive per byte it saves (the attention core: a FlashAttention kernel keeps only
its inputs, output and softmax statistics, but its forward is a third of its cost), re-running is
the wrong trade. :func:`kept` marks such an op by name; when the block runs under recomputation
with that name in its ``keep`` set:

* in the first forward, the op runs with its saved tensors stored for real (an inner
  ``torch.autograd.graph.saved_tensors_hooks`` pair that keeps them detached, with autograd's
  in-place version check, and takes precedence over the checkpoint's discarding hooks), and its
  output is remembered;
* in the recomputation, the op is not run again: the remembered output (detached) takes its place,
  so the ops after it save the same tensors as in the first forward, and nothing inside it is
  recomputed. Backward through the op uses the tensors it kept.

Anything an op keeps must be a pure function of its inputs (no randomness, no in-place updates of
state), as for every recomputed op. Outside a recomputed block, or for a name not in ``keep``,
:func:`kept` is a plain call. Used by :func:`harts_runtime.ops.attention.compact_attention` under
the name ``"attention"`` and by :func:`harts_runtime.layers.kda.run_kda_schedule` (the rounds of a
KDA or Gated DeltaNet layer: its chunk kernels' forward is about a third of the layer's core time,
and what they save is a few row-wide tensors) under ``"linear_attention"``; torch's own selective checkpointing (``create_selective_checkpoint_contexts``)
sees only aten ops, not the Triton/CuTe kernels of these autograd functions, hence this room.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

import torch

from harts_runtime import regions
from harts_runtime.errors import InvalidInputError

__all__ = ["KEEPABLE", "KeptRegions", "checked_keep", "kept", "recomputed", "saves_are_transient"]

KEEPABLE = frozenset(regions.KEEPABLE)
"""Names that :func:`kept` is called with somewhere in the runtime: ``"attention"`` (every
full-attention core, :func:`~harts_runtime.ops.attention.compact_attention`) and
``"linear_attention"`` (every chunkwise linear-attention schedule, KDA and Gated DeltaNet:
:func:`~harts_runtime.layers.kda.run_kda_schedule`)."""


def checked_keep(keep) -> frozenset[str]:
    """``keep`` as a frozenset of :data:`KEEPABLE` names; :class:`InvalidInputError` (field
    ``keep``) naming any other."""
    keep = frozenset(keep)
    if not keep <= KEEPABLE:
        raise InvalidInputError(
            "keep", f"unknown regions {sorted(keep - KEEPABLE)}; choose from {sorted(KEEPABLE)}"
        )
    return keep


class KeptRegions:
    """The kept outputs of one recomputed block call, in call order (:func:`kept`)."""

    def __init__(self, keep: frozenset[str]):
        self.keep = keep
        self.outputs: list = []
        self.replaying = False  # False during the first forward, True during the recomputation
        self.next = 0

    def run(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` with this frame active; every run after the first replays."""
        self.next = 0
        token = _ACTIVE.set(self)
        try:
            return fn(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)
            self.replaying = True


_ACTIVE: ContextVar[KeptRegions | None] = ContextVar("harts_kept_regions", default=None)
_TRANSIENT: ContextVar[bool] = ContextVar("harts_saves_transient", default=False)


def recomputed(transient: bool, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` as the body of a recomputed block (what
    :func:`harts_runtime.recompute.apply_recompute` checkpoints): :func:`saves_are_transient` is
    ``transient`` inside it, outside kept regions. The same in the first forward and in the
    recomputation: the checkpoint requires the recomputation to save the very tensors the first
    forward saved (their number, order and metadata), and the first forward's saves are discarded
    anyway."""
    token = _TRANSIENT.set(bool(transient))
    try:
        return fn(*args, **kwargs)
    finally:
        _TRANSIENT.reset(token)


def saves_are_transient() -> bool:
    """Whether an op should save for backward what its backward would otherwise recompute from
    its inputs (the KDA core's WY factors and state scan): True in a recomputed block
    (:func:`recomputed`) with grad enabled, outside kept regions. The block's first forward
    stores nothing (the checkpoint discards every save) and its recomputation's saves live only
    until the block's own backward is done: the time without the memory. False outside
    recomputation (a save lives from the forward to the backward of the whole model) and inside a
    kept region (its saves do too)."""
    return _TRANSIENT.get() and torch.is_grad_enabled()


def _detach(out):
    """The output cut from its graph but still requiring grad where it did (a fresh leaf), so the
    ops after it save the same tensors in the recomputation as in the forward."""
    if isinstance(out, torch.Tensor):
        return out.detach().requires_grad_(out.requires_grad)
    if isinstance(out, tuple):
        return tuple(_detach(o) for o in out)
    return out


def kept(name: str, fn: Callable, *args):
    """``fn(*args)``; kept (not recomputed) when a recomputed block's ``keep`` names ``name``."""
    frame = _ACTIVE.get()
    if frame is None or name not in frame.keep or not torch.is_grad_enabled():
        return fn(*args)
    if frame.replaying:
        if frame.next >= len(frame.outputs):
            raise RuntimeError(f"kept region {name!r}: the recomputation ran more kept ops than the forward")
        out = frame.outputs[frame.next]
        frame.next += 1
        return out
    token = _TRANSIENT.set(False)  # what the region saves lives until the model's backward
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            out = fn(*args)
    finally:
        _TRANSIENT.reset(token)
    frame.outputs.append(_detach(out))
    return out


def _pack(t: torch.Tensor):
    """Keep ``t`` without its ``grad_fn`` (an op that saves its own output would otherwise hold a
    reference cycle through autograd's C++ nodes, which no garbage collection frees; autograd
    reattaches the output's ``grad_fn`` on unpack), with its version for the in-place check that
    saved-tensor hooks switch off."""
    return t.detach(), t._version


def _unpack(packed) -> torch.Tensor:
    t, version = packed
    if t._version != version:
        raise RuntimeError(
            "kept region: a tensor saved for backward was modified by an inplace operation "
            f"(version {version} when saved, {t._version} now)"
        )
    return t
