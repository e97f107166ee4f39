"""``benchmarks/cp_eval.py``: the analytic model of context parallelism's collectives per model and
step (identities, no processes), its predicted table (the README block is the JSON's), the
``"states"`` split numbers of its gloo harness, and, ``slow``, its ``--quick`` gloo run (measured
bytes equal to the model's, in ``"states"`` mode once the runtime has it). The per-layer formulas
are ``harts_runtime.parallel.cp_cost``'s (``tests/runtime/parallel/test_cp_cost.py``)."""

import importlib
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def _load():
    # imported by name from benchmarks/ (on sys.path, which spawned workers inherit), so that
    # run_distributed's processes can import its worker
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return importlib.import_module("cp_eval")


ce = _load()
KDA = ce.Mixer("kda", 16, 16, 128, 128, 16 * 384, 4)
MLA = ce.Mixer("mla", 16, latent=576, q_head=192, v_head=128)
DIMS = ce.ModelDims(1536, (KDA, KDA, KDA, MLA), (0, 128, 128, 128), 2)


@pytest.mark.parametrize("c", [2, 4, 8])
def test_head_parallel_rows_move_2_c_minus_1_over_c_n_d_each_way(c):
    n, d, s = 1024 * c, 1536, 2
    by = ce.head_parallel_mixer(KDA, d, n, c, 0, s)
    for p in ("forward", "backward"):
        assert sum(r["received"] for r in by[p]) == 2 * (c - 1) * n * d * s // c
        assert sorted(r["collective"] for r in by[p]) == ["all_gather", "reduce_scatter"]


def test_uneven_rows_are_padded_to_ceil_n_over_c():
    r = ce.gather_rows(10, 4, 8, 4)  # shards of 3, 3, 3, 1 rows padded to 3
    assert r["payload"] == 4 * 3 * 8 * 4 and r["received"] == 3 * 3 * 8 * 4
    assert [ce.rows_of(10, 4, k) for k in range(4)] == [3, 3, 3, 1]
    assert [ce.rows_of(3, 4, k) for k in range(4)] == [1, 1, 1, 0]


