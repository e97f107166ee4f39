"""Hugging Face checkpoint folders <-> :class:`~harts_runtime.models.hybrid.model.HybridModel`.

:func:`load_pretrained` reads a transformers checkpoint folder (``config.json`` plus
``model.safetensors``, or shards listed in ``model.safetensors.index.json``) into our model;
:func:`save_pretrained` writes one that ``transformers.AutoModelForCausalLM.from_pretrained``
loads. The family is ``config.json``'s ``model_type`` (:data:`FAMILIES`): Kimi-Linear
(:mod:`harts_runtime.models.kimi_linear`), Qwen3-Next (:mod:`harts_runtime.models.qwen3_next`) and
Qwen3.5-MoE text (:mod:`harts_runtime.models.qwen3_5_moe`; of a vision-language ``qwen3_5_moe``
folder the text model, the vision tower and MTP head skipped); those modules hold the config and
tensor maps (their state-dict adapters, :mod:`harts_runtime.models.state_dict_adapter`). Needs
the ``hf`` extra (``safetensors``; transformers only to run the checkpoint on the HF side).

Loading builds the model on the meta device, allocates it uninitialised on the target device
(no random init), then reads one tensor at a time (``safetensors.safe_open``) and copies it into
its parameter (cast to the model dtype, moved to the device), so the weights are never held twice.
Both spellings of the tensors load (the checkpoint one, per-expert tensors, which
``save_pretrained`` and the released checkpoints use, and the in-memory one of the transformers
model's ``state_dict()``); saving writes the checkpoint spelling.

A folder is checked before anything is allocated, and every problem is one
:class:`~harts_runtime.errors.InvalidInputError` naming the field (or tensor, or file) and the file:
a ``config.json`` or index that is not a JSON object, a config without ``model_type``, size fields
that are not positive integers, a model whose parameters need more bytes than the target device
(or, on the CPU, the host) has available (counted on the meta device from one block of each kind,
so even a million-layer config is refused at once), an index entry outside the folder or naming a
missing file, a file that is not valid safetensors (truncated, corrupt header); and while reading,
a tensor that is not floating point or holds NaN or infinite values.

Both work on parallelized models too (:func:`harts_runtime.parallel.parallelize`, every parameter
a DTensor). ``load_pretrained(path, mesh=mesh)`` builds the model on the meta device, parallelizes
it, allocates it, and has each rank read only the slices of the HF tensors its own shards come
from (:func:`harts_runtime.parallel.checkpoint.load_pretrained_sharded`). ``save_pretrained`` of a
sharded model is collective: every rank calls it, each parameter is gathered (``full_tensor()``)
in a fixed order, and rank 0 assembles one HF tensor at a time
(:meth:`~harts_runtime.models.state_dict_adapter.HFStateDictAdapter.assemble`) into safetensors
shard files of at most ``max_shard_bytes``, so no rank holds more than one shard file's tensors
plus the gathered tensors of the HF tensor being written. Training checkpoints (sharded weights
and optimizer state, resumable under another parallel configuration) are
:func:`harts_runtime.parallel.checkpoint.save_checkpoint` / ``load_checkpoint``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from harts_runtime.errors import InvalidInputError

__all__ = ["FAMILIES", "export_weights", "load_pretrained", "model_bytes", "save_pretrained"]

FAMILIES = ("kimi_linear", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
"""``config.json`` ``model_type`` values :func:`load_pretrained` reads (``qwen3_5_moe``: its text part)."""


def _family(model_type: str):
    """model_type -> (from_hf_config, to_hf_config, adapter class)."""
    if model_type == "kimi_linear":
        from harts_runtime.models import kimi_linear as m

        return m.from_hf_config, m.to_hf_config, m.KimiLinearStateDictAdapter
    if model_type == "qwen3_next":
        from harts_runtime.models import qwen3_next as m

        return m.from_hf_config, m.to_hf_config, m.QwenStateDictAdapter
    if model_type in ("qwen3_5_moe_text", "qwen3_5_moe"):
        from harts_runtime.models import qwen3_5_moe as m

        return m.from_hf_config, m.to_hf_config, m.Qwen35MoeStateDictAdapter
    raise InvalidInputError("model_type", f"{model_type!r}; supported: {', '.join(FAMILIES)}")


def _infer_model_type(cfg) -> str:
    """The family of a model built without a checkpoint config: its mixers decide."""
    if any(m in ("kda", "mla") for m in cfg.mixers):
        return "kimi_linear"
    if "gdn" in cfg.mixers and cfg.gdn_projection == "split":
        return "qwen3_5_moe_text"
    return "qwen3_next"


CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9
"""Default largest safetensors file :func:`save_pretrained` writes (transformers' ``"5GB"``)."""


def _dtype_name(dtype) -> str | None:
    if dtype is None or isinstance(dtype, str):
        return dtype
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    raise InvalidInputError("dtype", f"expected a torch.dtype or a name, got {dtype!r}")


def _read_json(file: Path) -> dict:
    """The JSON object in ``file``; InvalidInputError naming the file when it is unreadable, not
    JSON, or not an object."""
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InvalidInputError(file.name, f"{file} is not UTF-8 text") from None
    except OSError as e:
        raise InvalidInputError(file.name, f"cannot read {file}: {e.strerror or e}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidInputError(
            file.name, f"{file} is not JSON (line {e.lineno} column {e.colno}: {e.msg})"
        ) from None
    if not isinstance(value, dict):
        raise InvalidInputError(file.name, f"{file} holds a JSON {type(value).__name__}, not an object")
    return value


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a folder: those its index names (each a plain file name inside the
    folder that exists), else ``model.safetensors``."""
    index_file = path / INDEX_NAME
    if index_file.is_file():
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InvalidInputError(
                "weight_map", f"{index_file} has no weight_map object naming the tensors' files"
            )
        files: dict[str, str] = {}  # file name -> first tensor naming it
        for tensor, name in weight_map.items():
            if not isinstance(name, str) or not name:
                raise InvalidInputError(
                    f"weight_map[{tensor}]", f"{name!r} in {index_file} is not a file name"
                )
            files.setdefault(name, tensor)
        root = path.resolve()
        for name, tensor in sorted(files.items()):
            if Path(name).name != name or name in (".", "..") or (path / name).resolve().parent != root:
                raise InvalidInputError(
                    f"weight_map[{tensor}]", f"{name!r} in {index_file} is outside the folder {path}"
                )
            if not (path / name).is_file():
                raise InvalidInputError(
                    name, f"listed in {index_file} (weight_map[{tensor}]) but not a file in {path}"
                )
        return [path / f for f in sorted(files)]
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    raise InvalidInputError("path", f"{path} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")


#: Config fields read as sizes: each, when present, must be a positive integer.
_SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "v_head_dim",
    "linear_head_dim",
    "linear_num_heads",
    "linear_conv_kernel_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)
#: Sizes beyond which a field is the first suspect when a model does not fit (the error names it).
_PLAUSIBLE = {
    "num_hidden_layers": 1_000,
    "hidden_size": 65_536,
    "vocab_size": 2_000_000,
    "num_local_experts": 4_096,
    "num_experts": 4_096,
    "intermediate_size": 1_000_000,
    "moe_intermediate_size": 1_000_000,
}


def _check_sizes(hf_config: dict, file: Path) -> None:
    """Every size field of ``hf_config`` (and of a ``text_config`` in it) a positive integer."""
    for where, cfg in (("", hf_config), ("text_config.", hf_config.get("text_config"))):
        if not isinstance(cfg, dict):
            continue
        for name in _SIZE_FIELDS:
            v = cfg.get(name)
            if v is None:
                continue
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v != int(v)
                or v < 1
            ):
                raise InvalidInputError(where + name, f"{v!r} in {file} is not a positive integer")


def model_bytes(cfg) -> int:
    """Bytes of the parameters and buffers of ``HybridModel(cfg)``, without building it: one block
    of each (mixer, FFN) kind on the meta device, times its count, plus the embedding, the final
    norm and the head. Milliseconds for any number of layers and any width."""
    from harts_runtime.models.hybrid.model import HybridModel

    kinds = Counter(zip(cfg.mixers, cfg.ffns))
    skeleton = HybridModel(
        cfg.replace(mixers=tuple(m for m, _ in kinds), ffns=tuple(f for _, f in kinds)), "meta"
    )
    total = 0
    for name, t in skeleton.state_dict().items():
        size = t.numel() * t.element_size()
        if name.startswith("blocks."):
            size *= kinds[list(kinds)[int(name.split(".")[1])]]
        total += size
    return total


def _available_bytes(device) -> tuple[int | None, str]:
    """``(free bytes, where)`` of the device a model goes to: a CUDA device's free memory, the
    host's available memory for the CPU; ``(None, ...)`` when unknown (the meta device, others)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(dev)[0]), f"{dev} (free)"
        except (RuntimeError, AssertionError):
            return None, str(dev)
    if dev.type != "cpu":
        return None, str(dev)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "the host (MemAvailable)"
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "the host"
    except (AttributeError, OSError, ValueError):
        return None, "the host"


def _human(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} bytes"


def _check_fits(cfg, hf_config: dict, file: Path, device, shards: int = 1) -> None:
    """InvalidInputError, before anything is allocated, when the model's bytes (split over
    ``shards`` ranks: a lower bound of one rank's share) exceed what ``device`` has available. The
    field is the config's least plausible size field (else the file)."""
    needed = model_bytes(cfg)
    available, where = _available_bytes(device)
    if available is None or needed <= available * shards:
        return
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else hf_config
    ratios = {k: text[k] / v for k, v in _PLAUSIBLE.items() if isinstance(text.get(k), (int, float))}
    field = max(ratios, key=ratios.get) if ratios and max(ratios.values()) > 1 else file.name
    share = f", at least {_human(needed / shards)} on each of {shards} ranks" if shards > 1 else ""
    value = f" ({field} = {text[field]})" if field in text else ""
    raise InvalidInputError(
        field,
        f"the model of {file}{value} needs {_human(needed)} of parameters{share}, more than the "
        f"{_human(available)} available on {where}; nothing was allocated",
    )


def _read_config(path, dtype, overrides) -> tuple[Path, dict, str, object]:
    """``(path, hf_config, model_type, ModelConfig)`` of a checkpoint folder, every problem an
    InvalidInputError naming the field and ``config.json``."""
    path = Path(path)
    file = path / CONFIG_NAME
    if not file.is_file():
        raise InvalidInputError("path", f"{path} has no {CONFIG_NAME}")
    hf_config = _read_json(file)
    model_type = hf_config.get("model_type")
    if model_type is None:
        raise InvalidInputError("model_type", f"missing from {file}; supported: {', '.join(FAMILIES)}")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise InvalidInputError("model_type", f"{model_type!r} in {file}; supported: {', '.join(FAMILIES)}")
    from_hf_config, _, _ = _family(model_type)
    _check_sizes(hf_config, file)
    try:
        cfg = from_hf_config(hf_config, dtype=_dtype_name(dtype), **overrides)
    except InvalidInputError as e:
        top = e.field.split("[", 1)[0].split(".", 1)[0]
        if top in hf_config or top in (hf_config.get("text_config") or {}):
            raise InvalidInputError(e.field, f"{str(e)[len(e.field) + 2 :]} (in {file})") from None
        raise
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
        raise InvalidInputError(
            CONFIG_NAME, f"{file} does not describe a {model_type} model: {e!r}"
        ) from None
    return path, hf_config, model_type, cfg


def _open_folder(path, dtype, overrides, *, device=None, shards: int = 1, check_memory: bool = True):
    """``(path, hf_config, model_type, ModelConfig, adapter)`` of a checkpoint folder; with
    ``check_memory``, the model's bytes (over ``shards`` ranks) checked against ``device``'s
    memory first (None: the host's), before the adapter builds the model on the meta device."""
    path, hf_config, model_type, cfg = _read_config(path, dtype, overrides)
    if check_memory:
        _check_fits(cfg, hf_config, path / CONFIG_NAME, device, shards)
    _, _, adapter_cls = _family(model_type)
    adapter = (
        adapter_cls(cfg, prefix="model.language_model.") if model_type == "qwen3_5_moe" else adapter_cls(cfg)
    )
    return path, hf_config, model_type, cfg, adapter


def _safetensors_error():
    from safetensors import SafetensorError

    return SafetensorError


@contextlib.contextmanager
def _reading(file: Path, name: str | None = None):
    """Turns what safetensors raises on a bad file (a truncated or corrupt header, unreadable
    data) into an InvalidInputError naming the file (and the tensor being read)."""
    try:
        yield
    except (_safetensors_error(), OSError, RuntimeError) as e:
        detail = " ".join(str(e).split()) or type(e).__name__
        where = f"tensor {name} of {file}" if name else str(file)
        raise InvalidInputError(name or file.name, f"cannot read {where}: {detail}") from None


def _check_dtype(name: str, dtype: str, file: Path) -> None:
    """A checkpoint tensor (safetensors dtype string, e.g. ``F32``) must be floating point."""
    if not (dtype.startswith("F") or dtype.startswith("BF")):
        raise InvalidInputError(name, f"is {dtype} in {file}; checkpoint weights are floating point")


def _scan_headers(files: list[Path], adapter, stack: contextlib.ExitStack) -> dict:
    """Opens every safetensors file (kept open by ``stack``) and checks the headers before any
    tensor is read: each file valid, no tensor twice, every tensor one of the config's (skipping
    those the adapter ignores), of its shape and floating point, none missing. Returns ``{HF name:
    (file handle, file)}``."""
    from safetensors import safe_open

    where: dict[str, tuple] = {}
    for f in files:
        with _reading(f):
            fh = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            names = list(fh.keys())
        for name in names:
            if name in where:
                raise InvalidInputError(name, f"appears twice (again in {f.name})")
            if adapter.ignored(name):  # outside the text model (vision tower, MTP head)
                continue
            with _reading(f, name):
                header = fh.get_slice(name)
                dtype, shape = header.get_dtype(), tuple(header.get_shape())
            _check_dtype(name, dtype, f)
            want = adapter.hf_shape(name)
            if shape != want:
                raise InvalidInputError(name, f"shape {shape} != {want} of this config (in {f})")
            where[name] = (fh, f)
    missing = adapter.missing(where)
    if missing:
        raise InvalidInputError(missing[0], f"missing from the checkpoint ({len(missing)} tensors missing)")
    return where


def _check_finite(name: str, tensor: torch.Tensor, file: Path) -> None:
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise InvalidInputError(name, f"has {bad} non-finite values (NaN or infinity) in {file}")


def load_pretrained(path, dtype=None, device=None, *, mesh=None, parallelize=None, **overrides):
    """A :class:`HybridModel` with the weights of the checkpoint folder ``path``.

    ``dtype``: a ``torch.dtype`` or name (None: the config's ``dtype`` when it is float32 /
    bfloat16 / float64, else float32). ``device``: where the weights go (None: ``"cpu"``, or with
    a CUDA ``mesh`` the current CUDA device). ``overrides``: :class:`ModelConfig` execution fields
    (``chunk_size``, ``attn_backend``, ``kda_backend``, ``lm_head_rows``, ...). The model is
    returned in training mode (``nn.Module``'s default); ``model.hf_config`` keeps the checkpoint's
    config dict so that :func:`save_pretrained` writes its other fields (token ids, ...) back.

    ``mesh``: a :class:`harts_runtime.parallel.ParallelMesh`: the model is parallelized on it
    (``harts_runtime.parallel.parallelize(model, mesh, **parallelize)``) and each rank reads only
    its shards' slices (:func:`harts_runtime.parallel.checkpoint.load_pretrained_sharded`);
    collective, every rank calls it.

    Raises :class:`InvalidInputError` naming the config field, tensor or file, and the file
    (module docstring): a folder that is not a readable checkpoint, unsupported options, a model
    that does not fit the device (checked before anything is allocated), unknown, missing,
    misshapen, non-floating-point or non-finite tensors.
    """
    if mesh is not None:
        from harts_runtime.parallel.checkpoint import load_pretrained_sharded

        return load_pretrained_sharded(
            path, mesh, dtype=dtype, device=device, parallelize=parallelize, **overrides
        )
    if parallelize is not None:
        raise InvalidInputError("parallelize", "needs a mesh")
    from harts_runtime.models.hybrid.model import HybridModel

    device = "cpu" if device is None else device
    path, hf_config, _, cfg, adapter = _open_folder(path, dtype, overrides, device=device)
    files = _weight_files(path)
    with contextlib.ExitStack() as stack:
        tensors = _scan_headers(files, adapter, stack)  # before anything is allocated
        # built on the meta device and allocated uninitialised: every tensor is written below
        # ("auto" attention is resolved per call, on the device the rows are on)
        model = HybridModel(cfg, device="meta").to_empty(device=device)
        model.config = cfg
        targets = model.state_dict(keep_vars=True)
        written: dict[str, set] = {}
        with torch.no_grad():
            for k, v in adapter.extra_ours().items():
                targets[k].copy_(v)
                written[k] = {None}
            for name, (fh, f) in tensors.items():
                with _reading(f, name):
                    tensor = fh.get_tensor(name)
                _check_finite(name, tensor, f)
                for ours, slot, part in adapter.convert_slots(name, tensor):
                    (targets[ours] if slot is None else targets[ours][slot]).copy_(part)
                    written.setdefault(ours, set()).add(slot)
                del tensor
    for k, t in targets.items():  # the adapter's table covers every tensor; checked, not assumed
        w = written.get(k, set())
        if None not in w and len(w) != t.shape[0]:
            raise InvalidInputError(k, "not written by any checkpoint tensor")
    model.hf_config = hf_config
    return model


def _save_setup(model, model_type):
    """``(hf_config dict, adapter)`` for saving ``model`` as ``model_type`` (see
    :func:`save_pretrained`); raises what the family cannot express."""
    cfg = model.config
    base = getattr(model, "hf_config", None)
    if model_type is None:
        model_type = (base or {}).get("model_type") or _infer_model_type(cfg)
        model_type = "qwen3_5_moe_text" if model_type == "qwen3_5_moe" else model_type
    if model_type == "qwen3_5_moe":
        raise InvalidInputError(
            "model_type", "qwen3_5_moe (vision-language) is not written; use qwen3_5_moe_text"
        )
    _, to_hf_config, adapter_cls = _family(model_type)
    if model_type == "kimi_linear":  # Qwen-only options Kimi-Linear's config cannot carry
        for name in ("zero_centered_norms", "shared_expert_gate"):
            if getattr(cfg, name):
                raise InvalidInputError(name, "True has no Kimi-Linear equivalent")
    return to_hf_config(cfg, base=base), adapter_cls(cfg)


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


def _hf_tensors(model, adapter):
    """``(HF name, full tensor)`` of every checkpoint tensor of ``model``, one at a time, in the
    adapter's order, on every rank (a sharded parameter is gathered with ``full_tensor()``, a
    collective in the same order everywhere, and dropped after its last HF tensor)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    _check_state(adapter, state, _sharded(model))  # before the first tensor: an error writes nothing
    return _hf_stream(adapter, state)


def _hf_stream(adapter, state: dict):
    names = list(adapter.checkpoint_names)
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
            yield name, adapter.assemble(name, ours)
            for p in pieces[name]:
                if last_use[p.ours] == i:
                    full.pop(p.ours, None)


def export_weights(model, model_type: str | None = None):
    """Stream ``(transformers name, tensor)`` pairs of ``model``'s weights, one tensor at a time, in
    the checkpoint spelling :func:`save_pretrained` writes (for a rollout engine's weight sync:
    vLLM / SGLang ``load_weights``). A parallelized model's tensors are gathered collectively:
    every rank iterates the whole stream (each gets the full tensors). ``model_type`` as for
    :func:`save_pretrained`."""
    _, adapter = _save_setup(model, model_type)
    return _hf_tensors(model, adapter)


def save_pretrained(
    model, path, model_type: str | None = None, *, max_shard_bytes: int = MAX_SHARD_BYTES
) -> None:
    """Write ``config.json`` and the safetensors weights of a :class:`HybridModel` to ``path``
    (created if needed), loadable by ``transformers.AutoModelForCausalLM.from_pretrained``.

    ``model_type``: the family to write (``kimi_linear``, ``qwen3_next`` or ``qwen3_5_moe_text``;
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

    Raises :class:`InvalidInputError` naming the :class:`ModelConfig` field or tensor that the
    family cannot express (Kimi-Linear: GQA layers, MLA with RoPE, softmax routing, a non-zero KDA
    output-gate bias, ...; Qwen: other mixers, sigmoid routing, an ungated shared expert, ...), or
    ``max_shard_bytes`` when it is not a positive integer.
    """
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise InvalidInputError("max_shard_bytes", f"must be a positive integer, got {max_shard_bytes!r}")
    hf_config, adapter = _save_setup(model, model_type)
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
        writer.close()
        (path / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if sharded:
        dist.barrier()
