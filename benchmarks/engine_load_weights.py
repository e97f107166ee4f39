"""Feed the weight stream (``names="vllm"`` / ``"sglang"``) into the engine's own ``load_weights`` on
the CPU, and report what the loader consumed and rejected.

Two steps, in two virtual environments (the engines pin their own torch):

1. in the project's venv, ``python benchmarks/engine_load_weights.py write DIR`` writes, for each of
   the five families' tiny models, ``DIR/<family>/`` (``save_pretrained``: what the engine starts
   from) and ``DIR/streams/<family>.<engine>.safetensors`` (the stream's tensors) with
   ``DIR/streams/<family>.<engine>.json`` (their names in stream order);
2. in the engine's venv, ``python benchmarks/engine_load_weights.py load DIR --engine vllm``
   builds each family's model class of the engine on the CPU (``--device meta``: shapes only), feeds
   the stream one pair at a time to ``model.load_weights`` and prints, per family, the pairs fed, the
   ones the loader raised on, the parameters loaded (of all), those never loaded, the parameters
   whose values equal the fed tensor of their name (through the class's ``hf_to_vllm_mapper``:
   the unfused ones), and a control: a misnamed tensor, which the
   loader must refuse (``rejected``) or drop (``dropped silently``). A family whose class cannot be
   built on this machine is reported with the error's last line.

vLLM is run on its CPU platform (``VLLM_TARGET_DEVICE=cpu``), its check that Triton for CPUs is
installed skipped: building a model and loading weights runs no kernel. Results and the install
findings are in ``benchmarks/README.md`` ("Engine loaders on the CPU").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

FAMILIES = ("kimi_linear", "qwen3_next", "qwen3_5_moe", "nemotron_h", "ling3")
ENGINES = ("vllm", "sglang")
VLLM_CLASSES = {  # the class vLLM's registry gives each family's architecture
    "kimi_linear": "vllm.models.kimi_k3:KimiLinearForCausalLM",
    "qwen3_next": "vllm.model_executor.models.qwen3_next:Qwen3NextForCausalLM",
    "qwen3_5_moe": "vllm.models.qwen3_5:Qwen3_5MoeForCausalLM",
    "nemotron_h": "vllm.model_executor.models.nemotron_h:NemotronHForCausalLM",
    "ling3": "vllm.model_executor.models.bailing_moe_v3:BailingMoeV3ForCausalLM",
    # the released Qwen3.5-MoE checkpoints' class: the same text model under a vision tower
    "qwen3_5_moe_vl": "vllm.models.qwen3_5:Qwen3_5MoeForConditionalGeneration",
}
CASES = FAMILIES + ("qwen3_5_moe_vl",)
"""The families, and Qwen3.5-MoE's vision-language class fed the text model's stream."""
CONTROL = "model.layers.0.not_a_tensor.weight"


# ---------------------------------------------------------------------------------- step 1
def write(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from harts_runtime import HybridModel, model_config, save_pretrained
    from harts_runtime.engine.weights import weights
    from harts_runtime.hf.save import save_setup
    from harts_runtime.models.registry import get_family

    flavors = {
        "kimi_linear": "kimi-linear-tiny",
        "qwen3_5_moe": "qwen3.5-tiny",
        "nemotron_h": "nemotron-h-tiny",
        "ling3": "ling3-tiny",
    }
    (out / "streams").mkdir(parents=True, exist_ok=True)
    for family in FAMILIES:
        if family == "qwen3_next":  # no tiny flavor: a small Qwen3-Next config
            hf = {
                "model_type": "qwen3_next",
                "vocab_size": 96,
                "hidden_size": 32,
                "intermediate_size": 48,
                "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 24,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 8,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 8,
                "linear_value_head_dim": 8,
                "linear_conv_kernel_dim": 4,
                "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                "mlp_only_layers": [1],
                "norm_topk_prob": True,
                "partial_rotary_factor": 0.5,
            }
            cfg = get_family("qwen3_next").from_hf_config(hf, dtype="float32")
        else:
            cfg = model_config(flavors[family], dtype="float32")
        torch.manual_seed(0)
        model = HybridModel(cfg)
        zero = ("local_tokens_per_expert",) + tuple(s for s, _ in save_setup(model)[1].zero_only)
        with torch.no_grad():
            for name, t in model.state_dict().items():
                if t.is_floating_point() and not name.endswith(zero):
                    t.add_(0.1 * torch.randn_like(t))
        save_pretrained(model, out / family)
        for engine in ENGINES:
            pairs = [(n, t.contiguous()) for b in weights(model, engine) for n, t in b]
            save_file(dict(pairs), out / "streams" / f"{family}.{engine}.safetensors")
            (out / "streams" / f"{family}.{engine}.json").write_text(json.dumps([n for n, _ in pairs]))
        print(f"{family}: {len(pairs)} tensors -> {out / family}")
    _write_vl(out)


def _write_vl(out: Path) -> None:
    """``DIR/qwen3_5_moe_vl/config.json``: the tiny Qwen3.5-MoE text model under a one-block vision
    tower (``Qwen3_5MoeForConditionalGeneration``, as the released checkpoints), its streams the
    text model's."""
    import shutil

    import transformers

    text = json.loads((out / "qwen3_5_moe" / "config.json").read_text())
    for k in ("architectures", "transformers_version"):
        text.pop(k, None)
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "out_hidden_size": text["hidden_size"],
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "in_channels": 3,
    }
    cfg = transformers.Qwen3_5MoeConfig(
        text_config=text,
        vision_config=vision,
        architectures=["Qwen3_5MoeForConditionalGeneration"],
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
    )
    cfg.save_pretrained(out / "qwen3_5_moe_vl")
    for engine in ENGINES:
        for ext in ("safetensors", "json"):
            shutil.copy(
                out / "streams" / f"qwen3_5_moe.{engine}.{ext}",
                out / "streams" / f"qwen3_5_moe_vl.{engine}.{ext}",
            )
    print(f"qwen3_5_moe_vl: the text model's streams -> {out / 'qwen3_5_moe_vl'}")


