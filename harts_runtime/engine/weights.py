"""The rollout engine's weight contract: a manifest of the weights (:func:`weight_manifest`) and a
re-iterable stream of full tensors in manifest order, one bucket at a time (:func:`weights`).

What vLLM's weight transfer and SGLang's ``update_weights_from_*`` read on the trainer side:

* the manifest lists, for every tensor the rollout model loads, its name, dtype, full shape, layer
  group (``N`` of ``model.layers.<N>.``, None outside the layers) and the ranks that hold a piece
  of it; it is the same on every rank and costs no communication (shapes come from the adapter's
  table, dtypes and holders from the parameters);
* the stream yields *buckets*, lists of ``(name, full tensor)`` in manifest order, each of at most
  ``bucket_bytes`` (a tensor larger than the bucket is a bucket of its own). Under FSDP / TP each
  parameter is gathered (``full_tensor()``, a collective in the same order on every rank, so every
  rank iterates the whole stream) when the first tensor that needs it is assembled and dropped after
  its last one. The memory the stream holds beyond the model is the bucket being built plus the
  gathered parameters still needed; :attr:`WeightStream.peak_bytes` records its maximum over the
  last iteration (a count of tensor bytes, not an allocator measurement).

``names``: ``"transformers"`` (a transformers model's in-memory names and fused shapes, what
``load_state_dict(strict=True)`` of the rollout model takes; experts as ``[E, 2I, D]`` / ``[E, D,
I]``), ``"checkpoint"`` (a checkpoint folder's spelling: what ``save_pretrained`` writes, per-expert
tensors), ``"vllm"`` or ``"sglang"`` (what that engine's ``model.load_weights`` takes for the
model's family: the checkpoint's tensors and shapes under the engine's names, the rules in
:mod:`harts_runtime.engine.weight_names`; the checkpoint's names except Qwen3.5-MoE's for vLLM,
``model.language_model.``, and Ling-3.0's KDA layers' ``attention.o_proj`` for ``attention.dense``).
Each ``model.layers.<N>.`` block is contiguous in the order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from harts_runtime.engine.weight_names import ENGINES, engine_name, engine_rule
from harts_runtime.errors import InvalidInputError

if TYPE_CHECKING:
    from harts_runtime.models.state_dict_adapter import HFStateDictAdapter

__all__ = ["NAMES", "WeightEntry", "WeightStream", "weight_manifest", "weights"]

NAMES = ("transformers", "checkpoint", "vllm", "sglang")
"""The spellings of the manifest and the stream."""
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class WeightEntry:
    """One tensor of the manifest."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    """The full (unsharded) shape."""
    layer: int | None
    """``N`` of ``model.layers.<N>.`` (None: embeddings, final norm, LM head, ...)."""
    ranks: tuple[int, ...]
    """Global ranks holding a piece of it (every rank of a replicated or sharded parameter's mesh;
    ``(0,)`` in one process)."""

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _holders(t) -> tuple[int, ...]:
    if _is_dtensor(t):
        return tuple(sorted(set(t.device_mesh.mesh.flatten().tolist())))
    return tuple(range(dist.get_world_size())) if dist.is_initialized() else (0,)


def _setup(model, names: str, model_type: str | None):
    """``(adapter, state, order, layer, label)``: ``order`` the adapter's names (in-memory or
    checkpoint table) in stream order, ``label`` each one's name in the ``names`` spelling."""
    from harts_runtime.hf.save import _check_state, _sharded, save_setup
    from harts_runtime.models.registry import get_family

    if names not in NAMES:
        raise InvalidInputError("names", f"choose one of {NAMES}, got {names!r}")
    hf_config, adapter = save_setup(model, model_type)
    adapter = cast("HFStateDictAdapter", adapter)
    rule = None
    if names in ENGINES:  # refused before any gathering: a family the engine has no loader for
        rule = engine_rule(names, get_family(hf_config["model_type"]).name)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    _check_state(adapter, state, _sharded(model))
    table = "memory_names" if names == "transformers" else "checkpoint_names"  # the families' tables
    order = list(getattr(adapter, table))
    # each layer's block contiguous, blocks in order of first appearance, the rest where it was
    layer = {n: (int(m.group(1)) if (m := _LAYER.search(n)) else None) for n in order}
    first, index = {}, {n: i for i, n in enumerate(order)}
    for i, n in enumerate(order):
        first.setdefault(layer[n], i)
    order = sorted(order, key=lambda n: (first[layer[n]], index[n]))
    mixers = model.config.mixers  # each layer's kind, for the rules' layer_renames
    label = {
        n: (n if rule is None else engine_name(rule, n, None if layer[n] is None else mixers[layer[n]]))
        for n in order
    }
    return adapter, state, order, layer, label


