"""``HartsEngine`` in one process (float32, CPU): the step equals ``train_step``; any loss function
plugs in (compact equals trajectory-wise); clipping, the LR schedule and the non-finite guard; save
and resume continue bit for bit; ``export_weights`` round-trips through transformers' model."""

import dataclasses

import numpy as np
import pytest
import torch

from harts_runtime import HybridModel, InvalidInputError, StepInputs, model_config, step_logprobs, train_step
from harts_runtime.engine import EngineConfig, HartsEngine
from harts_runtime.rollouts import Rollouts
from harts_runtime.testing import random_batch

pytestmark = pytest.mark.usefixtures("one_thread")

CAP = 30
TOL = dict(rtol=2e-5, atol=1e-6)  # float32: compact vs trajectory-wise execution of the same step


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    return HybridModel(
        model_config("debug", dtype="float32", moe={"use_expert_bias": True}).replace(**overrides)
    )


def _step(seed=1):
    cfg = model_config("debug")
    batch = random_batch(3, num=12, vocab=cfg.vocab_size, max_new=10)
    return StepInputs.synthetic(batch, seed=seed, vocab_size=cfg.vocab_size)


def test_forward_backward_is_the_train_step():
    step = _step()
    engine = HartsEngine(_model(), EngineConfig(capacity=CAP, compact_always=True))  # as train_step
    ref = _model()
    out = engine.forward_backward(step)
    r = train_step(ref, None, step, capacity=CAP)
    assert out.loss == pytest.approx(r.loss, rel=1e-6)
    assert out.metrics["rows"] == r.rows and out.metrics["microbatches"] == r.num_microbatches >= 2
    m, kl_coef = out.metrics, step.config.kl_coef  # the loss function's metrics are step sums of shares
    assert m["loss_fn/pg_loss"] + kl_coef * m["loss_fn/kl_loss"] == pytest.approx(m["policy_loss"], rel=1e-5)
    assert m["loss_fn/kl"] == pytest.approx(m["objective/kl"], rel=1e-5)  # token means, two ways
    assert m["loss_fn/clipfrac"] == pytest.approx(m["objective/clipfrac"], abs=1e-6)
    assert 0.0 <= m["loss_fn/clipfrac"] <= 1.0
    for (n, p), q in zip(engine.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0, msg=lambda m, n=n: f"d{n}: {m}")
    torch.testing.assert_close(engine.logprobs(step), step_logprobs(ref, step, capacity=CAP).cpu())


def _nll(logprobs, inputs):
    """A plug-in objective: token-mean negative log-likelihood under the step's weights."""
    loss = -(inputs.weights * logprobs).sum()
    return loss, {"nll": loss.detach()}


def test_any_loss_function_compact_equals_trajectory():
    step = _step()
    outs, grads = {}, {}
    for mode in ("compact", "trajectory"):  # without the router losses, which depend on the packing
        engine = HartsEngine(
            _model(moe={"aux_loss_coef": 0.0, "z_loss_coef": 0.0}), EngineConfig(capacity=CAP, mode=mode)
        )
        outs[mode] = engine.forward_backward(step, _nll)
        grads[mode] = {n: p.grad for n, p in engine.model.named_parameters() if p.grad is not None}
    assert outs["compact"].loss == pytest.approx(outs["trajectory"].loss, rel=1e-5)
    assert "loss_fn/nll" in outs["compact"].metrics
    torch.testing.assert_close(outs["compact"].logprobs, outs["trajectory"].logprobs, **TOL)
    for n, g in grads["trajectory"].items():
        torch.testing.assert_close(
            grads["compact"][n], g, rtol=2e-4, atol=2e-6, msg=lambda m, n=n: f"d{n}: {m}"
        )


