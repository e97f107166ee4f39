"""Only the engine plans and checks, once per step: ``make_microbatch`` / ``run_microbatch`` neither
call the planner (a compact microbatch without its call plan is refused naming ``call_plan``) nor
re-check the step per microbatch (no host sync per microbatch); a bad token id, or a value written
through ``.numpy()`` (no version counter sees it) before a step, is still refused by the engine's step
check with the same one-line error, before any gradient changes."""

import numpy as np
import pytest
import torch

from harts_runtime import HybridModel, InvalidInputError, StepInputs, model_config
from harts_runtime.engine import EngineConfig, HartsEngine, microbatch_call_plan
from harts_runtime.microbatch import make_microbatch, run_microbatch
from harts_runtime.rollouts import Rollouts
from harts_runtime.testing import random_batch

pytestmark = pytest.mark.usefixtures("one_thread")

CAP = 30
TOKENS = [[1, 2, 3, 4], [1, 2, 5]]


def _model(seed=0):
    torch.manual_seed(seed)
    return HybridModel(model_config("debug", dtype="float32"))


def _step(seed=1, vocab=None):
    cfg = model_config("debug")
    batch = random_batch(3, num=12, vocab=vocab or cfg.vocab_size, max_new=10)
    return StepInputs.synthetic(batch, seed=seed, vocab_size=cfg.vocab_size)


def _grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_the_microbatch_never_plans(monkeypatch):
    import harts_planner

    model, step = _model(), _step()
    with pytest.raises(InvalidInputError, match="microbatch_call_plan") as e:
        make_microbatch(model, step, [0, 1], "compact")
    assert e.value.field == "call_plan"
    with pytest.raises(InvalidInputError) as e:
        run_microbatch(model, step, [0, 1], "compact")
    assert e.value.field == "call_plan"
    plan = microbatch_call_plan(model, step, [0, 1])
    monkeypatch.setattr(harts_planner, "plan_calls", lambda *a, **k: pytest.fail("planned again"))
    mb = make_microbatch(model, step, [0, 1], "compact", plan)
    assert mb.stats["num_calls"] == int(plan.num_calls)
    assert make_microbatch(model, step, [], "compact").num_rows == 0  # the empty one needs no plan
    assert microbatch_call_plan(model, step, []) is None


def test_the_call_plan_is_the_engines():
    """``microbatch_call_plan`` is what the engine plans for the same microbatch."""
    model, step = _model(), _step()
    engine = HartsEngine(model, EngineConfig(capacity=CAP))
    _, calls, _ = engine.plan(step)
    assert len(calls) >= 2
    plan_step = engine.plan(step)[0]
    for traj in plan_step.microbatches:
        mine = microbatch_call_plan(model, step, traj)
        theirs = calls[int(traj[0])]
        assert int(mine.num_calls) == int(theirs.num_calls)
        assert np.array_equal(np.asarray(mine.position_ids), np.asarray(theirs.position_ids))


