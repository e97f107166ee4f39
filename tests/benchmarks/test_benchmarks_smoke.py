"""CPU smoke tests of the GPU benchmarks at tiny sizes: ``benchmarks/layer_speed.py`` writes its
top-level keys and a parity record per case; ``benchmarks/train_eval.py`` runs every section on the
Qwen3.5-shaped flavor (GDN + gated attention + MoE with a gated shared expert) and on a Qwen3.5
checkpoint folder (``--model PATH``); ``benchmarks/parallel_eval.py`` runs under ``torchrun`` on 2
CPU processes (gloo), with context parallelism on a long tree too, and parses its configuration
syntax; ``benchmarks/grpo_step.py`` runs the whole step on 2 CPU processes. The debug-flavor and Kimi-Linear-folder
runs of train_eval are in ``test_train.py`` and ``test_kimi_linear.py``."""

import importlib.util
import json
import os

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_layer_speed_lengths_and_train_eval_keys(tmp_path):
    """The trajectory profile scales to exactly the row count; the train_eval headline numbers are
    read from its JSON (file or --out folder), and are None where it has none."""
    ls = _load("layer_speed")
    for total in (65_536, 320, 47, 9):
        lengths = ls.scaled_lengths(total)
        assert sum(lengths) == total and len(lengths) == 8 and min(lengths) >= 1
    assert ls.scaled_lengths(65_536)[0] > ls.scaled_lengths(65_536)[-1]
    doc = {
        "meta": {"model": "ling-tiny (24 layers)"},
        "speedup": {"tflops": {"compact": 121.0, "trajectory": 118.0}, "fbg_speedup_over_ideal": 0.99},
        "breakdown": {"device_busy": 0.9, "wall_s": 7.75, "device_kernel_s": 6.99, "host_overhead_s": 0.76},
    }
    (tmp_path / "train_eval.json").write_text(json.dumps(doc))
    got = ls.read_train_eval(str(tmp_path))
    assert (got["model_tflops"], got["device_busy"], got["speedup_vs_ideal"]) == (121.0, 0.9, 0.99)
    missing = ls.read_train_eval(str(tmp_path / "nope"))
    assert missing["model_tflops"] is None and "error" in missing
    assert ls.read_train_eval(None)["device_busy"] is None


