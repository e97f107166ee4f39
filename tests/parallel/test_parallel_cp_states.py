"""Context parallelism by state passing (``cp_mode="states"`` and ``"auto"``, gloo) against one
process holding the whole microbatch.

Each CP rank holds its ``plan_cp`` row range through the whole model; KDA / GDN layers run their
rows from entry states folded from every rank's affine summaries, attention gathers the ancestor
rows its queries see (``parallel.cp_attention``). Trees: trajectories longer than the per-rank
capacity T, forking on both sides of the split's cuts, at ``cp = 4`` with a fork whose state comes
from two ranks back and forks whose replay rows live on earlier ranks (asserted on the plan).
``cp = 8`` runs past the debug model's 4 heads; ``cp = 2 x tp = 2`` + SP (``debug``, Nemotron-H)
holds a TP row block of each CP rank's split range between regions. Models: the ``debug`` hybrid, tiny Qwen3.5-MoE (GDN +
gated attention), Nemotron-H (Mamba2), Kimi-Linear (KDA + MLA: the latent gather) and Ling-3.0
(bounded-gate KDA + gated MLA with interleaved RoPE) checkpoints, each at ``cp = 2`` and ``cp = 4``
(past Kimi-Linear's 2 heads), loaded at chunk 8 (at 64 the grid would cut only between trees); every
case's split hands states across ranks (asserted).
Compared as in ``test_parallel_step``: both step losses, every log-prob, every gradient, the MoE
expert-load counts and every weight after two AdamW steps. Heads mode is ``test_parallel_cp``'s;
the local plans' oracle test is ``test_cp_states_plan``.
"""

import numpy as np
import pytest
import test_parallel_mamba2
import torch
from spawn_cases import SharedSpawns, selected_cases
from test_parallel_cp import TOL_LOGPROB_CP, T, _batch
from test_parallel_cp import _build as _build_cp
from test_parallel_step import _check, _tiny_checkpoint, train_parallel, train_single

from harts_runtime.parallel import ParallelDims

CHUNK = 8

