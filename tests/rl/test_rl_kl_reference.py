"""The online source's KL term and its choice of class: :func:`harts_runtime.rl.run.make_source`
picks the asynchronous source by ``max_staleness`` (no class swap in ``OnlineSource``); with
``kl_coef > 0`` the reference policy is the initial weights, its log-probs in every PPO mini-batch,
and a run saved and resumed equals the uninterrupted one (the reference again the initial weights);
a mesh is refused naming ``kl_coef``; both commands' step records carry the objective's statistics
and ``loss_fn/kl_loss``; ``--kl-estimator`` takes the declaration's choices."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from harts_runtime.errors import InvalidInputError
from harts_runtime.rl import RLConfig, RLRun
from harts_runtime.rl.async_source import AsyncSource
from harts_runtime.rl.run import make_source
from harts_runtime.rl.source import OnlineSource
from harts_runtime.rollouts import Rollouts

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(flavor="qwen3.5-tiny", prompts=2, forks={0: 2, 1: 2}, sync_sequences=1, seed=7)
KL = {"lr": 1e-2, "loss_config": {"kl_coef": 0.01, "loss_agg_mode": "token-mean"}}
TIMED = ("generate_seconds", "logprobs_seconds", "train_seconds", "sync_seconds", "step_seconds")


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_source_class_is_picked_by_max_staleness():
    assert type(make_source(RLConfig(**SMALL))) is OnlineSource
    assert type(make_source(RLConfig(**SMALL, max_staleness=1))) is AsyncSource
    # OnlineSource is the synchronous source whatever the config says (no class swap)
    assert type(OnlineSource(RLConfig(**SMALL, max_staleness=1))) is OnlineSource


@pytest.mark.slow
def test_reference_logprobs_are_the_initial_weights_in_every_mini_batch(tmp_path):
    """kl_coef 0.01, 2 PPO epochs x 2 mini-batches: at step 2 (the weights trained by step 1's four
    updates) every update's batch carries reference log-probs equal to a separately built engine's
    (same flavor and seed: the initial weights), not the current engine's; the KL enters the loss."""
    config = RLConfig(**SMALL, steps=2, ppo_epochs=2, mini_batches=2)
    run = RLRun(config, KL, tmp_path / "r")
    initial = RLRun(config, KL, tmp_path / "initial").engine  # never trained
    assert run.source.reference is not None
    assert _same_weights(_weights(run.source.reference.model), _weights(initial.model))
    parts: list[Rollouts] = []
    split = run.source.updates
    run.source.updates = lambda batch: parts.extend(split(batch)) or parts[-4:]
    run.run_step()
    rec = run.run_step()
    assert len(parts) == 8 and rec["updates"] == 4
    step2 = parts[4:]
    assert {id(p) for p in step2[:2]} == {id(p) for p in step2[2:]}  # epoch 2 reuses the mini-batches
    for part in step2:
        assert part.ref_logprobs is not None
        fresh = Rollouts.from_lists(_tokens(part))
        want = initial.logprobs(fresh).float()
        mask = part.loss_mask
        # scored with the whole batch (other microbatches than the mini-batch alone): float32 close
        torch.testing.assert_close(part.ref_logprobs[mask], want[mask], atol=2e-5, rtol=0)
        now = run.engine.logprobs(fresh).float()
        assert (now[mask] - want[mask]).abs().max() > 1e-3  # the engine has moved: a real reference
    assert rec["loss_fn/kl"] > 0 and rec["objective/kl"] > 0
    assert rec["loss_fn/kl_loss"] == pytest.approx(rec["loss_fn/kl"])  # k3 mean, token-mean
    for key in ("objective/clipfrac", "objective/response_length_mean", "objective/advantage_mean",
                "objective/advantage_std", "objective/approx_kl"):  # fmt: skip
        assert key in rec


def _tokens(ro: Rollouts) -> list[list[int]]:
    off = ro.offsets.tolist()
    return [ro.tokens[a:b].tolist() for a, b in zip(off[:-1], off[1:])]


