"""Malformed values, each refused at the point of use with one
``InvalidInputError`` naming the field (and file / line for a rollout file): float64 values beyond
float32's range, advantages edited to NaN after a step was built, a FIFO as ``--data``, a
100,000-digit integer, nested token lists and binary token values in Parquet, token ids >= 2^31,
NaN group ids, complex advantages, and ``load_pretrained`` with ``rms_norm_eps: NaN``, a deeply
nested ``config.json`` or ``device="cuda"`` without CUDA."""

from __future__ import annotations

import json
import os
import shutil
import signal

import numpy as np
import pytest
import torch

from harts_runtime import InvalidInputError
from harts_runtime.rollout_files import read_rollout_file
from harts_runtime.rollouts import Rollouts

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = [[1, 2, 3, 4], [1, 2, 5]]


def refused(fn, field, *words) -> str:
    with pytest.raises(InvalidInputError) as e:
        fn()
    text = str(e.value)
    assert type(e.value).__name__ in ("InvalidInputError", "RolloutFileError"), type(e.value)
    assert e.value.field == field, text
    assert "\n" not in text and len(text) < 400, text
    for w in words:
        assert w in text, (w, text)
    return text


def _row(tokens=(1, 2, 3, 4)):
    n = len(tokens) - 1
    return {"tokens": list(tokens), "advantages": 1.0, "loss_mask": [1] * n, "old_logprobs": [-1.0] * n}


# ------------------------------------------------------------------------------ values
def test_float64_advantages_beyond_float32_are_refused():
    refused(
        lambda: Rollouts.from_lists(TOKENS, advantages=[1e39, 0.0]),
        "advantages[0][0]",
        "not finite in float32",
    )
    r = Rollouts.from_lists(TOKENS, advantages=[0.0, 0.0], ref_logprobs=[-1.0, -1.0])
    step = r.step_inputs()
    step.advantages = torch.full(step.advantages.shape, 1e39, dtype=torch.float64)
    refused(step.check_values, "advantages[0][0]", "not finite in float32")
    step.advantages = torch.full(step.advantages.shape, 1e30, dtype=torch.float64)
    step.check_values()  # large but representable: fine


def test_advantages_edited_to_nan_after_the_step_is_built_are_caught_by_train_step():
    from harts_runtime import HybridModel, model_config, train_step

    torch.manual_seed(0)
    model = HybridModel(model_config("debug", dtype="float32"))
    r = Rollouts.from_lists(TOKENS, advantages=[1.0, -1.0], ref_logprobs=[-1.0, -1.0])
    step = r.step_inputs()
    train_step(model, None, step, capacity=30)
    step.advantages[2] = float("nan")  # in place, after the first step
    refused(lambda: train_step(model, None, step, capacity=30), "advantages[0][2]", "finite")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_complex_advantages_are_refused():
    refused(lambda: Rollouts.from_lists(TOKENS, advantages=[1 + 2j, 0.0]), "advantages[0]", "real numbers")
    ids = torch.tensor([[1, 2, 3]])
    adv = torch.ones(1, 3, dtype=torch.complex64)
    refused(lambda: Rollouts.from_padded(ids, torch.ones(1, 3), advantages=adv), "advantages", "complex")


@pytest.mark.parametrize("bad", [float("nan"), 1.5, "q1"])
def test_group_ids_that_are_not_integers_are_refused(bad):
    refused(
        lambda: Rollouts.from_lists(TOKENS, group_ids=[bad, 1]), "group_ids" + ("[0]" if bad != "q1" else "")
    )
    ids = torch.tensor([[1, 2, 3]])
    if bad != "q1":
        refused(
            lambda: Rollouts.from_padded(ids, torch.ones(1, 3), group_ids=torch.tensor([bad])), "group_ids[0]"
        )


