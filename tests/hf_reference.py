"""Helpers shared by the tests that compare our models with transformers' (test_kimi_linear.py,
test_qwen3_next.py): transformers' logits and next-token log-probs per trajectory, ours on the
trajectory layout, the relative error they are judged by."""

from __future__ import annotations

import numpy as np
import torch

import harts_planner as hp
from harts_runtime.layout import trajectory_layout


def hf_logits(model, tokens) -> torch.Tensor:
    """transformers' logits of one trajectory, float32 [L, V]."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def hf_target_logprobs(model, trajs) -> torch.Tensor:
    """transformers' next-token log-probs of every trajectory run alone, float64, concatenated in
    order (the targets of ``StepInputs``: positions 1..L-1 of each)."""
    out = []
    for t in trajs:
        lsm = torch.log_softmax(hf_logits(model, t).double(), -1)
        out.append(lsm[torch.arange(len(t) - 1), torch.tensor(t[1:])])
    return torch.cat(out)


def ours_logits(model, trajs, grad: bool = False) -> torch.Tensor:
    """Logits of every position of ``trajs`` packed back to back (our trajectory execution)."""
    batch = hp.RolloutBatch.from_token_lists(trajs)
    cfg = model.config
    layout = trajectory_layout(batch, np.arange(len(trajs)), cfg.chunk_size, cfg.conv_size)
    layout = layout.to(next(model.parameters()).device)
    with torch.set_grad_enabled(grad):
        hidden, _ = model.forward_hidden(layout)
        return model.logits(hidden)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def compact_and_trajectory_grads(model, vocab: int, seed: int = 7):
    """One prefix-sharing microbatch (a trunk, three continuations and a fork inside the trunk)
    through ``run_microbatch`` in both modes: ``{mode: (loss, {param name: grad})}``."""
    from harts_runtime import StepInputs, run_microbatch
    from harts_runtime.engine import microbatch_call_plan

    rng = np.random.default_rng(seed)
    trunk = rng.integers(0, vocab, size=21).tolist()
    trajs = [trunk + rng.integers(0, vocab, size=n).tolist() for n in (4, 17, 11)] + [trunk[:9] + [1, 2]]
    step = StepInputs.synthetic(hp.RolloutBatch.from_token_lists(trajs), 0)
    out = {}
    for mode in ("compact", "trajectory"):
        model.zero_grad(set_to_none=True)
        traj = np.arange(len(trajs))
        loss, _ = run_microbatch(model, step, traj, mode, call_plan=microbatch_call_plan(model, step, traj))
        out[mode] = (
            loss.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )
    return out


def unwrap(fn):
    """The function under a decorator (transformers wraps its fla-backed kernels)."""
    return getattr(fn, "__wrapped__", fn)


def use_torch_paths(monkeypatch, *, kda: bool = False, gdn: bool = False) -> None:
    """Make transformers run its own PyTorch references where it would pick fla's Triton kernels
    (they need a GPU, and fla 0.6's gated-delta-rule backward refuses Hopper with Triton < 3.7.1):
    Kimi-Linear's ``chunk_kimi_delta_attention`` (``kda``), Qwen3-Next / Qwen3.5's
    ``torch_chunk_gated_delta_rule`` and ``causal_conv1d_fn`` (``gdn``)."""
    if kda:
        import transformers.models.kimi_linear.modeling_kimi_linear as mk

        monkeypatch.setattr(mk, "chunk_kimi_delta_attention", unwrap(mk.chunk_kimi_delta_attention))
    if gdn:
        import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as m35
        import transformers.models.qwen3_next.modeling_qwen3_next as m3n

        for m in (m3n, m35):
            for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
                monkeypatch.setattr(m, name, unwrap(getattr(m, name)))