@pytest.mark.slow
def test_kl_run_resumed_equals_the_uninterrupted_run(tmp_path):
    """kl_coef 0.01 with PPO epochs: 2 steps, save, resume to 4 gives the records (all but
    timings) and the weights of 4 uninterrupted steps; the resumed reference is the initial weights
    (not the checkpoint's)."""
    config = RLConfig(**SMALL, steps=4, ppo_epochs=2, mini_batches=2)
    a = RLRun(config, KL, tmp_path / "a")
    ra = [a.run_step() for _ in range(4)]
    b = RLRun(config, KL, tmp_path / "b")
    rb = [b.run_step() for _ in range(2)]
    b.write_run()
    b.save()
    c = RLRun.resume(tmp_path / "b")
    assert c.step == 2 and c.source.reference is not None
    assert _same_weights(_weights(c.source.reference.model), _weights(a.source.reference.model))
    assert not _same_weights(_weights(c.source.reference.model), _weights(c.engine.model))
    rc = [c.run_step() for _ in range(2)]
    for x, y in zip(ra, rb + rc, strict=True):
        assert x.keys() == y.keys()
        for key in x.keys() - set(TIMED):
            assert x[key] == y[key], (x["step"], key, x[key], y[key])
    assert ra[-1]["loss_fn/kl"] > 0
    assert _same_weights(_weights(a.engine.model), _weights(c.engine.model))


def test_a_kl_term_under_a_mesh_is_refused_naming_kl_coef():
    src = OnlineSource(RLConfig(**SMALL))
    loss = SimpleNamespace(kl_coef=0.01)
    engine = SimpleNamespace(mesh=object(), config=SimpleNamespace(loss_config=loss))
    with pytest.raises(InvalidInputError, match=r"^kl_coef: 0.01 needs a reference policy") as e:
        src.attach(engine, rollout_factory=lambda eng: None)
    assert "\n" not in str(e.value) and src.reference is None
    loss.kl_coef = 0.0  # no KL term: no reference, a mesh is the engine's business
    src.attach(engine, rollout_factory=lambda eng: None)
    assert src.reference is None


def test_kl_estimator_takes_the_declared_choices(tmp_path, capsys):
    from harts_runtime.cli.rl import build_parser, main

    args = build_parser().parse_args(["--kl-estimator", "low-var-kl", "--out", "x"])
    assert args.kl_estimator == "low-var-kl"
    help_text = build_parser().format_help()
    assert "--max-staleness K" in help_text
    out = tmp_path / "run"
    argv = ["--flavor", "qwen3.5-tiny", "--prompts", "2", "--sync-sequences", "1", "--steps", "1"]
    assert main([*argv, "--kl-coef", "0.01", "--kl-estimator", "low-var-kl", "--out", str(out)]) == 0
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["loss_fn/kl_loss"] >= 0 and "objective/kl" in rec
    assert json.loads((out / "run.json").read_text())["engine"]["loss_config"]["kl_estimator"] == "low-var-kl"
    capsys.readouterr()
    assert main([*argv, "--kl-estimator", "k9", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kl-estimator" in err[0] and "low-var-kl" in err[0], err


def test_harts_train_records_the_objective_statistics():
    from harts_runtime.trainer.loop import step_record

    metrics = {
        "policy_loss": 0.5, "router_loss": 0.0, "semantic_tokens": 10, "rows": 5, "compression": 2.0,
        "microbatches": 1, "replay_tokens": 0, "plan_seconds": 0.0, "fbg_seconds": 0.1,
        "loss_fn/kl_loss": 0.25, "objective/kl": torch.tensor(0.25, dtype=torch.float64),
        "objective/clipfrac": 0.125, "mismatch/k3": 1.0,
    }  # fmt: skip
    res = SimpleNamespace(loss=torch.tensor(0.5), metrics=metrics)
    rep = SimpleNamespace(grad_norm=1.0, lr=1e-3, skipped=False)
    rec = step_record(1, 0, res, rep, 1.0)
    assert rec["objective/kl"] == 0.25 and isinstance(rec["objective/kl"], float)
    assert rec["objective/clipfrac"] == 0.125 and rec["loss_fn/kl_loss"] == 0.25
    assert "mismatch/k3" not in rec
