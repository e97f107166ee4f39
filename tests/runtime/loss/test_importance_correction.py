"""Importance correction of the train / rollout mismatch (:mod:`harts_runtime.loss.correction`):
the loss equals an fp64 per-token reference written from the formulas, for every correction and
aggregation mode; compact execution equals trajectory-wise execution with the correction on
(shared prefix tokens take each trajectory's own weight); microbatch shares add up to the
whole-step objective; the step's mismatch metrics equal their formulas, per version lag too; bad
behaviour log-probs, versions and options are refused naming the field."""

import json
import math

import numpy as np
import pytest
import torch

from harts_runtime import HybridModel, InvalidInputError, StepInputs, model_config
from harts_runtime.engine import EngineConfig, HartsEngine
from harts_runtime.loss.correction import IS_CORRECTIONS, mismatch_metrics
from harts_runtime.loss.objectives import AGG_MODES, PolicyLossConfig, aggregation_weights, policy_loss
from harts_runtime.rollout_files import read_rollout_file
from harts_runtime.rollouts import Rollouts
from harts_runtime.testing import random_batch

pytestmark = pytest.mark.usefixtures("one_thread")

CAP = 30
CFG = model_config("debug", dtype="float32", moe={"aux_loss_coef": 0.0, "z_loss_coef": 0.0})
TOL = {"logprobs": (1e-6, 2e-5), "loss": (1e-7, 1e-5), "grad": (2e-6, 2e-4)}  # float32 (atol, rtol)


# ---------------------------------------------------------------------------------- fp64 reference
def _reference(lp, old, adv, mask, cu, mu, cfg):
    """The clipped surrogate with the importance weight of ``cfg``, token by token in Python
    floats (weights) and float64 scalars (the graph), aggregated by the step-level weights."""
    high = cfg.clip_ratio_low if cfg.clip_ratio_high is None else cfg.clip_ratio_high
    agg = aggregation_weights(mask, cu, cfg.loss_agg_mode, cfg.loss_norm)
    kind = cfg.is_correction
    total = lp.new_zeros(())
    for i in range(len(cu) - 1):
        ts = range(int(cu[i]), int(cu[i + 1]))
        d = {t: min(max(float(lp[t].detach()) - float(mu[t]), -20.0), 20.0) for t in ts}
        on = [t for t in ts if bool(mask[t])]
        geo = math.exp(sum(d[t] for t in on) / len(on)) if on else 1.0
        for t in ts:
            rho = geo if kind.startswith("seq-") else math.exp(d[t])
            if kind == "none":
                w = 1.0
            elif kind.endswith("tis"):
                w = min(rho, cfg.is_cap)
            else:
                w = rho if cfg.is_low <= rho <= cfg.is_high else 0.0
            r = torch.exp((lp[t] - old[t]).clamp(-20.0, 20.0))  # the PPO ratio's own clamp
            a = float(adv[t])
            pg = torch.maximum(-a * r, -a * r.clamp(1 - cfg.clip_ratio_low, 1 + high))
            if cfg.clip_ratio_c is not None and a < 0:
                pg = torch.minimum(pg, torch.tensor(-a * cfg.clip_ratio_c, dtype=lp.dtype))
            total = total + float(agg[t]) * w * pg
    return total


