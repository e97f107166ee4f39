"""The verl backend (``harts_runtime.integrations.verl``): verl's own ``ppo_loss`` / ``agg_loss``
through ``VerlHartsEngine`` on rollout trees from ``tests/trees.py``.

* The step loss, every gradient and the returned jagged log-probs of the compact backend (several
  HARTS microbatches, verl's global denominators) equal verl's per-trajectory computation: its loss
  called once on the whole batch with its own local normalisation, log-probs from HARTS's
  trajectory-wise execution; for ``token-mean``, ``seq-mean-token-mean`` and
  ``seq-mean-token-sum-norm`` with the KL loss on. The trajectory-wise backend agrees too.
* In 2 gloo processes (no Ray) with the batch dispatched as verl does (trees split over the two
  ranks): each rank gets its own rows' log-probs, the step loss, the summed gradients and the
  clipped step of ``train_batch`` equal the one-process reference.
* Forward-only entropy equals the full-logit entropy; on a tiny Kimi-Linear checkpoint built by
  transformers the log-probs equal transformers' per-trajectory ones (transformers < 5.11, which
  verl pins, has no Kimi-Linear: the reference then runs under ``HARTS_HF_PYTHON``).
* The registry resolves backend ``harts``; bad settings get one-line errors naming the field.

Skipped when verl is not installed (CI runs it in its own venv stage, ``.ci/run``).
"""

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("safetensors")

from tensordict import TensorDict  # noqa: E402
from trees import seeded  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config.optimizer import FSDPOptimizerConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from harts_runtime import InvalidInputError  # noqa: E402
from harts_runtime.engine import EngineConfig, HartsEngine  # noqa: E402
from harts_runtime.integrations.verl import (  # noqa: E402
    HartsActorConfig,
    HartsEngineConfig,
    VerlHartsEngine,
    harts_logprobs_to_verl,
    rollouts_of,
)
from harts_runtime.loss.objectives import PolicyLossConfig  # noqa: E402

HERE = Path(__file__).resolve().parent
V = 96
CHUNK = 8
CAPACITY = 48  # several compact microbatches for the batches below
LR = 1e-3
TOL_LOSS = 1e-5  # relative, float32
TOL_LOGPROB = 2e-5  # absolute, float32 log-probs
TOL_GRAD = 1e-4  # max |a - b| over max |b|, per tensor

pytestmark = pytest.mark.usefixtures("one_thread")

KIMI = dict(
    model_type="kimi_linear",
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=4,
    v_head_dim=8,
    qk_nope_head_dim=8,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    num_local_experts=4,
    norm_topk_prob=True,
    linear_head_dim=8,
    linear_num_heads=2,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse"],
    tie_word_embeddings=False,
)


# ------------------------------------------------------------------------------ inputs
def trajectories(seed: int = 0, num: int = 12) -> list[list[int]]:
    """A random forest (prefix sharing inside trees), every trajectory >= 3 tokens."""
    rng = np.random.default_rng(seed + 100)
    out = []
    for t in seeded(seed, num, vocab=V, max_new=10, first_len=(12, 20)):
        out.append(list(t) + rng.integers(0, V, size=max(0, 3 - len(t))).tolist())
    return out


