"""A step's per-token fields are checked when it runs, not only when it is built: an advantage or
log-prob edited in place after construction (``step.advantages[3] = float("nan")``) is refused with a
one-line :class:`InvalidInputError` naming the field, through ``train_step`` and through
``HartsEngine.forward_backward``, before any gradient or parameter changes; a field changed in place
also refreshes what the step derived from it (its aggregation weights)."""

import pytest
import torch

from harts_runtime import HybridModel, InvalidInputError, StepInputs, model_config, train_step
from harts_runtime.engine import EngineConfig, HartsEngine
from harts_runtime.testing import random_batch

pytestmark = pytest.mark.usefixtures("one_thread")

CAP = 30

EDITS = [
    ("advantages", 3, float("nan"), "advantages["),
    ("advantages", 0, float("-inf"), "advantages["),
    ("old_logprobs", 5, float("inf"), "old_logprobs["),
    ("old_logprobs", 2, float("nan"), "old_logprobs["),
    ("old_logprobs", 1, 0.5, "old_logprobs["),  # a log-prob above 0
    ("ref_logprobs", 4, float("-inf"), "ref_logprobs["),
]


def _model(seed=0):
    torch.manual_seed(seed)
    return HybridModel(model_config("debug", dtype="float32"))


def _step(seed=1):
    cfg = model_config("debug")
    batch = random_batch(3, num=12, vocab=cfg.vocab_size, max_new=10)
    return StepInputs.synthetic(batch, seed=seed, vocab_size=cfg.vocab_size)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _assert_untouched(model, before):
    for p, q in zip(model.parameters(), before):
        assert p.grad is None or not p.grad.abs().sum()
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)


@pytest.mark.parametrize("name,index,value,prefix", EDITS)
def test_check_values_refuses_an_in_place_edit(name, index, value, prefix):
    step = _step()
    step.check_values()  # fine as built
    getattr(step, name)[index] = value
    with pytest.raises(InvalidInputError) as e:
        step.check_values()
    assert e.value.field.startswith(prefix) and "\n" not in str(e.value)


def test_check_values_refuses_a_bad_mask_and_a_replaced_field():
    step = _step()
    step.loss_mask = step.loss_mask.float()
    step.check_values()  # 0 / 1 floats are a mask
    step.loss_mask[2] = 0.5
    with pytest.raises(InvalidInputError, match="boolean or 0 / 1") as e:
        step.check_values()
    assert e.value.field == "loss_mask"
    step = _step()
    step.old_logprobs = torch.zeros(5)
    with pytest.raises(InvalidInputError, match="P = S - N") as e:
        step.check_values()
    assert e.value.field == "old_logprobs"
    step = _step()
    step.advantages = None
    with pytest.raises(InvalidInputError, match="required") as e:
        step.check_values()
    assert e.value.field == "advantages"


@pytest.mark.parametrize("name,index,value,prefix", EDITS[:3])
@pytest.mark.parametrize("ran_before", [False, True], ids=["fresh", "after-a-step"])
def test_train_step_refuses_an_in_place_edit(name, index, value, prefix, ran_before):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = _step()
    if ran_before:  # the step's derived values (weights, device copies) are cached by then
        train_step(model, opt, step, capacity=CAP)
    before = _params(model)
    opt.zero_grad(set_to_none=True)
    getattr(step, name)[index] = value
    with pytest.raises(InvalidInputError) as e:
        train_step(model, opt, step, capacity=CAP)
    assert e.value.field.startswith(prefix)
    _assert_untouched(model, before)


@pytest.mark.parametrize("name,index,value,prefix", EDITS[:3])
@pytest.mark.parametrize("ran_before", [False, True], ids=["fresh", "after-a-step"])
def test_engine_forward_backward_refuses_an_in_place_edit(name, index, value, prefix, ran_before):
    engine = HartsEngine(_model(), EngineConfig(capacity=CAP))
    step = _step()
    if ran_before:
        engine.forward_backward(step)
        engine.optimizer_step()
    before = _params(engine.model)
    getattr(step, name)[index] = value
    with pytest.raises(InvalidInputError) as e:
        engine.forward_backward(step)
    assert e.value.field.startswith(prefix)
    _assert_untouched(engine.model, before)


def test_an_in_place_change_refreshes_the_derived_weights():
    step = _step()
    old = step.weights.clone()
    step.loss_mask[: step.num_targets // 2] = False  # a valid edit: fewer targets count
    step.check_values()
    fresh = StepInputs(step.batch, step.advantages, step.loss_mask, step.old_logprobs, step.ref_logprobs)
    torch.testing.assert_close(step.weights, fresh.weights, rtol=0, atol=0)
    assert not torch.equal(step.weights, old)


def test_an_unchanged_step_is_checked_once(monkeypatch):
    """``check_tokens`` (the engine calls it once per step) re-runs the value check only when a field
    changed."""
    step = _step()
    calls = []
    real = StepInputs.check_values
    monkeypatch.setattr(StepInputs, "check_values", lambda self: calls.append(1) or real(self))
    for _ in range(3):
        step.check_tokens(model_config("debug").vocab_size)
    assert calls == []
    step.advantages[0] = 0.25
    step.check_tokens(model_config("debug").vocab_size)
    step.check_tokens(model_config("debug").vocab_size)
    assert calls == [1]