# ---------------------------------------------------------------------------------- step 2
def _last_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and "further information" not in ln]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]


_STUB = '''"""A stand-in for torchvision: vLLM's Qwen3.5 files import it for image processing only."""


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Any


class Any(metaclass=_Meta):
    def __init__(self, *a, **k):
        pass

    def __getattr__(self, name):
        return Any()

    def __call__(self, *a, **k):
        return Any()


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return Any
'''
_STUB_MODULES = (
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
    "torchvision.io",
    "torchvision.ops",
    "torchvision.utils",
)


def stub_torchvision(root: Path) -> None:
    """A torchvision stand-in under ``root`` (with a dist-info: transformers asks its version), put
    first on ``sys.path`` and ``PYTHONPATH`` (vLLM inspects architectures in a subprocess). PyPI's
    torchvision builds are CUDA builds whose operators do not register over a CPU torch; no image
    is processed here."""
    for name in _STUB_MODULES:
        path = root.joinpath(*name.split("."))
        path.mkdir(parents=True, exist_ok=True)
        (path / "__init__.py").write_text(_STUB)
    meta = root / "torchvision-0.28.0.dist-info"
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))


def _build_vllm(family: str, folder: Path, device: str):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import importlib

    import torch
    import vllm.platforms.cpu as cpu_platform
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    cpu_platform.CpuPlatform.check_and_update_config = classmethod(lambda cls, c: None)
    mc = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float32", enforce_eager=True)
    vc = VllmConfig(
        model_config=mc, device_config=DeviceConfig(device="cpu"), load_config=LoadConfig(load_format="dummy")
    )
    destroy_model_parallel()  # the groups (expert parallel or not) follow each model's config
    destroy_distributed_environment()
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method="tcp://127.0.0.1:29533",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        module, cls = VLLM_CLASSES[family].split(":")
        with torch.device(device):
            model = getattr(importlib.import_module(module), cls)(vllm_config=vc, prefix="")
    return model, lambda pairs: _in_config(vc, model, pairs)