def verl_batch(trajs, seed: int = 0, global_batch_size=None) -> TensorDict:
    """What verl's trainer hands an engine: left-padded prompts, right-padded responses, masks,
    old / reference log-probs and GRPO advantages, converted by verl's ``left_right_2_no_padding``."""
    rng = np.random.default_rng(seed)
    b = len(trajs)
    split = [int(rng.integers(1, len(t))) for t in trajs]  # prompt length, >= 1 response token
    lp, r = max(split), max(len(t) - p for t, p in zip(trajs, split))
    prompts = torch.zeros(b, lp, dtype=torch.long)
    responses = torch.zeros(b, r, dtype=torch.long)
    attention = torch.zeros(b, lp + r, dtype=torch.long)
    response_mask = torch.zeros(b, r, dtype=torch.long)
    for i, (t, p) in enumerate(zip(trajs, split)):
        n = len(t) - p
        prompts[i, lp - p :] = torch.tensor(t[:p])
        responses[i, :n] = torch.tensor(t[p:])
        attention[i, lp - p : lp + n] = 1
        response_mask[i, :n] = torch.from_numpy((rng.random(n) > 0.2).astype(np.int64))  # tool tokens off
    if not response_mask.any():
        response_mask[0, 0] = 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    real = attention[:, lp:].float()
    adv = torch.from_numpy(rng.normal(size=(b, 1))).float() * real
    td = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], -1),
            "attention_mask": attention,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "old_log_probs": -torch.from_numpy(rng.uniform(0.2, 4.0, size=(b, r))).float() * real,
            "ref_log_prob": -torch.from_numpy(rng.uniform(0.2, 4.0, size=(b, r))).float() * real,
            "advantages": adv,
        },
        batch_size=[b],
    )
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=1.0, global_batch_size=global_batch_size, calculate_entropy=False)
    return td


def actor_config(loss_agg_mode="token-mean", **kw) -> HartsActorConfig:
    return HartsActorConfig(
        rollout_n=1,
        use_dynamic_bsz=True,
        loss_agg_mode=loss_agg_mode,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        **kw,
    )


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    """A tiny random Kimi-Linear folder written by our ``save_pretrained`` (no transformers needed)."""
    from harts_runtime import HybridModel, save_pretrained
    from harts_runtime.models import kimi_linear

    out = tmp_path_factory.mktemp("kimi")
    torch.manual_seed(0)
    save_pretrained(HybridModel(kimi_linear.from_hf_config(KIMI, dtype="float32", chunk_size=CHUNK)), out)
    return str(out)


def logits_of(model, trajs) -> torch.Tensor:
    """Full logits of every position of ``trajs`` (trajectory layout, packed back to back)."""
    import harts_planner as hp
    from harts_runtime.layout import trajectory_layout

    batch = hp.RolloutBatch.from_token_lists(trajs)
    layout = trajectory_layout(batch, np.arange(len(trajs)), model.config.chunk_size, model.config.conv_size)
    with torch.no_grad():
        hidden, _ = model.forward_hidden(layout.to(model.device))
        return model.logits(hidden)


class _Model:
    def __init__(self, path):
        self.path = self.local_path = path


def backend(path, mode="compact", capacity=CAPACITY, clip=None, **harts) -> VerlHartsEngine:
    eng = VerlHartsEngine(
        model_config=_Model(path),
        engine_config=HartsEngineConfig(
            capacity=capacity, mode=mode, dtype="float32", chunk_size=CHUNK, **harts
        ),
        optimizer_config=FSDPOptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=clip or 0.0),
        checkpoint_config=None,
    )
    eng.initialize()
    return eng


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def grads(model) -> dict:
    return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def reference(path, td, config):
    """verl's per-trajectory computation: HARTS's trajectory-wise log-probs of the whole batch in
    one microbatch, verl's ``ppo_loss`` called once on all rows with its own local normalisation
    (``dp_size`` 1, no global token count). Returns ``(loss, log-probs [P], grads, rollouts)``."""
    eng = HartsEngine.build(
        path,
        EngineConfig(mode="trajectory", capacity=10**6, max_grad_norm=None, loss_config=PolicyLossConfig()),
        dtype="float32",
        chunk_size=CHUNK,
    )
    rollouts = rollouts_of(td, V)
    lengths = torch.as_tensor(rollouts.lengths)
    gbs = tu.get_non_tensor_data(td, "global_batch_size", None)  # verl's when set, else its local count

    def loss_fn(lp, inputs):
        traj = inputs.trajectories.cpu()
        data = tu.index_select_tensor_dict(td, traj)
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=gbs)
        loss, _ = ppo_loss(config, {"log_probs": harts_logprobs_to_verl(lp, lengths[traj])}, data)
        return loss

    out = eng.forward_backward(rollouts, loss_fn)
    assert out.metrics["microbatches"] == 1
    return out.loss, out.logprobs, grads(eng.model), rollouts


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


FROZEN = ("mixer.g_proj.1.bias",)  # no Kimi-Linear tensor: frozen at zero by the backend where a model has it


