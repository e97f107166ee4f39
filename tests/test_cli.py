"""The `harts-planner` CLI and RolloutBatch save/load."""

from __future__ import annotations

import json

import numpy as np
import pytest

import harts_planner as hp
from harts_planner import cli, synth


def test_demo_json_reports_what_ingestion_found(capsys):
    assert cli.main(["demo", "--preset", "small", "--seed", "3", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    syn = synth.generate("small", seed=3)
    assert out["trajectories"] == len(syn.offsets) - 1
    assert out["semantic_tokens"] == syn.semantic_tokens
    assert out["compact_tokens"] == syn.compact_tokens_expected
    assert out["compression"] == pytest.approx(syn.semantic_tokens / syn.compact_tokens_expected)
    assert out["max_fanout"] >= 2 and out["max_depth_segments"] >= 2


def test_demo_table(capsys):
    assert cli.main(["demo", "--preset", "tiny", "--quiet"]) == 0
    text = capsys.readouterr().out
    for label in ("trajectories", "semantic tokens S", "compact tokens C", "compression S/C",
                  "tree depth", "fan-out", "time"):
        assert label in text


@pytest.mark.parametrize("suffix", [".hrb", ".jsonl"])
def test_synth_then_load_round_trip(tmp_path, suffix, capsys):
    path = tmp_path / f"batch{suffix}"
    assert cli.main(["synth", str(path), "--preset", "tiny", "--seed", "5", "--quiet"]) == 0
    loaded = hp.RolloutBatch.load(path)
    syn = synth.generate("tiny", seed=5)
    assert np.array_equal(loaded.tokens, syn.tokens) and np.array_equal(loaded.offsets, syn.offsets)
    assert np.array_equal(loaded.tree_ids, syn.tree_ids)
    again = tmp_path / f"again{suffix}"
    loaded.save(again)
    assert hp.RolloutBatch.load(again).compact_tokens == loaded.compact_tokens


def test_cli_reports_bad_input_without_traceback(capsys):
    assert cli.main(["demo", "--preset", "nope", "--quiet"]) == 2
    assert "preset" in capsys.readouterr().err
