"""Checkpoint tensor names -> transformers' in-memory names (:func:`to_transformers_names`).

:func:`~harts_runtime.hf.export_weights` yields the tensors in the spelling of a checkpoint folder
(what :func:`~harts_runtime.hf.save_pretrained` writes and vLLM / SGLang ``load_weights`` read).
transformers 5 converts some of them while loading a folder, so a model built in memory names and
shapes them differently (``load_state_dict`` of the checkpoint spelling loads only part of it):

=======================================================  ================================================
checkpoint (export_weights)                              in memory (transformers 5)
=======================================================  ================================================
``layers.N.block_sparse_moe.X``                          ``layers.N.mlp.X`` (Kimi-Linear)
``self_attn.{f_a_proj,f_b_proj}.weight``,                ``self_attn.forget_gate.X`` (Kimi-Linear KDA)
``self_attn.dt_bias``, ``self_attn.A_log``
``self_attn.{q,k,v}_conv1d.weight`` ``[C, 1, K]`` each   ``self_attn.conv1d.weight`` ``[3C, 1, K]`` (q, k, v)
``mlp.experts.E.{w1|gate_proj}.weight`` ``[I, H]`` and   ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``
``mlp.experts.E.{w3|up_proj}.weight``                    (gate rows first, then up)
``mlp.experts.E.{w2|down_proj}.weight`` ``[H, I]``       ``mlp.experts.down_proj`` ``[E, H, I]``
=======================================================  ================================================

A family whose checkpoints spell more names differently gives its renames as its state-dict
adapter's optional ``memory_renames``: ``(pattern, replacement)`` pairs of :func:`re.sub`, applied in
order to each checkpoint name before the rules above (Ling-3.0: ``model.word_embeddings`` ->
``model.embed_tokens``, ``attention.`` -> ``self_attn.`` and so on; Nemotron-H: ``backbone.`` ->
``model.``). Experts live under ``mlp.experts`` or ``mixer.experts`` (Nemotron-H); a family whose
experts have no gate projection (only ``up_proj`` / ``down_proj``) fuses them to
``experts.up_proj`` ``[E, I, H]`` and ``experts.down_proj`` ``[E, H, I]``.

Every other name is the same in both. Streaming: a fused tensor is yielded once all of its parts
have arrived (experts are counted from the stream itself: the parts of one layer arrive together,
as :func:`export_weights` yields them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

__all__ = ["to_transformers_names"]

_KDA_GATE = re.compile(r"^(.*\.self_attn)\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$")
_CONV = re.compile(r"^(.*\.self_attn)\.([qkv])_conv1d\.weight$")
_EXPERT = re.compile(r"^(.*\.(?:mlp|mixer)\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def _rename(name: str, renames: tuple[tuple[str, str], ...] = ()) -> str:
    for pattern, replacement in renames:
        name = re.sub(pattern, replacement, name)
    name = re.sub(r"(\.layers\.\d+)\.block_sparse_moe\.", r"\1.mlp.", name)
    m = _KDA_GATE.match(name)
    return f"{m.group(1)}.forget_gate.{m.group(2)}" if m else name


def _fuse(blocks: list[list[torch.Tensor]]) -> torch.Tensor:
    """``[E, sum of rows, cols]`` from each expert's row blocks, written once into one new tensor
    (a stack of concatenations would copy every expert twice and launch 2E + 1 kernels)."""
    first = blocks[0][0]
    rows = sum(t.shape[0] for t in blocks[0])
    out = torch.empty((len(blocks), rows, first.shape[1]), dtype=first.dtype, device=first.device)
    for e, parts in enumerate(blocks):
        lo = 0
        for t in parts:
            out[e, lo : lo + t.shape[0]].copy_(t)
            lo += t.shape[0]
    return out


def to_transformers_names(
    pairs: Iterable[tuple[str, torch.Tensor]], adapter=None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs in checkpoint spelling -> the same weights under transformers' in-memory
    names and shapes (module docstring), ready for ``model.load_state_dict(dict(...), strict=True)``.
    ``adapter``: the family's state-dict adapter, whose optional ``memory_renames`` apply first
    (None: the Kimi-Linear / Qwen rules only). Tensors pass through unchanged but for the fused ones
    (new tensors)."""
    renames = tuple(getattr(adapter, "memory_renames", ()) or ())
    convs: dict[str, dict[str, torch.Tensor]] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}

    def flush_experts(prefix: str):
        parts = experts.pop(prefix)
        order = sorted(parts)
        roles = {"gate", "up", "down"} if any("gate" in parts[e] for e in order) else {"up", "down"}
        if order != list(range(len(order))) or any(set(parts[e]) != roles for e in order):
            missing = [e for e in range(max(order) + 1) if e not in parts or set(parts[e]) != roles]
            raise ValueError(f"{prefix}: expert tensors incomplete (experts {missing})")
        if "gate" in roles:
            yield f"{prefix}.gate_up_proj", _fuse([[parts[e]["gate"], parts[e]["up"]] for e in order])
        else:
            yield f"{prefix}.up_proj", _fuse([[parts[e]["up"]] for e in order])
        yield f"{prefix}.down_proj", _fuse([[parts[e]["down"]] for e in order])

    for name, tensor in pairs:
        name = _rename(name, renames)
        m = _CONV.match(name)
        if m:
            got = convs.setdefault(m.group(1), {})
            got[m.group(2)] = tensor
            if len(got) == 3:
                del convs[m.group(1)]
                yield f"{m.group(1)}.conv1d.weight", torch.cat([got["q"], got["k"], got["v"]], 0)
            continue
        m = _EXPERT.match(name)
        if m:
            for prefix in [p for p in experts if p != m.group(1)]:  # the previous layer is complete
                yield from flush_experts(prefix)
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[_ROLE[m.group(3)]] = tensor
            continue
        for prefix in list(experts):
            yield from flush_experts(prefix)
        yield name, tensor
    for prefix in list(experts):
        yield from flush_experts(prefix)
    if convs:
        raise ValueError(f"{sorted(convs)[0]}: q / k / v conv1d weights incomplete")
