"""verl's batches as HARTS steps and back: the DP all-gather of verl's ``TensorDict`` shares
(:func:`gather_rows`), the step's token ids as :class:`~harts_runtime.rollouts.Rollouts`
(:func:`rollouts_of`), verl's global loss denominators (:func:`step_denominators`) and HARTS's
per-target values in verl's jagged layout (:func:`harts_logprobs_to_verl`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorData, NonTensorStack
from verl.utils import tensordict_utils as tu

from harts_runtime.errors import InvalidInputError
from harts_runtime.rollouts import Rollouts

__all__ = ["gather_rows", "harts_logprobs_to_verl", "rollouts_of", "step_denominators"]


def _group_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_padded(t: torch.Tensor, n: int, n_max: int, group, dev) -> list[torch.Tensor]:
    """All-gather ``t`` (first dimension ``n`` here, ``n_max`` at most) over ``group``; returns each
    rank's tensor padded to ``n_max`` rows."""
    buf = t.new_zeros((n_max, *t.shape[1:]), device=dev)
    buf[:n] = t.to(dev)
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, buf, group=group)
    return [o.cpu() for o in out]


def gather_rows(data: TensorDict, group) -> tuple[TensorDict, int]:
    """The whole step: every rank's rows of ``data`` concatenated in DP-rank order, and where this
    rank's rows start. Tensor fields (dense ``[b, ...]`` and jagged ``[b, j]``) are all-gathered,
    per-sample non-tensor lists as objects; scalar metadata stays this rank's (verl sets it alike on
    every rank). Fields must agree across ranks in dtype and trailing shape (one-line
    :class:`InvalidInputError` naming the field otherwise). Without a group (or one rank) ``data``
    itself. Collective over ``group``."""
    if group is None or dist.get_world_size(group) == 1:
        return data, 0
    b = data.batch_size[0]
    meta: dict[str, Any] = {"b": b, "fields": {}}
    local = {}
    for key in data.keys():
        v = data.get(key)
        if isinstance(v, NonTensorStack):
            meta["fields"][key] = ("stack", list(v.tolist()))
        elif isinstance(v, NonTensorData):
            continue
        elif isinstance(v, torch.Tensor) and v.is_nested:
            if v.dim() != 2:
                raise InvalidInputError(
                    f"data[{key!r}]",
                    f"jagged fields must be [b, j] (got {v.dim()} dimensions; multimodal inputs are not supported)",
                )
            vals, off = v.values(), v.offsets()
            meta["fields"][key] = ("nested", str(vals.dtype), int(vals.shape[0]))
            local[key] = (vals, off.diff())
        elif isinstance(v, torch.Tensor):
            meta["fields"][key] = ("dense", str(v.dtype), tuple(v.shape[1:]))
            local[key] = v
    metas: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(metas, meta, group=group)
    rank = dist.get_rank(group)
    start = sum(m["b"] for m in metas[:rank])
    sizes = [m["b"] for m in metas]
    b_max = max(sizes)
    dev = _group_device(group)
    out: dict[str, Any] = {}
    for r, m in enumerate(metas):
        if set(m["fields"]) != set(meta["fields"]):
            diff = sorted(set(m["fields"]) ^ set(meta["fields"]))
            raise InvalidInputError(f"data[{diff[0]!r}]", f"present on only one of DP ranks {r} and {rank}")
    # one order on every rank (a TensorDict's key order is not: the collectives must pair up)
    for key in sorted(meta["fields"]):
        info = meta["fields"][key]
        for r, m in enumerate(metas):
            other = m["fields"].get(key)
            if other is None or other[0] != info[0] or (info[0] != "stack" and other[:2] != info[:2]):
                raise InvalidInputError(
                    f"data[{key!r}]", f"rank {r} holds it as {other}, rank {rank} as {info}"
                )
            if info[0] == "dense" and other[2] != info[2]:
                raise InvalidInputError(
                    f"data[{key!r}]",
                    f"trailing shapes differ over DP ranks: {other[2]} (rank {r}) vs {info[2]}",
                )
        if info[0] == "stack":
            out[key] = [x for m in metas for x in m["fields"][key][1]]
        elif info[0] == "dense":
            parts = _gather_padded(local[key], b, b_max, group, dev)
            out[key] = torch.cat([p[:n] for p, n in zip(parts, sizes)])
        else:
            vals, lens = local[key]
            nnz = [m["fields"][key][2] for m in metas]
            vparts = _gather_padded(vals, int(vals.shape[0]), max(nnz), group, dev)
            lparts = _gather_padded(lens, b, b_max, group, dev)
            values = torch.cat([p[:n] for p, n in zip(vparts, nnz)])
            lengths = torch.cat([p[:n] for p, n in zip(lparts, sizes)])
            offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
            out[key] = torch.nested.nested_tensor_from_jagged(values, offsets)
    step = TensorDict({k: v for k, v in out.items() if not isinstance(v, list)}, batch_size=[sum(sizes)])
    for k, v in out.items():
        if isinstance(v, list):
            tu.assign_non_tensor_stack(step, k, v)
    for key in data.keys():
        v = data.get(key)
        if isinstance(v, NonTensorData) and not isinstance(v, NonTensorStack):
            step[key] = v
    return step, start