def check_grads(got: dict, want: dict, where=""):
    assert set(got) == {n for n in want if not n.endswith(FROZEN)}, where
    for n, g in got.items():
        err = rel(g, want[n])
        assert err <= TOL_GRAD, f"{where} d{n}: relative error {err:.2e}"


def verl_rows(lp_nested) -> list[torch.Tensor]:
    """The positions of each row that score a token (all but the last)."""
    return [r[:-1] for r in lp_nested.unbind()]


# ------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_verl_loss_equals_per_trajectory_verl(path, agg):
    cfg = actor_config(agg)
    td = verl_batch(trajectories(0))
    ref_loss, ref_lp, ref_grads, rollouts = reference(path, td.clone(), cfg)
    for mode in ("compact", "trajectory"):
        eng = backend(path, mode)
        out = eng.forward_backward_batch(td.clone(), partial(ppo_loss, config=cfg))
        assert eng.last_output.metrics["microbatches"] > 1, mode
        if mode == "compact":
            assert eng.last_output.metrics["compression"] > 1.2  # prefixes run once
        assert abs(out["loss"][0] - ref_loss) <= TOL_LOSS * max(1.0, abs(ref_loss)), (
            mode,
            out["loss"],
            ref_loss,
        )
        got = torch.cat(verl_rows(out["model_output"]["log_probs"]))
        torch.testing.assert_close(got, ref_lp, rtol=0, atol=TOL_LOGPROB)
        check_grads(grads(eng.engine.model), ref_grads, mode)
        m = out["metrics"]
        pg = m["actor/pg_loss"]  # verl's name and aggregation: the step's sum of microbatch shares
        assert pg.aggregation.value == "sum" and len(pg.values) == 1
        assert m["harts/rows"][0] < rollouts.tokens.size or mode == "trajectory"
        assert {"actor/pg_clipfrac", "actor/ppo_kl", "kl_loss"} <= set(m)


def test_train_batch_steps_and_metrics(path):
    """verl's ``BaseEngine.train_batch`` (zero grad, forward/backward, clipped AdamW step) and the
    LR schedule step, on the backend."""
    cfg = actor_config()
    eng = backend(path, clip=1e-3)
    before = {n: p.detach().clone() for n, p in eng.engine.model.named_parameters()}
    with eng.train_mode():
        out = eng.train_batch(verl_batch(trajectories(1)), partial(ppo_loss, config=cfg))
    assert out["metrics"]["grad_norm"] > 1e-3  # clipped to 1e-3: the step still moves the weights
    assert any(not torch.equal(p, before[n]) for n, p in eng.engine.model.named_parameters())
    assert eng.lr_scheduler_step() == pytest.approx(LR)
    assert all(p.grad is None for p in eng.engine.model.parameters())  # train_mode zeroes on exit


def test_checkpoint_round_trip_and_weight_export(path, tmp_path):
    """``save_checkpoint`` / ``load_checkpoint`` restore weights, AdamW state and verl's LR schedule
    (a resumed run's next step equals the uninterrupted one's); ``get_per_tensor_param`` streams the
    transformers tensors ``save_pretrained`` writes (names and shapes), after training too."""
    from safetensors import safe_open

    cfg = actor_config()
    loss = partial(ppo_loss, config=cfg)
    a = backend(path)
    with a.train_mode():
        a.train_batch(verl_batch(trajectories(5)), loss)
    a.lr_scheduler_step()
    a.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    b = backend(path)
    b.load_checkpoint(str(tmp_path / "ckpt"))
    assert b.lr_scheduler.state_dict()["last_epoch"] == a.lr_scheduler.state_dict()["last_epoch"]
    for eng in (a, b):
        with eng.train_mode():
            eng.train_batch(verl_batch(trajectories(6)), loss)
    for (n, p), (_, q) in zip(a.engine.model.named_parameters(), b.engine.model.named_parameters()):
        assert torch.equal(p, q), n
    assert all(n.endswith(FROZEN) for n in b.frozen)  # trained, still exportable
    gen, peft = b.get_per_tensor_param()
    exported = dict(gen)
    assert peft is None
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        assert set(exported) == set(f.keys())
        for name in f.keys():
            assert exported[name].shape == f.get_tensor(name).shape, name