@pytest.mark.slow
def test_layer_speed_tiny_writes_keys_and_parity(tmp_path, monkeypatch):
    """``layer_speed.py --tiny`` on the CPU: every case runs, parity is recorded (fla's layers are
    skipped without CUDA), warm repeats and the first pass are timed, the top-level keys exist."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # fla must not run under the interpreter here
    ls = _load("layer_speed")
    readme = tmp_path / "README.md"
    out = tmp_path / "layer_speed.json"
    assert ls.main(["--tiny", "--out", str(out), "--readme", str(readme)]) == 0
    assert not readme.exists()  # tiny runs never touch the README
    res = json.loads(out.read_text())
    for key in ls.TOP_KEYS:
        assert key in res
    assert res["kda_compact_vs_trajectory"] is not None and res["kda_compact_vs_trajectory"] > 0
    assert res["kda_fwdbwd_vs_fla"] is None  # fla needs CUDA
    cases = res["cases"]
    assert set(cases) == set(ls.CASES)
    for name, d in cases.items():
        assert "error" not in d, (name, d.get("traceback"))
    for name in ("kda", "gdn"):
        assert cases[name]["parity"]["status"].startswith("skipped")
        assert cases[name]["ours"]["status"] == "ok"
        assert cases[name]["ours"]["fwdbwd"]["ms"] > 0 and cases[name]["ours"]["fwdbwd"]["first_pass_s"] > 0
    kc = cases["kda_compact"]
    assert kc["parity"]["status"] == "ok" and kc["parity"]["max_rel_err"] < 1e-4, kc["parity"]
    mb = kc["microbatch"]
    assert mb["packed_rows"] == mb["compact_rows"] + mb["replay_rows"]
    assert kc["trajectory"]["rows"] == mb["packed_rows"]
    crit = mb["scan_critical_chunks"]  # rounds in sequence: at least the longest one-call sequence
    assert crit["compact"] >= crit["trajectory_same_sequences"] > 0 and crit["trajectory"] > 0
    if mb["rounds"] > 1:
        assert crit["compact"] > crit["trajectory_same_sequences"]
    moe = cases["moe"]
    assert moe["parity"]["status"] == "ok" and moe["parity"]["max_rel_err"] < 1e-4, moe["parity"]
    assert moe["fwdbwd_vs_roofline"] > 0 and moe["host"]["wall_ms"] > 0
    for sname, s in cases["attention"]["shapes"].items():
        ran = {b: r for b, r in s["backends"].items() if r.get("status") == "ok"}
        assert len(ran) >= 2 and s["fastest"] in ran, sname
        for b, r in ran.items():
            p = r["parity"]
            assert p["status"] == "reference" or p["max_rel_err"] < 1e-4, (sname, b, p)


def test_train_eval_executed_flops_count_the_recomputed_forward():
    """Executed FLOPs: model FLOPs (3 x forward) plus the recomputed forward, less the attention
    cores (keys x per-key cost) and the linear-attention cores' forward less their backward's WY
    and state-scan recomputation (rows x per-row costs) when they are kept."""
    te = _load("train_eval")
    from harts_runtime.flops import layer_costs

    cfg = te.model_config("ling-tiny", 8)
    work = te.work_compression(cfg, [300, 200], [list(range(300)), list(range(120, 200))])
    full = te.executed_flops(cfg, work, "compact", ())
    kept = te.executed_flops(cfg, work, "compact", ("attention",))
    assert full == pytest.approx(work["compact_flops"] * 4 / 3)
    assert full - kept == pytest.approx(work["compact_keys"] * layer_costs(cfg)["attn_per_key"])
    assert 0 < kept < full
    both = te.executed_flops(cfg, work, "compact", ("attention", "linear_attention"))
    costs = layer_costs(cfg)
    # ling-tiny's first 8 layers: 6 KDA layers, each core 16 heads x (4 B K + 2 B V + 6 K V)
    assert costs["linear_core"] == 6 * 16 * (4 * 64 * 128 + 2 * 64 * 128 + 6 * 128 * 128)
    # each core's backward redoes 16 heads x (2 B (K + V) + 4 K V) per row when its forward is kept
    assert costs["linear_core_recompute"] == 6 * 16 * (2 * 64 * 256 + 4 * 128 * 128)
    skipped = costs["linear_core"] - costs["linear_core_recompute"]
    assert kept - both == pytest.approx(work["compact_rows"] * skipped)
    assert 0 < both < kept


def test_layer_speed_merge_combines_partial_runs(tmp_path):
    """``--merge``: the cases of several results in one (a later file's case wins), each with the
    date of its run, the train_eval numbers carried, the README block rewritten."""
    ls = _load("layer_speed")

    def run(date, cases, te=None):
        return {
            "meta": {"date": date, "device": "GPU", "dtype": "bfloat16", "args": {}},
            "cases": cases,
            "train_eval": te or ls.read_train_eval(None),
        }

    te = {"model_tflops": 245.6, "device_busy": 0.991, "speedup_vs_ideal": 0.998, "model_tflops_mfu": 202.0}
    a = run("day 1", {"kda": {"fwdbwd_vs_fla": 0.98}, "moe": {"old": True}}, te)
    b = run(
        "day 2",
        {"moe": {"new": True}, "gdn": {"skipped": "budget"}, "kda_compact": {"compact_vs_trajectory": 1.2}},
    )
    for name, doc in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{ls.BEGIN}\nold\n{ls.END}\n")
    out = tmp_path / "merged.json"
    merge = ",".join(str(tmp_path / f"{n}.json") for n in "ab")
    assert ls.main(["--merge", merge, "--out", str(out), "--readme", str(readme)]) == 0
    res = json.loads(out.read_text())
    assert sorted(res["cases"]) == ["kda", "kda_compact", "moe"]  # skipped cases are not carried
    assert (
        res["cases"]["moe"] == {"new": True, "measured": "day 2"}
        and res["cases"]["kda"]["measured"] == "day 1"
    )
    assert (res["kda_fwdbwd_vs_fla"], res["kda_compact_vs_trajectory"], res["model_tflops"]) == (
        0.98,
        1.2,
        245.6,
    )
    assert [s["cases"] for s in res["meta"]["sources"]] == [["kda", "moe"], ["kda_compact", "moe"]]
    assert "old" not in readme.read_text() and "245.6" in readme.read_text() and "202.0" in readme.read_text()


def _train_eval_ok(res):
    for name in ("speedup", "fidelity", "replay", "breakdown"):
        assert "error" not in res[name], res[name].get("traceback")
    assert res["speedup"]["ideal_work_compression"] > 1
    for key in ("no_recompute", "recompute"):
        f = res["fidelity"][key]
        assert f["harts_cos"] > 0.9999 and f["harts_max_abs_logit_diff"] < 1e-3, f
    assert sum(d["tokens"] for d in res["replay"]["replay"][1:]) > 0
    assert "harts.kda.core" in res["breakdown"]["ranges"]  # the GDN core runs the KDA schedule


@pytest.mark.slow
def test_train_eval_qwen35_flavor_tiny(tmp_path):
    """``train_eval.py --flavor qwen3.5-35b-a3b --tiny``: the flavor's pattern at tiny widths
    (3 GDN + 1 gated attention, MoE with a gated shared expert); every section runs."""
    te = _load("train_eval")
    argv = ["--device", "cpu", "--flavor", "qwen3.5-35b-a3b", "--tiny", "--out", str(tmp_path)]
    assert te.main(argv) == 0
    res = json.loads((tmp_path / "train_eval.json").read_text())
    assert "G G G GA" in res["meta"]["model"] and "tiny widths" in res["meta"]["model"]
    _train_eval_ok(res)


@pytest.mark.slow
def test_train_eval_qwen35_checkpoint_folder(tmp_path):
    """``train_eval.py --model PATH`` on a Qwen3.5-MoE text checkpoint folder (written by
    ``save_pretrained`` from the tiny flavor): every section runs on the loaded model."""
    pytest.importorskip("safetensors")
    import torch

    from harts_runtime import HybridModel, model_config, save_pretrained

    te = _load("train_eval")
    torch.manual_seed(0)
    save_pretrained(HybridModel(te.tiny_config(model_config("qwen3.5-35b-a3b", 4))), tmp_path / "hf")
    out = tmp_path / "eval"
    assert te.main(["--device", "cpu", "--model", str(tmp_path / "hf"), "--tiny", "--out", str(out)]) == 0
    res = json.loads((out / "train_eval.json").read_text())
    assert str(tmp_path / "hf") in res["meta"]["model"]
    _train_eval_ok(res)


def test_parallel_eval_configs_and_baseline_schedule():
    """``parallel_eval.py``'s configuration syntax (key=value lists separated by ';', predefined
    names, the old comma list of names), the world-size filling and skip messages, and the
    trajectory baseline's packing (every trajectory once, equal counts per replica)."""
    import numpy as np

    pe = _load("parallel_eval")
    items = pe.parse_configs("dp_shard=2,tp=2,sp,ep=2; tp=2,sp=0 ;table4-8gpu", ["dp2,ep2"])
    assert [t for t, _ in items] == ["dp_shard=2,tp=2,sp,ep=2", "tp=2,sp=0", "table4-8gpu", "dp2", "ep2"]
    assert items[0][1] == {"dp_shard": 2, "tp": 2, "sequence_parallel": True, "ep": 2}
    assert items[1][1] == {"tp": 2, "sequence_parallel": False}
    assert items[2][1] == {"dp_shard": 4, "tp": 2, "sequence_parallel": True, "ep": 4}
    for bad, word in (
        ("dp=2", "dp_shard"),
        ("tp=x", "tp"),
        ("pp=2", "unknown key"),
        ("fast", "unknown configuration"),
    ):
        with pytest.raises(pe.ConfigSpecError, match=word):
            pe.parse_configs(bad, None)
    dims, why = pe.make_dims({"tp": 2, "sequence_parallel": True}, 4)  # dp_shard from the world
    assert why is None and (dims.dp_shard, pe.dims_label(dims)) == (2, "dp_shard=2,tp=2,sp")
    assert "needs 4 ranks" in pe.make_dims({"dp_shard": 4}, 2)[1]
    assert "ep" in pe.make_dims({"dp_shard": 2, "ep": 4}, 2)[1]
    names = {w: [n for n, _ in pe.predefined_for(w)] for w in (2, 4, 8)}
    assert "dp2-tp2-sp-ep2" in names[4] and "dp4-tp2-sp-ep4" in names[8] and "tp2-sp" in names[2]
    for w, got in names.items():
        for n in got:
            assert pe.make_dims(pe.parse_kv(pe.PREDEFINED[n]), w)[1] is None, n
    cp = pe.parse_configs("cp=2,cp_mode=states;cp4-auto;dp2-cp4-states", None)
    assert cp[0][1] == {"cp": 2, "cp_mode": "states"} and cp[1][1] == {"cp": 4, "cp_mode": "auto"}
    assert cp[2][1] == {"dp_shard": 2, "cp": 4, "cp_mode": "states"}
    for bad, word in (("cp=2,cp_mode=rings", "cp_mode takes"), ("cp_mode=states", "needs cp >= 2")):
        with pytest.raises(pe.ConfigSpecError, match=word):
            pe.parse_configs(bad, None)
    dims, why = pe.make_dims({"cp": 2, "cp_mode": "states"}, 4)  # dp_shard = 4 / cp
    assert why is None and (dims.dp_shard, dims.cp, pe.dims_label(dims)) == (2, 2, "dp_shard=2,cp=2")
    assert "needs 8 ranks" in pe.make_dims({"dp_shard": 2, "cp": 4}, 4)[1]
    assert {"cp2", "cp2-states"} <= set(names[2]) and "dp2-cp2-states" in names[4] and "cp8-auto" in names[8]
    assert (pe.parse_rows("256k"), pe.parse_rows("1M"), pe.parse_rows("4096")) == (262_144, 1 << 20, 4096)
    with pytest.raises(pe.ConfigSpecError, match="--tree-rows"):
        pe.parse_rows("lots")
    step = pe.long_tree_step(640, 2, 512, 0)  # two trees of 640 rows, four trajectories each
    b = step.batch
    assert b.compact_tokens == 1280 and b.num_trajectories == 8
    assert min(b.lengths) > 640 // 2 and b.semantic_tokens == 8 * 384  # 40% + 10% + 10% of the rows
    lengths = np.array([30, 5, 5, 12, 7, 40, 3, 9], dtype=np.int64)
    for dp in (1, 2, 4):
        per = pe._baseline_schedule(lengths, 48, dp)
        seen = np.sort(np.concatenate([p for packs in per for p in packs]))
        assert seen.tolist() == list(range(len(lengths)))
        assert len({len(packs) for packs in per}) == 1 and all(lengths[p].sum() <= 48 for r in per for p in r)
        plan = pe.BaselinePlan(per, lengths)
        assert plan.dp_size == dp and int(plan.work.sum()) == int(lengths.sum())