def rollouts_of(step: TensorDict, vocab_size: int | None = None) -> Rollouts:
    """The step's token ids (``input_ids``, jagged: prompt + response of each sequence) as
    :class:`Rollouts` (no fields: verl's loss reads its own)."""
    ids = step.get("input_ids", None)
    if not (isinstance(ids, torch.Tensor) and ids.is_nested):
        raise InvalidInputError(
            "data['input_ids']", "the harts backend needs verl's no-padding (jagged) input_ids"
        )
    tokens = ids.values().cpu().numpy().astype(np.int64, copy=False)
    offsets = ids.offsets().cpu().numpy().astype(np.int64)
    return Rollouts(tokens, offsets).check(vocab_size)


def step_denominators(step: TensorDict) -> tuple[int | None, int | None]:
    """verl's global loss denominators of the whole step: ``batch_num_tokens`` (the ``loss_mask``
    tokens, as verl's engine all-reduces them) and ``global_batch_size`` (verl's when it set one,
    else the sequences with at least one response token, what ``agg_loss`` counts on one batch)."""
    mask = step.get("loss_mask", None)
    if mask is None:
        mask = step.get("response_mask", None)
    tokens = None
    if isinstance(mask, torch.Tensor):
        tokens = int((mask.values() if mask.is_nested else mask).sum())
    gbs = tu.get_non_tensor_data(step, "global_batch_size", None)
    if gbs is None:
        rm = step.get("response_mask", None)
        if isinstance(rm, torch.Tensor) and not rm.is_nested:
            gbs = int((rm.sum(-1) > 0).sum())
    return tokens, gbs


def harts_logprobs_to_verl(values: torch.Tensor, lengths, fill: float = 0.0) -> torch.Tensor:
    """HARTS per-target values ``[P]`` (trajectory ``i`` owns ``L_i - 1`` consecutive entries) as
    verl's jagged ``[k, L_i]`` model output: position ``t`` holds entry ``t`` (the value scoring
    token ``t + 1``), the last position ``fill``. Differentiable in ``values``."""
    lengths = torch.as_tensor(np.asarray(lengths), dtype=torch.int64)
    k = len(lengths)
    p = int(values.numel())
    if p != int(lengths.sum()) - k:
        raise InvalidInputError("values", f"expected {int(lengths.sum()) - k} per-target entries, got {p}")
    shift = torch.repeat_interleave(torch.arange(k), lengths - 1)
    idx = (torch.arange(p) + shift).to(values.device)
    flat = values.new_full((p + k,), fill).index_copy(0, idx, values)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(values.device)
    return torch.nested.nested_tensor_from_jagged(flat, offsets)