def test_entropy_and_infer(path):
    """Forward-only with ``calculate_entropy``: entropies of every scored position equal the full
    logits' (HARTS computes one per compact row); log-probs as in training; no loss needed."""
    trajs = trajectories(2)
    td = verl_batch(trajs)
    tu.assign_non_tensor(td, calculate_entropy=True)
    eng = backend(path)
    with eng.eval_mode():
        out = eng.infer_batch(td, loss_function=None)
    ent = torch.cat(verl_rows(out["model_output"]["entropy"]))
    lp = torch.cat(verl_rows(out["model_output"]["log_probs"]))
    logits = logits_of(eng.engine.model, trajs).double()
    lsm = torch.log_softmax(logits, -1)
    want_ent, want_lp, off = [], [], 0
    for t in trajs:
        rows = lsm[off : off + len(t) - 1]
        want_ent.append(-(rows.exp() * rows).sum(-1))
        want_lp.append(rows[torch.arange(len(t) - 1), torch.tensor(t[1:])])
        off += len(t)
    torch.testing.assert_close(ent.double(), torch.cat(want_ent), rtol=0, atol=1e-4)
    torch.testing.assert_close(lp.double(), torch.cat(want_lp), rtol=0, atol=1e-4)


def test_kimi_linear_logprobs_equal_transformers(tmp_path):
    """On a Kimi-Linear checkpoint built and saved by transformers, the backend's jagged log-probs
    (compact execution: prefixes once, KDA state handoffs, ancestor-KV MLA) equal transformers'
    run on each trajectory alone."""
    import transformers

    trajs = trajectories(3)
    (tmp_path / "trajs.json").write_text(json.dumps(trajs))
    if hasattr(transformers, "KimiLinearForCausalLM"):
        sys.path.insert(0, str(HERE))
        from kimi_reference import build

        build(tmp_path, trajs)
    else:
        python = os.environ.get("HARTS_HF_PYTHON")
        if not python:
            pytest.skip(
                f"transformers {transformers.__version__} has no Kimi-Linear: set HARTS_HF_PYTHON to an "
                "interpreter whose transformers has it (CI: the main stage's venv)"
            )
        subprocess.run([python, str(HERE / "kimi_reference.py"), str(tmp_path)], check=True, timeout=300)
    ref = torch.load(tmp_path / "ref.pt")["logprobs"]
    eng = backend(str(tmp_path / "hf"))
    td = verl_batch(trajs)
    with eng.eval_mode():
        out = eng.infer_batch(td)
    assert eng.last_output.metrics["compression"] > 1.2
    lp = torch.cat(verl_rows(out["model_output"]["log_probs"])).double()
    err = float((lp - ref).abs().max())
    assert err <= 1e-4 * float(ref.abs().max()), err


# ------------------------------------------------------------------------------ two processes
def _worker(rank, world, path, aggs, order):
    from harts_runtime.integrations.verl import VerlHartsEngine  # noqa: F401 (registers the backend)

    torch.set_num_threads(1)
    td = verl_batch(trajectories(0))
    td = tu.index_select_tensor_dict(td, torch.as_tensor(order))  # verl's balancing reorders rows
    mine = tu.chunk_tensordict(td, world)[rank]  # and its dispatch chunks them over DP ranks
    if rank == 1:  # the ranks' key orders need not agree
        mine = mine.select(*reversed(list(mine.keys())))
    eng = backend(path, clip=1e6)
    assert eng.get_data_parallel_size() == world and eng.get_data_parallel_rank() == rank
    out = {}
    for agg in aggs:
        cfg = actor_config(agg)
        tu.assign_non_tensor(mine, global_batch_size=td.batch_size[0] if agg != "token-mean" else None)
        with eng.train_mode():
            res = eng.forward_backward_batch(mine, partial(ppo_loss, config=cfg))
            g = grads(eng.engine.model)
            norm = float(eng.engine.grad_norm())
        out[agg] = {
            "loss": res["loss"][0],
            "logprobs": [r.clone() for r in verl_rows(res["model_output"]["log_probs"])],
            "grads": g,
            "grad_norm": norm,
            "pg_loss": res["metrics"]["actor/pg_loss"].values,
            "microbatches": eng.last_output.metrics["microbatches"],
        }
    tu.assign_non_tensor(mine, calculate_entropy=True)
    with eng.eval_mode():
        res = eng.infer_batch(mine)
    out["entropy"] = [r.clone() for r in verl_rows(res["model_output"]["entropy"])]
    return out


