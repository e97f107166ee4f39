"""The one rule for the parameters a model must not train because its transformers family has no
tensor for them.

A family's checkpoint carries only the family's tensors. Our :class:`HybridModel` can have a few
more, which the family's state-dict adapter lists as :meth:`extra_ours` (the tensors loading fills
with constants because no checkpoint tensor writes them). Those that are parameters (e.g. the KDA
output-gate bias of a Kimi-Linear model, zero) would leave the family when trained: the saved and
exported checkpoint must hold them at their constant (``save_pretrained`` / ``export_weights``
refuse a non-zero ``zero_only`` tensor), so they are frozen before the first step.
"""

from __future__ import annotations

import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.hf.save import save_setup

__all__ = ["freeze_family_constants"]


def freeze_family_constants(model, *, strict: bool = True) -> list[str]:
    """Freeze (``requires_grad_(False)``) the parameters of ``model`` that its transformers family
    has no tensor for, and return their state-dict names (all of them, also those already frozen;
    ``[]`` when there are none). Idempotent.

    The family is the one :func:`harts_runtime.hf.save_pretrained` writes (the loaded checkpoint's,
    else the one the config implies). The rule is: a parameter is frozen exactly when its name is
    one of the adapter's ``extra_ours()`` (our tensors no checkpoint tensor carries). This covers
    both earlier rules: the trainer's (``extra_ours`` among the parameters) is this one, and the
    verl engine's (the adapter's ``zero_only`` suffixes among the parameters) is contained in it,
    since every ``zero_only`` tensor is an ``extra_ours`` one (no checkpoint tensor, loaded as
    zero, saved only while zero). The buffers among ``extra_ours`` (expert-load counts, a Qwen
    expert bias) are not trained and are left alone; a config that would change the Qwen expert
    bias (``moe.use_expert_bias``) is one the family cannot express, refused below.

    ``strict``: True raises :class:`InvalidInputError` naming the :class:`ModelConfig` field that
    the family cannot express at all (a Kimi-Linear model with a GQA layer or zero-centred norms, a
    Qwen model with sigmoid routing, ...), before anything is frozen; False returns ``[]`` for such
    a model instead (it can be trained, never exported).
    """
    try:
        _, adapter = save_setup(model)
    except InvalidInputError:
        if strict:
            raise
        return []
    fixed = set(adapter.extra_ours())
    names = []
    for name, t in model.state_dict(keep_vars=True).items():
        if name in fixed and isinstance(t, torch.nn.Parameter):
            t.requires_grad_(False)
            names.append(name)
    return names
