"""``harts_runtime.parallel.cp_cost``: both CP modes' per-layer bytes against explicit per-collective
sums (a simulated exchange between the ranks), the time on a link, and the ``auto`` choice (it flips
at the crossover, falls back to ``"states"`` when ``"heads"`` is impossible, agrees on every rank)."""

import random

import pytest

from harts_runtime.errors import InvalidInputError
from harts_runtime.parallel import cp_cost as cc

KDA = cc.Mixer("kda", 16, 16, 128, 128, 16 * 384, 4)
GDN = cc.Mixer("gdn", 16, 32, 128, 128, 2 * 16 * 128 + 32 * 128, 4)
MAMBA2 = cc.Mixer("mamba2", 128, 128, 128, 64, 128 * 64 + 2 * 8 * 128, 4, groups=8)
MLA = cc.Mixer("mla", 16, latent=576, q_head=192, v_head=128)
GQA = cc.Mixer("gqa", 32, kv_heads=8, head_dim=128)
GATED = cc.Mixer("gated_attention", 16, kv_heads=2, head_dim=256)
ALL = [KDA, GDN, MAMBA2, MLA, GQA, GATED]
FREE = cc.Link(1e9, 0.0)  # bytes only


def _blocks(n, c):
    per = -(-n // c) if n else 0
    return [max(0, min(n, (r + 1) * per) - min(n, r * per)) for r in range(c)], per


def _simulated_heads(mix, d, n, c, s, recompute):
    """Bytes each rank receives in ``"heads"``, by walking every (source, destination) pair of every
    collective: shards padded to ``ceil(n / c)`` rows for all-gathers and reduce-scatters, the
    all-to-alls moving each rank's rows of each rank's heads."""
    blocks, per = _blocks(n, c)
    got = [0] * c
    for dst in range(c):
        for src in range(c):
            if src == dst:
                continue
            if mix.kind == "mla":
                q, o = mix.heads * mix.q_head // c, mix.heads * mix.v_head // c
                fwd = per * mix.latent + blocks[src] * q + blocks[dst] * o  # latent, rows->heads, heads->rows
                bwd = per * mix.latent + blocks[dst] * q + blocks[src] * o
            else:
                fwd = 2 * per * d  # the input's shard from src, src's partial of dst's block
                bwd = 2 * per * d
            got[dst] += (fwd * (2 if recompute else 1) + bwd) * s
    return got


@pytest.mark.parametrize("mix", ALL, ids=lambda m: m.kind)
@pytest.mark.parametrize("recompute", [False, True])
def test_heads_bytes_equal_the_simulated_exchange(mix, recompute):
    rng = random.Random(7)
    for _ in range(20):
        c = rng.choice([2, 4, 8, 16])
        n = rng.randrange(0, 5000)
        d = rng.choice([64, 1536, 2304])
        s = rng.choice([2, 4])
        mc = cc.mode_costs(mix, d, n, c, FREE, act_bytes=s, recompute=recompute, heads_available=True)
        want = _simulated_heads(mix, d, n, c, s, recompute)
        assert mc["heads"].received == max(want), (mix.kind, n, c)
        per_pass = 3 if mix.kind == "mla" else 2
        assert mc["heads"].calls == per_pass * (3 if recompute else 2)


@pytest.mark.parametrize("mix", ALL, ids=lambda m: m.kind)
def test_states_bytes_equal_the_explicit_sums(mix):
    rng = random.Random(11)
    for _ in range(20):
        c = rng.choice([2, 4, 8, 32, 64])
        n = rng.randrange(1, 100_000)
        d, s = 2048, 2
        pieces = rng.randrange(1, 6)
        halo = rng.randrange(0, 300)
        attn = rng.choice([None, rng.randrange(0, n)])
        shape = cc.SplitShape(pieces, halo, attn)
        got = cc.mode_costs(mix, d, n, c, FREE, split=shape, act_bytes=s, recompute=True)["states"]
        if mix.kind in ("kda", "gdn"):  # per state head K x V state + K x K transition, fp32
            one = mix.state_heads * (mix.k * mix.v + mix.k * mix.k) * 4
            per_pass = (c - 1) * pieces * one + halo * d * s
        elif mix.kind == "mamba2":  # per head P x N state + one decay
            one = mix.state_heads * (mix.k * mix.v + 1) * 4
            per_pass = (c - 1) * pieces * one + halo * d * s
        else:
            width = mix.latent if mix.kind == "mla" else 2 * mix.kv_heads * mix.head_dim
            rows = (c - 1) * -(-n // c) if attn is None else attn
            per_pass = rows * width * s
        assert got.received == 3 * per_pass, (mix.kind, c, n)
        if mix.kind in cc.LINEAR_KINDS:  # independent of the microbatch's rows
            again = cc.mode_costs(mix, d, 2 * n, c, FREE, split=shape, act_bytes=s)["states"]
            assert again.received == got.received


def test_time_is_bytes_over_bandwidth_plus_latency_and_the_extra_compute():
    link = cc.Link(100e9, 50e-6)
    mc = cc.mode_costs(KDA, 1536, 65_536, 4, link, states_extra_s=0.25)
    for mode in ("heads", "states"):
        m = mc[mode]
        assert m.seconds == pytest.approx(m.received / 100e9 + m.calls * 50e-6 + m.extra_s)
    assert mc["states"].extra_s == 0.25 and mc["heads"].extra_s == 0.0


@pytest.mark.parametrize("mix", [KDA, GDN, MAMBA2], ids=lambda m: m.kind)
@pytest.mark.parametrize("c", [2, 4, 8, 16])
def test_the_choice_flips_at_the_crossover(mix, c):
    d = 2048
    nstar = cc.crossover_rows(mix, d, c, 2)
    # rows that are multiples of C, so the padded shards are exact
    below = (int(nstar) // c - 1) * c
    above = (int(nstar) // c + 2) * c
    assert below > 0
    if not cc.heads_possible(mix, c)[0]:  # Mamba2's 8 groups over 16 ranks: no crossover to cross
        assert cc.choose_cp_mode(mix, d, below, c, FREE) == "states"
        return
    assert cc.choose_cp_mode(mix, d, below, c, FREE) == "heads"
    assert cc.choose_cp_mode(mix, d, above, c, FREE) == "states"
    # the summary pass's compute moves the crossover up
    assert cc.choose_cp_mode(mix, d, above, c, FREE, states_extra_s=1.0) == "heads"


def test_attention_prefers_the_gathered_kv_over_head_parallel_rows():
    # GQA / gated attention gather 2 H_kv d_h < 2 D values per row; MLA the latent alone
    for mix, d in ((GATED, 2048), (GQA, 4096), (MLA, 1536)):
        mc = cc.mode_costs(mix, d, 262_144, 8, FREE)
        assert mc["states"].received < mc["heads"].received and mc["choice"] == "states"
    # an MHA layer whose K and V are as wide as its hidden rows: the same bytes per row in both
    # modes, and on the tie "heads" (the one-process math)
    mha = cc.Mixer("gqa", 16, kv_heads=16, head_dim=64)
    mc = cc.mode_costs(mha, 1024, 4096, 4, FREE, recompute=False)
    assert mc["heads"].received == mc["states"].received and mc["choice"] == "heads"


def test_states_when_heads_are_impossible():
    tiny = 64  # far below the crossover: "heads" would move fewer bytes
    assert cc.choose_cp_mode(KDA, 1536, tiny, 2, FREE) == "heads"
    mc = cc.mode_costs(KDA, 1536, tiny, 32, FREE)  # 16 heads over 32 ranks
    assert not mc["heads"].possible and "num_heads = 16" in mc["heads"].reason
    assert mc["choice"] == "states"
    assert cc.choose_cp_mode(KDA, 1536, tiny, 4, FREE, tp=8) == "states"  # tp * cp = 32
    assert cc.choose_cp_mode(MAMBA2, 4096, tiny, 2, FREE, heads_available=False) == "states"
    ok, why = cc.heads_possible(MAMBA2, 16)  # 8 groups over 16 ranks
    assert not ok and "n_groups" in why
    # GQA: the CP degree must divide the KV heads or be a multiple of them
    assert cc.heads_possible(cc.Mixer("gqa", 12, kv_heads=2, head_dim=64), 4)[0]
    assert not cc.heads_possible(cc.Mixer("gqa", 12, kv_heads=3, head_dim=64), 2)[0]
    assert cc.heads_possible(KDA, 1) == (True, "")


def test_every_rank_chooses_alike_from_the_split_wide_shape():
    # mode_costs takes the most any rank receives, so the answer has no rank argument at all;
    # "heads" is evaluated over every rank (uneven blocks: the all-to-alls differ per rank)
    n, c = 1001, 4
    mc = cc.mode_costs(MLA, 1536, n, c, FREE, recompute=False)
    per_rank = [
        sum(
            r["received"]
            for p in ("forward", "backward")
            for r in cc.head_parallel_mixer(MLA, 1536, n, c, k, 2)[p]
        )
        for k in range(c)
    ]
    assert len(set(per_rank)) > 1 and mc["heads"].received == max(per_rank)


def test_one_rank_moves_nothing():
    for mix in ALL:
        mc = cc.mode_costs(mix, 512, 1000, 1, cc.Link.NVLINK, states_extra_s=3.0)
        assert mc["heads"].received == mc["states"].received == 0 and mc["states"].seconds == 0
        assert mc["choice"] == "heads"


@pytest.mark.parametrize(
    "call,field",
    [
        (lambda: cc.Mixer("mamba3", 4), "kind"),
        (lambda: cc.Mixer("kda", 0, 1, 1, 1), "heads"),
        (lambda: cc.Mixer("gqa", 4), "kv_heads"),
        (lambda: cc.Link(0, 1e-6), "link.bytes_per_s"),
        (lambda: cc.SplitShape(pieces=-1), "split.pieces"),
        (lambda: cc.mode_costs(KDA, 1536, 100, 0, FREE), "cp"),
        (lambda: cc.mode_costs(KDA, 1536, -1, 2, FREE), "rows"),
        (lambda: cc.mode_costs(KDA, 1536, 100, 2, FREE, act_bytes=3), "act_bytes"),
        (lambda: cc.mode_costs(KDA, 1536, 100, 2, "nvlink"), "link"),
        (lambda: cc.mode_costs(KDA, 1536, 100, 2, FREE, states_extra_s=-1), "states_extra_s"),
        (lambda: cc.crossover_rows(MLA, 1536, 2, 2), "kind"),
    ],
)
def test_bad_input_names_the_field(call, field):
    with pytest.raises(InvalidInputError) as e:
        call()
    assert e.value.field == field and str(e.value).startswith(field + ":")


def test_mixers_of_reads_the_configs():
    from harts_runtime import model_config

    kimi = cc.mixers_of(model_config("kimi-linear-tiny"))
    assert [m.kind for m in kimi] == ["kda", "mla", "kda", "mla"]
    assert (kimi[0].heads, kimi[0].k, kimi[0].v) == (2, 16, 16) and kimi[1].latent == 16 + 8
    nem = cc.mixers_of(model_config("nemotron-h-tiny"))
    m2 = next(m for m in nem if m is not None and m.kind == "mamba2")
    assert (m2.heads, m2.k, m2.v, m2.groups, m2.conv_channels) == (4, 16, 16, 2, 4 * 16 + 2 * 2 * 16)
    assert m2.summary_elements == 4 * (16 * 16 + 1)
    assert None in nem and any(m is not None and m.kind == "gqa" for m in nem)
    bad = type("Cfg", (), {"hidden_size": 8, "num_heads": 2, "mixers": ("rwkv",)})()
    with pytest.raises(InvalidInputError, match=r"mixers\[0\]"):
        cc.mixers_of(bad)


def test_split_shape_of_a_planner_split():
    import numpy as np

    import harts_planner as hp
    from harts_runtime.testing import synthetic_tree_batch

    batch = synthetic_tree_batch(
        3, prompt=200, turns=3, turn_len=(40, 90), fork_prob=0.8, fanout=2, vocab=100
    )
    split = hp.plan_cp(batch, None, 4, 16)
    shape = cc.SplitShape.of_split(split)
    assert shape.pieces == int(np.diff(np.asarray(split.send_offsets)).max())
    assert shape.rank_rows == int(np.diff(np.asarray(split.rank_row_offsets)).max())
    assert shape.halo_rows > 0 and shape.halo_sent > 0 and 0 < shape.attention_rows <= split.num_rows
    # one chain: rank r sees every row before its block, the last rank the most
    chain = hp.plan_cp(hp.RolloutBatch.from_token_lists([list(range(1000))]), None, 4, 16)
    assert cc.SplitShape.of_split(chain).attention_rows == int(chain.rank_row_offsets[3])
    one = cc.SplitShape.of_split(chain)
    assert one.pieces == 1 and one.halo_rows == one.halo_sent == split.conv_width - 1  # cuts on the grid
    assert one.attention_sent == 3 * int(chain.rank_row_offsets[1])  # rank 0's rows, to each later rank
