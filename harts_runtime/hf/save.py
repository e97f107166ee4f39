"""Writing a :class:`~harts_runtime.models.HybridModel` as a transformers checkpoint folder.

:func:`save_pretrained` writes ``config.json`` and safetensors weights that
``transformers.AutoModelForCausalLM.from_pretrained`` loads; :func:`export_weights` streams the
same tensors, one at a time, for a rollout engine's weight sync. The family written is the loaded
checkpoint's, or the one :func:`harts_runtime.models.registry.family_of` gives the config
(:func:`save_setup`: that choice and the family's checks).

Both work on parallelized models (:func:`harts_runtime.parallel.parallelize`, every parameter a
DTensor) and are then collective: every rank calls them, each parameter is gathered
(``full_tensor()``) in a fixed order, and (for ``save_pretrained``) rank 0 assembles one HF tensor
at a time (:meth:`~harts_runtime.models.state_dict_adapter.HFStateDictAdapter.assemble`) into
safetensors shard files of at most ``max_shard_bytes`` (:class:`_ShardWriter`), so no rank holds
more than one shard file's tensors plus the gathered tensors of the HF tensor being written.
Training checkpoints (sharded weights and optimizer state, resumable under another parallel
configuration) are :func:`harts_runtime.parallel.checkpoint.save_checkpoint` / ``load_checkpoint``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from harts_runtime.errors import InvalidInputError
from harts_runtime.hf.folder import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME
from harts_runtime.models.registry import family_of, get_family

__all__ = ["MAX_SHARD_BYTES", "export_weights", "save_pretrained", "save_setup"]

MAX_SHARD_BYTES = 5 * 10**9
"""Default largest safetensors file :func:`save_pretrained` writes (transformers' ``"5GB"``)."""


def save_setup(model, model_type: str | None = None) -> tuple[dict, object]:
    """``(config.json dict, state-dict adapter)`` for writing ``model`` as ``model_type``.

    ``model_type`` None: the loaded checkpoint's (``model.hf_config``), a type its family only
    reads (``qwen3_5_moe``, vision-language) written as the family's own (``qwen3_5_moe_text``);
    without a checkpoint config the family that owns ``model.config``
    (:func:`harts_runtime.models.registry.family_of`). Raises :class:`InvalidInputError` for a
    ``model_type`` no family writes and for what the family cannot express (the family's
    ``to_hf_config`` names the :class:`ModelConfig` field; Kimi-Linear has no zero-centred norms
    and no shared-expert gate)."""
    cfg = model.config
    base = getattr(model, "hf_config", None)
    if model_type is None:
        loaded = (base or {}).get("model_type")
        family = get_family(loaded) if loaded is not None else family_of(cfg)
        model_type = family.model_type
    else:
        family = get_family(model_type)
        if model_type in family.read_only:
            raise InvalidInputError(
                "model_type", f"{model_type} is read, not written; use {family.model_type}"
            )
    if family.name == "kimi_linear":  # Qwen-only options Kimi-Linear's config cannot carry
        for name in ("zero_centered_norms", "moe.shared_expert_gate"):
            if cfg.field_value(name):
                raise InvalidInputError(name, "True has no Kimi-Linear equivalent")
    return family.to_hf_config(cfg, base=base), family.make_adapter(cfg, model_type)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _check_state(adapter, state: dict, sharded: bool) -> None:
    """The adapter's checks of our state dict (names, shapes, tensors that must be zero) on the
    global tensors, without gathering them: under sharding each DTensor is checked as a
    same-shaped expanded scalar, 1 where any rank holds a non-zero entry (one all-reduce)."""
    if not sharded:
        adapter._check_ours(state)
        return
    names = [k for k, v in state.items() if _is_dtensor(v)]
    flags = torch.tensor([bool((state[k].to_local() != 0).any()) for k in names], dtype=torch.float32)
    if dist.get_backend() == "nccl":
        flags = flags.cuda()
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    proxy = dict(state)
    for k, f in zip(names, flags.tolist()):
        proxy[k] = torch.full((), f).expand(state[k].shape)
    adapter._check_ours(proxy)


class _ShardWriter:
    """safetensors files of at most ``max_bytes`` each (a larger tensor gets a file of its own),
    written as tensors arrive; :meth:`close` names them ``model-0000i-of-0000n.safetensors`` and
    writes the index, or a single ``model.safetensors`` when one file holds everything."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.files: list[list[str]] = []  # tensor names of each written file
        self.total = 0

    def _tmp(self, i: int) -> Path:
        return self.path / f".model-{i + 1:05d}.safetensors.partial"

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if self.current:
            save_file(self.current, str(self._tmp(len(self.files))), metadata={"format": "pt"})
            self.files.append(list(self.current))
            self.current, self.current_bytes = {}, 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + n > self.max_bytes:
            self._flush()
        self.current[name] = tensor
        self.current_bytes += n
        self.total += n

    def close(self) -> None:
        self._flush()
        count = len(self.files)
        if count == 1:
            os.replace(self._tmp(0), self.path / WEIGHTS_NAME)
            return
        weight_map = {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self._tmp(i), self.path / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _remove_weights(path: Path) -> None:
    """Drop a previous save's weight files (transformers prefers ``model.safetensors`` to an index)."""
    for f in path.iterdir():
        n = f.name
        if n in (WEIGHTS_NAME, INDEX_NAME) or (n.startswith("model-") and n.endswith(".safetensors")):
            f.unlink()
        elif n.startswith(".model-") and n.endswith(".safetensors.partial"):
            f.unlink()


@contextlib.contextmanager
def _quiet_redistribute():
    """DTensor warns on every gather of an FSDP x TP ``_StridedShard`` parameter; once is enough."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _sharded(model) -> bool:
    sharded = any(_is_dtensor(v) for v in model.state_dict().values())
    if sharded and not dist.is_initialized():
        raise InvalidInputError("model", "has DTensor parameters but torch.distributed is not initialised")
    return sharded


def _hf_tensors(model, adapter, memory: bool = False, device="cpu"):
    """``(HF name, full tensor)`` of every checkpoint tensor of ``model`` (``memory``: every tensor
    of a transformers model's ``state_dict()``, the adapter's in-memory table), one at a time, in the
    adapter's order, on every rank (a sharded parameter is gathered with ``full_tensor()``, a
    collective in the same order everywhere, and dropped after its last HF tensor), on ``device``
    (None: where the model's tensor is)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    _check_state(adapter, state, _sharded(model))  # before the first tensor: an error writes nothing
    names = list(adapter.memory_names if memory else adapter.checkpoint_names)
    return _hf_stream(adapter, state, names, device)


def _hf_stream(adapter, state: dict, names: list[str], device="cpu"):
    pieces = {n: adapter.pieces(n) for n in names}
    last_use = {p.ours: i for i, n in enumerate(names) for p in pieces[n]}
    full: dict[str, torch.Tensor] = {}

    def ours(k: str) -> torch.Tensor:
        if k not in full:
            t = state[k]
            full[k] = t.full_tensor() if _is_dtensor(t) else t  # collective, same order on every rank
        return full[k]

    with torch.no_grad(), _quiet_redistribute():
        for i, name in enumerate(names):
            for p in pieces[name]:
                ours(p.ours)
            yield name, adapter.assemble(name, ours, device)
            for p in pieces[name]:
                if last_use[p.ours] == i:
                    full.pop(p.ours, None)


def export_weights(model, model_type: str | None = None, *, memory: bool = False):
    """Stream ``(transformers name, tensor)`` pairs of ``model``'s weights, one tensor at a time, in
    the checkpoint spelling :func:`save_pretrained` writes (for a rollout engine's weight sync:
    vLLM / SGLang ``load_weights``), or with ``memory=True`` in a transformers model's in-memory
    names and fused shapes (its ``state_dict()``: experts as ``[E, 2I, D]`` / ``[E, D, I]``, each
    assembled from ours at once, never split per expert and stacked again), each on the device of
    the model's tensors (a GPU model's stream stays on the GPU). A parallelized model's
    tensors are gathered collectively: every rank iterates the whole stream (each gets the full
    tensors). ``model_type`` as for :func:`save_pretrained`."""
    _, adapter = save_setup(model, model_type)
    return _hf_tensors(model, adapter, memory=memory, device=None)


def save_pretrained(
    model, path, model_type: str | None = None, *, max_shard_bytes: int = MAX_SHARD_BYTES
) -> None:
    """Write ``config.json`` and the safetensors weights of a :class:`HybridModel` to ``path``
    (created if needed), loadable by ``transformers.AutoModelForCausalLM.from_pretrained``.

    ``model_type``: the family to write (``kimi_linear``, ``qwen3_next``, ``qwen3_5_moe_text`` or
    ``bailing_hybrid``;
    None: the loaded checkpoint's, a ``qwen3_5_moe`` one written as its text model, else the one
    the mixers imply: KDA/MLA Kimi-Linear, split-projection GDN Qwen3.5-MoE, else Qwen3-Next).

    The weights go to ``model.safetensors`` when they fit in ``max_shard_bytes``, else to
    ``model-0000i-of-0000n.safetensors`` files of at most that size (a larger single tensor gets
    a file of its own) listed in ``model.safetensors.index.json``; a previous save's weight files
    in ``path`` are removed. One HF tensor is assembled at a time, so the writer holds at most one
    file's tensors plus the (gathered) tensors of the HF tensor being assembled.

    A parallelized model (parameters DTensors, :func:`harts_runtime.parallel.parallelize`) is
    saved collectively: every rank must call this with the same arguments; each parameter is
    gathered (``full_tensor()``) in the same order on every rank and rank 0 writes the folder.

    Checkpoint tensors loaded but not run (``model.hf_kept``: Ling-3.0's MTP layers) are written
    back unchanged when the family written keeps them.

    Raises :class:`InvalidInputError` naming the :class:`ModelConfig` field or tensor that the
    family cannot express (Kimi-Linear: GQA layers, MLA with RoPE, softmax routing, a non-zero KDA
    output-gate bias, ...; Qwen: other mixers, sigmoid routing, an ungated shared expert, ...), or
    ``max_shard_bytes`` when it is not a positive integer.
    """
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise InvalidInputError("max_shard_bytes", f"must be a positive integer, got {max_shard_bytes!r}")
    hf_config, adapter = save_setup(model, model_type)
    sharded = _sharded(model)
    rank = dist.get_rank() if sharded else 0
    tensors = _hf_tensors(model, adapter)  # checks first: a refused model leaves the folder as it was
    path = Path(path)
    writer = None
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        _remove_weights(path)
        writer = _ShardWriter(path, max_shard_bytes)
    for name, tensor in tensors:
        if writer is not None:
            writer.add(name, tensor)
    if writer is not None:
        for name, tensor in getattr(model, "hf_kept", {}).items():
            if adapter.kept(name):  # not run (Ling-3.0's MTP layers): written back as loaded
                writer.add(name, tensor)
        writer.close()
        (path / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if sharded:
        dist.barrier()
