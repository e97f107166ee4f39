"""Train step: compact (HARTS) and trajectory-wise execution of the same model and batch give the
same per-token log-probs, loss and parameter gradients (fp32), with and without recomputation;
the step-level loss normalisation makes microbatch contributions add up to the unchanged
whole-step objective; a few optimizer steps learn a synthetic task; the CLI runs."""

import io
import json
import random

import numpy as np
import pytest
import torch

import harts_planner as hp
from harts_runtime import (
    HybridModel,
    StepInputs,
    StepInputsError,
    apply_recompute,
    model_config,
    pack_trajectories,
    run_microbatch,
    step_logprobs,
    train_demo,
    train_step,
)
from harts_runtime.cli import main
from harts_runtime.engine import microbatch_call_plan
from harts_runtime.loss.objectives import AGG_MODES, PolicyLossConfig, policy_loss
from harts_runtime.testing import FreshTokens

B = 8  # debug flavor chunk size
# Named tolerances (atol, rtol), fp32 compact vs trajectory-wise.
TOL = {"logprobs": (2e-5, 1e-5), "loss": (1e-6, 1e-5), "grad": (2e-6, 2e-3)}


pytestmark = pytest.mark.usefixtures("one_thread")


VOCAB_WRAP = 500  # token ids stay inside the debug vocabulary (512)


def forks_at_chunk_boundaries():
    t = FreshTokens(wrap=VOCAB_WRAP)
    trunk = t(3 * B + 5)
    return [trunk] + [trunk[:p] + t(B + 3) for p in (B - 1, B, B + 1, 2 * B - 1, 2 * B, 2 * B + 1)]


def many_trees(seed=0):
    t, rng = FreshTokens(wrap=VOCAB_WRAP), random.Random(seed)
    out = []
    for _ in range(5):
        trajs = [t(rng.randint(B, 4 * B))]
        for _ in range(rng.randint(1, 6)):
            parent = rng.choice(trajs)
            p = rng.choice([B - 1, B, B + 1, rng.randint(1, len(parent) - 1)])
            p = min(max(p, 1), len(parent) - 1)
            trajs.append(parent[:p] + t(rng.randint(1, 2 * B)))
        nested = trajs[-1][: min(len(trajs[-1]) - 1, 2 * B + 1)] + t(3)  # nested fork
        out += trajs + [nested]
    return out + [t(1), t(B), trajs[0]]  # single token, duplicate


SCENARIOS = {
    "forks_B-1_B_B+1": forks_at_chunk_boundaries,
    "many_trees_0": many_trees,
    "many_trees_1": lambda: many_trees(1),
}


def make(trajs, seed=0, **cfg):
    batch = hp.RolloutBatch.from_token_lists(trajs)
    torch.manual_seed(seed)
    model = HybridModel(model_config("debug", **cfg))
    return model, StepInputs.synthetic(batch, seed, vocab_size=model.config.vocab_size)


