"""The reference policy and the objective's knobs through the engine (float32, CPU): a
:class:`~harts_runtime.engine.ReferencePolicy` scores bit for bit as the engine at the step it was
taken, stays frozen after an optimizer step (the KL metric then > 0); with the KL term and the
entropy bonus on, compact execution equals trajectory-wise execution (loss, log-probs, gradients,
``objective/*`` metrics), and the bonus's gradient is the naive full-softmax entropy's."""

import numpy as np
import pytest
import torch

from harts_runtime import HybridModel, InvalidInputError, StepInputs, model_config
from harts_runtime.engine import EngineConfig, HartsEngine, ReferencePolicy
from harts_runtime.loss.objectives import PolicyLossConfig
from harts_runtime.rollouts import Rollouts
from harts_runtime.testing import random_batch

pytestmark = pytest.mark.usefixtures("one_thread")

CAP = 30
CFG = model_config("debug", dtype="float32", moe={"aux_loss_coef": 0.0, "z_loss_coef": 0.0})
KNOBS = PolicyLossConfig(
    kl_coef=0.2, kl_estimator="k3", entropy_coef=0.05, loss_agg_mode="seq-mean-token-mean"
)


def _model(seed=0):
    torch.manual_seed(seed)
    return HybridModel(CFG)


def _rollouts(seed=3):
    batch = random_batch(seed, num=10, vocab=CFG.vocab_size, max_new=10)
    tok, off = np.asarray(batch.tokens), np.asarray(batch.offsets)
    step = StepInputs.synthetic(batch, seed=seed, vocab_size=CFG.vocab_size)
    return Rollouts(
        tok.astype(np.int64), off.astype(np.int64), step.advantages, step.loss_mask, step.old_logprobs
    ).check(CFG.vocab_size)


def test_reference_scores_as_the_engine_then_stays_frozen():
    engine = HartsEngine(_model(), EngineConfig(capacity=CAP, lr=3e-2, loss_config=KNOBS))
    rollouts = _rollouts()
    ref = engine.reference_policy()
    assert isinstance(ref, ReferencePolicy) and ref.version == 0
    assert ref.num_bytes == sum(
        t.numel() * t.element_size() for t in (*_model().parameters(), *_model().buffers())
    )
    assert not any(p.requires_grad for p in ref.model.parameters())
    own = engine.logprobs(rollouts)
    ref.attach(rollouts)
    assert torch.equal(rollouts.ref_logprobs, own)  # the same step path, the same weights: bit-equal
    out = engine.forward_backward(rollouts)
    assert out.metrics["objective/kl"] == 0.0 and out.metrics["objective/entropy"] > 0
    assert all(p.grad is None for p in ref.model.parameters())
    engine.optimizer_step()
    assert torch.equal(ref.logprobs(rollouts), own)  # frozen
    moved = engine.logprobs(rollouts)
    assert (moved - own).abs().max() > 1e-3
    out = engine.forward_backward(rollouts)
    assert out.metrics["objective/kl"] > 0 and out.metrics["loss_fn/kl"] == pytest.approx(
        out.metrics["objective/kl"], rel=1e-4
    )


def test_kl_and_entropy_compact_equals_trajectory():
    rollouts = _rollouts(5)
    g = torch.Generator().manual_seed(0)
    lp = HartsEngine(_model(), EngineConfig(capacity=CAP)).logprobs(rollouts)
    rollouts.ref_logprobs = (lp - 0.3 * torch.rand(lp.shape, generator=g)).clamp(max=0.0)  # KL > 0
    rollouts.old_logprobs = lp + 0.2 * torch.randn(lp.shape, generator=g).clamp(-1, 1)  # some clipping
    rollouts.old_logprobs = rollouts.old_logprobs.clamp(max=0.0)
    outs, grads = {}, {}
    for mode in ("compact", "trajectory"):
        engine = HartsEngine(_model(), EngineConfig(capacity=CAP, mode=mode, loss_config=KNOBS))
        outs[mode] = engine.forward_backward(rollouts)
        grads[mode] = {n: p.grad for n, p in engine.model.named_parameters() if p.grad is not None}
    c, t = outs["compact"], outs["trajectory"]
    assert c.metrics["rows"] < t.metrics["rows"]  # the tree shared prefixes
    assert c.loss == pytest.approx(t.loss, rel=1e-5)
    torch.testing.assert_close(c.logprobs, t.logprobs, rtol=2e-5, atol=1e-6)
    for k in ("kl", "entropy", "clipfrac", "response_length_mean", "advantage_std"):
        assert c.metrics[f"objective/{k}"] == pytest.approx(t.metrics[f"objective/{k}"], rel=1e-5), k
    assert c.metrics["objective/kl"] > 0 and 0 < c.metrics["objective/clipfrac"] < 1
    assert c.metrics["loss_fn/entropy"] == pytest.approx(c.metrics["objective/entropy"], rel=1e-5)
    for n, gt in grads["trajectory"].items():
        torch.testing.assert_close(
            grads["compact"][n], gt, rtol=2e-4, atol=2e-6, msg=lambda m, n=n: f"d{n}: {m}"
        )


