"""``load_pretrained`` on folders that are not good checkpoints: every problem is one
``InvalidInputError`` naming the field (or tensor, or file) and the file, in one line, before
anything is allocated where it can be known from the headers; never another exception type.
``harts-train --model`` prints that line and exits 2. The sharded path (``mesh=``) runs the same
checks: ``tests/parallel/test_parallel_checkpoint.py``."""

from __future__ import annotations

import json
import os
import resource
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from hf_configs import kimi_linear_config, qwen_config  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from harts_runtime import InvalidInputError, load_pretrained  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """A tiny Kimi-Linear folder with one weights file."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("kimi")
    transformers.KimiLinearForCausalLM(kimi_linear_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny Qwen3.5-MoE folder in several files with an index."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen")
    model = transformers.Qwen3_5MoeForCausalLM(qwen_config("qwen3_5_moe_text"))
    model.save_pretrained(path, max_shard_size="40KB")
    assert (path / INDEX).is_file()
    return path


def copy_folder(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def refused(path, field, *words, **kw) -> InvalidInputError:
    """load_pretrained(path) raises InvalidInputError naming ``field`` (and every word), one line."""
    with pytest.raises(InvalidInputError) as e:
        load_pretrained(path, **kw)
    err = e.value
    assert type(err) is InvalidInputError
    assert err.field == field, str(err)
    text = str(err)
    assert text.startswith(field + ": ") and "\n" not in text, text
    for w in words:
        assert w in text, (w, text)
    return err


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensor(path, file, name, fn):
    sd = load_file(str(path / file))
    sd[name] = fn(sd[name])
    save_file(sd, str(path / file), metadata={"format": "pt"})


# ------------------------------------------------------------------------------ files
def test_a_truncated_weights_file_is_named(kimi, tmp_path):
    path = copy_folder(kimi, tmp_path / "x")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    refused(path, "model.safetensors", str(path / "model.safetensors"), "cannot read")


def test_a_corrupt_shard_is_named(sharded, tmp_path):
    path = copy_folder(sharded, tmp_path / "x")
    shard = sorted(p.name for p in path.glob("model-*.safetensors"))[1]
    (path / shard).write_bytes(b"\xff" * 64)
    refused(path, shard, str(path / shard))


def test_a_missing_shard_is_named_with_the_index(sharded, tmp_path):
    path = copy_folder(sharded, tmp_path / "x")
    shard = sorted(p.name for p in path.glob("model-*.safetensors"))[-1]
    (path / shard).unlink()
    refused(path, shard, INDEX, "weight_map[")


@pytest.mark.parametrize(
    "target", ["../outside.safetensors", "/etc/hostname", "sub/model.safetensors", "..", "link.safetensors"]
)
def test_an_index_naming_a_file_outside_the_folder_is_refused(sharded, tmp_path, target):
    path = copy_folder(sharded, tmp_path / "x")
    (tmp_path / "outside.safetensors").write_bytes((path / sorted(path.glob("model-*"))[0].name).read_bytes())
    if target == "link.safetensors":  # a link inside the folder to a file outside it
        os.symlink(tmp_path / "outside.safetensors", path / target)
    index = json.loads((path / INDEX).read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = target
    (path / INDEX).write_text(json.dumps(index))
    refused(path, f"weight_map[{name}]", "outside the folder", INDEX)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"weight_map": []}', ""])
def test_an_index_that_is_not_a_json_object_is_named(sharded, tmp_path, text):
    path = copy_folder(sharded, tmp_path / "x")
    (path / INDEX).write_text(text)
    field = "weight_map" if "weight_map" in text else INDEX
    refused(path, field, INDEX)


@pytest.mark.parametrize("text", ["{", "model_type: kimi_linear", "null", '"kimi_linear"', "\xff"])
def test_a_config_that_is_not_a_json_object_is_named(kimi, tmp_path, text):
    path = copy_folder(kimi, tmp_path / "x")
    (path / "config.json").write_bytes(text.encode("latin-1"))
    refused(path, "config.json", str(path / "config.json"))


def test_a_config_without_model_type_is_refused(kimi, tmp_path):
    """It used to be taken for Kimi-Linear."""
    path = copy_folder(kimi, tmp_path / "x")
    edit_config(path, model_type=None)
    refused(path, "model_type", "missing", "config.json", "kimi_linear")
    edit_config(path, model_type=["kimi_linear"])
    refused(path, "model_type", "config.json")


@pytest.mark.parametrize("value", [0, -4, 1.5, "64", True, float("inf")])
def test_size_fields_must_be_positive_integers(kimi, tmp_path, value):
    path = copy_folder(kimi, tmp_path / "x")
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_size"] = value
    (path / "config.json").write_text(json.dumps(cfg))  # inf is written as Infinity
    refused(path, "hidden_size", "positive integer", "config.json")


def test_a_config_field_error_names_the_file(kimi, tmp_path):
    path = copy_folder(kimi, tmp_path / "x")
    edit_config(path, hidden_act="gelu")
    refused(path, "hidden_act", "config.json")


# ------------------------------------------------------------------------------ sizes
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", 10**9),
        ("num_hidden_layers", 10**6),
        ("num_local_experts", 10**7),
        ("vocab_size", 10**12),
    ],
)
def test_absurd_sizes_are_refused_before_allocating(kimi, tmp_path, field, value):
    """The model's bytes (counted on the meta device, one block per kind) against the host's
    available memory: refused at once, with nothing allocated."""
    path = copy_folder(kimi, tmp_path / "x")
    changes = {field: value}
    if field == "num_hidden_layers":
        changes.update(layer_types=["linear_attention", "full_attention"] * (value // 2))
        changes.update(mlp_layer_types=["dense"] + ["sparse"] * (value - 1))
    if field == "hidden_size":  # a float in JSON (1e9) is an integer size too
        changes[field] = float(value)
    edit_config(path, **changes)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    err = refused(path, field, "of parameters", "available on", "config.json", f"{field} = ")
    assert "TiB" in str(err) or "GiB" in str(err)
    assert time.perf_counter() - start < 60
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 1024, grown_mib  # no weights were allocated (the config lists are tens of MB)


def test_a_model_that_does_not_fit_the_device_is_refused(kimi, monkeypatch):
    """The check reads the target device's free memory (here: a host with 1 MiB available)."""
    import harts_runtime.hf.folder as folder

    monkeypatch.setattr(folder, "available_bytes", lambda device: (2**10, "the host"))
    refused(
        kimi, "config.json", "KiB of parameters", "1.0 KiB available on the host", "nothing was allocated"
    )
    monkeypatch.setattr(folder, "available_bytes", lambda device: (None, "meta"))
    assert load_pretrained(kimi) is not None  # unknown memory: not refused