def _in_config(vc, model, pairs):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vc):
        return model.load_weights(pairs)


def load(out: Path, engine: str, families, device: str, stream: str | None = None) -> int:
    import torch
    from safetensors.torch import load_file

    if engine != "vllm":
        print(f"{engine}: no loader runner (see benchmarks/README.md)")
        return 2
    failures = 0
    for family in families:
        t0 = time.perf_counter()
        try:
            model, feed = _build_vllm(family, out / family, device)
        except Exception as e:  # report the engine's refusal and go on with the next family
            print(f"{family}: not built: {_last_line(e)}")
            failures += 1
            continue
        built = time.perf_counter() - t0
        spelling = stream or engine
        tensors = load_file(out / "streams" / f"{family}.{spelling}.safetensors")
        order = json.loads((out / "streams" / f"{family}.{spelling}.json").read_text())
        loaded: set[str] = set()
        rejected = []
        for name in order:
            try:
                loaded |= set(feed([(name, tensors[name])]) or ())
            except Exception as e:
                rejected.append(f"{name} ({_last_line(e)})")
        params = dict(model.named_parameters())
        mapper = getattr(model, "hf_to_vllm_mapper", None)  # the class's renames (prefixes)
        same = sum(
            1
            for n, t in tensors.items()
            if (m := n if mapper is None else mapper.map_name(n)) in params
            and params[m].device.type != "meta"
            and params[m].shape == t.shape
            and torch.equal(params[m].detach(), t)
        )
        try:
            control = "dropped silently" if not feed([(CONTROL, torch.zeros(4))]) else "loaded (!)"
        except Exception:
            control = "rejected"
        vision = sorted(n for n in set(params) - loaded if n.startswith("visual."))  # not ours
        missing = sorted(set(params) - loaded - set(vision))
        print(
            f"{family}: built in {built:.1f} s; fed {len(order)} ({spelling}), rejected {len(rejected)}; parameters "
            f"loaded {len(loaded & set(params))} of {len(params)}, never loaded {len(missing)}; "
            f"{f'vision tower (not ours) {len(vision)}; ' if vision else ''}"
            f"equal to the fed tensor of that name {same}; misnamed control {control}; "
            f"{time.perf_counter() - t0:.1f} s"
        )
        for r in rejected[:5]:
            print(f"  rejected: {r}")
        for m in missing[:5]:
            print(f"  never loaded: {m}")
        failures += bool(rejected or missing)
    return 1 if failures else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    w = sub.add_parser("write", help="the project's venv: the folders and the streams")
    w.add_argument("dir", type=Path)
    ld = sub.add_parser("load", help="the engine's venv: feed the streams to its load_weights")
    ld.add_argument("dir", type=Path)
    ld.add_argument("--engine", choices=ENGINES, required=True)
    ld.add_argument("--family", choices=CASES, action="append")
    ld.add_argument("--device", choices=("cpu", "meta"), default="cpu")
    ld.add_argument("--stream", choices=ENGINES, help="feed this engine's spelling instead (a control)")
    ld.add_argument(
        "--stub-torchvision",
        type=Path,
        metavar="DIR",
        help="write a torchvision stand-in there and import it (vLLM's Qwen3.5 files need one)",
    )
    args = p.parse_args(argv)
    if args.step == "write":
        write(args.dir)
        return 0
    if args.stub_torchvision is not None:
        stub_torchvision(args.stub_torchvision)
    return load(args.dir, args.engine, args.family or CASES, args.device, args.stream)


if __name__ == "__main__":
    sys.exit(main())