def _random_inputs(seed, n=7, extreme=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g)
    lengths[0] = 0  # a trajectory without targets
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    t = int(cu[-1])
    lp = -torch.rand(t, generator=g, dtype=torch.float64) * 3
    old = lp - 0.2 * torch.randn(t, generator=g, dtype=torch.float64)
    mu = (lp + 0.6 * torch.randn(t, generator=g, dtype=torch.float64)).clamp(max=0.0)
    if extreme:  # ratios past the exp clamp both ways
        mu[::3] = -60.0
        lp = lp.clone()
        lp[1::5] = -45.0
    adv = torch.randn(t, generator=g, dtype=torch.float64)
    mask = torch.rand(t, generator=g) < 0.75
    mask[int(cu[1]) : int(cu[2])] = False  # a trajectory without masked targets
    return lp, old, adv, mask, cu, mu


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("kind", IS_CORRECTIONS)
def test_loss_equals_the_fp64_reference(kind, mode):
    for seed, extreme in ((0, False), (1, True)):
        lp, old, adv, mask, cu, mu = _random_inputs(seed, extreme=extreme)
        cfg = PolicyLossConfig(
            is_correction=kind, is_cap=1.5, is_low=0.7, is_high=1.3, loss_agg_mode=mode, clip_ratio_c=3.0
        )
        x = lp.clone().requires_grad_()
        loss, metrics = policy_loss(x, old, adv, mask, cu, cfg, behaviour_logprobs=mu)
        (g,) = torch.autograd.grad(loss, x)
        y = lp.clone().requires_grad_()
        ref = _reference(y, old, adv, mask, cu, mu, cfg)
        (gr,) = torch.autograd.grad(ref, y)
        assert math.isfinite(float(loss.detach())) and torch.isfinite(g).all()
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(g, gr, rtol=1e-12, atol=1e-14)
        d = (lp - mu).clamp(-20, 20)[mask]
        assert float(metrics["is_k3"]) == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-12)
        assert float(metrics["is_ratio_max"]) == pytest.approx(float(d.exp().max()), rel=1e-12)


def test_none_with_behaviour_logprobs_is_the_plain_loss_and_old_numerator_reads_old():
    lp, old, adv, mask, cu, mu = _random_inputs(2)
    plain, _ = policy_loss(lp, old, adv, mask, cu, PolicyLossConfig())
    same, m = policy_loss(lp, old, adv, mask, cu, PolicyLossConfig(), behaviour_logprobs=mu)
    assert float(plain) == float(same) and "is_k3" in m and "is_clipped" not in m
    cfg = PolicyLossConfig(is_correction="token-tis", is_numerator="old")
    got, _ = policy_loss(lp, old, adv, mask, cu, cfg, behaviour_logprobs=mu)
    w = (old - mu).clamp(-20, 20).exp().clamp(max=cfg.is_cap)  # old / behaviour, truncated
    r = (lp - old).exp()
    pg = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))
    want = (w * pg * aggregation_weights(mask, cu)).sum()
    assert float(got) == pytest.approx(float(want), rel=1e-12)


# ---------------------------------------------------------------------------------- the engine
def _rollouts(seed=3, noise=0.4):
    """A random tree batch with behaviour log-probs near the model's own and versions 0 .. 2."""
    batch = random_batch(seed, num=10, vocab=CFG.vocab_size, max_new=10)
    tok, off = np.asarray(batch.tokens), np.asarray(batch.offsets)
    trajs = [tok[off[i] : off[i + 1]].tolist() for i in range(len(off) - 1)]
    rng = np.random.default_rng(seed)
    ro = Rollouts.from_lists(
        trajs,
        advantages=rng.standard_normal(len(trajs)).tolist(),
        loss_mask=[(rng.random(len(t)) < 0.8).tolist() for t in trajs],
        old_logprobs=[[-6.0] * len(t) for t in trajs],
    )
    lp = HartsEngine(_model(), EngineConfig(capacity=CAP)).logprobs(ro)
    g = torch.Generator().manual_seed(seed)
    ro.behaviour_logprobs = (lp + noise * torch.randn(lp.shape, generator=g)).clamp(max=0.0)
    ro.weight_versions = torch.randint(-1, 3, lp.shape, generator=g)
    ro.old_logprobs = lp.clone()
    return ro.check(CFG.vocab_size)


def _model():
    torch.manual_seed(0)
    return HybridModel(CFG)