def weight_manifest(model, names: str = "transformers", model_type: str | None = None) -> list[WeightEntry]:
    """The manifest of ``model``'s weights in stream order (module docstring); no communication.
    Raises :class:`InvalidInputError` naming ``names`` (unknown, or an engine with no loader for the
    model's family) or what the family cannot express (:func:`harts_runtime.hf.save_setup`)."""
    adapter, state, order, layer, label = _setup(model, names, model_type)
    out = []
    for n in order:
        pieces = adapter.pieces(n)
        ours = [state[p.ours] for p in pieces]
        ranks = sorted(set().union(*(_holders(t) for t in ours)))
        out.append(WeightEntry(label[n], ours[0].dtype, tuple(adapter.hf_shape(n)), layer[n], tuple(ranks)))
    return out


class WeightStream:
    """A re-iterable stream of buckets ``[(name, full tensor), ...]`` (module docstring): each
    ``iter()`` runs the whole stream again (collectively under a mesh). ``manifest``: the
    :class:`WeightEntry` list in stream order; ``peak_bytes``: the most tensor bytes the last
    iteration held at once (the bucket plus gathered parameters still needed)."""

    def __init__(self, model, names: str, bucket_bytes: int, model_type: str | None, device):
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise InvalidInputError("bucket_bytes", f"must be a positive integer, got {bucket_bytes!r}")
        self.model, self.names, self.bucket_bytes = model, names, bucket_bytes
        self.model_type, self.device = model_type, device
        self.manifest = weight_manifest(model, names, model_type)
        self.peak_bytes = 0

    def __iter__(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        from harts_runtime.hf.save import _quiet_redistribute

        adapter, state, order, _, label = _setup(self.model, self.names, self.model_type)
        pieces = {n: adapter.pieces(n) for n in order}
        last_use = {p.ours: i for i, n in enumerate(order) for p in pieces[n]}
        gathered: dict[str, torch.Tensor] = {}
        held = {"gathered": 0}
        self.peak_bytes = 0

        def ours(k: str) -> torch.Tensor:
            if k not in gathered:
                t = state[k]
                if _is_dtensor(t):
                    t = t.full_tensor()  # collective, the same order on every rank
                    held["gathered"] += t.numel() * t.element_size()
                gathered[k] = t
            return gathered[k]

        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        with torch.no_grad(), _quiet_redistribute():
            for i, name in enumerate(order):
                for p in pieces[name]:
                    ours(p.ours)
                t = adapter.assemble(name, ours, self.device)
                n = t.numel() * t.element_size()
                if bucket and size + n > self.bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.append((label[name], t))
                size += n
                self.peak_bytes = max(self.peak_bytes, size + held["gathered"])
                for p in pieces[name]:
                    if last_use[p.ours] == i:
                        g = gathered.pop(p.ours, None)
                        if g is not None and _is_dtensor(state[p.ours]):
                            held["gathered"] -= g.numel() * g.element_size()
            if bucket:
                yield bucket


def weights(
    model,
    names: str = "transformers",
    bucket_bytes: int = 1 << 30,
    model_type: str | None = None,
    device=None,
) -> WeightStream:
    """The bucketed stream of ``model``'s full weights in manifest order (:class:`WeightStream`;
    ``device``: where the assembled tensors go, None: the model's). Raises
    :class:`InvalidInputError` naming ``names`` or ``bucket_bytes``."""
    return WeightStream(model, names, bucket_bytes, model_type, device)