def test_two_gloo_processes_equal_one(path):
    """verl's balancing and dispatch split the trees over 2 ranks; the backend gathers the step,
    plans it with D = 2 and routes each rank its rows: log-probs, step loss, summed gradients and
    their global norm equal one process running verl's loss on the whole batch; so do the
    forward-only entropies (the LM head gathered from its FSDP2 shards)."""
    from harts_runtime.parallel import run_distributed

    aggs = ("token-mean", "seq-mean-token-mean")
    td = verl_batch(trajectories(0))
    b = td.batch_size[0]
    order = np.argsort(np.arange(b) % 2, kind="stable")  # even rows to rank 0, odd to rank 1: trees split
    results = run_distributed(_worker, 2, path, aggs, order, timeout=240)
    for agg in aggs:
        full = tu.index_select_tensor_dict(td, torch.as_tensor(order))
        if agg != "token-mean":
            tu.assign_non_tensor(full, global_batch_size=b)
        ref_loss, ref_lp, ref_grads, rollouts = reference(path, full, actor_config(agg))
        got_rows = [r for res in results for r in res[agg]["logprobs"]]
        assert len(got_rows) == b
        for got, want in zip(got_rows, rollouts.to_lists(ref_lp)):
            torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=TOL_LOGPROB)
        want_norm = float(
            torch.linalg.vector_norm(
                torch.stack([g.norm() for n, g in ref_grads.items() if not n.endswith(FROZEN)])
            )
        )
        for rank, res in enumerate(r[agg] for r in results):
            where = f"{agg} rank {rank}"
            assert abs(res["loss"] - ref_loss) <= TOL_LOSS * max(1.0, abs(ref_loss)), (
                where,
                res["loss"],
                ref_loss,
            )
            check_grads(res["grads"], ref_grads, where)
            assert res["grad_norm"] == pytest.approx(want_norm, rel=1e-4), where
            assert res["pg_loss"] == results[0][agg]["pg_loss"], where
            assert res["microbatches"] == 2, where  # one per replica
    full = tu.index_select_tensor_dict(td, torch.as_tensor(order))
    tu.assign_non_tensor(full, calculate_entropy=True)
    want = verl_rows(backend(path).infer_batch(full)["model_output"]["entropy"])
    got = [r for res in results for r in res["entropy"]]
    torch.testing.assert_close(torch.cat(got), torch.cat(want), rtol=0, atol=1e-5)


def _cp_worker(rank, world, path):
    from harts_runtime.integrations.verl import VerlHartsEngine  # noqa: F401 (registers the backend)

    torch.set_num_threads(1)
    td = verl_batch(trajectories(0))
    eng = backend(path, capacity=CP_T, clip=1e6, cp=2)
    assert eng.get_data_parallel_size() == 1 and eng.get_data_parallel_rank() == 0  # one replica
    assert eng.is_mp_src_rank_with_outputs() == (rank == 0)
    with eng.train_mode():
        res = eng.forward_backward_batch(td, partial(ppo_loss, config=actor_config()))
        g = grads(eng.engine.model)
    tu.assign_non_tensor(td, calculate_entropy=True)
    with eng.eval_mode():
        ent = eng.infer_batch(td)["model_output"]["entropy"]
    return {
        "loss": res["loss"][0],
        "logprobs": [r.clone() for r in verl_rows(res["model_output"]["log_probs"])],
        "grads": g,
        "entropy": [r.clone() for r in verl_rows(ent)],
    }


