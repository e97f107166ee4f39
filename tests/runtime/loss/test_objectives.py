"""GRPO / PPO objectives on mapped log-probs against trajectory-wise training (CPU).

The objectives see (log-probs, metadata) only. Compact: logits once per compact row, mapped
log-probs; expanded: logits for every semantic position, ordinary log_softmax. Metadata differs
between positions that share a compact row (labels, advantages, masks, old and reference
log-probs), so only per-position restoration passes. The last test runs a whole tiny hybrid block
(GQA attention + MoE + LM head + GRPO + router losses) both ways and compares every gradient.
"""

import numpy as np
import pytest
import torch

from harts_runtime.layers.attention import AttentionConfig, CompactAttention
from harts_runtime.layers.moe import CompactMoE, MoEConfig
from harts_runtime.layout import RowLayout
from harts_runtime.loss.logprobs import mapped_logprobs, targets_from_batch
from harts_runtime.loss.objectives import (
    AGG_MODES,
    PolicyLossConfig,
    aggregate,
    aggregation_weights,
    gae,
    grpo_advantages,
    grpo_loss,
    kl_penalty,
    per_token,
    policy_loss,
    ppo_loss,
)
from harts_runtime.testing import random_batch, views_from_batch


# ------------------------------------------------------------------ trajectory-wise references
def padded(values: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Flat [T] -> [N, L] zero-padded (the layout of an ordinary trainer)."""
    lengths = cu.diff().tolist()
    out = values.new_zeros(len(lengths), max(lengths))
    for i, (a, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
        out[i, :n] = values[a : a + n]
    return out


def verl_agg(loss_mat, mask, mode, norm=None):
    """verl's ``agg_loss`` on [N, L]."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return (loss_mat * mask).sum(-1).mean()
    if mode == "seq-mean-token-mean":
        seq_mask = (mask.sum(-1) > 0).to(loss_mat.dtype)
        seq = (loss_mat * mask).sum(-1) / (mask.sum(-1) + 1e-30)
        return (seq * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-sum-norm":
        return (loss_mat * mask).sum() / (loss_mat.shape[-1] if norm is None else norm)
    if mode == "sum":
        return (loss_mat * mask).sum()
    raise AssertionError(mode)


def reference_policy_loss(lp, old, adv, mask, cu, cfg, ref=None):
    """Per-token PPO/GRPO formulas on the padded layout, written out independently."""
    lp, old, adv, m = (padded(x, cu) for x in (lp, old, adv, mask.to(lp.dtype)))
    high = cfg.clip_ratio_low if cfg.clip_ratio_high is None else cfg.clip_ratio_high
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - cfg.clip_ratio_low, 1 + high))
    if cfg.clip_ratio_c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.clip_ratio_c), pg)
    loss = verl_agg(pg, m, cfg.loss_agg_mode, cfg.loss_norm)
    if cfg.kl_coef:
        r = padded(ref, cu) - lp
        loss = loss + cfg.kl_coef * verl_agg(
            (torch.exp(r) - r - 1).clamp(-10, 10), m, cfg.loss_agg_mode, cfg.loss_norm
        )
    return loss


# ----------------------------------------------------------------------------- metadata
def metadata(batch, targets, seed):
    """Per-token RL metadata as a trainer has it: group-relative advantages broadcast to tokens, a
    prompt mask plus random tool-output holes, old and reference log-probs."""
    gen = torch.Generator().manual_seed(seed)
    n, p = batch.num_trajectories, targets.row_index.numel()
    cu = targets.cu_seqlens
    rewards = torch.randn(n, generator=gen, dtype=torch.float64)
    groups = torch.from_numpy(batch.component.astype(np.int64))
    adv = per_token(grpo_advantages(rewards, groups), cu)
    adv = adv + 0.1 * torch.randn(p, generator=gen, dtype=torch.float64)  # token-level shaping
    col = torch.arange(p) - cu[:-1].repeat_interleave(cu.diff())
    mask = (col >= 1) & (torch.rand(p, generator=gen) > 0.2)
    mask[cu[1:] - 1] = True  # every trajectory keeps an action
    return {
        "old": 0.3 * torch.randn(p, generator=gen, dtype=torch.float64),
        "ref": 0.3 * torch.randn(p, generator=gen, dtype=torch.float64),
        "adv": adv,
        "mask": mask,
        "cu": cu,
    }


