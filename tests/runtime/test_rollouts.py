"""Rollouts in RL frameworks' shapes (lists, padded [B, L] with masks, jagged) <-> HARTS's per-target
layout, and the one-line input checks (``harts_runtime.rollouts``, ``StepInputs``)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_runtime import InvalidInputError, StepInputs
from harts_runtime.rollouts import Rollouts
from harts_runtime.testing import random_batch


def _lists(lengths, seed=0):
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, 50, size=n).tolist() for n in lengths]
    adv = [rng.standard_normal(n - 1).tolist() for n in lengths]
    old = [(-rng.random(n - 1) - 0.1).tolist() for n in lengths]
    mask = [(rng.random(n - 1) < 0.7).tolist() for n in lengths]
    return tokens, adv, old, mask


def test_lists_per_target_per_token_and_scalar_agree():
    tokens, adv, old, mask = _lists([4, 7, 2])
    a = Rollouts.from_lists(tokens, advantages=adv, old_logprobs=old, loss_mask=mask, vocab_size=50)
    per_token = [[9.0] + x for x in adv]  # the first (position 0) value is dropped
    b = Rollouts.from_lists(tokens, advantages=per_token, old_logprobs=old, loss_mask=mask)
    torch.testing.assert_close(a.advantages, b.advantages)
    assert a.num_targets == 3 + 6 + 1 and list(a.target_offsets) == [0, 3, 9, 10]
    c = Rollouts.from_lists(tokens, advantages=[1.0, -2.0, 0.5])
    assert c.to_lists(c.advantages) == [[1.0] * 3, [-2.0] * 6, [0.5]]
    np.testing.assert_allclose(np.concatenate(a.to_lists(a.old_logprobs)), np.concatenate(old), rtol=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=6))
def test_padded_and_jagged_round_trip(rows):
    """Random row lengths with left and right padding: padded -> Rollouts -> padded gives the
    token-aligned values back (first position and padding filled); jagged likewise."""
    width = max(left + n + right for n, left, right in rows)
    b = len(rows)
    ids = torch.zeros(b, width, dtype=torch.long)
    am = torch.zeros(b, width, dtype=torch.long)
    vals = torch.zeros(b, width)
    g = torch.Generator().manual_seed(len(rows))
    for i, (n, left, _) in enumerate(rows):
        ids[i, left : left + n] = torch.randint(0, 30, (n,), generator=g)
        am[i, left : left + n] = 1
        vals[i, left + 1 : left + n] = -torch.rand(n - 1, generator=g) - 0.01
    r = Rollouts.from_padded(ids, am, old_logprobs=vals, advantages=vals, vocab_size=30)
    assert r.num_trajectories == b and r.num_targets == sum(n - 1 for n, _, _ in rows)
    torch.testing.assert_close(r.to_padded(r.old_logprobs, am), vals)
    jag_ids = torch.nested.nested_tensor([ids[i, am[i].bool()] for i in range(b)], layout=torch.jagged)
    jag_vals = r.to_jagged(r.old_logprobs)
    r2 = Rollouts.from_jagged(jag_ids, old_logprobs=jag_vals)
    torch.testing.assert_close(r2.old_logprobs, r.old_logprobs)
    np.testing.assert_array_equal(r2.tokens, r.tokens)
    r3 = Rollouts.from_jagged([t for t in jag_ids.unbind()], old_logprobs=list(jag_vals.unbind()))
    torch.testing.assert_close(r3.old_logprobs, r.old_logprobs)


def _error(fn) -> InvalidInputError:
    with pytest.raises(InvalidInputError) as e:
        fn()
    assert "\n" not in str(e.value) and e.value.field in str(e.value)
    return e.value


def test_bad_rollouts_name_the_field():
    tokens, adv, old, mask = _lists([4, 3])
    nan_adv = [list(adv[0]), [adv[1][0], float("nan")]]
    assert _error(lambda: Rollouts.from_lists(tokens, advantages=nan_adv)).field == "advantages[1][1]"
    inf_old = [old[0], [float("-inf"), -1.0]]
    assert _error(lambda: Rollouts.from_lists(tokens, old_logprobs=inf_old)).field == "old_logprobs[1][0]"
    pos_old = [[0.5, -1.0, -1.0], old[1]]
    assert _error(lambda: Rollouts.from_lists(tokens, old_logprobs=pos_old)).field == "old_logprobs[0][0]"
    bad_tok = [tokens[0], [1, 2, 50]]
    e = _error(lambda: Rollouts.from_lists(bad_tok, vocab_size=50))
    assert e.field == "tokens[1][2]" and "[0, 50)" in str(e)
    assert _error(lambda: Rollouts.from_lists(tokens, loss_mask=[[1, 0, 2], [1, 1]])).field == "loss_mask[2]"
    assert (
        _error(lambda: Rollouts.from_lists(tokens, advantages=[[1.0], [1.0, 2.0]])).field == "advantages[0]"
    )
    assert _error(lambda: Rollouts.from_lists([[1, 2], []])).field == "trajectories[1]"
    assert _error(lambda: Rollouts.from_lists(tokens, group_ids=[0, 1, 2])).field == "group_ids"
    ids = torch.tensor([[1, 2, 3, 4]])
    assert (
        _error(lambda: Rollouts.from_padded(ids, torch.tensor([[1, 0, 1, 1]]))).field == "attention_mask[0]"
    )
    assert _error(lambda: Rollouts.from_padded(ids, torch.ones(1, 3))).field == "attention_mask"
    assert _error(lambda: Rollouts.from_jagged(ids)).field == "input_ids"


def test_step_inputs_refuse_poisoned_fields():
    batch = random_batch(3, num=6, vocab=40, max_new=6)
    good = StepInputs.synthetic(batch, seed=1, vocab_size=40)
    adv = good.advantages.clone()
    adv[5] = float("nan")
    e = _error(lambda: StepInputs(batch, adv, good.loss_mask, good.old_logprobs))
    assert e.field.startswith("advantages[")
    old = good.old_logprobs.clone()
    old[0] = float("-inf")
    assert (
        _error(lambda: StepInputs(batch, good.advantages, good.loss_mask, old)).field == "old_logprobs[0][0]"
    )
    mask = good.loss_mask.float()
    mask[1] = 0.5
    assert _error(lambda: StepInputs(batch, good.advantages, mask, good.old_logprobs)).field == "loss_mask"
    e = _error(lambda: good.check_tokens(10))
    assert e.field.startswith("tokens[") and "[0, 10)" in str(e)