def _run(ro, loss_config, **options):
    engine = HartsEngine(_model(), EngineConfig(capacity=CAP, loss_config=loss_config, **options))
    out = engine.forward_backward(ro)
    return out, {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "loss_config",
    [
        PolicyLossConfig(is_correction="token-tis", is_cap=1.2),
        PolicyLossConfig(is_correction="token-mis", is_low=0.8, is_high=1.25),
        PolicyLossConfig(is_correction="seq-tis", is_cap=1.02, loss_agg_mode="seq-mean-token-mean"),
        PolicyLossConfig(is_correction="seq-mis", is_low=0.95, is_high=1.05, is_numerator="old"),
    ],
    ids=lambda c: f"{c.is_correction}-{c.is_numerator}",
)
def test_compact_equals_trajectory_with_correction(loss_config):
    ro = _rollouts()
    runs = {mode: _run(ro, loss_config, mode=mode, compact_always=True) for mode in ("compact", "trajectory")}
    (oc, gc), (ot, gt) = runs["compact"], runs["trajectory"]
    assert oc.metrics["rows"] < ot.metrics["rows"]  # prefixes were shared
    kind = "clipped" if loss_config.is_correction.endswith("tis") else "masked"
    assert 0.0 < oc.metrics[f"mismatch/{kind}"] < 1.0  # the correction acted on some tokens, not all
    torch.testing.assert_close(oc.logprobs, ot.logprobs, atol=TOL["logprobs"][0], rtol=TOL["logprobs"][1])
    assert oc.loss == pytest.approx(ot.loss, abs=TOL["loss"][0], rel=TOL["loss"][1])
    assert gc.keys() == gt.keys()
    for n, g in gt.items():
        torch.testing.assert_close(
            gc[n], g, atol=TOL["grad"][0], rtol=TOL["grad"][1], msg=lambda m, n=n: f"d{n}: {m}"
        )
    # the step loss is the unchanged objective on the whole step (microbatch shares add up)
    step = StepInputs(
        ro.batch(),
        ro.advantages,
        ro.loss_mask,
        ro.old_logprobs,
        loss_config=loss_config,
        behaviour_logprobs=ro.behaviour_logprobs,
    )
    whole, _ = policy_loss(
        ot.logprobs.double(),
        step.old_logprobs.double(),
        step.advantages.double(),
        step.loss_mask,
        step.cu_seqlens,
        loss_config,
        behaviour_logprobs=step.behaviour_logprobs.double(),
    )
    assert ot.metrics["microbatches"] >= 2
    assert ot.loss == pytest.approx(float(whole), abs=1e-6, rel=1e-5)


def test_step_metrics_equal_their_formulas_per_version_lag():
    ro = _rollouts(seed=5)
    cfg = PolicyLossConfig(is_correction="token-tis", is_cap=1.1)
    out, _ = _run(ro, cfg)
    m, lp = out.metrics, out.logprobs.double()
    keep = ro.loss_mask
    d = (lp - ro.behaviour_logprobs.double()).clamp(-20, 20)
    rho = d.exp()
    assert m["mismatch/tokens"] == int(keep.sum())
    assert m["mismatch/k3"] == pytest.approx(float((rho - 1 - d)[keep].mean()), rel=1e-9)
    assert m["mismatch/ratio_max"] == pytest.approx(float(rho[keep].max()), rel=1e-9)
    assert m["mismatch/clipped"] == pytest.approx(float((rho[keep] > 1.1).double().mean()), rel=1e-9)
    v = ro.weight_versions
    top = int(v[keep & (v >= 0)].max())  # the engine has taken 0 optimizer steps
    lags = sorted({top - int(x) for x in v[keep & (v >= 0)]})
    assert sum(m[f"mismatch/lag{g}/tokens"] for g in lags) == int((keep & (v >= 0)).sum())
    for g in lags:
        sel = keep & (v >= 0) & (top - v == g)
        assert m[f"mismatch/lag{g}/ratio_max"] == pytest.approx(float(rho[sel].max()), rel=1e-9)
        assert m[f"mismatch/lag{g}/k3"] == pytest.approx(float((rho - 1 - d)[sel].mean()), rel=1e-9)
    again = mismatch_metrics(
        lp,
        ro.behaviour_logprobs,
        keep,
        torch.from_numpy(ro.target_offsets),
        cfg,
        weight_versions=v,
        version=7,
    )
    assert {k for k in again if k.startswith("mismatch/lag")} >= {
        f"mismatch/lag{7 - x}/tokens" for x in range(3)
    }
    assert 0.0 <= m["loss_fn/is_k3"] and m["loss_fn/is_k3"] == pytest.approx(m["mismatch/k3"], rel=1e-4)


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 0.5, 1e39])
def test_bad_behaviour_logprobs_are_refused_naming_the_entry(bad):
    trajs = [[1, 2, 3], [1, 2, 4, 5]]
    beh = [[-1.0, -1.0], [-1.0, -1.0, -1.0]]
    beh[1][2] = bad
    with pytest.raises(InvalidInputError, match=r"behaviour_logprobs\[1\]\[2\]"):
        Rollouts.from_lists(trajs, behaviour_logprobs=beh)
    ro = Rollouts.from_lists(trajs, behaviour_logprobs=[[-1.0] * 2, [-1.0] * 3])
    step = ro.step_inputs(loss_config=PolicyLossConfig())
    step.behaviour_logprobs = step.behaviour_logprobs.double()
    step.behaviour_logprobs[4] = bad
    with pytest.raises(InvalidInputError, match=r"^behaviour_logprobs\[1\]\[2\]"):
        step.check_values()