# ---------------------------------------------------------------------- objective formulas
@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_matches_padded_reductions(mode):
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 3, 4, 9, 9 + 6])
    loss = torch.randn(15, generator=gen, dtype=torch.float64)
    mask = torch.rand(15, generator=gen) > 0.3
    mask[3] = False  # a trajectory with no action token
    got = aggregate(loss, mask, cu, mode)
    want = verl_agg(padded(loss, cu), padded(mask.double(), cu), mode)
    torch.testing.assert_close(got, want)
    # the mode is written once, as weights: aggregate == sum(w * loss), the train step's form
    w = aggregation_weights(mask, cu, mode)
    assert w.dtype == torch.float64 and w.shape == loss.shape and not w[~mask].any()
    torch.testing.assert_close((w * loss).sum(), want)


@pytest.mark.parametrize(
    "cfg",
    [
        PolicyLossConfig(),
        PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-mean"),
        PolicyLossConfig(clip_ratio_c=3.0, kl_coef=0.05, loss_agg_mode="seq-mean-token-sum"),
        PolicyLossConfig(kl_coef=0.01, loss_agg_mode="seq-mean-token-sum-norm", loss_norm=7.0),
    ],
    ids=["ppo", "dapo", "dual_clip_kl", "dr_grpo"],
)
def test_policy_loss_matches_reference_formulas(cfg):
    gen = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 5, 7, 15])
    lp = (0.5 * torch.randn(15, generator=gen, dtype=torch.float64)).requires_grad_()
    old, ref, adv = (torch.randn(15, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(15, generator=gen) > 0.25
    loss, metrics = policy_loss(lp, old, adv, mask, cu, cfg, ref)
    (g,) = torch.autograd.grad(loss, lp)
    want = reference_policy_loss(lp, old, adv, mask, cu, cfg, ref)
    (g_want,) = torch.autograd.grad(want, lp)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(g, g_want)
    assert 0 <= float(metrics["clipfrac"]) <= 1


def test_grpo_advantages_and_kl_estimators():
    r = torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0, 3.0])
    g = torch.tensor([7, 7, 7, 2, 2, 9])
    adv = grpo_advantages(r, g, eps=0.0)
    for grp in (7, 2):
        sel = g == grp
        torch.testing.assert_close(adv[sel], (r[sel] - r[sel].mean()) / r[sel].std())
    assert adv[5] == 0
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), lp - ref)
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), 0.5 * (lp - ref) ** 2)
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.exp(ref - lp) - (ref - lp) - 1)


def test_gae_matches_a_plain_loop():
    gen = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 4, 10])
    rewards, values = torch.randn(10, generator=gen), torch.randn(10, generator=gen)
    mask = torch.ones(10, dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, cu, gamma=0.9, lam=0.8)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        last, nxt = 0.0, 0.0
        for t in reversed(range(a, b)):
            last = rewards[t] + 0.9 * nxt - values[t] + 0.9 * 0.8 * last
            nxt = values[t]
            torch.testing.assert_close(adv[t], torch.as_tensor(last, dtype=adv.dtype))
    torch.testing.assert_close(ret, adv + values)


# ------------------------------------------------------- compact vs trajectory-wise, end to end
def head_setup(seed, vocab=48, d=12):
    batch = random_batch(50 + seed, num=14, vocab=4)
    t = targets_from_batch(batch)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch.compact_tokens, d, generator=gen, dtype=torch.float64, requires_grad=True)
    head = torch.randn(vocab, d, generator=gen, dtype=torch.float64, requires_grad=True)
    return batch, t, hidden, head