BOTH = ("attention", "linear_attention")
CASES = {
    # name: (model, world, dims, keep (None: no recomputation), cp_mode ("alternate": auto, its
    # choice forced to take both modes by turns))
    "debug-cp4-auto-recompute": ("debug", 4, dict(cp=4), (), "auto"),
    # C = 8 past the debug model's 4 heads (auto has only states there)
    "debug-cp8": ("debug", 8, dict(cp=8), None, "auto"),
    "debug-cp2-dp_shard2": ("debug", 4, dict(cp=2, dp_shard=2), None, "states"),
    "debug-cp2-ep2": ("debug", 4, dict(cp=2, dp_shard=2, ep=2), None, "states"),
    "debug-cp2-tp2": ("debug", 4, dict(cp=2, tp=2), None, "states"),
    # SP: each TP rank holds a row_block of its CP rank's split range between regions
    "debug-cp2-tp2-sp-recompute": ("debug", 4, dict(cp=2, tp=2, sequence_parallel=True), (), "states"),
    # auto's per-layer choice forced to alternate: head-parallel layers on the split's rows under SP
    "debug-cp2-tp2-sp-mixed": ("debug", 4, dict(cp=2, tp=2, sequence_parallel=True), None, "alternate"),
    "qwen35-cp2-kept": ("qwen3_5_moe_text", 2, dict(cp=2), BOTH, "states"),
    "qwen35-cp4": ("qwen3_5_moe_text", 4, dict(cp=4), None, "states"),  # GDN + gated attention, MoE
    "nemotron_h-cp2": ("nemotron_h", 2, dict(cp=2), None, "states"),
    "nemotron_h-cp4-recompute": ("nemotron_h", 4, dict(cp=4), (), "states"),  # Mamba2 (SSD summaries)
    # Mamba2 on its TP rank's groups, whole split ranges inside the TP region
    "nemotron_h-cp2-tp2-sp": ("nemotron_h", 4, dict(cp=2, tp=2, sequence_parallel=True), None, "states"),
    "kimi-cp2": ("kimi_linear", 2, dict(cp=2), None, "states"),  # KDA + MLA (latent gather)
    "kimi-cp4-recompute": ("kimi_linear", 4, dict(cp=4), (), "states"),  # past its 2 heads
    "ling3-cp2-kept": ("ling3", 2, dict(cp=2), BOTH, "states"),
    "ling3-cp4": ("ling3", 4, dict(cp=4), None, "states"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        "qwen3_5_moe_text": _tiny_checkpoint(tmp_path_factory, "qwen3_5_moe_text"),
        "nemotron_h": test_parallel_mamba2._checkpoint(tmp_path_factory, 4),
        "kimi_linear": _tiny_checkpoint(tmp_path_factory, "kimi_linear"),
        "ling3": _ling3_checkpoint(tmp_path_factory),
    }


def _ling3_checkpoint(tmp_path_factory):
    """A random-weight Ling-3.0 checkpoint folder (``test_ling3``'s tiny ``BailingHybridConfig`` at
    2 layers: KDA with the bounded gate, then MLA with interleaved RoPE and the output gate; a dense
    first layer, then the sigmoid group-limited MoE with a shared expert and SwiGLU limits)."""
    import transformers

    from harts_runtime import HybridModel, save_pretrained
    from harts_runtime.models import ling3

    hf = transformers.BailingHybridConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
        routed_scaling_factor=2.5, kv_lora_rank=12, q_lora_rank=None, qk_rope_head_dim=8,
        v_head_dim=8, qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=3,
        num_local_experts=8, first_k_dense_replace=1, head_dim=8, layer_group_size=2,
        num_mtp_layers=0, expert_swiglu_limit_list=[0, 0.4], share_expert_swiglu_limit_list=[0, 0.5],
        pad_token_id=None, eos_token_id=None,
    )  # fmt: skip
    cfg = ling3.from_hf_config(hf, dtype="float32", chunk_size=CHUNK)
    assert tuple(cfg.mixers) == ("kda", "mla") and tuple(cfg.ffns) == ("dense", "moe"), cfg
    torch.manual_seed(5)
    path = tmp_path_factory.mktemp("ling3")
    save_pretrained(HybridModel(cfg), path)
    return str(path)


def _build(name, path, dp, cp):
    import harts_planner as hp
    from harts_runtime import StepInputs, load_pretrained

    if name == "nemotron_h":  # Mamba2 + attention + MoE, chunk 8, trees forking on and off the grid
        return test_parallel_mamba2._build(path, dp, cp)
    if name == "debug":
        return _build_cp(name, path, dp, cp)
    # the checkpoints at chunk 8 (a folder loads at 64, the grid then cuts only between trees)
    model = load_pretrained(path, dtype="float32", chunk_size=CHUNK)
    batch = _batch(model.config.vocab_size)
    assert max(batch.lengths) > T[cp] and max(batch.lengths) <= cp * T[cp], batch.lengths
    step = StepInputs.synthetic(batch, seed=1, vocab_size=model.config.vocab_size)
    return model, step, hp.plan_step(batch, dp, T[cp], CHUNK, cp_size=cp)


def _alternate(self, split, n):
    """:meth:`CpChooser.choose` with both modes by turns where a block can run both."""
    return [can[0] if len(can) == 1 or split is None else can[i % 2] for i, can in enumerate(self.possible)]


def _worker(rank, world, name, path, dims_kw, keep, cp_mode):
    from harts_runtime.engine import microbatch_call_plan
    from harts_runtime.microbatch import make_microbatch
    from harts_runtime.parallel.context_states import CpChooser

    choose = CpChooser.choose
    if cp_mode == "alternate":  # this process only (spawned), this case only
        CpChooser.choose, cp_mode = _alternate, "auto"
    try:
        dims = ParallelDims(world_size=world, **dims_kw)
        mesh = dims.build_mesh()
        model, step, plan = _build(name, path, dims.dp, dims.cp)
        out = train_parallel(model, step, plan, mesh, keep, cp_mode=cp_mode)
        out["chosen"] = []  # the mode every mixer ran in each of this replica's microbatches
        for mb in plan.microbatches[mesh.coords["replica"] :: dims.dp]:
            traj = np.asarray(mb, dtype=np.int64)
            st = make_microbatch(model, step, traj, "compact", microbatch_call_plan(model, step, traj)).stats
            out["chosen"].append({k: v for k, v in st.items() if k.startswith("cp_states/")})
    finally:
        CpChooser.choose = choose
    return out


