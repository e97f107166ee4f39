"""``load_pretrained(path, mesh=...)`` on folders that are not good checkpoints (issue 25), 2-process
gloo run: every rank raises ``InvalidInputError`` naming the field (or tensor, or file) and the
file, one line, for a config without ``model_type``, a size that does not fit the device (the
model's bytes over the ranks, before anything is allocated), a truncated shard, an integer tensor,
and a NaN inside an expert that only one EP rank reads: that rank names the tensor, the other
raises too (one all-reduce), so no rank is left waiting in a later collective."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from harts_runtime.parallel import ParallelDims
from harts_runtime.parallel.launch import run_distributed

pytest.importorskip("safetensors")

INDEX = "model.safetensors.index.json"


def _worker(rank, world, folders):
    """{case: (error type, field, message)} of every folder's sharded load under dp_shard=2 x ep=2."""
    from harts_runtime import load_pretrained

    out = {}
    for case, folder in folders.items():
        mesh = ParallelDims(world_size=world, dp_shard=2, ep=2).build_mesh()
        try:
            load_pretrained(folder, mesh=mesh)
            out[case] = None
        except Exception as e:  # noqa: BLE001 - the test checks the type
            out[case] = (type(e).__name__, getattr(e, "field", None), str(e))
    return out


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_tensor(path: Path, name: str, fn) -> str:
    from safetensors.torch import load_file, save_file

    file = json.loads((path / INDEX).read_text())["weight_map"][name]
    sd = load_file(str(path / file))
    sd[name] = fn(sd[name])
    save_file(sd, str(path / file), metadata={"format": "pt"})
    return file


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_every_rank_refuses_a_bad_folder(tmp_path):
    import transformers
    from hf_configs import qwen_config

    torch.manual_seed(0)
    good = tmp_path / "good"
    transformers.Qwen3_5MoeForCausalLM(qwen_config("qwen3_5_moe_text")).save_pretrained(
        good, max_shard_size="40KB"
    )
    folders = {}

    folders["model_type"] = _copy(good, tmp_path / "model_type")
    cfg = json.loads((good / "config.json").read_text())
    (folders["model_type"] / "config.json").write_text(
        json.dumps({k: v for k, v in cfg.items() if k != "model_type"})
    )

    folders["size"] = _copy(good, tmp_path / "size")
    (folders["size"] / "config.json").write_text(json.dumps({**cfg, "num_experts": 10**7}))

    folders["truncated"] = _copy(good, tmp_path / "truncated")
    shard = sorted(p.name for p in good.glob("model-*.safetensors"))[0]
    data = (good / shard).read_bytes()
    (folders["truncated"] / shard).write_bytes(data[: len(data) - 8])

    folders["integer"] = _copy(good, tmp_path / "integer")
    int_file = _edit_tensor(folders["integer"], "model.norm.weight", lambda t: t.to(torch.int32))

    # experts 0-1 belong to EP rank 0, 2-3 to EP rank 1: only rank 1 reads expert 3
    folders["nan"] = _copy(good, tmp_path / "nan")
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"
    nan_file = _edit_tensor(
        folders["nan"], expert, lambda t: t.index_fill(0, torch.tensor([0]), float("nan"))
    )

    results = run_distributed(_worker, 2, {k: str(v) for k, v in folders.items()}, timeout=240)
    for r in results:
        for case, got in r.items():
            assert got is not None and got[0] == "InvalidInputError", (case, got)
            assert "\n" not in got[2] and got[2].startswith(f"{got[1]}: "), got
        assert r["model_type"][1] == "model_type" and "config.json" in r["model_type"][2]
        assert r["size"][1] == "num_experts" and "on each of 2 ranks" in r["size"][2]
        assert r["truncated"][1] == shard and str(Path(folders["truncated"]) / shard) in r["truncated"][2]
        assert (
            r["integer"][1] == "model.norm.weight"
            and "I32" in r["integer"][2]
            and int_file in r["integer"][2]
        )
    fields = sorted(r["nan"][1] for r in results)
    assert fields == sorted([expert, "path"]), [r["nan"] for r in results]
    for r in results:
        if r["nan"][1] == expert:
            assert "non-finite" in r["nan"][2] and nan_file in r["nan"][2]
        else:
            assert "another rank" in r["nan"][2] and str(folders["nan"]) in r["nan"][2]