def grads(model):
    """Gradients by parameter name (names as without recomputation's ``.block.`` wrapper)."""
    return {
        n.replace(".block.", "."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def assert_grads_close(a, b, what):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(
            a[n], b[n], atol=TOL["grad"][0], rtol=TOL["grad"][1], msg=lambda m, n=n: f"{what}: d{n}: {m}"
        )


RECOMPUTE = {
    "plain": (False, ()),
    "recompute": (True, ()),
    "keep_attention": (True, ("attention",)),
    "keep_both": (True, ("attention", "linear_attention")),
}


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_compact_equals_trajectory(scenario, recompute):
    model, step = make(SCENARIOS[scenario]())
    apply_recompute(model, RECOMPUTE[recompute][0], keep=RECOMPUTE[recompute][1])
    all_traj = np.arange(step.batch.num_trajectories)
    out = {}
    for mode in ("compact", "trajectory"):
        model.zero_grad(set_to_none=True)
        loss, st = run_microbatch(
            model, step, all_traj, mode, call_plan=microbatch_call_plan(model, step, all_traj)
        )
        lp = torch.empty(step.num_targets)
        lp[st["target_index"]] = st["logprobs"]
        out[mode] = (loss, lp, grads(model), st)
    (lc, pc, gc, sc), (lt, pt, gt, st) = out["compact"], out["trajectory"]
    assert sc["rows"] == step.batch.compact_tokens < st["rows"] == step.batch.semantic_tokens
    assert sc["num_calls"] >= 2 and sc["replay_tokens"] > 0  # handoffs and replay exercised
    torch.testing.assert_close(
        pc, pt, atol=TOL["logprobs"][0], rtol=TOL["logprobs"][1], msg=lambda m: f"logprobs: {m}"
    )
    torch.testing.assert_close(lc, lt, atol=TOL["loss"][0], rtol=TOL["loss"][1], msg=lambda m: f"loss: {m}")
    assert_grads_close(gc, gt, "compact vs trajectory")
    assert len(gc) == len(list(model.parameters()))  # every parameter gets a gradient


def _counting_regions(monkeypatch, calls: dict):
    """Count the runs of every attention core (the reference backend) and of every linear-attention
    schedule (``harts_runtime.layers.kda._run_rounds``, KDA and Gated DeltaNet alike)."""
    from harts_runtime.layers import kda
    from harts_runtime.ops import attention as att

    spec = att.BACKENDS["reference"]
    rounds = kda._run_rounds

    def count(name, fn):
        def counted(*a):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a)

        return counted

    monkeypatch.setitem(
        att.BACKENDS, "reference", att.Backend("reference", spec.kind, count("attention", spec.fn))
    )
    monkeypatch.setattr(kda, "_run_rounds", count("linear_attention", rounds))


@pytest.mark.parametrize(
    "keep", [("attention",), ("linear_attention",), ("attention", "linear_attention")], ids="+".join
)
def test_kept_regions_run_once_and_give_the_same_gradients(monkeypatch, keep):
    """keep=("attention",) / ("linear_attention",) / both: each kept core (the attention kernel;
    the KDA rounds with their gathers and state handoffs) runs once per forward instead of twice
    (forward + recomputation), the others still twice, and loss and gradients are bit-equal to
    full-block recomputation."""
    calls = {}
    _counting_regions(monkeypatch, calls)
    model, step = make(forks_at_chunk_boundaries())
    all_traj = np.arange(step.batch.num_trajectories)
    out = {}
    for k in ((), keep):
        apply_recompute(model, True, keep=k)
        model.zero_grad(set_to_none=True)
        calls.clear()
        loss, _ = run_microbatch(
            model, step, all_traj, "compact", call_plan=microbatch_call_plan(model, step, all_traj)
        )
        out[k] = (loss.detach(), grads(model), dict(calls))
    (l_full, g_full, n_full), (l_keep, g_keep, n_keep) = out[()], out[keep]
    layers = {
        "attention": sum(m in ("mla", "gqa") for m in model.config.mixers),
        "linear_attention": sum(m in ("kda", "gdn") for m in model.config.mixers),
    }
    assert all(n > 0 for n in layers.values()), model.config.mixers
    for name, n in layers.items():
        assert n_full[name] == 2 * n, (name, n_full)
        assert n_keep[name] == (n if name in keep else 2 * n), (name, n_keep)
    assert torch.equal(l_full, l_keep)
    for n in g_full:
        assert torch.equal(g_full[n], g_keep[n]), n
    with pytest.raises(ValueError, match="keep"):
        apply_recompute(model, True, keep=("lm_head",))


def test_the_chunk_core_saves_its_intermediates_only_where_saves_are_transient(monkeypatch):
    """``save_intermediates`` reaches the KDA core True exactly in recomputed blocks outside kept
    regions (first forward and recomputation alike: the checkpoint needs the same saves in both);
    False without recomputation, inside a kept ``linear_attention`` region (its saves live until
    the model's backward), with ``apply_recompute(save_intermediates=False)`` and without grad."""
    from harts_runtime.layers import kda

    seen = []
    core = kda.chunk_kda_with_states

    def spy(*a, save_intermediates=False, **kw):
        seen.append(save_intermediates)
        return core(*a, save_intermediates=save_intermediates, **kw)

    monkeypatch.setattr(kda, "chunk_kda_with_states", spy)
    model, step = make(forks_at_chunk_boundaries())
    all_traj = np.arange(step.batch.num_trajectories)
    n = sum(m in ("kda", "gdn") for m in model.config.mixers)
    got = {}
    settings = {**RECOMPUTE, "keep_linear": (True, ("linear_attention",)), "lean": (True, ())}
    for name, (rc, keep) in settings.items():
        apply_recompute(model, rc, keep=keep, save_intermediates=name != "lean")
        seen.clear()
        run_microbatch(
            model, step, all_traj, "compact", call_plan=microbatch_call_plan(model, step, all_traj)
        )
        got[name] = list(seen)
    rounds = len(got["plain"]) // n
    assert rounds >= 2 and len(got["plain"]) == n * rounds
    assert got["plain"] == [False] * (n * rounds)
    for name in ("recompute", "keep_attention"):  # every first forward, then the recomputations
        assert got[name] == [True] * (2 * n * rounds), name
    assert got["lean"] == [False] * (2 * n * rounds)
    for name in ("keep_linear", "keep_both"):  # the kept rounds run once, their saves persist
        assert got[name] == [False] * (n * rounds), name
    from harts_runtime.ops.keep import recomputed, saves_are_transient

    assert recomputed(True, saves_are_transient) and not saves_are_transient()
    assert not recomputed(False, saves_are_transient)
    with torch.no_grad():
        assert not recomputed(True, saves_are_transient)


def test_kept_regions_free_a_graph_dropped_without_backward():
    """A forward under grad whose graph is dropped without backward (an error between forward and
    backward, a skipped microbatch) leaves no kept region alive: the kept tensors hold no
    reference cycle through autograd's nodes. An in-place change of a kept tensor is caught."""
    import gc

    from harts_runtime.ops.keep import KeptRegions

    model, step = make(forks_at_chunk_boundaries())
    apply_recompute(model, True, keep=("attention", "linear_attention"))
    all_traj = np.arange(step.batch.num_trajectories)

    def alive():
        gc.collect()
        return sum(isinstance(o, KeptRegions) for o in gc.get_objects())

    before = alive()
    for _ in range(2):
        run_microbatch(
            model,
            step,
            all_traj,
            "compact",
            backward=False,
            call_plan=microbatch_call_plan(model, step, all_traj),
        )  # forward under grad
    assert alive() == before

    from harts_runtime.ops.keep import kept

    x = torch.randn(4, 3, requires_grad=True)
    frame = KeptRegions(frozenset({"attention"}))

    def region(t):
        y = t.exp()  # exp saves its output
        return y

    y = frame.run(lambda: kept("attention", region, x))
    with torch.no_grad():
        y.mul_(2)  # modifies the tensor exp saved
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


def test_train_step_over_different_microbatchings_agrees():
    """Whole steps: compact microbatches from plan_step at T=48 vs the baseline's first-fit packing
    at T=48 (different groupings; aux loss off since it is per microbatch by definition)."""
    model, step = make(many_trees(2), moe={"aux_loss_coef": 0.0})
    res = {}
    for mode in ("compact", "trajectory"):
        for recompute in (False, True):
            model.zero_grad(set_to_none=True)
            r = train_step(apply_recompute(model, recompute), None, step, None, mode, capacity=48)
            assert r.recompute == recompute
            res[mode, recompute] = (r, grads(model))
    ref_r, ref_g = res["trajectory", False]
    assert res["compact", False][0].num_microbatches >= 2 and ref_r.num_microbatches >= 3
    assert res["compact", False][0].compression > 1.5
    for key, (r, g) in res.items():
        assert r.loss == pytest.approx(ref_r.loss, abs=TOL["loss"][0], rel=TOL["loss"][1]), key
        assert_grads_close(g, ref_g, str(key))
        assert r.plan_seconds >= 0 and r.fbg_seconds > 0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_microbatch_contributions_sum_to_the_unchanged_step_objective(mode):
    model, step = make(many_trees(3), moe={"aux_loss_coef": 0.0, "z_loss_coef": 0.0})
    step.loss_config = PolicyLossConfig(kl_coef=0.01, loss_agg_mode=mode, clip_ratio_c=3.0)
    n = step.batch.num_trajectories
    parts = [np.arange(0, n, 3), np.arange(1, n, 3), np.arange(2, n, 3)]
    total = sum(
        float(
            run_microbatch(
                model, step, p, "compact", backward=False, call_plan=microbatch_call_plan(model, step, p)
            )[0]
        )
        for p in parts
    )
    lp = step_logprobs(model, step, "trajectory")
    ref, _ = policy_loss(
        lp,
        step.old_logprobs,
        step.advantages,
        step.loss_mask,
        step.cu_seqlens,
        step.loss_config,
        step.ref_logprobs,
    )
    assert total == pytest.approx(float(ref), rel=1e-5, abs=1e-7)


def test_z_loss_is_grouping_invariant():
    model, step = make(many_trees(4), moe={"aux_loss_coef": 0.0, "z_loss_coef": 1.0})
    n = step.batch.num_trajectories
    all_traj = np.arange(n)
    plan = microbatch_call_plan(model, step, all_traj)
    whole = run_microbatch(model, step, all_traj, "compact", backward=False, call_plan=plan)[1]["router_loss"]
    split = sum(
        run_microbatch(model, step, p, "trajectory", backward=False)[1]["router_loss"]
        for p in (np.arange(n // 2), np.arange(n // 2, n))
    )
    assert float(whole) == pytest.approx(float(split), rel=1e-5)


def test_a_few_steps_learn_a_synthetic_task():
    """Trajectories follow ``next = (3 * cur + 1) mod 97`` from random starts (shared prefixes,
    forks); positive advantages; old log-probs from the initial model. The clipped surrogate must
    fall and the targets' log-probs must rise."""
    rng = np.random.default_rng(0)
    trajs = []
    for _ in range(4):
        x = [int(rng.integers(97))]
        for _ in range(40):
            x.append((3 * x[-1] + 1) % 97)
        trajs += [x[: int(rng.integers(20, 41))] for _ in range(3)]
    batch = hp.RolloutBatch.from_token_lists(trajs)
    torch.manual_seed(0)
    model = HybridModel(model_config("debug"))
    p = batch.semantic_tokens - batch.num_trajectories
    probe = StepInputs.synthetic(batch, 0)
    old = step_logprobs(model, probe, "compact")
    step = StepInputs(
        batch,
        torch.ones(p),
        torch.ones(p, dtype=torch.bool),
        old,
        objective="ppo",
        loss_config=PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=10.0),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = [
        train_step(apply_recompute(model, i % 2 == 1), opt, step, None, "compact").loss for i in range(6)
    ]
    assert losses[-1] < losses[0] - 0.5, losses
    assert float(step_logprobs(model, step, "compact").mean()) > float(old.mean()) + 0.5


def test_step_inputs_and_packing_errors_name_the_field():
    batch = hp.RolloutBatch.from_token_lists([[1, 2, 3], [1, 2, 4]])
    p = 4
    with pytest.raises(StepInputsError) as e:
        StepInputs(batch, torch.zeros(p + 1), torch.ones(p), torch.zeros(p))
    assert e.value.field == "advantages"
    with pytest.raises(StepInputsError) as e:
        StepInputs(batch, torch.zeros(p), torch.ones(p), torch.zeros(p))  # grpo KL needs ref
    assert e.value.field == "ref_logprobs"
    with pytest.raises(StepInputsError) as e:
        StepInputs([[1, 2]], torch.zeros(p), torch.ones(p), torch.zeros(p))
    assert e.value.field == "batch"
    with pytest.raises(StepInputsError) as e:
        pack_trajectories([3, 9, 2], 8)
    assert e.value.field == "trajectories[1]"
    step = StepInputs.synthetic(batch, 0)
    with pytest.raises(StepInputsError) as e:
        run_microbatch(HybridModel(model_config("debug")), step, [0, 1], "tree")
    assert e.value.field == "mode"


def test_pack_trajectories_first_fit_decreasing():
    lengths = np.array([5, 3, 8, 2, 2, 6, 1])
    bins = pack_trajectories(lengths, 8)
    assert sorted(np.concatenate(bins).tolist()) == list(range(len(lengths)))
    assert all(lengths[b].sum() <= 8 for b in bins)
    assert len(bins) == int(np.ceil(lengths.sum() / 8))  # tight here


def test_cli_runs_both_modes(capsys):
    # T large enough for one microbatch per mode: the per-microbatch MoE aux loss (as in Megatron)
    # depends on which trajectories share a microbatch, the rest of the loss does not
    assert (
        main(["--preset", "tiny", "--steps", "2", "--mode", "both", "--device", "cpu", "--capacity", "4096"])
        == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert (
        len(out) == 6
        and out[0].startswith("step 0 compact")
        and "compression=" in out[0]
        and "loss=" in out[0]
    )
    assert out[1].startswith("step 0 trajectory")
    # both modes start every step from the same weights (two copies, two optimizers): same losses
    diffs = [float(line.rsplit("=", 1)[1]) for line in out if "|loss(compact) - loss(trajectory)|" in line]
    # step 0 is the same math on the same weights; after one AdamW step float-rounding differences
    # in near-zero gradients are amplified to O(lr) updates, so step 1 only tracks closely
    assert len(diffs) == 2 and diffs[0] < 1e-5 and diffs[1] < 1e-3, diffs


def test_cli_recompute_keeping_attention_matches_full_recompute(capsys):
    """``--recompute --keep attention`` trains the same losses as ``--recompute`` (the kept
    attention cores are the same values, not recomputed)."""
    losses = []
    for extra in ([], ["--keep", "attention"]):
        argv = ["--preset", "tiny", "--steps", "2", "--device", "cpu", "--capacity", "4096", "--json"]
        assert main(argv + ["--recompute", *extra]) == 0
        losses.append([json.loads(line)["loss"] for line in capsys.readouterr().out.strip().splitlines()])
    assert losses[0] == losses[1] and len(losses[0]) == 2


def test_train_demo_prints_and_returns_every_step():
    out = io.StringIO()
    res = train_demo(preset="tiny", steps=2, seed=3, max_len=64, out=out)
    lines = out.getvalue().strip().splitlines()
    assert [r["step"] for r in res] == [0, 1] and len(lines) == 6
    for i, r in enumerate(res):
        assert r["compact"]["mode"] == "compact" and r["trajectory"]["mode"] == "trajectory"
        assert r["abs_loss_diff"] == abs(r["compact"]["loss"] - r["trajectory"]["loss"])
        assert (
            lines[3 * i].startswith(f"step {i} compact")
            and f"loss={r['compact']['loss']:.6f}" in lines[3 * i]
        )
        assert lines[3 * i + 2] == f"step {i} |loss(compact) - loss(trajectory)| = {r['abs_loss_diff']:.3e}"
        assert r["compact"]["rows"] < r["trajectory"]["rows"] == r["trajectory"]["semantic_tokens"]
    assert res[0]["abs_loss_diff"] < 1e-5


@pytest.mark.slow
def test_gpu_eval_script_smoke_on_cpu(tmp_path):
    """benchmarks/train_eval.py end to end at CPU smoke sizes: every section runs and reports."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "train_eval.py")
    spec = importlib.util.spec_from_file_location("train_eval", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = [
        "--device",
        "cpu",
        "--flavor",
        "debug",
        "--tiny",
        "--out",
        str(tmp_path),
        "--sections",
        ",".join(mod.SECTIONS),
    ]
    assert mod.main(argv) == 0
    res = json.loads((tmp_path / "train_eval.json").read_text())
    for name in mod.SECTIONS:
        assert "error" not in res[name], res[name].get("traceback")
    m = res["microbatches"]
    assert [r["index"] for r in m["compact"]["microbatches"]] == list(
        range(s_mbs := len(m["compact"]["microbatches"]))
    )
    assert s_mbs >= 2 and all(
        r["fbg_s"] > 0 and r["rows"] > 0 and r["rounds"] >= 1 for r in m["compact"]["microbatches"]
    )
    assert (
        sum(r["rows"] for r in m["compact"]["microbatches"]) == res["speedup"]["runs"]["compact"][0]["rows"]
    )
    assert (
        sum(r["rows"] for r in m["trajectory"]["microbatches"]) == res["speedup"]["batch"]["semantic_tokens"]
    )
    assert res["breakdown"]["microbatch"]["index"] == m["compact"]["median_index"]
    assert res["newshapes"]["first_fbg_s"] > 0 and res["first"]["first_s"] > 0
    s = res["speedup"]
    assert s["non_replay_row_compression"] > 1 and s["ideal_work_compression"] > 1 and s["fbg_speedup"] > 0
    assert res["fidelity"]["no_recompute"]["harts_cos"] > 0.9999
    replay = res["replay"]
    assert replay["replay"][0]["tokens"] > 0 and sum(d["tokens"] for d in replay["replay"][1:]) > 0
    assert "harts.kda.core" in res["breakdown"]["ranges"]
    md = (tmp_path / "train_eval.md").read_text()
    assert (
        "## Speedup (Table 4)" in md
        and "## Microbatches of the slice" in md
        and "## A step of never-seen shapes" in md
    )


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--flavor", "nope"], "flavor: unknown 'nope'"),
        (["--layers", "99"], "num_layers: flavor 'debug' supports 1..32 layers"),
        (["--steps", "-1"], "--steps: must be >= 0"),
        (["--device", "not-a-device"], "--device: not a device"),
        (["--preset", "nope"], "preset: unknown preset 'nope'"),
        (["--model", "/nonexistent"], "--model: '/nonexistent' is not a checkpoint folder"),
        (["--model", ".", "--layers", "2"], "--model: a checkpoint folder replaces --flavor and --layers"),
        (["--keep", "attention"], "--keep: needs --recompute"),
        (["--recompute", "--keep", "lm_head"], "--keep: unknown regions ['lm_head']"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(argv, fragment, capsys):
    assert main(["--device", "cpu", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("harts-train: error:")


def test_cli_without_torch_says_what_to_install():
    """`harts-train` is installed with the planner alone: --help works and a run is one error line."""
    import subprocess
    import sys

    code = "import sys; sys.modules['torch'] = None; from harts_runtime.cli import main; sys.exit(main(sys.argv[1:]))"
    helped = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "--flavor" in helped.stdout
    ran = subprocess.run([sys.executable, "-c", code, "--steps", "1"], capture_output=True, text=True)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert "torch is not installed: pip install '.[runtime]' torch==2.13.0" in ran.stderr
