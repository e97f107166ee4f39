"""The objective's knobs (:class:`~harts_runtime.loss.objectives.PolicyLossConfig`): the KL term
and entropy bonus equal an fp64 per-token reference for every aggregation mode; the chunked LM-head
entropy equals a naive full-softmax entropy forward and backward (shared rows mapped like
log-probs); the step statistics equal their formulas; the loss function's per-microbatch shares add
up to the step's token means; bad knobs are refused naming the field."""

import dataclasses

import pytest
import torch

from harts_runtime import InvalidInputError
from harts_runtime.loss.functions import MicrobatchInputs, make_policy_loss_fn
from harts_runtime.loss.logprobs import lm_head_entropy
from harts_runtime.loss.objectives import (
    AGG_MODES,
    KL_ESTIMATORS,
    PolicyLossConfig,
    aggregation_weights,
    policy_loss,
)
from harts_runtime.loss.statistics import step_statistics


def _inputs(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 8, (n,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    t = int(cu[-1])
    r = lambda: torch.randn(t, generator=g, dtype=torch.float64)
    lp = -torch.rand(t, generator=g, dtype=torch.float64) * 3
    old, ref = lp - 0.3 * r(), (lp - 0.5 * r()).clamp(max=0.0)
    adv, ent = r(), torch.rand(t, generator=g, dtype=torch.float64) * 4
    mask = torch.rand(t, generator=g) < 0.7
    mask[int(cu[1]) : int(cu[2])] = False  # a trajectory without masked targets
    return lp, old, ref, adv, ent, mask, cu


def _naive_kl(lp, ref, est):
    d = lp - ref
    if est == "k1":
        return d
    if est == "k2":
        return 0.5 * d * d
    return (torch.exp(-d) + d - 1).clamp(max=10.0)  # k3 / low-var-kl (|d| < 20 here)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_kl_and_entropy_terms_equal_the_fp64_reference(mode):
    for seed, est in enumerate(KL_ESTIMATORS):
        lp, old, ref, adv, ent, mask, cu = _inputs(seed)
        cfg = PolicyLossConfig(kl_coef=0.07, kl_estimator=est, entropy_coef=0.013, loss_agg_mode=mode)
        x, h = lp.clone().requires_grad_(), ent.clone().requires_grad_()
        loss, m = policy_loss(x, old, adv, mask, cu, cfg, ref, entropy=h)
        gx, gh = torch.autograd.grad(loss, (x, h))
        y, e = lp.clone().requires_grad_(), ent.clone().requires_grad_()
        w = aggregation_weights(mask, cu, mode)
        total = y.new_zeros(())
        for t in range(len(lp)):  # token by token
            r = torch.exp(y[t] - old[t])
            a = float(adv[t])
            pg = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
            total = total + float(w[t]) * (pg + 0.07 * _naive_kl(y[t], ref[t], est) - 0.013 * e[t])
        want_x, want_h = torch.autograd.grad(total, (y, e))
        torch.testing.assert_close(loss, total, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(gx, want_x, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(gh, want_h, rtol=1e-12, atol=1e-14)
        on = mask
        assert float(m["kl"]) == pytest.approx(float(_naive_kl(lp, ref, est)[on].mean()), rel=1e-12)
        assert float(m["entropy"]) == pytest.approx(float(ent[on].mean()), rel=1e-12)
        assert float(m["kl_loss"]) == pytest.approx(float((w * _naive_kl(lp, ref, est)).sum()), rel=1e-12)


def test_knobs_off_leave_the_loss_alone_and_bad_knobs_are_named():
    lp, old, ref, adv, ent, mask, cu = _inputs(9)
    plain, _ = policy_loss(lp, old, adv, mask, cu, PolicyLossConfig())
    same, m = policy_loss(lp, old, adv, mask, cu, PolicyLossConfig(), ref, entropy=ent)
    assert float(plain) == float(same) and "kl" in m and "kl_loss" not in m and "entropy_loss" not in m
    for kw, name in (
        (dict(kl_coef=-0.1), "kl_coef"),
        (dict(kl_coef=float("nan")), "kl_coef"),
        (dict(entropy_coef=-1.0), "entropy_coef"),
        (dict(entropy_coef=float("inf")), "entropy_coef"),
        (dict(kl_estimator="k9"), "kl_estimator"),
    ):
        with pytest.raises(InvalidInputError) as e:
            PolicyLossConfig(**kw)
        assert e.value.field == name
    with pytest.raises(InvalidInputError, match="ref_logprobs"):
        policy_loss(lp, old, adv, mask, cu, PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(InvalidInputError, match="entropy"):
        policy_loss(lp, old, adv, mask, cu, PolicyLossConfig(entropy_coef=0.1))


def _naive_entropy(hidden, weight):
    logp = (hidden.double() @ weight.double().T).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lm_head_entropy_equals_a_full_softmax(dtype):
    g = torch.Generator().manual_seed(4)
    n, d, v = 23, 10, 37
    hidden = (2 * torch.randn(n, d, generator=g)).to(dtype)
    weight = torch.randn(v, d, generator=g).to(dtype)
    rows = torch.randint(0, n, (41,), generator=g)  # shared rows, rows without targets
    coef = torch.randn(41, generator=g, dtype=torch.float64)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = lm_head_entropy(h1, w1, rows, rows=7)  # 4 row chunks
    (got.double() * coef).sum().backward()
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want = _naive_entropy(h2, w2)[rows]
    (want * coef).sum().backward()
    torch.testing.assert_close(got.double(), want.detach(), **tol)
    torch.testing.assert_close(h1.grad.double(), h2.grad, **tol)
    torch.testing.assert_close(w1.grad.double(), w2.grad, **tol)


def test_step_statistics_equal_their_formulas_and_microbatch_shares_add_up():
    lp, old, ref, adv, ent, mask, cu = _inputs(5, n=9)
    cfg = PolicyLossConfig(kl_coef=0.1, clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-mean")
    s = step_statistics(lp, old, adv, mask, cu, cfg, ref_logprobs=ref, entropy=ent)
    on = mask
    lengths = [int(mask[int(a) : int(b)].sum()) for a, b in zip(cu[:-1], cu[1:])]
    assert s["objective/tokens"] == int(on.sum())
    assert s["objective/response_length_mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert s["objective/response_length_max"] == max(lengths)
    assert s["objective/advantage_mean"] == pytest.approx(float(adv[on].mean()), rel=1e-12)
    assert s["objective/advantage_std"] == pytest.approx(float(adv[on].std(unbiased=False)), rel=1e-12)
    r = (lp - old).exp()
    clipped = [float(-a * min(max(x, 0.8), 1.28)) > float(-a * x) for x, a in zip(r[on], adv[on])]
    assert s["objective/clipfrac"] == pytest.approx(sum(clipped) / len(clipped), rel=1e-12)
    assert 0 < s["objective/clipfrac"] < 1
    assert s["objective/kl"] == pytest.approx(float(_naive_kl(lp, ref, "k3")[on].mean()), rel=1e-12)
    assert s["objective/entropy"] == pytest.approx(float(ent[on].mean()), rel=1e-12)
    # the loss function's metrics over two microbatches (any split) sum to the same token means
    w = aggregation_weights(mask, cu, cfg.loss_agg_mode)
    fn, sums = make_policy_loss_fn(), {}
    for trajs in ([0, 3, 4, 8], [1, 2, 5, 6, 7]):
        idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in trajs])
        lens = torch.tensor([int(cu[i + 1] - cu[i]) for i in trajs])
        inputs = MicrobatchInputs(
            target_index=idx,
            advantages=adv[idx],
            old_logprobs=old[idx],
            ref_logprobs=ref[idx],
            loss_mask=mask[idx],
            weights=w[idx],
            cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
            trajectories=torch.tensor(trajs),
            config=cfg,
            semantic_tokens=0,
            entropy=ent[idx],
            mask_total=float(mask.sum()),
        )
        _, m = fn(lp[idx], inputs)
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    for k in ("clipfrac", "kl", "entropy", "approx_kl"):
        assert sums[k] == pytest.approx(s[f"objective/{k}"], rel=1e-12), k
    whole, _ = policy_loss(lp, old, adv, mask, cu, dataclasses.replace(cfg), ref)
    assert sums["pg_loss"] + 0.1 * sums["kl_loss"] == pytest.approx(float(whole), rel=1e-12)
