"""The state-passing local plans (``harts_runtime.parallel.context_states``) in one process: every
rank's local call plan, summaries, fold and rerun, simulated rank by rank with the all-gather
replaced by a concatenation, against the one-process KDA schedule of the whole microbatch (float64,
random trees, the KDA core with KDA and GDN gates and Mamba2's SSD core, C = 2, 3, 4, 8); the
pruned summary run against the whole local plan's; the local convolution windows against the
microbatch's; and the one-line errors of ``cp_mode``."""

import numpy as np
import pytest
import torch

import harts_planner as hp
from harts_runtime.errors import InvalidInputError
from harts_runtime.layers.kda import _run_rounds
from harts_runtime.layout.rows import compact_layout
from harts_runtime.parallel.context_states import CpChooser, cp_rows_plan, fold, run_local, summaries
from harts_runtime.testing import synthetic_tree_batch

B, W, H, K, V = 8, 4, 2, 4, 3


def _microbatch(seed):
    rng = np.random.default_rng(seed)
    batch = synthetic_tree_batch(
        seed, prompt=int(rng.integers(3, 30)), turns=3, turn_len=(3, 14), fork_prob=0.7, fanout=2, vocab=50
    )
    traj = np.arange(len(np.asarray(batch.lengths)), dtype=np.int64)
    call_plan = hp.plan_calls(batch, B, microbatch=traj, conv_width=W)
    return batch, traj, call_plan, compact_layout(batch, call_plan)