@pytest.mark.parametrize("how", ["step_inputs", "rollouts"])
def test_a_step_is_checked_once_not_per_microbatch(monkeypatch, how):
    """One value check and at most one token scan per step, however many microbatches: a Rollouts
    by :meth:`Rollouts.check` alone (its step is built without checking the same values, routes or
    tokens again); a StepInputs by :meth:`StepInputs.check_values` as it comes in (its tokens scanned
    against the vocabulary at its first step, then remembered)."""
    import harts_runtime.ops.router as router
    import harts_runtime.rollouts as rollouts_module
    import harts_runtime.step_inputs as step_inputs_module

    model, step = _model(), _step()
    if how == "rollouts":
        tokens, off = step.batch.tokens, step.batch.offsets
        trajs = [list(tokens[off[i] : off[i + 1]]) for i in range(step.batch.num_trajectories)]
        n = len(trajs)
        routes = [np.full((len(t), 0, 1), -1) for t in trajs]  # checked too: once
        step = Rollouts.from_lists(trajs, advantages=[1.0] * n, ref_logprobs=[-1.0] * n, routes=routes)
    engine = HartsEngine(model, EngineConfig(capacity=CAP))
    counts = {"values": 0, "tokens": 0, "routes": 0}

    def count(owner, name, key):
        real = getattr(owner, name)

        def counted(*a, **k):
            counts[key] += 1
            return real(*a, **k)

        monkeypatch.setattr(owner, name, counted)

    count(StepInputs, "check_values", "values")
    count(Rollouts, "check", "values")
    count(rollouts_module, "check_token_range", "tokens")
    count(step_inputs_module, "check_token_range", "tokens")
    count(router, "check_routes", "routes")
    out = engine.forward_backward(step)
    assert out.metrics["microbatches"] >= 2  # several microbatches, one check each
    once = int(how == "rollouts")
    assert counts == {"values": 1, "tokens": 1, "routes": once}
    engine.forward_backward(step)  # and again the next step (a StepInputs' tokens are remembered)
    assert counts == {"values": 2, "tokens": 1 + once, "routes": 2 * once}


@pytest.mark.parametrize("how", ["step_inputs", "rollouts"])
def test_a_bad_token_is_refused_by_the_engine_with_the_same_error(how):
    model = _model()
    vocab = model.config.vocab_size
    engine = HartsEngine(model, EngineConfig(capacity=CAP))
    tokens = [list(t) for t in TOKENS]
    tokens[1][2] = vocab  # one past the vocabulary
    r = Rollouts.from_lists(tokens, advantages=[1.0, -1.0], ref_logprobs=[-1.0, -1.0])
    if how == "step_inputs":
        step = r.step_inputs()
        with pytest.raises(InvalidInputError) as direct:
            step.check_tokens(vocab)
    else:
        step = r
        with pytest.raises(InvalidInputError) as direct:
            r.check(vocab)
    with pytest.raises(InvalidInputError) as e:
        engine.forward_backward(step)
    assert (e.value.field, str(e.value)) == (direct.value.field, str(direct.value))
    assert e.value.field == "tokens[1][2]" and str(vocab) in str(e.value)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "name, value, field, words",
    [
        ("advantages", float("nan"), "advantages[0][2]", ("finite", "nan")),
        ("old_logprobs", float("inf"), "old_logprobs[1][0]", ("<= 0", "inf")),
        ("old_logprobs", 0.5, "old_logprobs[1][1]", ("<= 0", "0.5")),
        ("ref_logprobs", float("-inf"), "ref_logprobs[0][1]", ("finite", "-inf")),
    ],
)
def test_values_written_through_numpy_are_refused_at_the_next_step(name, value, field, words):
    """A write through ``.numpy()`` bumps no version counter; the engine's step check reads every
    value each step and refuses it before the loss and backward (gradients untouched)."""
    model = _model()
    engine = HartsEngine(model, EngineConfig(capacity=CAP))
    step = Rollouts.from_lists(TOKENS, advantages=[1.0, -1.0], ref_logprobs=[-1.0, -1.0]).step_inputs()
    engine.forward_backward(step)  # checked and run once: fine
    grads = _grads(model)
    i, j = (int(x) for x in field[len(name) :].strip("[]").split("]["))
    k = int(step.cu_seqlens[i]) + j
    getattr(step, name).numpy()[k] = value  # bypasses the version counter
    with pytest.raises(InvalidInputError) as e:
        engine.forward_backward(step)
    text = str(e.value)
    assert e.value.field == field and "\n" not in text and all(w in text for w in words), text
    for a, b in zip(grads, _grads(model)):
        assert (a is None and b is None) or torch.equal(a, b)
    getattr(step, name).numpy()[k] = -0.5  # repaired: runs again
    assert np.isfinite(engine.forward_backward(step, forward_only=True).loss)