def test_entropy_bonus_gradient_is_the_naive_entropys():
    """The bonus alone (no policy term: zero advantages, token-mean): its LM-head gradient equals
    that of the naive mean full-softmax entropy of every masked target's row."""
    rollouts = _rollouts(7)
    rollouts.advantages = torch.zeros_like(rollouts.advantages)
    cfg = PolicyLossConfig(entropy_coef=1.0, loss_agg_mode="token-mean")
    engine = HartsEngine(_model(), EngineConfig(capacity=CAP, loss_config=cfg))
    out = engine.forward_backward(rollouts)
    got = engine.model.lm_head.weight.grad.clone()
    kept = {}
    engine.model.zero_grad(set_to_none=True)
    engine.forward_backward(
        rollouts, forward_only=True, keep_hidden=lambda st: kept.setdefault(len(kept), st)
    )
    w = engine.model.lm_head.weight.detach().double().requires_grad_()
    mask = rollouts.loss_mask
    total, terms = w.new_zeros(()), []
    for st in kept.values():
        logp = (st["hidden"].double()[st["row_index"]] @ w.T).log_softmax(-1)
        h = -(logp.exp() * logp).sum(-1)
        m = mask[st["target_index"]]
        total = total + h[m].sum()
        terms.append(h.detach()[m])
    loss = -total / mask.sum()
    (want,) = torch.autograd.grad(loss, w)
    assert out.metrics["objective/entropy"] == pytest.approx(float(torch.cat(terms).mean()), rel=1e-5)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def test_entropy_metric_alone_leaves_the_step_and_sharded_copies_are_refused():
    rollouts = _rollouts(8)
    outs = {}
    for name, cfg in (("plain", PolicyLossConfig()), ("metric", PolicyLossConfig(entropy_metric=True))):
        engine = HartsEngine(_model(), EngineConfig(capacity=CAP, loss_config=cfg))
        outs[name] = (engine.forward_backward(rollouts), engine.model.lm_head.weight.grad.clone())
    (plain, g0), (metric, g1) = outs["plain"], outs["metric"]
    assert plain.loss == metric.loss and torch.equal(g0, g1)  # no bonus: the same step, bit for bit
    assert "objective/entropy" not in plain.metrics and metric.metrics["objective/entropy"] > 0
    engine.mesh = object()  # as a sharded engine: the copy and the entropy are one-process only
    with pytest.raises(InvalidInputError) as e:
        engine.reference_policy()
    assert e.value.field == "reference"
    with pytest.raises(InvalidInputError) as e:
        engine.forward_backward(rollouts)
    assert e.value.field == "entropy_coef"


def test_a_rebuilt_initial_model_is_the_reference_of_a_resumed_run():
    rollouts = _rollouts(9)
    engine = HartsEngine(_model(), EngineConfig(capacity=CAP, lr=3e-2, loss_config=PolicyLossConfig()))
    first = engine.reference_policy().logprobs(rollouts)
    engine.forward_backward(rollouts)
    engine.optimizer_step()  # the engine now holds trained weights, as after a resume
    rebuilt = ReferencePolicy(engine, model=_model())  # the initial weights, rebuilt from the seed
    assert torch.equal(rebuilt.logprobs(rollouts), first)
    assert not torch.equal(engine.reference_policy().logprobs(rollouts), first)
    for bad in (engine.model, HybridModel(CFG.replace(vocab_size=CFG.vocab_size + 8))):
        with pytest.raises(InvalidInputError) as e:
            ReferencePolicy(engine, model=bad)
        assert e.value.field == "model"