def test_clipping_schedule_and_non_finite_guard():
    step = _step()
    cfg = EngineConfig(lr=1e-2, capacity=CAP, max_grad_norm=1e-3, warmup_steps=2)
    engine = HartsEngine(_model(), cfg)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.forward_backward(step)
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    report = engine.optimizer_step()
    assert report.grad_norm == pytest.approx(norm, rel=1e-5) and not report.skipped
    assert report.lr == pytest.approx(1e-2 / 3)  # warm-up: (step + 1) / (warmup + 1)
    assert all(not m.local_tokens_per_expert.any() for m in engine.model.moe_layers())  # per-step counts
    # the same AdamW step on the clipped gradients, by hand
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2 / 3, eps=cfg.eps, weight_decay=0.0)
    coef = 1e-3 / (norm + 1e-6)
    for n, p in ref.named_parameters():
        p.grad = grads[n] * coef if n in grads else None
    opt.step()
    for n, p in engine.model.named_parameters():
        torch.testing.assert_close(p.detach(), dict(ref.named_parameters())[n].detach(), rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in engine.model.named_parameters())
    # a non-finite gradient: the step is skipped, the weights stay, the gradients are dropped
    engine.forward_backward(step)
    next(p for p in engine.model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
    now = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    report = engine.optimizer_step()
    assert report.skipped and "non-finite" in report.reason and report.step == 1
    assert all(p.grad is None for p in engine.model.parameters())
    for n, p in engine.model.named_parameters():
        assert torch.equal(p.detach(), now[n]), n


def test_lr_schedules():
    c = EngineConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", total_steps=12, min_lr_ratio=0.1)
    f = [c.lr_factor(s) for s in range(14)]
    assert f[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert (
        f[7] == pytest.approx(0.1 + 0.9 * 0.5) and f[12] == pytest.approx(0.1) and f[13] == pytest.approx(0.1)
    )
    lin = EngineConfig(lr=1.0, lr_schedule="linear", total_steps=4)
    assert [lin.lr_factor(s) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    for kw, field in [
        (dict(lr=0), "lr"),
        (dict(lr_schedule="cosine"), "total_steps"),
        (dict(lr_schedule="step"), "lr_schedule"),
        (dict(max_grad_norm=-1.0), "max_grad_norm"),
        (dict(mode="tree"), "mode"),
        (dict(microbatch_cost=-1), "microbatch_cost"),
        (dict(capacity=8, microbatch_cost=9), "microbatch_cost"),
    ]:
        with pytest.raises(InvalidInputError) as e:
            EngineConfig(**kw)
        assert e.value.field == field


def _train(engine, step, n):
    out = []
    for _ in range(n):
        out.append(engine.forward_backward(step).loss)
        engine.optimizer_step()
    return out


def test_save_and_resume_continue_bit_for_bit(tmp_path):
    step = _step()
    cfg = EngineConfig(lr=1e-3, capacity=CAP, warmup_steps=1, lr_schedule="linear", total_steps=6)
    straight = HartsEngine(_model(), cfg)
    losses = _train(straight, step, 3)
    first = HartsEngine(_model(), cfg)
    assert _train(first, step, 1) == losses[:1]
    first.save(tmp_path / "ckpt")
    resumed = HartsEngine(_model(seed=7), cfg)  # other weights: all of them must come from the checkpoint
    extra = resumed.load(tmp_path / "ckpt")
    assert extra["engine_step"] == 1 and resumed.step == 1
    assert resumed.optimizer.param_groups[0]["lr"] == straight.config.lr * cfg.lr_factor(1)
    assert _train(resumed, step, 2) == losses[1:]
    for (n, p), q in zip(resumed.model.named_parameters(), straight.model.parameters()):
        assert torch.equal(p.detach(), q.detach()), n
    for (n, b), c in zip(resumed.model.named_buffers(), straight.model.buffers()):
        assert torch.equal(b, c), n
    with pytest.raises(InvalidInputError) as e:
        resumed.load(tmp_path / "missing")
    assert e.value.field == "path"


def test_rollouts_in_and_log_probs_out():
    step = _step()
    b = step.batch
    off = np.asarray(b.offsets)
    toks = np.asarray(b.tokens)
    lists = [toks[off[i] : off[i + 1]].tolist() for i in range(b.num_trajectories)]
    cu = step.cu_seqlens.numpy()
    cut = lambda t: [t[cu[i] : cu[i + 1]].tolist() for i in range(b.num_trajectories)]  # noqa: E731
    r = Rollouts.from_lists(
        lists,
        advantages=cut(step.advantages),
        loss_mask=cut(step.loss_mask),
        old_logprobs=cut(step.old_logprobs),
        ref_logprobs=cut(step.ref_logprobs),
    )
    engine = HartsEngine(_model(), EngineConfig(capacity=CAP))
    via_rollouts = engine.forward_backward(r).logprobs
    torch.testing.assert_close(via_rollouts, engine.logprobs(step))
    assert len(r.to_lists(via_rollouts)[0]) == len(lists[0]) - 1
    bad = Rollouts.from_lists([[1, 2, 3]], advantages=[[0.0, 0.0]])
    bad.tokens[2] = 10_000
    with pytest.raises(InvalidInputError) as e:
        engine.forward_backward(bad)
    assert e.value.field == "tokens[0][2]"


def test_export_weights_round_trips_through_transformers(tmp_path, monkeypatch):
    """Train one step, stream ``export_weights`` into a fresh transformers model (strict load), and
    its logits are ours (a tiny Qwen3.5-MoE checkpoint; float32)."""
    transformers = pytest.importorskip("transformers")
    from hf_configs import qwen_config
    from hf_reference import hf_logits, ours_logits, rel_err, use_torch_paths

    use_torch_paths(monkeypatch, gdn=True)
    hf_cfg = qwen_config("qwen3_5_moe_text", ["linear_attention", "full_attention"])
    torch.manual_seed(0)
    transformers.Qwen3_5MoeForCausalLM(hf_cfg).float().save_pretrained(tmp_path / "hf")
    engine = HartsEngine.build(tmp_path / "hf", EngineConfig(lr=1e-2, capacity=64), dtype="float32")
    batch = random_batch(5, num=6, vocab=engine.vocab_size, max_new=8)
    engine.forward_backward(StepInputs.synthetic(batch, seed=2, vocab_size=engine.vocab_size))
    engine.optimizer_step()  # trained weights, not the checkpoint's
    from safetensors.torch import save_file

    out = tmp_path / "exported"  # the stream, as a rollout engine would receive it, read by transformers
    out.mkdir()
    save_file({k: v.contiguous() for k, v in engine.export_weights()}, str(out / "model.safetensors"))
    (out / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    hf, info = transformers.Qwen3_5MoeForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    hf = hf.float().eval()
    trajs = [[3, 9, 27, 4, 1, 8], [5, 5, 2, 60, 7]]
    engine.model.eval()
    for t in trajs:
        ours = ours_logits(engine.model, [t])
        assert rel_err(ours, hf_logits(hf, t)) < 1e-4


def test_built_in_objectives_are_loss_functions():
    """GRPO and PPO are two loss functions of the contract: passing them explicitly gives the
    step's built-in objective of that name."""
    from harts_runtime.loss import grpo_loss_fn, ppo_loss_fn

    for objective, fn in (("grpo", grpo_loss_fn), ("ppo", ppo_loss_fn)):
        step = dataclasses.replace(_step(), objective=objective, _cache={})
        a = HartsEngine(_model(), EngineConfig(capacity=CAP)).forward_backward(step, fn)
        b = HartsEngine(_model(), EngineConfig(capacity=CAP)).forward_backward(step)
        assert a.loss == b.loss and torch.equal(a.logprobs, b.logprobs), objective


def test_microbatch_cost_reaches_the_planner(monkeypatch):
    """EngineConfig.microbatch_cost is the planner's option: the step is planned with it, and the
    step's loss does not depend on how the trajectories were grouped."""
    import harts_planner

    seen = []
    real = harts_planner.Planner.plan_step  # the engine plans through its Planner (in-process here)

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("microbatch_cost"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(harts_planner.Planner, "plan_step", spy)
    step = _step()
    losses = [
        HartsEngine(_model(), EngineConfig(capacity=CAP, microbatch_cost=cost)).forward_backward(step).loss
        for cost in (0, CAP)
    ]
    assert seen == [0, CAP]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_short_trees_run_trajectory_wise_when_compact_would_execute_more_rows():
    """Trees that share one token: compact rows plus KDA replay are no fewer than the expanded rows,
    so the engine runs that microbatch trajectory-wise (never more rows than trajectory-wise); the
    step's loss and log-probs equal the forced-compact and the trajectory-wise runs."""
    import harts_planner as hp

    cfg = model_config("debug")
    rng = np.random.default_rng(0)
    tails = [rng.integers(1, cfg.vocab_size, size=9).tolist() for _ in range(4)]
    batch = hp.RolloutBatch.from_token_lists([[3] + t for t in tails])  # forks at position 1
    step = StepInputs.synthetic(batch, seed=3, vocab_size=cfg.vocab_size)
    expanded = int(np.asarray(batch.lengths).sum())
    outs = {}
    for name, kw in (
        ("auto", {}),
        ("compact", dict(compact_always=True)),
        ("trajectory", dict(mode="trajectory")),
    ):
        outs[name] = HartsEngine(_model(), EngineConfig(capacity=64, **kw)).forward_backward(step)
    auto, forced = outs["auto"].metrics, outs["compact"].metrics
    assert auto["trajectory_fallbacks"] == 1 and forced["trajectory_fallbacks"] == 0
    assert forced["rows"] + forced["replay_tokens"] >= expanded  # what the guard saw
    assert auto["rows"] == expanded and auto["replay_tokens"] == 0
    for other in ("compact", "trajectory"):
        assert outs["auto"].loss == pytest.approx(outs[other].loss, rel=2e-5)
        torch.testing.assert_close(outs["auto"].logprobs, outs[other].logprobs, **TOL)


def test_engine_config_routes_each_option_to_its_one_declaration():
    """Flat keywords land in the options class that declares them and are checked there; an
    unknown one is refused naming it; ``replace`` keeps the rest; an external schedule leaves the
    learning rate to the caller."""
    from harts_runtime.options import ExecutionOptions, OptimizerOptions

    cfg = EngineConfig(lr=1e-3, capacity=64, recompute=True, keep=("attention",))
    assert cfg.execution == ExecutionOptions(capacity=64, recompute=True, keep=("attention",))
    assert cfg.optimizer == OptimizerOptions(lr=1e-3) and (cfg.lr, cfg.capacity) == (1e-3, 64)
    assert cfg.replace(capacity=32).capacity == 32 and cfg.replace(capacity=32).lr == 1e-3
    for kw, field in (
        (dict(capcity=64), "capcity"),
        (dict(keep=("attention",)), "keep"),  # keep without recompute
        (dict(keep=("mlp",), recompute=True), "keep"),
        (dict(capacity=64, microbatch_cost=65), "microbatch_cost"),
        (dict(lr_schedule="cosine"), "total_steps"),
    ):
        with pytest.raises(InvalidInputError) as e:
            EngineConfig(**kw)
        assert e.value.field == field
    engine = HartsEngine(_model(), EngineConfig(capacity=CAP, lr=1e-2, lr_schedule="external"))
    assert engine.scheduler is None
    engine.forward_backward(_step())
    engine.optimizer.param_groups[0]["lr"] = 5e-3  # the caller's schedule
    engine.optimizer_step()
    assert engine.optimizer.param_groups[0]["lr"] == 5e-3


def test_a_sidecar_planner_gives_the_in_process_step():
    """``planner="host:port"``: the step is planned on a harts-planner sidecar, and its loss and
    log-probs equal the in-process planner's."""
    pytest.importorskip("grpc")
    from harts_planner.rpc.server import SidecarProcess

    step = _step()
    local = HartsEngine(_model(), EngineConfig(capacity=CAP)).forward_backward(step)
    with SidecarProcess(workers=1) as sidecar:
        engine = HartsEngine(_model(), EngineConfig(capacity=CAP, planner=sidecar.address))
        assert engine.planner.is_remote
        remote = engine.forward_backward(step)
        engine.planner.close()
    assert remote.loss == local.loss and remote.metrics["rows"] == local.metrics["rows"]
    torch.testing.assert_close(remote.logprobs, local.logprobs, rtol=0, atol=0)
