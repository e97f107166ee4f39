"""Reading a transformers checkpoint folder: ``config.json``, the weight files, their headers.

Every problem is one :class:`~harts_runtime.errors.InvalidInputError` naming the field (or tensor,
or file) and the file, raised before anything is allocated: a ``config.json`` or index that is not
a JSON object, a config without ``model_type`` or of one no family reads
(:func:`harts_runtime.models.registry.model_types`), size fields that are not positive integers, a model whose parameters need more bytes than the
target device (or, on the CPU, the host) has available (counted on the meta device from one block
of each kind, :func:`model_bytes`, so even a million-layer config is refused at once), an index
entry outside the folder or naming a missing file, a file that is not valid safetensors (truncated,
corrupt header), a header naming an unknown, misshapen, duplicate or non-floating-point tensor, a
tensor of the config missing. While a tensor is read, :func:`reading` turns safetensors' errors
into the same error and :func:`check_finite` refuses NaN and infinite values.

The steps, each usable alone: :func:`read_config` (``config.json`` -> :class:`ModelConfig`),
:func:`open_folder` (that, the memory check and the family's state-dict adapter),
:func:`weight_files` (the safetensors files, from the index or ``model.safetensors``),
:func:`scan_headers` (every header checked, the files kept open). Readers of the tensors are
:mod:`harts_runtime.hf.load` (one process) and :mod:`harts_runtime.hf.sharded` (each rank its
slices).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections import Counter
from pathlib import Path

import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.models.registry import get_family, model_types

__all__ = [
    "CONFIG_NAME",
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "available_bytes",
    "check_finite",
    "human_bytes",
    "kept_tensors",
    "model_bytes",
    "open_folder",
    "read_config",
    "reading",
    "scan_headers",
    "weight_files",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


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
    except RecursionError:
        raise InvalidInputError(file.name, f"{file} is JSON nested too deeply") from None
    except ValueError as e:  # an integer of more than 4,300 digits
        raise InvalidInputError(file.name, f"{file} is not usable JSON ({str(e).split(';')[0]})") from None
    if not isinstance(value, dict):
        raise InvalidInputError(file.name, f"{file} holds a JSON {type(value).__name__}, not an object")
    return value


def weight_files(path: Path) -> list[Path]:
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


def _check_finite_numbers(hf_config: dict, file: Path) -> None:
    """Every number of ``hf_config`` (and of a ``text_config`` in it) finite: Python's JSON reads
    ``NaN`` and ``Infinity`` (``rms_norm_eps: NaN`` turned every activation NaN)."""
    for where, cfg in (("", hf_config), ("text_config.", hf_config.get("text_config"))):
        if not isinstance(cfg, dict):
            continue
        for name, v in cfg.items():
            values = v if isinstance(v, list) else [v]
            for x in values:
                if isinstance(x, float) and not math.isfinite(x):
                    raise InvalidInputError(where + str(name), f"{x!r} in {file} is not a finite number")


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


def available_bytes(device) -> tuple[int | None, str]:
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


def human_bytes(n: float) -> str:
    """``n`` bytes for a message: ``"1.5 GiB"``, ``"12.0 KiB"``, ``"512 bytes"`` (binary units)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} bytes"


def _check_fits(cfg, hf_config: dict, file: Path, device, shards: int = 1) -> None:
    """InvalidInputError, before anything is allocated, when the model's bytes (split over
    ``shards`` ranks: a lower bound of one rank's share) exceed what ``device`` has available. The
    field is the config's least plausible size field (else the file)."""
    needed = model_bytes(cfg)
    available, where = available_bytes(device)
    if available is None or needed <= available * shards:
        return
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else hf_config
    ratios = {k: text[k] / v for k, v in _PLAUSIBLE.items() if isinstance(text.get(k), (int, float))}
    field = max(ratios, key=ratios.get) if ratios and max(ratios.values()) > 1 else file.name
    share = f", at least {human_bytes(needed / shards)} on each of {shards} ranks" if shards > 1 else ""
    value = f" ({field} = {text[field]})" if field in text else ""
    raise InvalidInputError(
        field,
        f"the model of {file}{value} needs {human_bytes(needed)} of parameters{share}, more than the "
        f"{human_bytes(available)} available on {where}; nothing was allocated",
    )