def test_bad_versions_options_and_missing_behaviour_are_refused():
    trajs = [[1, 2, 3], [1, 2, 4, 5]]
    for bad, field in ((1.5, r"weight_versions\[0\]\[1\]"), (-2, r"weight_versions\[0\]\[1\]")):
        with pytest.raises(InvalidInputError, match=field):
            Rollouts.from_lists(trajs, weight_versions=[[0, bad], [0, 1, 2]])
    with pytest.raises(InvalidInputError, match="^behaviour_logprobs: required by is_correction='seq-tis'"):
        Rollouts.from_lists(trajs).step_inputs(loss_config=PolicyLossConfig(is_correction="seq-tis"))
    for kw, field in (
        ({"is_correction": "tis"}, "is_correction"),
        ({"is_cap": 0.5}, "is_cap"),
        ({"is_low": 1.5}, "is_low"),
        ({"is_high": float("nan")}, "is_high"),
        ({"is_numerator": "behaviour"}, "is_numerator"),
    ):
        with pytest.raises(InvalidInputError, match=f"^{field}: "):
            PolicyLossConfig(**kw)


def test_shapes_and_files_carry_behaviour_and_versions(tmp_path):
    trajs = [[1, 2, 3], [4, 5, 6, 7]]
    beh = [[0.0, -0.5, -0.25], [0.0, -1.0, -2.0, -3.0]]  # per token: the first is dropped
    ver = [[-1, 2, 2], [-1, 0, 1, 1]]
    ref = Rollouts.from_lists(trajs, behaviour_logprobs=beh, weight_versions=ver)
    assert ref.behaviour_logprobs.tolist() == [-0.5, -0.25, -1.0, -2.0, -3.0]
    assert ref.weight_versions.tolist() == [2, 2, 0, 1, 1] and ref.weight_versions.dtype == torch.int64
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    am = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    padded = Rollouts.from_padded(
        ids,
        am,
        behaviour_logprobs=torch.tensor([[0.0] + beh[0], beh[1]]),
        weight_versions=torch.tensor([[0] + ver[0], ver[1]]),
    )
    assert torch.equal(padded.behaviour_logprobs, ref.behaviour_logprobs)
    assert torch.equal(padded.weight_versions, ref.weight_versions)
    path = tmp_path / "r.jsonl"
    rows = [
        {
            "tokens": t,
            "advantages": 1.0,
            "loss_mask": 1,
            "old_logprobs": b,
            "behaviour_logprobs": b,
            "weight_versions": v,
        }
        for t, b, v in zip(trajs, beh, ver)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    rf = read_rollout_file(path)
    assert rf.has_behaviour_logprobs and rf.has_weight_versions and not rf.has_ref_logprobs
    (step,) = rf.steps
    assert torch.equal(step.behaviour_logprobs, ref.behaviour_logprobs)
    assert torch.equal(step.weight_versions, ref.weight_versions)
    rows[1]["weight_versions"] = [0, 0, "x", 0]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(InvalidInputError, match=r"r.jsonl:2: weight_versions\[2\]: expected an integer"):
        read_rollout_file(path)
    rows[1]["weight_versions"] = 3
    rows[0].pop("behaviour_logprobs")
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(
        InvalidInputError, match="r.jsonl:2: behaviour_logprobs: given here but missing on line 1"
    ):
        read_rollout_file(path)