def _split_shape(name, path, cp):
    """The receives (rows entered from a state handed on by an earlier rank), the most ranks back a
    receive's state comes from, and the replay rows of receives, over the step's microbatches."""
    import harts_planner as hp

    model, step, plan = _build(name, path, 1, cp)
    receives, back, replay = 0, 0, 0
    for mb in plan.microbatches:
        s = hp.plan_cp(
            step.batch, np.asarray(mb), cp, model.config.chunk_size, conv_width=model.config.conv_size
        )
        receives += s.num_receives
        for i in range(s.num_receives):
            if s.receive_state[i] >= 0:
                back = max(back, int(s.receive_rank[i]) - int(s.state_rank[s.receive_state[i]]))
            replay += len(s.replay(i))
    return receives, back, replay


@pytest.fixture(scope="module")
def spawns(request, checkpoints):
    """The cases' ranks, one spawn per world size (``spawn_cases``)."""
    engine = "test_engine_cp_mode_states_reports_the_choice_and_matches_one_process"
    cases = {engine: (2, _engine_worker, ())}
    for case, (name, world, dims_kw, keep, cp_mode) in CASES.items():
        cases[case] = (world, _worker, (name, checkpoints.get(name), dims_kw, keep, cp_mode))
    return SharedSpawns(cases, selected_cases(request, "test_cp_states_step_matches_one_process", engine))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_cp_states_step_matches_one_process(case, checkpoints, spawns):
    name, world, dims_kw, keep, cp_mode = CASES[case]
    path = checkpoints.get(name)
    dims = ParallelDims(world_size=world, **dims_kw)
    receives, back, replay = _split_shape(name, path, dims.cp)
    assert receives > 0  # states cross the ranks' cuts (not only whole trees per rank)
    if dims.cp >= 4:
        assert back >= 2 and replay > 0
    results = spawns.results(case)
    chosen = {v for r in results for mb in r["chosen"] for v in mb.values()}
    both = cp_mode == "alternate" or (cp_mode == "auto" and dims.cp < 8)
    assert chosen == ({0, 1} if both else {1}), chosen  # auto: both ran
    _check(results, train_single(*_build(name, path, dims.dp, dims.cp), keep), tol_logprob=TOL_LOGPROB_CP)


def _engine_worker(rank, world):
    from test_parallel_cp import T, _batch

    from harts_runtime import StepInputs
    from harts_runtime.engine import EngineConfig, HartsEngine

    torch.manual_seed(0)  # test_parallel_cp's engine config, states mode
    config = EngineConfig(
        lr=1e-3, eps=1e-6, capacity=T[2], max_grad_norm=0.05, warmup_steps=1, cp_mode="states"
    )
    engine = HartsEngine.build(
        "debug", config, ParallelDims(world_size=world, cp=2), dtype="float32", num_heads=4
    )
    step = StepInputs.synthetic(_batch(engine.vocab_size), seed=1, vocab_size=engine.vocab_size)
    out = engine.forward_backward(step)
    return out.loss, out.logprobs, out.metrics


@pytest.mark.slow
def test_engine_cp_mode_states_reports_the_choice_and_matches_one_process(request, spawns):
    """``EngineConfig(cp_mode="states")`` under ``cp = 2``: the step's metrics count the microbatches
    each mixer ran by state passing, and the loss and log-probs are one process's."""
    from test_parallel_cp import _engine_single

    results = spawns.results(request.node.name)
    want_loss, want_lp, _, _ = _engine_single()["steps"][0]
    for loss, lp, metrics in results:
        blocks = {k: v for k, v in metrics.items() if k.startswith("cp_states/")}
        assert blocks == {f"cp_states/blocks.{i}": metrics["microbatches"] for i in range(4)}, blocks
        assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
        torch.testing.assert_close(lp, want_lp, rtol=0, atol=TOL_LOGPROB_CP)