def _features(n, seed, core):
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    q = torch.nn.functional.normalize(torch.randn(n, H, K, **f64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(n, H, K, **f64), dim=-1)
    v = torch.randn(n, H, V, **f64)
    gate = -torch.rand(n, H, **f64) if core in ("gdn", "ssd") else -torch.rand(n, H, K, **f64)
    return q, k, v, gate, None if core == "ssd" else torch.rand(n, H, **f64)


def _simulate(seed, C, core):
    from harts_runtime.layers import mamba2

    batch, traj, call_plan, layout = _microbatch(seed)
    n = layout.num_rows
    feats = _features(n, seed, core)
    if core == "ssd":
        want = mamba2._run_rounds(layout.kda.replay, *feats[:4], B, "naive")  # physical order
    else:
        want = _run_rounds(layout.kda.replay, *feats, B, "naive")
    split = hp.plan_cp(batch, traj, C, B, conv_width=W)
    r2p = np.asarray(call_plan.row_to_physical, dtype=np.int64)
    ranks = [cp_rows_plan(layout, split, r, r2p) for r in range(C)]
    by_row = [None if t is None else t[torch.from_numpy(r2p)] for t in feats]
    local = []
    for rows in ranks:
        lo, hi = rows.block
        e = torch.from_numpy(np.concatenate([np.arange(lo, hi), rows.local.halo]).astype(np.int64))
        local.append([None if t is None else t[e] for t in by_row])
    m = ranks[0].local.max_sends
    assert all(r.local.max_sends == m for r in ranks)
    parts, width = [], K * V + (1 if core == "ssd" else K * K)
    for rows, f in zip(ranks, local):  # every rank's summaries, all-gathered
        s, _ = summaries(rows.local, *f, chunk_size=B, backend="naive")
        s = torch.zeros(0, H, width, dtype=torch.float64) if s is None else s
        parts.append(torch.cat([s, s.new_zeros(m - s.shape[0], H, width)]))
    gathered = torch.cat(parts)
    got = []
    for rows, f in zip(ranks, local):
        entry = fold(rows.local, gathered, K, V) if rows.local.num_entries else []
        o, _ = run_local(rows.local.sched, *f, entry, chunk_size=B, backend="naive")
        got.append(o)
    err = float((torch.cat(got) - want[torch.from_numpy(r2p)]).abs().max())
    back = [
        int(split.receive_rank[i]) - int(split.state_rank[split.receive_state[i]])
        for i in range(split.num_receives)
        if split.receive_state[i] >= 0
    ]
    replay = sum(len(split.replay(i)) for i in range(split.num_receives))
    windows_ok = all(
        np.array_equal(r.local.conv.index.numpy()[r.local.conv_exact], r.local.conv_table[r.local.conv_exact])
        for r in ranks
    )
    return err, back, replay, windows_ok, all(r.identity for r in ranks)


def test_local_plans_equal_the_one_process_schedule():
    backs, replays, permuted = [], 0, 0
    for seed in range(6):
        for C in (2, 3, 4, 8):
            err, back, replay, windows_ok, identity = _simulate(seed, C, ("kda", "gdn", "ssd")[seed % 3])
            assert err <= 1e-12, (seed, C, err)
            assert windows_ok, (seed, C)
            backs += back
            replays += replay
            permuted += not identity
    # the trees exercise what the plans must get right: states two or more ranks back, forks whose
    # replay rows live on earlier ranks, and physical orders that differ from the split's rows
    assert max(backs) >= 2 and replays > 0 and permuted > 0


class _Block:
    def __init__(self, kind):
        self.mixer, self.mixer_kind, self.ffn = torch.nn.Identity(), kind, None


class _Model(torch.nn.Module):
    def __init__(self, kinds):
        super().__init__()
        self.blocks = [_Block(k) for k in kinds]


def test_the_summary_run_prunes_to_the_sends_and_equals_the_full_run():
    """A rank's summary run (``LocalPlan.summary``: the pieces leading to its sends, each cut after
    its last needed boundary) gives the summaries of the whole local plan (float64, within 1e-12)
    and packs fewer rows on these trees."""
    full_rows = pruned_rows = 0
    for seed in range(6):
        core = ("kda", "gdn", "ssd")[seed % 3]
        batch, traj, call_plan, layout = _microbatch(seed)
        r2p = np.asarray(call_plan.row_to_physical, dtype=np.int64)
        for C in (3, 4, 8):
            split = hp.plan_cp(batch, traj, C, B, conv_width=W)
            for r in range(C):
                plan = cp_rows_plan(layout, split, r, r2p).local
                if plan.summary is None:
                    continue
                f = _features(plan.rows, 100 * seed + r, core)
                got, _ = summaries(plan, *f, chunk_size=B, backend="naive")
                plan.summary = None  # the whole local plan
                want, _ = summaries(plan, *f, chunk_size=B, backend="naive")
                assert float((got - want).abs().max()) <= 1e-12 * max(1.0, float(want.abs().max()))
                full_rows += plan.sched.packed_rows
                pruned_rows += cp_rows_plan(layout, split, r, r2p).local.summary.packed_rows
    assert 0 < pruned_rows < full_rows, (pruned_rows, full_rows)


def test_cp_mode_errors_are_one_line_naming_the_field():
    from harts_runtime import EngineConfig

    with pytest.raises(InvalidInputError) as e:
        EngineConfig(cp_mode="rows")
    assert e.value.field == "cp_mode" and "\n" not in str(e.value)
    with pytest.raises(InvalidInputError) as e:
        CpChooser.of(_Model(["kda", "hyena"]), "states", 2, tp=2)  # a kind states does not run
    assert e.value.field == "cp_mode" and "hyena" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(InvalidInputError) as e:
        CpChooser.of(_Model(["kda"]), "columns", 2)
    assert e.value.field == "cp_mode" and "heads" in str(e.value)


def test_a_split_past_the_per_rank_capacity_is_one_line():
    from harts_runtime import HybridModel, StepInputs, model_config
    from harts_runtime.microbatch import make_microbatch
    from harts_runtime.parallel.context_states import attach_cp_rows

    class Mesh:
        def size(self):
            return 4

        def get_local_rank(self):
            return 0

    model = HybridModel(model_config("debug", num_heads=4, dtype="float32"))
    # one 60-row path fits C x T = 4 x 15 rows, but cuts fall on the chunk grid (B = 8): 16 rows a rank
    batch = hp.RolloutBatch.from_token_lists([list(range(1, 61))])
    step = StepInputs.synthetic(batch, seed=1, vocab_size=model.config.vocab_size)
    call_plan = hp.plan_calls(batch, model.config.chunk_size, microbatch=np.array([0]), conv_width=4)
    mb = make_microbatch(model, step, np.array([0]), "compact", call_plan)
    chooser = CpChooser.of(model, "states", 4)
    assert hp.plan_step(batch, 1, 15, 8, cp_size=4).cp_size == 4
    with pytest.raises(InvalidInputError) as e:
        attach_cp_rows(step, mb, call_plan, cp_mesh=Mesh(), chooser=chooser, capacity=15)
    assert e.value.field == "cp" and "capacity 15" in str(e.value) and "\n" not in str(e.value)
    attach_cp_rows(step, mb, call_plan, cp_mesh=Mesh(), chooser=chooser)  # unchecked: served
    assert mb.layout.info["cp_rows"].modes == ["states"] * 4