CP_T = 16  # per-rank capacity under harts.cp = 2: the batch's trajectories run up to 30 tokens


def test_context_parallel_pair_equals_one_process(path):
    """``harts.cp = 2``: two ranks run each microbatch of up to 2 x T rows together (trajectories
    longer than T); log-probs, loss, gradients and entropies equal one process's per-trajectory
    verl computation."""
    from harts_runtime.parallel import run_distributed

    td = verl_batch(trajectories(0))
    assert 2 * CP_T >= max(map(len, trajectories(0))) > CP_T
    results = run_distributed(_cp_worker, 2, path, timeout=240)
    ref_loss, ref_lp, ref_grads, rollouts = reference(path, td, actor_config())
    want_ent = verl_rows(backend(path).infer_batch(_with_entropy(td))["model_output"]["entropy"])
    for rank, res in enumerate(results):
        assert abs(res["loss"] - ref_loss) <= TOL_LOSS * max(1.0, abs(ref_loss)), rank
        for got, want in zip(res["logprobs"], rollouts.to_lists(ref_lp)):
            torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=TOL_LOGPROB)
        check_grads(res["grads"], ref_grads, f"rank {rank}")
        torch.testing.assert_close(torch.cat(res["entropy"]), torch.cat(want_ent), rtol=0, atol=1e-5)


def _with_entropy(td):
    td = td.clone()
    tu.assign_non_tensor(td, calculate_entropy=True)
    return td


# ------------------------------------------------------------------------------ registry and errors
def test_registry_resolves_harts():
    from verl.workers.engine import EngineRegistry

    assert EngineRegistry.get_engine_cls("language_model", "harts") is VerlHartsEngine
    assert HartsActorConfig(rollout_n=1, use_dynamic_bsz=True).engine.strategy == "harts"