def both_ways(batch, t, hidden, head, loss_fn):
    """loss_fn(logprobs) on compact (mapped) and expanded log-probs; returns (loss, grads) for each."""
    results = []
    for compact in (True, False):
        hidden.grad = head.grad = None
        if compact:
            lp = mapped_logprobs(hidden @ head.t(), t, chunk=13)  # [C, V] logits only
        else:
            lp = (hidden[t.row_index] @ head.t()).log_softmax(-1).gather(1, t.labels[:, None])[:, 0]
        loss = loss_fn(lp)
        loss.backward()
        results.append((loss.detach(), hidden.grad.clone(), head.grad.clone()))
    return results


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_on_mapped_logprobs_equals_trajectory_wise(mode, seed):
    batch, t, hidden, head = head_setup(seed)
    meta = metadata(batch, t, seed)
    cfg = PolicyLossConfig(kl_coef=0.02, loss_agg_mode=mode)
    (lc, hc, wc), (le, he, we) = both_ways(
        batch,
        t,
        hidden,
        head,
        lambda lp: grpo_loss(lp, meta["old"], meta["adv"], meta["mask"], meta["cu"], meta["ref"], cfg)[0],
    )
    torch.testing.assert_close(lc, le, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hc, he, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(wc, we, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_with_value_loss_equals_trajectory_wise(seed):
    batch, t, hidden, head = head_setup(seed)
    meta = metadata(batch, t, seed + 10)
    value_head = torch.randn(hidden.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    returns = torch.randn(t.row_index.numel(), generator=gen, dtype=torch.float64)
    old_values = torch.randn(t.row_index.numel(), generator=gen, dtype=torch.float64)
    cfg = PolicyLossConfig(clip_ratio_c=3.0, loss_agg_mode="token-mean")

    def loss_fn(lp):
        values = (hidden @ value_head)[t.row_index]  # one value per compact row, gathered
        return ppo_loss(
            lp,
            meta["old"],
            meta["adv"],
            meta["mask"],
            meta["cu"],
            cfg,
            values=values,
            old_values=old_values,
            returns=returns,
        )[0]

    (lc, hc, wc), (le, he, we) = both_ways(batch, t, hidden, head, loss_fn)
    torch.testing.assert_close(lc, le, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hc, he, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(wc, we, rtol=1e-10, atol=1e-12)


def test_metadata_really_differs_on_shared_rows():
    """The fixture exercises the hard case: one compact row, several positions with different labels,
    advantages and masks."""
    batch, t, _, _ = head_setup(0)
    meta = metadata(batch, t, 0)
    rows = t.row_index.numpy()
    shared = [r for r in np.unique(rows) if (rows == r).sum() > 1]
    sel = [np.nonzero(rows == r)[0] for r in shared]
    assert any(len(set(t.labels.numpy()[s])) > 1 for s in sel)
    assert any(len(set(meta["adv"].numpy()[s])) > 1 for s in sel)
    assert any(len(set(meta["mask"].numpy()[s])) > 1 for s in sel)


class TinyBlock(torch.nn.Module):
    """Embedding -> GQA attention (residual) -> MoE (residual) -> LM head."""

    def __init__(self, vocab=16, d=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.attn = CompactAttention(AttentionConfig(hidden_size=d, num_heads=4, num_kv_heads=2))
        self.moe = CompactMoE(
            MoEConfig(
                hidden_size=d,
                num_experts=4,
                top_k=2,
                intermediate_size=8,
                aux_loss_coef=0.1,
                z_loss_coef=0.01,
            )
        )
        self.head = torch.nn.Linear(d, vocab, bias=False)


def test_tiny_hybrid_block_grpo_all_gradients_equal_trajectory_wise():
    torch.manual_seed(0)
    model = TinyBlock().double()
    batch = random_batch(77, num=10, vocab=5)
    t = targets_from_batch(batch)
    meta = metadata(batch, t, 5)
    sem = torch.from_numpy(batch.compact_map.astype(np.int64))
    tokens = torch.from_numpy(batch.tokens.astype(np.int64))
    row_token = torch.zeros(batch.compact_tokens, dtype=torch.int64).index_copy(0, sem, tokens)
    cfg = PolicyLossConfig(kl_coef=0.01, loss_agg_mode="seq-mean-token-mean")

    def objective(lp, moe_out):
        return (
            grpo_loss(lp, meta["old"], meta["adv"], meta["mask"], meta["cu"], meta["ref"], cfg)[0]
            + moe_out.router_loss
        )

    # HARTS: everything once per compact row.
    layout = RowLayout(
        batch.compact_tokens,
        positions=torch.from_numpy(batch.row_depth.astype(np.int64)),
        multiplicity=torch.from_numpy(batch.multiplicity.astype(np.int64)),
        views=views_from_batch(batch),
    )
    x = model.embed(row_token)
    x = x + model.attn(x, layout)
    moe_out = model.moe(x, layout)
    x = x + moe_out.hidden
    loss_c = objective(mapped_logprobs(model.head(x), t), moe_out)
    loss_c.backward()
    grads_c = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # Trajectory-wise: every trajectory expanded.
    off = batch.offsets.tolist()
    xs = [model.embed(tokens[off[i] : off[i + 1]]) for i in range(batch.num_trajectories)]
    xs = [x + model.attn.forward_trajectory(x) for x in xs]
    x = torch.cat(xs)
    moe_out = model.moe(x)
    x = x + moe_out.hidden
    keep = t.positions
    lp = model.head(x[keep]).log_softmax(-1).gather(1, t.labels[:, None])[:, 0]
    loss_e = objective(lp, moe_out)
    loss_e.backward()

    torch.testing.assert_close(loss_c, loss_e, rtol=1e-10, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads_c[name], p.grad, rtol=1e-8, atol=1e-10, msg=f"d{name}")