def test_model_bytes_counts_every_parameter_and_buffer(kimi):
    from harts_runtime.hf import model_bytes, read_config

    model = load_pretrained(kimi)
    want = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert model_bytes(model.config) == want
    cfg = read_config(kimi, "bfloat16", {})[3]
    assert model_bytes(cfg) == sum(
        t.numel() * t.element_size() for t in load_pretrained(kimi, dtype="bfloat16").state_dict().values()
    )


# ------------------------------------------------------------------------------ tensors
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_integer_and_bool_tensors_are_refused(kimi, tmp_path, dtype):
    path = copy_folder(kimi, tmp_path / "x")
    name = "model.layers.0.input_layernorm.weight"
    edit_tensor(path, "model.safetensors", name, lambda t: t.to(dtype))
    refused(path, name, "floating point", "model.safetensors")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused(sharded, tmp_path, value):
    path = copy_folder(sharded, tmp_path / "x")
    index = json.loads((path / INDEX).read_text())
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    if name not in index["weight_map"]:  # the in-memory spelling: fused experts
        name = "model.layers.1.mlp.experts.down_proj"
    file = index["weight_map"][name]

    def poison(t):
        t = t.clone()
        t.view(-1)[3] = value
        return t

    edit_tensor(path, file, name, poison)
    refused(path, name, "non-finite", file)


def test_harts_train_prints_one_line_for_a_bad_folder(kimi, tmp_path, capsys):
    """The error is one ``harts-train: error:`` line naming the field and file (exit 2), no
    traceback; the trainer's progress lines (the batch) may come before it."""
    from harts_runtime.cli import main

    def one_error(*words):
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("harts-train: error:")]
        assert len(errors) == 1 and "Traceback" not in err, err
        assert all(w in errors[0] for w in words), errors

    path = copy_folder(kimi, tmp_path / "x")
    edit_config(path, model_type=None)
    for mode in ("compact", "both"):
        argv = ["--model", str(path), "--preset", "tiny", "--steps", "1", "--mode", mode, "--device", "cpu"]
        assert main(argv) == 2
        one_error("model_type", "config.json")
    data = (path / "model.safetensors").read_bytes()
    edit_config(path, model_type="kimi_linear")
    (path / "model.safetensors").write_bytes(data[:100])
    for mode in ("compact", "both"):
        argv = ["--model", str(path), "--preset", "tiny", "--steps", "1", "--mode", mode, "--device", "cpu"]
        assert main(argv) == 2
        one_error("model.safetensors", "cannot read")