@pytest.mark.parametrize("n,c", [(64, 4), (57, 2), (61, 4), (3, 4)])
def test_all_to_all_sent_equals_received_over_the_group(n, c):
    width = 16 * 192
    into = sum(ce.rows_to_heads(n, c, k, width, 2)["received"] for k in range(c))
    back = sum(ce.heads_to_rows(n, c, k, width, 2)["received"] for k in range(c))
    assert into == back == (c - 1) * n * (width // c) * 2


def test_recomputation_repeats_the_forward_collectives_in_backward():
    n, p, c = 4096, 3000, 4
    plain = ce.microbatch_collectives(DIMS, n, p, c, 0, recompute=False)
    rec = ce.microbatch_collectives(DIMS, n, p, c, 0, recompute=True)
    fwd = sum(r["received"] for r in plain if r["phase"] == "forward" and r["part"] != "head")
    assert sum(r["received"] for r in rec) == pytest.approx(sum(r["received"] for r in plain) + fwd)
    head = [r for r in rec if r["part"] == "head"]
    assert len(head) == 1 and head[0]["payload"] == 4 * p  # fp32 log-probs, once
    router = [r for r in rec if r["part"] == "ffn"]
    assert len(router) == 2 * 3 and all(r["payload"] == 4 * (2 * 128 + 2) for r in router)


def test_one_rank_has_no_cp_collectives_and_all_rows():
    assert ce.microbatch_collectives(DIMS, 100, 90, 1, 0, True) == []
    assert ce.fsdp_microbatch({"a": [(8, 4)]}, 1, 4) == []
    rows = ce.activation_rows(100, 1, 0, DIMS)
    assert rows["row_block"] == 100 and rows["gathered_rows"] == 0


def test_state_passing_crossover():
    for c in (2, 4, 8):
        n = ce.crossover_rows(KDA, 1536, c, 2)
        hp = sum(r["received"] for r in ce.head_parallel_mixer(KDA, 1536, int(n) * c, c, 0, 2)["forward"])
        sp = sum(r["received"] for r in ce.state_passing_mixer(KDA, 1536, int(n) * c, c, 2)["forward"])
        assert hp > sp  # above the crossover head-parallel moves more (linear layers)
    # ling-tiny's KDA: a 16 x (128^2 + 128^2) fp32 summary: ~700 rows at C = 2
    assert 600 < ce.crossover_rows(KDA, 1536, 2, 2) < 800
    # MLA: state passing gathers the latent alone, head-parallel adds the all-to-alls
    hp = ce.head_parallel_mixer(MLA, 1536, 8192, 4, 0, 2)["forward"]
    sp = ce.state_passing_mixer(MLA, 1536, 8192, 4, 2)["forward"]
    assert hp[0] == sp[0] and len(hp) == 3
    # the model per step: "states" passes each rank's numbers to every layer
    split = ce.RankSplit(pieces=2, halo_rows=10, attention_rows=100)
    recs = ce.microbatch_collectives(DIMS, 4096, 4000, 4, 1, True, "states", split)
    kda = [r for r in recs if r["layer"] == 0 and r["pass"] == "forward"]
    assert kda[1]["received"] == 3 * 2 * 16 * (2 * 128 * 128) * 4 and kda[0]["received"] == 10 * 1536 * 2
    mla = [r for r in recs if r["layer"] == 3 and r["part"] == "mixer"]
    assert [r["received"] for r in mla] == [100 * 576 * 2] * 3  # forward, backward, recompute


def test_fsdp_pads_dim0_per_parameter():
    assert ce.fsdp_unit_shard([(10, 3), (5,), ()], 4) == 3 * 3 + 2 + 1
    recs = ce.fsdp_microbatch({"u": [(10, 3)]}, 4, 2)
    assert [(r["phase"], r["collective"]) for r in recs] == [
        ("forward", "all_gather"),
        ("backward", "all_gather"),
        ("backward", "reduce_scatter"),
    ]
    assert recs[0]["received"] == 3 * 9 * 2


def test_dims_of_reads_the_configs():
    from harts_runtime import model_config

    ling = ce.dims_of(model_config("ling-tiny"))
    assert ling.hidden == 1536 and ling.act_bytes == 2 and len(ling.mixers) == 24
    assert ling.mixers[3].kind == "mla" and ling.mixers[3].latent == 576
    qwen = ce.dims_of(model_config("qwen3.5-35b-a3b"))
    gdn = qwen.mixers[0]
    assert (gdn.kind, gdn.heads, gdn.state_heads, gdn.k, gdn.v) == ("gdn", 16, 32, 128, 128)
    ga = qwen.mixers[3]
    assert (ga.kind, ga.kv_heads, ga.head_dim) == ("gated_attention", 2, 256)


def test_prediction_is_marked_predicted():
    row = ce.predict("ling-tiny", 262_144, 4)
    assert row["predicted"] is True and row["rows_per_rank"] == 65_536
    for mode in ("heads", "states", "auto"):
        m = row["modes"][mode]
        assert m["possible"] and m["step_s"] > row["compute_s"] > 0 and m["memory_GiB"] > row["static_GiB"]
    # auto takes each layer's faster mode: never slower than either
    assert (
        row["modes"]["auto"]["step_s"] <= min(row["modes"][m]["step_s"] for m in ("heads", "states")) + 1e-9
    )
    # past the head count "heads" is impossible and says why; Mamba2 whole groups per rank (8 groups)
    assert not ce.predict("ling-tiny", 262_144, 32)["modes"]["heads"]["possible"]
    assert ce.predict("nemotron-h-8b", 262_144, 8)["modes"]["heads"]["possible"]
    nem = ce.predict("nemotron-h-8b", 262_144, 16)["modes"]["heads"]
    assert not nem["possible"] and "n_groups" in nem["reason"]


def test_memory_includes_the_sharded_adamw_state():
    one = ce.predict("kimi-linear-48b-a3b", 1_048_576, 16, "infiniband", dp_shard=1)
    four = ce.predict("kimi-linear-48b-a3b", 1_048_576, 16, "infiniband", dp_shard=4)
    params = ce.param_counts("kimi-linear-48b-a3b")["params"]
    assert one["adamw_fp32_GiB"] == pytest.approx(16 * params / 16 / 2**30)
    assert one["static_GiB"] - four["static_GiB"] == pytest.approx(one["adamw_fp32_GiB"] * 3 / 4)


def test_parameter_counts_match_the_measured_runs():
    # the analytic counts (from the FLOPs per row) against the parameters the H200 runs reported
    for flavor in ce.MEASURED_ANCHORS:
        measured = ce._measured_anchor(flavor)["run_params"]
        assert ce.param_counts(flavor)["params"] == pytest.approx(measured, rel=1e-3)
    assert 48e9 < ce.param_counts("kimi-linear-48b-a3b")["params"] < 50e9
    assert 7.5e9 < ce.param_counts("nemotron-h-8b")["params"] < 8.5e9


def test_readme_block_is_the_results_json():
    doc = json.loads(open(ce.OUT).read())
    assert ce.markdown(doc["prediction"]) == doc["prediction_markdown"]
    readme = ce.README.read_text()
    assert doc["prediction_markdown"] in readme, (
        "benchmarks/README.md is stale: run python benchmarks/cp_eval.py"
    )
    first = {(x["flavor"], x["rows"], x["mode"]): x for x in doc["prediction"]["first_fit"]}
    assert set(first) == {
        (f, n, m) for f in ce.FLAVORS for n in ce.SIZES for m in ("heads", "states", "auto")
    }


def test_states_split_from_the_tree_equals_the_split_shape():
    # the harness's per-rank numbers (walking the tree's parents) against SplitShape.of_split (the
    # planner's CSR arrays only): the maxima agree; attention_sent is a bound there
    import numpy as np

    import harts_planner as hp

    batch = ce._batch(100)
    traj = np.arange(batch.num_trajectories)
    for c, b in ((2, 16), (4, 16), (4, 8)):
        sp = ce.states_split(batch, traj, c, b, 4)
        shape = ce.SplitShape.of_split(hp.plan_cp(batch, traj, c, b, conv_width=4))
        ranks = sp["ranks"]
        assert ranks[0]["attention_rows"] == 0 and ranks[0]["halo_rows"] == 0
        assert ranks[-1]["halo_sent"] == 0 and ranks[-1]["attention_sent"] == 0
        assert sum(r["halo_rows"] for r in ranks) == sum(r["halo_sent"] for r in ranks)
        assert sum(r["attention_rows"] for r in ranks) == sum(r["attention_sent"] for r in ranks)
        assert (shape.pieces, shape.rank_rows) == (sp["pieces"], sp["rank_rows"])
        assert shape.halo_rows == max(r["halo_rows"] for r in ranks) > 0
        assert shape.halo_sent == max(r["halo_sent"] for r in ranks)
        assert shape.attention_rows == max(r["attention_rows"] for r in ranks) > 0
        assert shape.attention_sent >= max(r["attention_sent"] for r in ranks)


@pytest.mark.slow
def test_quick_gloo_run_matches_the_model(tmp_path):
    out = tmp_path / "cp_eval.json"
    assert ce.main(["--quick", "--no-readme", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["prediction"]["predicted"] is True
    states_ok, why = ce.states_mode_available()
    for case in ce.QUICK:
        res = doc["measured"][case]
        if res.get("run") is False:  # the states-mode runtime is not in this checkout yet
            assert res["mode"] == "states" and not states_ok and res["reason"] == why
            continue
        ranks = res["ranks"]
        assert len(ranks) == 2
        for r in ranks:
            assert r["cp_mismatches"] == {} and r["fsdp_agrees"]
            for part, v in r["cp_received_bytes"].items():
                assert v["measured"] == v["analytic"], part