@pytest.mark.slow
def test_parallel_eval_two_process_cpu_smoke(tmp_path):
    """``torchrun --nproc-per-node 2 benchmarks/parallel_eval.py`` on the CPU (gloo, the debug flavor in
    float32): FSDP2 + EP and TP + SP match the single-process step (loss, every log-prob, every
    gradient, the expert-load counts), the speed and balance fields are there, a configuration of
    another world size is skipped, the reference files are removed."""
    import subprocess
    import sys

    out = tmp_path / "pe.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [
        os.path.join(BENCH, "parallel_eval.py"),
        "--device",
        "cpu",
        "--flavor",
        "debug",
        "--preset",
        "tiny",
    ]
    cmd += [
        "--capacity",
        "24",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--configs",
        "dp_shard=2,ep=2;tp=2,sp;dp_shard=4",
    ]
    cmd += ["--scratch", str(tmp_path), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    doc = json.loads(out.read_text())
    assert doc["environment"]["world_size"] == 2 and doc["environment"]["device"] == "cpu"
    assert doc["model"]["compute"] == "float32"
    ran, skipped = doc["results"][:2], doc["results"][2]
    assert "needs 4 ranks" in skipped["skipped"]
    assert [r["label"] for r in ran] == ["dp_shard=2,ep=2", "tp=2,sp"]
    for r in ran:
        assert r["loss_rel_diff"] < 1e-5, r
        assert r["logprob_coverage_ok"] and r["logprob_max_abs_diff"] < 1e-4, r
        assert r["grad_max_rel_err"] < 1e-3 and r["grad_min_cos"] > 0.9999, r["grad_worst"]
        assert r["grad_params_compared"] > 0 and r["expert_load_max_rel_diff"] < 1e-5 and r["bf16_ok"]
        for key in ("harts_fbg_s", "baseline_fbg_s", "fbg_speedup", "core_speedup", "fbg_speedup_over_ideal"):
            assert r[key] > 0, key
        assert r["step_compression"] > 1 and r["planner_s"] >= 0
        pred, meas = r["balance"]["predicted"], r["balance"]["measured"]
        assert sum(pred["replica_work"]) == r["plan"]["total_work"]
        assert len(pred["slot_work"]) == r["plan"]["num_slots"] == len(meas["rank_slot_seconds"][0])
        assert len(meas["rank_slot_seconds"]) == 2 and len(meas["replica_seconds"]) == r["dims"]["dp"]
    assert ran[0]["plan"]["num_slots"] >= 2  # several slots per replica at T = 24
    assert not list(tmp_path.glob("parallel_eval_ref*"))
    assert "| dp_shard=2,ep=2 |" in proc.stdout


@pytest.mark.slow
def test_parallel_eval_cp_long_tree_two_process_cpu_smoke(tmp_path):
    """``parallel_eval.py --tree-rows 192`` on 2 gloo processes under ``cp2`` (head-parallel) and, when
    the runtime has ``cp_mode``, ``cp2-states``: one tree whose trajectories are longer than T = 96
    matches the single process; every rank's counted bytes equal ``cp_eval``'s model per kind, and
    what the ranks sent equals what they received."""
    import subprocess
    import sys

    configs = "cp2;cp2-states"
    out = tmp_path / "pe_cp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [
        os.path.join(BENCH, "parallel_eval.py"),
        "--device",
        "cpu",
        "--flavor",
        "debug",
        "--tree-rows",
        "192",
    ]
    cmd += [
        "--iters",
        "1",
        "--warmup",
        "0",
        "--configs",
        configs,
        "--scratch",
        str(tmp_path),
        "--out",
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    doc = json.loads(out.read_text())
    assert doc["step"]["compact_tokens"] == 192 and doc["step"]["tree_rows"] == 192
    for r in doc["results"]:
        assert "skipped" not in r, r
        assert r["capacity"] == 96 and r["dims"]["cp"] == 2
        assert r["loss_rel_diff"] < 1e-5 and r["logprob_max_abs_diff"] < 1e-4 and r["bf16_ok"], r
        assert r["grad_max_rel_err"] < 1e-3, r["grad_worst"]
        assert r["harts_fbg_s"] > 0 and (r["baseline_error"] or r["fbg_speedup"] > 0)
        ranks = r["per_rank"]
        assert [x["rank"] for x in ranks] == [0, 1] and all(x["harts_step_s"] > 0 for x in ranks)
        sent = sum(
            v["sent"] for x in ranks for k, v in x["bytes"]["measured"].items() if k != "fsdp/all_gather"
        )
        got = sum(
            v["received"] for x in ranks for k, v in x["bytes"]["measured"].items() if k != "fsdp/all_gather"
        )
        assert sent == got and got > 0
        assert {k for x in ranks for k in x["bytes"]["measured"]} >= {"fsdp/all_gather", "head/all_reduce"}
        assert len(r["cp_split_predicted"]) == r["plan"]["num_microbatches"]
        assert len(r["cp_balance"]["measured"][0]["rank_busy_s"]) == 2
        mixers = [m for m in r["cp_modes_chosen"][0] if m != "none"]
        assert mixers == ["states"] * 4 if r["config"] == "cp2-states" else mixers == ["heads"] * 4
        for x in ranks:  # cp_eval's counted-bytes model is exact on every rank and kind, in both modes
            assert all(e == 0 for e in x["bytes"]["received_error_pct"].values()), x["bytes"]
    assert "| cp2 | 1 |" in proc.stdout


@pytest.mark.slow
def test_grpo_step_two_process_cpu_smoke(tmp_path):
    """``torchrun --nproc-per-node 2 benchmarks/grpo_step.py`` on the CPU (gloo, debug flavor, FSDP2 +
    EP2): both modes take whole steps; the split, speedups over the ideal, TFLOP/s per GPU beside
    Megatron-Bridge's figure and the planner's predicted balance beside each rank's busy time are there."""
    import subprocess
    import sys

    out = tmp_path / "gs.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [os.path.join(BENCH, "grpo_step.py"), "--device", "cpu", "--flavor", "debug", "--preset", "tiny"]
    cmd += [
        "--capacity",
        "64",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--configs",
        "dp_shard=2,ep=2",
        "--out",
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    doc = json.loads(out.read_text())
    assert doc["environment"]["world_size"] == 2 and doc["environment"]["nvls_off"]["NCCL_NVLS_ENABLE"] == "0"
    (r,) = doc["results"]
    assert r["label"] == "dp_shard=2,ep=2"
    for mode in ("compact", "trajectory"):
        m = r[mode]
        assert m["fbg_s"] > 0 and m["optimizer_s"] > 0 and m["plan_s"] >= 0
        assert m["step_s"] >= m["fbg_s"] + m["optimizer_s"]
        assert len(m["rank_parts_median"]) == 2
    assert "Kimi-Linear" in r["weight_sync"]["skipped"]  # the debug flavor has no transformers family
    assert r["speedup"]["fbg"] > 0 and r["ideal_work_compression"]["rows"] > 1
    assert r["speedup_over_ideal"]["fbg_rows"] == pytest.approx(
        r["speedup"]["fbg"] / r["ideal_work_compression"]["rows"]
    )
    assert (
        r["tflops_per_gpu"]["compact"] > 0
        and r["tflops_per_gpu"]["megatron_bridge"]["model_tflops_per_gpu"] == 185.6
    )
    bal = r["balance"]["compact"]
    assert len(bal["measured"]["rank_busy_seconds"]) == 2 and sum(bal["predicted"]["replica_work"]) > 0