def test_token_ids_at_or_above_2_31_are_refused_not_wrapped():
    refused(lambda: Rollouts.from_lists([[1, 2**32 + 5, 3]]), "tokens[0][1]", "4294967301", "int32")
    r = Rollouts.from_lists([[1, 2, 3]])
    r.tokens[1] = 2**31  # edited after the checks: batch() checks again
    refused(r.batch, "tokens[0][1]", "2147483648")
    assert np.asarray(Rollouts.from_lists([[1, 2**31 - 1]]).batch().tokens).tolist() == [1, 2**31 - 1]


# ------------------------------------------------------------------------------ rollout files
def test_a_fifo_as_data_is_refused_without_blocking(tmp_path, capsys):
    from harts_runtime.cli import main

    fifo = tmp_path / "r.jsonl"
    os.mkfifo(fifo)
    signal.alarm(60)  # a regression would block in open(); fail instead of hanging the suite
    try:
        refused(lambda: read_rollout_file(fifo), "data", "not a regular file")
        assert main(["--flavor", "debug", "--device", "cpu", "--data", str(fifo)]) == 2
    finally:
        signal.alarm(0)
    assert "not a regular file" in capsys.readouterr().err


def test_a_100000_digit_integer_names_the_file_and_line(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text(
        json.dumps(_row()) + "\n" + json.dumps(_row()).replace("[1, 2, 3, 4]", "[1, " + "9" * 100_000 + "]")
    )
    text = refused(lambda: read_rollout_file(f), "data", f"{f}:2:", "4300 digits")
    assert len(text) < 300


def test_a_30_digit_token_id_names_the_token(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps(_row((1, 10**30, 3))) + "\n")
    refused(lambda: read_rollout_file(f), "tokens[1]", f"{f}:1:", "outside")


def _parquet(path, tokens):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"tokens": [tokens], "advantages": [1.0], "loss_mask": [1], "old_logprobs": [-1.0]})
    pq.write_table(table, str(path))
    return path


def test_nested_token_lists_in_parquet_name_the_row_and_field(tmp_path):
    for name, toks in (("ragged.parquet", [[1, 2], [3]]), ("square.parquet", [[1, 2], [3, 4]])):
        path = _parquet(tmp_path / name, toks)
        refused(
            lambda path=path: read_rollout_file(path), "tokens[0]", "row 0", "expected an integer token id"
        )


def test_a_binary_parquet_tokens_value_is_a_short_line(tmp_path):
    path = _parquet(tmp_path / "bin.parquet", b"\x01" * 10_000_000)
    refused(lambda: read_rollout_file(path), "tokens", "row 0", "binary data (10,000,000 bytes)")


# ------------------------------------------------------------------------------ load_pretrained
@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from hf_configs import kimi_linear_config

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("kimi")
    transformers.KimiLinearForCausalLM(kimi_linear_config()).save_pretrained(path)
    return path


def _edited(kimi, tmp_path, text_fn):
    path = tmp_path / "m"
    shutil.copytree(kimi, path)
    cfg = (path / "config.json").read_text()
    (path / "config.json").write_text(text_fn(cfg))
    return path


def test_load_pretrained_refuses_a_nan_rms_norm_eps(kimi, tmp_path):
    from harts_runtime import load_pretrained

    path = _edited(kimi, tmp_path, lambda t: json.dumps(dict(json.loads(t), rms_norm_eps=float("nan"))))
    refused(lambda: load_pretrained(path), "rms_norm_eps", "not a finite number", "config.json")


def test_load_pretrained_refuses_a_deeply_nested_config(kimi, tmp_path):
    from harts_runtime import load_pretrained

    path = _edited(
        kimi, tmp_path, lambda t: t.rstrip()[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    refused(lambda: load_pretrained(path), "config.json", "nested too deeply")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_load_pretrained_on_cuda_without_cuda_names_the_device(kimi):
    from harts_runtime import load_pretrained

    refused(lambda: load_pretrained(kimi, device="cuda"), "device", "CUDA is not available")
    refused(lambda: load_pretrained(kimi, device="nonsense"), "device", "not a device name")