def test_example_config_selects_the_backend():
    """``examples/verl/harts_grpo.yaml`` composes with verl's ``ppo_trainer``, passes verl's
    ``validate_config``, and gives the actor and the reference model the harts engine (the ref
    keys popped as ``ActorRolloutRefWorker.init_model`` pops them)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.engine import EngineRegistry

    with initialize_config_dir(config_dir=str(HERE.parents[1] / "examples" / "verl"), version_base=None):
        cfg = compose(config_name="harts_grpo", overrides=["actor_rollout_ref.model.path=/ckpt"])
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert cfg.algorithm.adv_estimator == "grpo" and need_reference_policy(cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, HartsActorConfig) and isinstance(actor.engine, HartsEngineConfig)
    assert actor.engine.strategy == "harts" and actor.engine.capacity == 65536
    assert EngineRegistry.get_engine_cls("language_model", actor.engine.strategy) is VerlHartsEngine
    ref = cfg.actor_rollout_ref.ref
    with open_dict(ref):
        ref.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        for key in (
            "micro_batch_size",
            "micro_batch_size_per_gpu",
            "use_dynamic_bsz",
            "max_token_len_per_gpu",
        ):
            value = ref.pop(f"log_prob_{key}", None)
            ref[key.replace("micro", "ppo_micro").replace("max_token", "ppo_max_token")] = value
    ref = omega_conf_to_dataclass(ref)
    assert isinstance(ref.engine, HartsEngineConfig) and ref.engine.forward_only


def test_microbatch_cost_reaches_the_engine(path):
    eng = VerlHartsEngine(
        model_config=_Model(path),
        engine_config=HartsEngineConfig(
            capacity=CAPACITY, microbatch_cost=CAPACITY // 4, dtype="float32", chunk_size=CHUNK
        ),
        optimizer_config=FSDPOptimizerConfig(lr=LR, weight_decay=0.0),
        checkpoint_config=None,
    )
    eng.initialize()
    assert eng.engine.config.microbatch_cost == CAPACITY // 4
    with pytest.raises(InvalidInputError) as e:
        VerlHartsEngine(
            _Model(path),
            HartsEngineConfig(capacity=8, microbatch_cost=9, dtype="float32"),
            FSDPOptimizerConfig(lr=LR),
        ).initialize()
    assert e.value.field == "harts.microbatch_cost"


def test_bad_settings_name_the_field(path):
    with pytest.raises(InvalidInputError) as e:
        actor_config(entropy_coeff=0.01)
    assert e.value.field == "actor.entropy_coeff"
    with pytest.raises(InvalidInputError) as e:
        HartsEngineConfig(mode="tree")
    assert e.value.field == "harts.mode"
    eng = backend(path)
    td = verl_batch(trajectories(4, num=3))
    tu.assign_non_tensor(td, temperature=0.7)
    with pytest.raises(InvalidInputError) as e:
        eng.forward_backward_batch(td, partial(ppo_loss, config=actor_config()))
    assert e.value.field == "temperature"
    tu.assign_non_tensor(td, temperature=1.0, calculate_entropy=True)
    with pytest.raises(InvalidInputError) as e:
        eng.forward_backward_batch(td, partial(ppo_loss, config=actor_config()))
    assert e.value.field == "calculate_entropy"
    tu.assign_non_tensor(td, calculate_entropy=False, calculate_sum_pi_squared=True)
    with pytest.raises(InvalidInputError) as e:
        eng.infer_batch(td)
    assert e.value.field == "calculate_sum_pi_squared"
    with pytest.raises(InvalidInputError) as e:
        VerlHartsEngine(
            _Model(path), HartsEngineConfig(param_offload=True, dtype="float32"), FSDPOptimizerConfig(lr=LR)
        ).initialize()
    assert e.value.field == "param_offload"


def test_execution_options_are_declared_once():
    """``harts.*`` carries every field of ``ExecutionOptions`` (same defaults; ``param_dtype`` set by
    verl's ``dtype``), checked by ``ExecutionOptions`` itself with the field named for verl."""
    import dataclasses

    from harts_runtime.options import DEFAULT_CAPACITY, ExecutionOptions

    cfg = HartsEngineConfig()
    assert cfg.capacity == DEFAULT_CAPACITY and cfg.execution.param_dtype == "bfloat16"
    for f in dataclasses.fields(ExecutionOptions):
        if f.name != "param_dtype":
            assert getattr(cfg, f.name) == getattr(ExecutionOptions(), f.name), f.name
    cfg = HartsEngineConfig(recompute=True, keep=["linear_attention", "attention"], dtype="float32")
    assert cfg.execution == ExecutionOptions(recompute=True, keep=("attention", "linear_attention"))
    for kw, name in (
        (dict(keep=["attention"]), "harts.keep"),  # keep needs recompute
        (dict(recompute=True, keep=["mlp"]), "harts.keep"),
        (dict(capacity=0), "harts.capacity"),
        (dict(dtype="int8"), "harts.dtype"),
    ):
        with pytest.raises(InvalidInputError) as e:
            HartsEngineConfig(**kw)
        assert e.value.field == name, kw


def test_verl_sets_the_learning_rate(path):
    """The engine runs ``lr_schedule="external"``: its optimizer step leaves the LR alone, verl's
    warm-up schedule (``lr_scheduler_step``) sets it; the execution options reach the engine."""
    eng = VerlHartsEngine(
        model_config=_Model(path),
        engine_config=HartsEngineConfig(capacity=CAPACITY, dtype="float32", chunk_size=CHUNK),
        optimizer_config=FSDPOptimizerConfig(lr=LR, lr_warmup_steps=2, total_training_steps=10),
    )
    eng.initialize()
    assert eng.engine.config.lr_schedule == "external" and eng.engine.config.capacity == CAPACITY
    assert eng.engine.config.execution is eng.engine_config.execution
    lrs = lambda: [g["lr"] for g in eng.engine.optimizer.param_groups]  # noqa: E731
    assert lrs() == [0.0] * len(lrs())  # verl's warm-up starts at 0
    with eng.train_mode():
        eng.train_batch(verl_batch(trajectories(7, num=4)), partial(ppo_loss, config=actor_config()))
    assert lrs() == [0.0] * len(lrs())
    assert eng.lr_scheduler_step() == pytest.approx(LR / 2)
    assert lrs() == pytest.approx([LR / 2] * len(lrs()))