def read_config(path, dtype, overrides) -> tuple[Path, dict, str, object]:
    """``(path, hf_config, model_type, ModelConfig)`` of the checkpoint folder ``path``, every
    problem an InvalidInputError naming the field and ``config.json``. ``dtype``: a ``torch.dtype``,
    a name or None (the config's); ``overrides``: :class:`ModelConfig` execution fields."""
    path = Path(path)
    file = path / CONFIG_NAME
    if not file.is_file():
        raise InvalidInputError("path", f"{path} has no {CONFIG_NAME}")
    hf_config = _read_json(file)
    model_type = hf_config.get("model_type")
    supported = model_types()
    if model_type is None:
        raise InvalidInputError("model_type", f"missing from {file}; supported: {', '.join(supported)}")
    if not isinstance(model_type, str) or model_type not in supported:
        raise InvalidInputError("model_type", f"{model_type!r} in {file}; supported: {', '.join(supported)}")
    family = get_family(model_type)
    _check_sizes(hf_config, file)  # a size field first: "not a positive integer" says more
    _check_finite_numbers(hf_config, file)
    try:
        cfg = family.from_hf_config(hf_config, dtype=_dtype_name(dtype), **overrides)
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


def open_folder(path, dtype, overrides, *, device=None, shards: int = 1, check_memory: bool = True):
    """``(path, hf_config, model_type, ModelConfig, adapter)`` of a checkpoint folder; with
    ``check_memory``, the model's bytes (over ``shards`` ranks) checked against ``device``'s
    memory first (None: the host's), before the adapter builds the model on the meta device."""
    path, hf_config, model_type, cfg = read_config(path, dtype, overrides)
    if check_memory:
        _check_fits(cfg, hf_config, path / CONFIG_NAME, device, shards)
    adapter = get_family(model_type).make_adapter(cfg, model_type)  # with that type's tensor prefix
    return path, hf_config, model_type, cfg, adapter


def _safetensors_error():
    from safetensors import SafetensorError

    return SafetensorError


@contextlib.contextmanager
def reading(file: Path, name: str | None = None):
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


def scan_headers(files: list[Path], adapter, stack: contextlib.ExitStack) -> dict:
    """Opens every safetensors file (kept open by ``stack``) and checks the headers before any
    tensor is read: each file valid, no tensor twice, every tensor one of the config's (skipping
    those the adapter ignores), of its shape and floating point, none missing. Returns ``{HF name:
    (file handle, file)}``."""
    from safetensors import safe_open

    where: dict[str, tuple] = {}
    for f in files:
        with reading(f):
            fh = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            names = list(fh.keys())
        for name in names:
            if name in where:
                raise InvalidInputError(name, f"appears twice (again in {f.name})")
            if adapter.ignored(name):  # outside the text model (vision tower, MTP head)
                continue
            with reading(f, name):
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


def kept_tensors(files: list[Path], adapter) -> dict:
    """The checkpoint tensors the adapter keeps aside without running them (``adapter.kept(name)``:
    Ling-3.0's MTP layers), name -> tensor as stored, each checked finite; written back by
    :func:`harts_runtime.hf.save_pretrained`. Empty for adapters that keep none."""
    from safetensors import safe_open

    out = {}
    for f in files:
        with reading(f):
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for name in fh.keys():
                    if adapter.kept(name):
                        with reading(f, name):
                            out[name] = fh.get_tensor(name)
                        check_finite(name, out[name], f)
    return out


def check_finite(name: str, tensor: torch.Tensor, file: Path) -> None:
    """InvalidInputError naming the tensor ``name`` and ``file`` when ``tensor`` (a whole
    checkpoint tensor or a slice of one) holds NaN or infinite values."""
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise InvalidInputError(name, f"has {bad} non-finite values (NaN or infinity) in {file}")
