"""Counted communication and memory of context parallelism, both modes (issues 35 and 43).

Three parts, each usable alone:

* **The analytic model.** The per-layer byte formulas of both CP modes live in
  :mod:`harts_runtime.parallel.cp_cost` (the runtime's ``cp_mode="auto"`` chooses with them):
  ``"heads"`` (head-parallel, ``harts_runtime/parallel/context.py``: each mixer all-gathers its
  normed input rows ``[N, D]`` over the CP group and reduce-scatters its partial output; MLA
  all-gathers its ``r_kv + rope`` latent and moves queries / outputs rows <-> heads by all-to-all)
  and ``"states"`` (state passing, ``harts_runtime/parallel/context_states.py``: fp32 affine
  summaries all-gathered, halo rows by all-to-all, attention gathering the K/V or latent of the
  rows its queries see). This file adds what is per model and step: the log-probs and MoE router
  statistics all-reduced over CP, FSDP2's parameter all-gathers and gradient reduce-scatters over
  ``dp_shard x cp``, and the activation rows each rank holds. Conventions: *payload* is the
  collective's full tensor (the all-gather's output, the reduce-scatter's input, the all-reduce's
  tensor, the all-to-all's output); *received* is what one rank receives from the others:
  ``(C - 1) ceil(N / C) w s`` for an all-gather or reduce-scatter of ``[N, w]`` rows (DTensor pads
  every shard to ``ceil(N / C)`` rows), the other ranks' splits for an all-to-all,
  ``2 (C - 1) / C`` of the tensor for an all-reduce (a ring's; NCCL's bus-bandwidth convention).
* **The measurement** (``--measure``, CPU gloo, ``run_distributed``): one training step of the
  ``debug`` model at 4 heads (and of ``ling-tiny``'s layer pattern at tiny widths, 4 heads) under
  ``cp = 2``, ``cp = 4`` (block recomputation) and ``cp = 2 x dp_shard = 2``, on trees whose
  trajectories are longer than the per-rank capacity T, in ``"heads"`` mode and, when the runtime
  has it (``harts_runtime.parallel.context_states`` and ``parallelize(..., cp_mode=...)``), in
  ``"states"`` mode (the ``*-states`` cases; without it they are reported as not run, with the
  reason). A ``TorchDispatchMode`` sees every collective: the DTensor / functional ones
  (``_c10d_functional.*``, the ops ``torch.distributed.tensor.debug.CommDebugMode`` counts) and
  FSDP2's ``c10d`` ones (``_allgather_base_``, ``_reduce_scatter_base_``), attributed to layers by
  torch's ``ModTracker`` (``CommDebugMode``'s own module tracker fails on a module called twice in
  one step: ``IndexError`` in ``_fw_set_module_hook``). The ``torch.distributed`` Python calls are
  wrapped as well and their counts checked against the dispatch-level ones. Every rank's row block
  and the gathered N are recorded per microbatch; in ``"states"`` mode each rank's block, pieces,
  halo rows and attention rows come from ``harts_planner.plan_cp`` of the same microbatch (the
  attention rows exactly: the rows of other ranks on the paths of the rank's rows, from the batch's
  ``row_parent``). Measured and analytic bytes (calls, payload and received, per rank, layer, phase
  and collective) must agree exactly for the mixer, log-prob and router collectives and for FSDP2's
  (per phase and collective), and the Python-level call counts with the dispatched ones (an
  ``AssertionError`` otherwise).
* **The prediction** (marked *predicted* everywhere): step time and memory per rank of a 1M-row
  and a 4M-row agentic tree on ``ling-tiny``, Qwen3.5-35B-A3B, Kimi-Linear-48B-A3B and
  Nemotron-H-8B (the published widths) at C = 8, 16, 32, 64, on one NVLink node (C = 8) and across
  nodes (InfiniBand), in ``"heads"`` (where C divides every mixer's heads), ``"states"`` and
  ``"auto"`` (per layer, :func:`harts_runtime.parallel.cp_cost.choose_cp_mode`), with memory per
  rank including the fp32 AdamW state sharded over ``dp_shard x cp``, and which C first fits each
  tree on 139 GiB H200s. From the analytic bytes and the H200 measurements in
  ``benchmarks/results/`` (one GPU: the one-process step time and peak memory of a 65,303-row
  microbatch; Kimi-Linear and Nemotron-H are not measured: their rate and activation bytes are
  carried over, as the JSON says), with every assumption written into the JSON.

``python benchmarks/cp_eval.py`` (about 4 minutes on 2 cores: 7 gloo cases) writes ``benchmarks/results/cp_eval.json``
and the generated block of ``benchmarks/README.md`` (``--no-readme``: not); ``--quick`` runs the
``debug`` model at ``cp = 2`` only (both modes); ``--no-measure`` only the model and the
prediction. ``tests/benchmarks/test_cp_eval.py`` checks the model's identities and that the README
block is the JSON's (fast) and runs ``--quick`` (slow).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import inspect
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
OUT = os.path.join(RESULTS, "cp_eval.json")
README = Path(HERE) / "README.md"
BEGIN, END = "<!-- cp_eval:begin -->", "<!-- cp_eval:end -->"

from harts_runtime.parallel.cp_cost import (
    FP32,
    LINEAR_KINDS,
    Link,
    Mixer,
    ModelDims,
    SplitShape,
    all_reduce,
    crossover_rows,
    dims_of,
    gather_rows,
    head_parallel_mixer,
    heads_possible,
    heads_to_rows,
    mode_costs,
    record,
    row_block,
    rows_of,
    rows_to_heads,
    scatter_rows,
    state_passing_mixer,
)

__all__ = [  # the model's names, re-exported for the tests and readers of this file
    "Mixer",
    "ModelDims",
    "SplitShape",
    "all_reduce",
    "crossover_rows",
    "dims_of",
    "gather_rows",
    "head_parallel_mixer",
    "heads_to_rows",
    "row_block",
    "rows_of",
    "rows_to_heads",
    "scatter_rows",
    "state_passing_mixer",
]

LOGPROB_BYTES = FP32  # the [P] log-probs are float32
ROUTER_BYTES = FP32  # the 2E + 2 router statistics are float32
MODES = ("heads", "states")


# ================================================================================ per model and step
@dataclasses.dataclass(frozen=True)
class RankSplit:
    """What one rank's ``"states"`` collectives depend on: the most states any rank hands on, the
    halo and attention rows this rank fetches and those fetched from it (None: the bounds of
    ``SplitShape``), and the largest block."""

    pieces: int = 1
    halo_rows: int | None = None
    attention_rows: int | None = None
    rank_rows: int | None = None
    halo_sent: int | None = None
    attention_sent: int | None = None


def rank_split(split: dict, rank: int) -> RankSplit:
    """The :class:`RankSplit` of CP rank ``rank`` from :func:`states_split`'s dict."""
    mine = split["ranks"][rank]
    return RankSplit(
        split["pieces"],
        mine["halo_rows"],
        mine["attention_rows"],
        split["rank_rows"],
        mine["halo_sent"],
        mine["attention_sent"],
    )


def microbatch_collectives(
    dims: ModelDims,
    n: int,
    p: int,
    c: int,
    rank: int = 0,
    recompute: bool = False,
    mode: str = "heads",
    split: RankSplit | None = None,
) -> list[dict]:
    """Every CP collective of one microbatch (``n`` rows, ``p`` targets) on CP rank ``rank`` in
    ``mode`` (``"heads"`` or ``"states"``; ``split``: the rank's numbers in ``"states"``): a list of
    records ``{layer, part, phase, pass, collective, calls, payload, received}``. ``phase``:
    ``forward`` or ``backward`` (what runs during ``loss.backward()``: the backward pass, and the
    recomputed forward when ``recompute``); ``part``: ``mixer``, ``ffn`` (router statistics) or
    ``head`` (log-probs, ``layer = -1``)."""
    if mode not in MODES:
        raise ValueError(f"mode: unknown {mode!r}; choose one of {MODES}")
    out = []
    s = dims.act_bytes
    sp = split or RankSplit()
    for i, (mix, e) in enumerate(zip(dims.mixers, dims.experts)):
        if mix is not None and c > 1:
            if mode == "heads":
                by = head_parallel_mixer(mix, dims.hidden, n, c, rank, s)
            else:
                by = state_passing_mixer(
                    mix,
                    dims.hidden,
                    n,
                    c,
                    s,
                    sp.pieces,
                    sp.halo_rows,
                    sp.attention_rows,
                    sp.rank_rows,
                    sp.halo_sent,
                    sp.attention_sent,
                )
            passes = [("forward", "forward", by["forward"]), ("backward", "backward", by["backward"])]
            if recompute:
                passes.append(("backward", "recompute", by["forward"]))
            for phase, name, recs in passes:
                out += [dict(r, layer=i, part="mixer", phase=phase, **{"pass": name}) for r in recs]
        if e and c > 1:
            r = all_reduce(2 * e + 2, c, ROUTER_BYTES)
            out.append(dict(r, layer=i, part="ffn", phase="forward", **{"pass": "forward"}))
            if recompute:
                out.append(dict(r, layer=i, part="ffn", phase="backward", **{"pass": "recompute"}))
    if c > 1:
        out.append(
            dict(
                all_reduce(p, c, LOGPROB_BYTES), layer=-1, part="head", phase="forward", **{"pass": "forward"}
            )
        )
    return out


def fsdp_unit_shard(shapes, world: int) -> int:
    """Elements of one rank's shard of an FSDP2 unit whose parameters have ``shapes``: FSDP2 pads
    each parameter's dim 0 to a multiple of the world size and all-gathers the concatenation."""
    total = 0
    for shape in shapes:
        shape = tuple(shape) or (1,)
        rest = 1
        for x in shape[1:]:
            rest *= x
        total += -(-shape[0] // world) * rest
    return total


def fsdp_microbatch(units: dict, world: int, s: int, grad_s: int | None = None) -> list[dict]:
    """FSDP2's collectives per microbatch over ``dp_shard x cp`` = ``world``: each unit's parameters
    all-gathered in forward and again in backward (resharded after forward), its gradients
    reduce-scattered once. ``units``: name -> list of parameter shapes."""
    grad_s = grad_s or s
    out = []
    if world == 1:
        return out
    for name, shapes in units.items():
        shard = fsdp_unit_shard(shapes, world)
        ag = record("all_gather", world * shard * s, (world - 1) * shard * s)
        rs = record("reduce_scatter", world * shard * grad_s, (world - 1) * shard * grad_s)
        out += [dict(ag, unit=name, phase="forward"), dict(ag, unit=name, phase="backward")]
        out.append(dict(rs, unit=name, phase="backward"))
    return out


def activation_rows(n: int, c: int, rank: int, dims: ModelDims) -> dict:
    """Rows of activations rank ``rank`` holds for a microbatch of ``n`` rows in ``"heads"``: its
    row block for everything row-local, all ``n`` rows at each mixer for the gathered input
    ``[n, D]`` and the partial output (transient), and its ``1 / C`` of the heads over all rows
    (the same elements as ``n / C`` rows of every head)."""
    return {
        "row_block": rows_of(n, c, rank),
        "gathered_rows": n if c > 1 else 0,
        "head_rows_equivalent": n / c,
        "transient_bytes_per_mixer": 2 * n * dims.hidden * dims.act_bytes if c > 1 else 0,
    }


def summarize(records: list[dict], key=("layer", "part", "collective")) -> dict:
    out = defaultdict(lambda: {"calls": 0, "payload": 0, "received": 0})
    for r in records:
        k = tuple(r[x] for x in key)
        o = out[k]
        o["calls"] += r["calls"]
        o["payload"] += r["payload"]
        o["received"] += r["received"]
    return dict(out)


# ================================================================================ prediction
ASSUMPTIONS = {
    "links": {
        "nvlink": {
            "GBps": Link.NVLINK.bytes_per_s / 1e9,
            "latency_s": Link.NVLINK.latency_s,
            "note": (
                "per-rank receive rate of an all-gather / reduce-scatter / all-to-all inside one 8-GPU "
                "H200 NVSwitch node at messages of 100s of MB: NVLink 4 is 450 GB/s per direction, "
                "nccl-tests bus bandwidth about 360 GB/s; assumed, not measured (no multi-GPU machine lent)"
            ),
        },
        "infiniband": {
            "GBps": Link.INFINIBAND.bytes_per_s / 1e9,
            "latency_s": Link.INFINIBAND.latency_s,
            "note": (
                "a CP group across nodes: 400 Gb/s InfiniBand per GPU (one NIC each), about 50 GB/s, "
                "100 us per collective call; the ring's slowest link sets the rate; assumed"
            ),
        },
    },
    "scenarios": (
        "C = 8 on one node (NVLink) and across 8 nodes (InfiniBand, one rank per node); C = 16, 32, "
        "64 across nodes (InfiniBand); one tree per CP group, dp_shard = 1 (the job is the CP group), "
        "memory and time per rank"
    ),
    "overlap": (
        "the CP collectives run on the compute stream between a mixer's projections: not overlapped, "
        "added to the step time; FSDP2's all-gathers are prefetched and its reduce-scatters run beside "
        "the next unit's backward: overlapped, reported apart"
    ),
    "hbm_GiB": 139.0,
    "tree_keys": (
        "attention keys of the tree's compact rows = keys_fraction x N^2; keys_fraction = 0.2947, "
        "that of the measured 65,303-row swe-like microbatch (1,256,935,920 keys); a single chain "
        "would be 0.5"
    ),
    "keys_fraction": 1_256_935_920 / 65_303**2,
    "targets_fraction": "P = N (every compact row a target: an upper bound for the log-prob all-reduce)",
    "split": {
        "pieces": 4,
        "halo_rows": 4 * (3 + 63),
        "attention_rows": None,
        "note": (
            "states mode: each rank hands on 4 states (its cut's open path and 3 forks whose later "
            "children live on later ranks), receives 4 times (3 conv rows + up to 63 replay rows "
            "each), and its attention layers gather the all-gather bound (every other rank's "
            "block: what a chain's last rank sees); balanced blocks of ceil(N / C) rows"
        ),
    },
    "compute_scaling": (
        "one-process F/B/Grad time on the H200 scaled by the model FLOPs "
        "(harts_runtime.flops.model_flops of N rows and keys_fraction N^2 keys) and divided by C "
        "(heads: every mixer's heads and every row-local op's rows split evenly; states: the split "
        "balances linear work + attention over visible keys); kernel efficiency at H/C heads and N/C "
        "rows assumed equal to the measured one. states adds its summary pass: one more training "
        "pass of every linear-attention core (flops.layer_costs' linear_core, x3) on the rank's rows"
    ),
    "unmeasured_models": (
        "Kimi-Linear-48B-A3B and Nemotron-H-8B have no H200 run: their one-process time is their "
        "model FLOPs at the achieved FLOP rate of a measured model with the same kind of kernels "
        "(Kimi-Linear: ling-tiny's, KDA + MLA; Nemotron-H: Qwen3.5-35B-A3B's, a chunkwise linear "
        "core + GQA-family attention), their activation bytes per row the two measured models' mean "
        "bytes per row, layer half (mixer or FFN) and hidden unit x their layer halves x D"
    ),
    "memory": (
        "per rank: fp32 AdamW training state of every parameter (fp32 master, fp32 gradient, m, v: "
        "16 bytes) sharded over dp_shard x cp (FSDP2 with bf16 compute), plus the largest FSDP unit "
        "unsharded twice in bf16 (all-gather and prefetch) and once as its fp32 gradient before the "
        "reduce-scatter, plus the activation bytes per row (one-process peak minus its bf16 "
        "parameters and gradients, at 65,303 rows) x the rank's rows, plus the mode's transients: "
        "heads 4 [N, D] bf16 tensors at a mixer (gathered input, partial output, and in backward the "
        "gathered output gradient and the partial input gradient); states the gathered K/V or latent "
        "rows of an attention layer and their gradients (bf16)"
    ),
    "transient_nd": 4,
}

#: The published widths of the models without a measured run (their Hugging Face config.json:
#: moonshotai/Kimi-Linear-48B-A3B-Instruct, nvidia/Nemotron-H-8B-Base-8K), built by their family's
#: own ``from_hf_config``.
PUBLISHED = {
    "kimi-linear-48b-a3b": (
        "kimi_linear",
        dict(
            model_type="kimi_linear",
            vocab_size=163840,
            hidden_size=2304,
            intermediate_size=9216,
            moe_intermediate_size=1024,
            num_hidden_layers=27,
            num_attention_heads=32,
            num_key_value_heads=32,
            num_shared_experts=1,
            routed_scaling_factor=2.446,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            num_experts=256,
            num_experts_per_token=8,
            first_k_dense_replace=1,
            moe_layer_freq=1,
            moe_router_activation_func="sigmoid",
            moe_renormalize=True,
            use_grouped_topk=True,
            num_expert_group=1,
            topk_group=1,
            tie_word_embeddings=False,
            mla_use_nope=True,
            linear_attn_config=dict(
                kda_layers=[i for i in range(1, 28) if i % 4 and i != 27],
                full_attn_layers=[4, 8, 12, 16, 20, 24, 27],
                num_heads=32,
                head_dim=128,
                short_conv_kernel_size=4,
            ),
        ),
    ),
    "nemotron-h-8b": (
        "nemotron_h",
        dict(
            model_type="nemotron_h",
            vocab_size=131072,
            hidden_size=4096,
            hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
            num_hidden_layers=52,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=21504,
            mamba_num_heads=128,
            mamba_head_dim=64,
            ssm_state_size=128,
            n_groups=8,
            conv_kernel=4,
            mlp_hidden_act="relu2",
            tie_word_embeddings=False,
            use_conv_bias=True,
            use_bias=False,
        ),
    ),
}

MEASURED_ANCHORS = {
    # one-process H200 measurements (bf16, 65,303-row swe-like microbatch, block recomputation with
    # the attention and linear-attention cores kept)
    "ling-tiny": {"files": ["issue26_gpu/tuned/te24_tuned/train_eval.json"], "layers": [24]},
    "qwen3.5-35b-a3b": {
        "files": [
            "issue15_gpu_s5/te_qwen35_keep2/train_eval.json",  # 4 layers: G G G GA
            "issue15_gpu_s5/te_qwen35_8/train_eval.json",  # 8 layers
        ],
        "layers": [4, 8],
    },
}
RATE_FROM = {"kimi-linear-48b-a3b": "ling-tiny", "nemotron-h-8b": "qwen3.5-35b-a3b"}
FLAVORS = ("ling-tiny", "qwen3.5-35b-a3b", "kimi-linear-48b-a3b", "nemotron-h-8b")
SIZES = (1_048_576, 4_194_304)
CPS = (8, 16, 32, 64)


@functools.cache
def config_of(flavor: str):
    """The ``ModelConfig`` (bf16) of a prediction flavor: a named one, or a published config."""
    if flavor in PUBLISHED:
        family, hf = PUBLISHED[flavor]
        mod = importlib.import_module(f"harts_runtime.models.{family}.args")
        return mod.from_hf_config(hf, dtype="bfloat16")
    from harts_runtime import model_config

    return model_config(flavor).replace(dtype="bfloat16")


@functools.cache
def param_counts(flavor: str) -> dict:
    """Parameters of the whole model, of its largest FSDP unit (a block, the embedding, or the LM
    head) and of the embedding + LM head, from the per-row FLOPs of ``harts_runtime.flops``
    (a matmul of ``i x o`` weights costs ``2 i o`` per row) plus the short convolutions and all
    routed experts (the FLOPs count ``top_k``); norms and per-head vectors are left out (under
    0.1%). No model is built (a meta-device ``HybridModel`` of these widths still allocates
    host memory)."""
    from harts_runtime.flops import layer_costs

    cfg = config_of(flavor)
    per = layer_costs(cfg)["per_layer"]
    d, w = cfg.hidden_size, cfg.conv_size
    mo = cfg.moe
    n_mm = 2 if mo.activation == "relu2" else 3
    conv = {
        "kda": (2 * cfg.kda.head_k_dim + cfg.kda.head_v_dim) * (cfg.kda.num_heads or cfg.num_heads),
        "gdn": 2 * cfg.gdn.num_k_heads * cfg.gdn.head_k_dim + cfg.gdn.num_v_heads * cfg.gdn.head_v_dim,
        "mamba2": cfg.mamba2.num_heads * cfg.mamba2.head_dim
        + 2 * cfg.mamba2.n_groups * cfg.mamba2.state_size,
    }

    def mixer(kind):
        if kind in (None, "none"):
            return 0
        if kind in conv:  # matmuls from the FLOPs, less the convolution's and the core's, + conv weights
            core = _linear_core_flops(cfg, kind)
            return int((per[kind] - 2 * w * conv[kind] - core) / 2 + w * conv[kind])
        return int(per[kind] / 2)

    def ffn(kind):
        if kind == "none":
            return 0
        if kind == "moe":
            return int(per["moe"] / 2 + (mo.num_experts - mo.top_k) * n_mm * d * mo.intermediate_size)
        return int(per[kind] / 2)

    blocks = [mixer(m) + ffn(f) for m, f in zip(cfg.mixers, cfg.ffns)]
    embed = head = cfg.vocab_size * d
    return {
        "params": sum(blocks) + embed + head,
        "largest_unit": max([embed, head, *blocks]),
        "embed_and_head": embed + head,
    }


def _load(path: str) -> dict:
    with open(os.path.join(RESULTS, path)) as f:
        return json.load(f)


def _compact_run(doc: dict) -> dict:
    runs = doc["speedup"]["runs"]["compact"]
    return {
        "fbg_s": min(r["fbg_seconds"] for r in runs),
        "peak_GiB": max(r["peak_memory_gib"] for r in runs),
        "rows": runs[0]["rows"],
        "keys": doc["speedup"]["work"]["compact_keys"],
        "model": doc["meta"]["model"],
        "args": {k: doc["meta"]["args"].get(k) for k in ("keep", "fast_autotune", "layers")},
    }


def _halves(cfg) -> int:
    """Layer halves with work (a mixer or an FFN)."""
    return sum(m not in (None, "none") for m in cfg.mixers) + sum(f != "none" for f in cfg.ffns)


@functools.cache
def _measured_anchor(flavor: str) -> dict:
    """The one-process H200 time and activation bytes per row of ``flavor``'s full depth, from the
    measured runs (Qwen3.5-35B-A3B: 4 and 8 layers measured, the 40-layer step extrapolated by
    layer groups, linear in the groups: ``t40 = t4 + 9 (t8 - t4)``, the same for the peak)."""
    from harts_runtime.flops import model_flops

    spec = MEASURED_ANCHORS[flavor]
    runs = [_compact_run(_load(f)) for f in spec["files"]]
    cfg = config_of(flavor)
    full = len(cfg.mixers)
    groups = 0
    if len(runs) == 1:
        t, peak = runs[0]["fbg_s"], runs[0]["peak_GiB"]
    else:
        (a, la), (b, lb) = zip(runs, spec["layers"])
        groups = (full - la) / (lb - la)
        t = a["fbg_s"] + groups * (b["fbg_s"] - a["fbg_s"])
        peak = a["peak_GiB"] + groups * (b["peak_GiB"] - a["peak_GiB"])
    counts = [_load(f)["meta"]["params"] for f in spec["files"]]
    run_params = counts[0] if len(counts) == 1 else int(counts[0] + groups * (counts[1] - counts[0]))
    static = run_params * 4 / 2**30  # the measured recipe: bf16 parameters and gradients
    rows, keys = runs[0]["rows"], runs[0]["keys"]
    flops = model_flops(cfg, rows, keys)
    act = (peak - static) * 2**30 / rows
    return {
        "flavor": flavor,
        "measured": runs,
        "extrapolated": len(runs) > 1,
        "one_process_fbg_s": t,
        "one_process_peak_GiB": peak,
        "rows": rows,
        "keys": keys,
        "run_params": run_params,
        "flops": flops,
        "flop_rate": flops / t,
        "activation_bytes_per_row": act,
        "activation_bytes_per_row_half_hidden": act / (_halves(cfg) * cfg.hidden_size),
    }


def anchor(flavor: str) -> dict:
    """What the prediction of ``flavor`` scales: its achieved FLOP rate and activation bytes per row
    (measured, or carried over: ``ASSUMPTIONS["unmeasured_models"]``), and its parameter counts."""
    cfg = config_of(flavor)
    counts = param_counts(flavor)
    if flavor in MEASURED_ANCHORS:
        out = dict(_measured_anchor(flavor))
    else:
        src = _measured_anchor(RATE_FROM[flavor])
        per = sum(
            _measured_anchor(f)["activation_bytes_per_row_half_hidden"] for f in MEASURED_ANCHORS
        ) / len(MEASURED_ANCHORS)
        out = {
            "flavor": flavor,
            "measured": None,
            "rate_from": RATE_FROM[flavor],
            "flop_rate": src["flop_rate"],
            "activation_bytes_per_row_half_hidden": per,
            "activation_bytes_per_row": per * _halves(cfg) * cfg.hidden_size,
        }
    out.update(counts, layers=len(cfg.mixers), hidden=cfg.hidden_size)
    return out


def _linear_core_flops(cfg, kind: str) -> float:
    """Forward FLOPs per row of one ``kind`` layer's chunkwise core (``flops.layer_costs``)."""
    from harts_runtime.flops import layer_costs

    one = cfg.replace(mixers=(kind,), ffns=("none",))
    return layer_costs(one)["linear_core"]


def predict(
    flavor: str,
    n: int,
    c: int,
    link: str = "nvlink",
    dp_shard: int = 1,
    anc: dict | None = None,
    a: dict = ASSUMPTIONS,
) -> dict:
    """Predicted step time and memory per rank of one ``n``-row tree on ``c`` CP ranks (H200) over
    ``link`` in the three modes (``heads`` None where C does not divide some mixer's heads)."""
    from harts_runtime.flops import model_flops

    anc = anc or anchor(flavor)
    cfg = config_of(flavor)
    dims = dims_of(cfg, 2)
    ln = Link.NVLINK if link == "nvlink" else Link.INFINIBAND
    keys = int(a["keys_fraction"] * n * n)
    t1 = model_flops(cfg, n, keys) / anc["flop_rate"]
    compute = t1 / c
    sp = a["split"]
    shape = SplitShape(sp["pieces"], sp["halo_rows"], sp["attention_rows"], None)
    rank_rows = rows_of(n, c, 0)
    per_layer = []
    totals = {
        m: {"bytes": 0.0, "comm_s": 0.0, "extra_s": 0.0, "possible": True}
        for m in ("heads", "states", "auto")
    }
    for mix in dims.mixers:
        if mix is None:
            continue
        extra = 0.0
        if mix.kind in LINEAR_KINDS:
            extra = 3 * _linear_core_flops(cfg, mix.kind) * rank_rows / anc["flop_rate"]
        mc = mode_costs(
            mix,
            dims.hidden,
            n,
            c,
            ln,
            split=shape,
            act_bytes=2,
            recompute=True,
            states_extra_s=extra,
        )
        for mode in ("heads", "states"):
            t = totals[mode]
            t["bytes"] += mc[mode].received
            t["comm_s"] += mc[mode].seconds - mc[mode].extra_s
            t["extra_s"] += mc[mode].extra_s
            t["possible"] &= mc[mode].possible
            if not mc[mode].possible and "reason" not in t:
                t["reason"] = mc[mode].reason
        ch = mc[mc["choice"]]
        totals["auto"]["bytes"] += ch.received
        totals["auto"]["comm_s"] += ch.seconds - ch.extra_s
        totals["auto"]["extra_s"] += ch.extra_s
        per_layer.append(mc["choice"])
    # per step, not per layer: the log-prob all-reduce and the router statistics (both modes)
    fixed = [r for r in microbatch_collectives(dims, n, n, c, 0, True, "heads") if r["part"] != "mixer"]
    fixed_b = sum(r["received"] for r in fixed)
    fixed_s = ln.seconds(fixed_b, sum(r["calls"] for r in fixed))
    params, unit = anc["params"], anc["largest_unit"]
    static = (16 * params / (dp_shard * c) + (2 * 2 + 4) * unit) / 2**30
    act = anc["activation_bytes_per_row"] * rank_rows / 2**30
    kv_rows = (c - 1) * rank_rows if sp["attention_rows"] is None else sp["attention_rows"]
    kv_width = max([m.kv_width for m in dims.mixers if m is not None] + [0])
    transient = {
        "heads": a["transient_nd"] * n * dims.hidden * 2 / 2**30 if c > 1 else 0.0,
        "states": 2 * (kv_rows + rank_rows) * kv_width * 2 / 2**30 if c > 1 else 0.0,
    }
    transient["auto"] = max(
        transient[m] for m in ("heads", "states") if m == "states" or "heads" in per_layer
    )
    modes = {}
    for mode, t in totals.items():
        if not t["possible"]:
            modes[mode] = {"possible": False, "reason": t["reason"]}
            continue
        mem = static + act + transient[mode]
        comm = t["comm_s"] + fixed_s
        modes[mode] = {
            "possible": True,
            "cp_bytes_per_rank": t["bytes"] + fixed_b,
            "cp_comm_s": comm,
            "extra_compute_s": t["extra_s"],
            "step_s": compute + comm + t["extra_s"],
            "transient_GiB": transient[mode],
            "memory_GiB": mem,
            "fits": mem <= a["hbm_GiB"],
        }
    auto = modes["auto"]
    auto["layers_heads"] = per_layer.count("heads")
    auto["layers_states"] = per_layer.count("states")
    fsdp_bytes = (
        3 * (c * dp_shard - 1) / (c * dp_shard) * params * 2
    )  # 2 all-gathers + 1 reduce-scatter, bf16
    return {
        "predicted": True,
        "flavor": flavor,
        "rows": n,
        "cp": c,
        "link": link,
        "dp_shard": dp_shard,
        "rows_per_rank": rank_rows,
        "compute_s": compute,
        "static_GiB": static,
        "activation_GiB": act,
        "adamw_fp32_GiB": 16 * params / (dp_shard * c) / 2**30,
        "fsdp_bytes_per_rank": fsdp_bytes,
        "fsdp_s_if_not_overlapped": ln.seconds(fsdp_bytes, 0),
        "modes": modes,
        "max_rows_per_rank": max(0, int((a["hbm_GiB"] - static) * 2**30 / anc["activation_bytes_per_row"])),
    }


SCENARIOS = tuple(
    (c, link) for c in CPS for link in (("nvlink", "infiniband") if c == 8 else ("infiniband",))
)


def first_fit(rows: list[dict]) -> list[dict]:
    """Per model, tree size, link kind and mode: the smallest C whose predicted memory fits, and its step."""
    out = []
    for flavor in FLAVORS:
        for n in SIZES:
            for mode in ("heads", "states", "auto"):
                cands = [
                    r
                    for r in rows
                    if r["flavor"] == flavor
                    and r["rows"] == n
                    and r["modes"][mode]["possible"]
                    and r["modes"][mode]["fits"]
                ]
                # the cheapest link the C allows: NVLink at C = 8, InfiniBand above
                cands = [r for r in cands if r["link"] == ("nvlink" if r["cp"] == 8 else "infiniband")]
                best = min(cands, key=lambda r: r["cp"], default=None)
                out.append(
                    {
                        "flavor": flavor,
                        "rows": n,
                        "mode": mode,
                        "cp": best["cp"] if best else None,
                        "link": best["link"] if best else None,
                        "step_s": best["modes"][mode]["step_s"] if best else None,
                        "memory_GiB": best["modes"][mode]["memory_GiB"] if best else None,
                    }
                )
    return out


def prediction_table(sizes=SIZES, scenarios=SCENARIOS) -> dict:
    out = {"predicted": True, "assumptions": ASSUMPTIONS, "anchors": {}, "rows": []}
    for flavor in FLAVORS:
        anc = anchor(flavor)
        out["anchors"][flavor] = anc
        for n in sizes:
            for c, link in scenarios:
                out["rows"].append(predict(flavor, n, c, link, 1, anc))
    out["first_fit"] = first_fit(out["rows"])
    return out


def design_comparison(cps=(2, 4, 8, 16, 32, 64), rows=(65_536, 262_144, 1_048_576, 4_194_304)) -> dict:
    """Bytes per rank and microbatch of one layer, ``"heads"`` against ``"states"`` (one piece, the
    conv halo only, the all-gather bound for attention), per mixer kind of the four models (forward +
    backward + recomputation), and the crossover rows of the linear layers."""
    out = {}
    for flavor in FLAVORS:
        dims = dims_of(config_of(flavor), 2)
        kinds = {}
        for mix in dims.mixers:
            if mix is None or mix.kind in kinds:
                continue
            per = {}
            for c in cps:
                for n in rows:
                    mc = mode_costs(mix, dims.hidden, n, c, Link.NVLINK, act_bytes=2, recompute=True)
                    per[f"C={c},N={n}"] = {
                        "heads": mc["heads"].received if heads_possible(mix, c)[0] else None,
                        "states": mc["states"].received,
                    }
            entry = {"mixer": dataclasses.asdict(mix), "bytes": per}
            if mix.kind in LINEAR_KINDS:
                entry["crossover_rows"] = {c: crossover_rows(mix, dims.hidden, c, 2) for c in cps}
            kinds[mix.kind] = entry
        out[flavor] = {"hidden": dims.hidden, "kinds": kinds}
    return out


# ================================================================================ measurement
CASES = {
    # name: (model, world, dims, recompute, cp_mode)
    "debug-cp2": ("debug", 2, {"cp": 2}, False, "heads"),
    "debug-cp4-recompute": ("debug", 4, {"cp": 4}, True, "heads"),
    "debug-cp2-dp_shard2": ("debug", 4, {"cp": 2, "dp_shard": 2}, False, "heads"),
    "ling-tiny-cp2-recompute": ("ling-tiny", 2, {"cp": 2}, True, "heads"),
    "debug-cp2-states": ("debug", 2, {"cp": 2}, False, "states"),
    "debug-cp4-recompute-states": ("debug", 4, {"cp": 4}, True, "states"),
    "ling-tiny-cp2-recompute-states": ("ling-tiny", 2, {"cp": 2}, True, "states"),
}
QUICK = ("debug-cp2", "debug-cp2-states")
T = {2: 32, 4: 16}  # per-rank capacity: microbatches of up to 64 rows at either C


def _model(name: str):
    import torch

    from harts_runtime import HybridModel, model_config

    torch.manual_seed(0)
    if name == "debug":
        cfg = model_config("debug", num_heads=4, dtype="float32")
    else:  # ling-tiny's pattern (3 KDA + 1 MLA, dense first FFN, MoE with a shared expert) at
        # tiny widths and 4 heads, 8 layers
        sys.path.insert(0, HERE)
        from train_eval import tiny_config

        cfg = tiny_config(model_config(name)).replace(num_heads=4)
        cfg = cfg.replace(mixers=cfg.mixers[:8], ffns=cfg.ffns[:8])
    return HybridModel(cfg)


def _batch(vocab: int):
    from harts_runtime.testing import synthetic_tree_batch

    # a 20-token prompt, 3 turns of 6-12 tokens forking in two: trajectories of 38-56 tokens (> T)
    return synthetic_tree_batch(5, prompt=20, turns=3, turn_len=(6, 12), fork_prob=0.7, fanout=2, vocab=vocab)


def _counter_class():
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.utils._python_dispatch import TorchDispatchMode

    block_re = re.compile(r"blocks\.(\d+)\.(mixer|ffn)$")

    class CollectiveCounter(TorchDispatchMode):
        """Every collective dispatched under it: functional (DTensor, ``all_to_all_single``) and
        ``c10d`` (FSDP2), with the layer / part from :class:`ModTracker` and the phase."""

        def __init__(self):
            super().__init__()
            self.tracker = ModTracker()
            self.records = []
            self.microbatch = -1

        def __enter__(self):
            self.tracker.__enter__()
            return super().__enter__()

        def __exit__(self, *exc):
            super().__exit__(*exc)
            self.tracker.__exit__(*exc)

        def _where(self, collective):
            # the block from ModTracker's parents; the part from the collective (inside a block the
            # mixer's are all-gathers, reduce-scatters and all-to-alls, the router's an all-reduce):
            # during a recomputed forward ModTracker's parents can name the block's FFN for its mixer
            layer = -1
            for name in self.tracker.parents:
                m = block_re.search(name)
                if m:
                    layer = int(m.group(1))
            if layer < 0:
                return layer, "head"
            return layer, "ffn" if collective == "all_reduce" else "mixer"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func._schema.name
            ns, _, op = name.partition("::")
            if ns not in ("_c10d_functional", "_c10d_functional_autograd", "c10d") or op in (
                "wait_tensor",
                "_wrap_tensor_autograd",
            ):
                return out
            rec = self._measure(ns, op, args, out)
            if rec is None:
                return out
            layer, part = self._where(rec["collective"])
            rec.update(
                layer=layer,
                part=part,
                phase="backward" if self.tracker.is_bw else "forward",
                microbatch=self.microbatch,
                op=name,
                source="functional" if ns != "c10d" else "c10d",
            )
            self.records.append(rec)
            return out

        def _measure(self, ns, op, args, out):
            import torch.distributed as dist
            from torch.distributed.distributed_c10d import _resolve_process_group

            def nbytes(t):
                return t.numel() * t.element_size()

            if ns == "c10d":  # FSDP2: (output, input, ...) or (input_list, ...)
                if op == "_allgather_base_":
                    o, i = args[0], args[1]
                    w = o.numel() // max(1, i.numel())
                    return record("all_gather", nbytes(o), (w - 1) * nbytes(i)) | {"world": w}
                if op == "_reduce_scatter_base_":
                    o, i = args[0], args[1]
                    w = i.numel() // max(1, o.numel())
                    return record("reduce_scatter", nbytes(i), (w - 1) * nbytes(o)) | {"world": w}
                if op == "allreduce_":
                    t = args[0][0]
                    return record("all_reduce", nbytes(t), 0) | {"world": 0}
                return record(op, 0, 0)
            t = args[0]
            if op == "all_gather_into_tensor":
                c = int(args[1])
                return record("all_gather", c * nbytes(t), (c - 1) * nbytes(t)) | {"world": c}
            if op == "reduce_scatter_tensor":
                c = int(args[2])
                return record("reduce_scatter", nbytes(t), (c - 1) * nbytes(t) // c) | {"world": c}
            if op == "all_reduce":
                g = _resolve_process_group(args[2])
                c = g.size()
                return record("all_reduce", nbytes(t), 2 * (c - 1) * nbytes(t) / c) | {"world": c}
            if op == "all_to_all_single":
                out_splits, group = list(args[1]), _resolve_process_group(args[3])
                me = dist.get_rank(group)
                row = nbytes(out) // max(1, sum(out_splits)) if sum(out_splits) else 0
                recv = (sum(out_splits) - out_splits[me]) * row
                return record("all_to_all", nbytes(out), recv) | {"world": group.size()}
            return record(op, nbytes(t), 0)

    return CollectiveCounter


def _wrap_dist():
    """Count the ``torch.distributed`` Python collective calls (FSDP2 calls
    ``dist.all_gather_into_tensor`` / ``dist.reduce_scatter_tensor``); returns the counts and an undo."""
    import torch.distributed as dist

    counts = defaultdict(lambda: [0, 0])
    names = (
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_gather_single",  # FSDP2 in torch 2.13 calls these two
        "reduce_scatter_single",
        "all_reduce",
        "all_to_all_single",
    )
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def wrap(n, fn):
        def inner(*a, **k):
            t = next((x for x in (*a, *k.values()) if hasattr(x, "numel")), None)
            counts[n][0] += 1
            counts[n][1] += 0 if t is None else t.numel() * t.element_size()
            return fn(*a, **k)

        return inner

    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))

    def undo():
        for n, fn in saved.items():
            setattr(dist, n, fn)

    return counts, undo


def _fsdp_units(model) -> dict:
    """name -> parameter shapes of each FSDP2 unit (embedding, every block, the root's rest), as
    ``apply_fsdp`` wraps them (ep = 1)."""
    units = {"embed": [tuple(p.shape) for p in model.embed.parameters()]}
    seen = {id(p) for p in model.embed.parameters()}
    for i, b in enumerate(model.blocks):
        units[f"blocks.{i}"] = [tuple(p.shape) for p in b.parameters()]
        seen |= {id(p) for p in b.parameters()}
    units["root"] = [tuple(p.shape) for p in model.parameters() if id(p) not in seen]
    return units


def states_mode_available() -> tuple[bool, str]:
    """Whether the runtime has the ``"states"`` mode this harness drives
    (``harts_runtime.parallel.context_states`` and ``parallelize(..., cp_mode=...)``), and why not."""
    if importlib.util.find_spec("harts_runtime.parallel.context_states") is None:
        return False, "harts_runtime.parallel.context_states is not in this checkout"
    from harts_runtime.parallel import parallelize

    if "cp_mode" not in inspect.signature(parallelize).parameters:
        return False, "parallelize() takes no cp_mode argument"
    return True, ""


def states_split(batch, traj, c: int, chunk_size: int, conv_width: int) -> dict:
    """What the ``"states"`` model needs of one microbatch's split (``harts_planner.plan_cp`` with
    its default cost model), each rank's numbers computed from the tree itself (the batch's
    ``row_parent``), independently of ``SplitShape.of_split``: its block; the most states any rank
    hands on; its halo rows (the distinct replay and conv-context rows of its receives) and the halo
    rows other ranks fetch from it; its attention rows (the rows of earlier ranks on the paths of
    its rows) and those other ranks fetch from it."""
    import numpy as np

    import harts_planner as hp

    traj = np.asarray(traj, dtype=np.int64)
    split = hp.plan_cp(batch, traj, c, chunk_size, conv_width=conv_width)
    r2g = np.asarray(hp.plan_calls(batch, chunk_size, microbatch=traj, conv_width=conv_width).row_to_global)
    gp = np.asarray(batch.row_parent, dtype=np.int64)[r2g]
    pred = np.where(gp >= 0, np.searchsorted(r2g, np.maximum(gp, 0)), -1)
    pos = np.zeros(len(pred), dtype=np.int64)
    for x in range(len(pred)):  # parents come first in the split's row order
        pos[x] = 0 if pred[x] < 0 else pos[pred[x]] + 1
    rank = np.asarray(split.rank_of(np.arange(len(r2g))))
    need, halo = [], []
    for r in range(c):
        rows = split.rank_rows(r)
        seen = set()
        for x in rows:
            u = int(pred[x])
            while u >= 0 and rank[u] != r and u not in seen:
                seen.add(u)
                u = int(pred[u])
        need.append(seen)
        h = set()
        for i in range(int(split.receive_offsets[r]), int(split.receive_offsets[r + 1])):
            u = int(split.receive_row[i])
            a = int(split.receive_anchor[i])
            path = []
            while u >= 0 and pos[u] >= a - (conv_width - 1):  # the path from the anchor's conv rows to u
                path.append(u)
                u = int(pred[u])
            h.update(path)
        halo.append(h)
    sends = np.diff(np.asarray(split.send_offsets))
    ranks = []
    for r in range(c):
        rows = split.rank_rows(r)
        ranks.append(
            {
                "rows": [rows.start, rows.stop],
                "halo_rows": len(halo[r]),
                "halo_sent": sum(int(rank[x]) == r for q in range(c) for x in halo[q]),
                "attention_rows": len(need[r]),
                "attention_sent": sum(int(rank[x]) == r for q in range(c) for x in need[q]),
            }
        )
    rank_rows = int(np.diff(np.asarray(split.rank_row_offsets)).max())
    return {"pieces": int(sends.max()) if len(sends) else 0, "rank_rows": rank_rows, "ranks": ranks}


def _worker(rank, world, name, dims_kw, recompute, mode="heads"):
    import numpy as np

    import harts_planner as hp
    from harts_runtime import StepInputs, run_microbatch
    from harts_runtime.engine import microbatch_call_plan
    from harts_runtime.microbatch import make_microbatch
    from harts_runtime.parallel import ParallelDims, parallelize, run_replica_step

    dims = ParallelDims(world_size=world, **dims_kw)
    mesh = dims.build_mesh()
    model = _model(name)
    cfg = model.config
    units = _fsdp_units(model)
    batch = _batch(cfg.vocab_size)
    step = StepInputs.synthetic(batch, seed=1, vocab_size=cfg.vocab_size)
    plan = hp.plan_step(batch, dims.dp, T[dims.cp], cfg.chunk_size, cp_size=dims.cp)
    takes_mode = "cp_mode" in inspect.signature(parallelize).parameters
    parallelize(model, mesh, recompute=recompute, **({"cp_mode": mode} if takes_mode else {}))
    model.train()
    cp_rank = mesh.cp.get_local_rank()
    counter = _counter_class()()
    mbs = []

    def microbatch(slot, traj):
        traj = np.asarray(traj, dtype=np.int64)
        mb = make_microbatch(model, step, traj, "compact", microbatch_call_plan(model, step, traj))
        n = mb.num_rows
        rows = {"n": n, "p": int(mb.target_index.shape[0]), "row_block": list(row_block(n, dims.cp, cp_rank))}
        if mode == "states":
            rows["split"] = states_split(batch, traj, dims.cp, cfg.chunk_size, cfg.conv_size)
            rows["row_block"] = rows["split"]["ranks"][cp_rank]["rows"]
        seen = {}

        def hook(mod, args, _out, seen=seen):
            seen.setdefault("embed_rows", int(_out.shape[0]))

        def mixer_pre(mod, args, seen=seen):
            seen["mixer_input_rows"] = max(seen.get("mixer_input_rows", 0), int(args[0].shape[0]))

        h = [model.embed.register_forward_hook(hook)]
        for b in model.blocks:  # the mixer's inner layers see the gathered rows (or latent)
            if b.mixer is not None:
                h += [m.register_forward_pre_hook(mixer_pre) for m in b.mixer.modules() if m is not b.mixer]
        counter.microbatch = len(mbs)
        loss, _ = run_microbatch(model, step, microbatch=mb)
        for x in h:
            x.remove()
        rows.update(seen)
        mbs.append(rows)
        return loss

    dist_counts, undo = _wrap_dist()
    t0 = time.perf_counter()
    try:
        with counter:
            res = run_replica_step(plan, mesh, microbatch)
    finally:
        undo()
    return {
        "rank": rank,
        "cp_rank": cp_rank,
        "coords": mesh.coords,
        "records": counter.records,
        "microbatches": mbs,
        "dist_calls": {k: list(v) for k, v in dist_counts.items()},
        "units": units,
        "loss": res.loss,
        "seconds": time.perf_counter() - t0,
        "config": {
            "hidden_size": cfg.hidden_size,
            "mixers": list(cfg.mixers),
            "ffns": list(cfg.ffns),
            "num_heads": cfg.num_heads,
        },
    }


def _cfg_of(name: str):
    return _model(name).config


def compare(case: str, results: list, dims_kw: dict, recompute: bool, name: str, mode: str = "heads") -> dict:
    """Measured against analytic, per rank: the CP collectives per (layer, part, phase, collective)
    (must agree exactly), FSDP2's per (phase, collective), and the rows (``"states"``: each rank's
    block of the split; the rows inside a mixer are not checked there)."""
    cfg = _cfg_of(name)
    md = dims_of(cfg, 4)  # float32 on the CPU
    c = dims_kw.get("cp", 1)
    world_fsdp = c * dims_kw.get("dp_shard", 1)
    out = {"ranks": []}
    key = ("layer", "part", "phase", "collective")
    for r in results:
        cp_meas = [x for x in r["records"] if x["source"] == "functional"]
        fsdp_meas = [x for x in r["records"] if x["source"] == "c10d" and x["collective"] != "all_reduce"]
        ana, fsdp_ana, rows = [], [], []
        for mb in r["microbatches"]:
            n, p = mb["n"], mb["p"]
            want = activation_rows(n, c, r["cp_rank"], md)
            if mode == "states":
                sp = mb["split"]
                mine = sp["ranks"][r["cp_rank"]]
                rs = rank_split(sp, r["cp_rank"])
                ana += microbatch_collectives(md, n, p, c, r["cp_rank"], recompute, "states", rs)
                want = dict(
                    want,
                    row_block=mine["rows"][1] - mine["rows"][0],
                    gathered_rows=mb.get("mixer_input_rows", 0),
                )
            else:
                ana += microbatch_collectives(md, n, p, c, r["cp_rank"], recompute)
            fsdp_ana += fsdp_microbatch(r["units"], world_fsdp, 4)
            got_block = mb.get("embed_rows", 0)
            rows.append(
                {
                    "n": n,
                    "row_block_measured": got_block,
                    "row_block_analytic": want["row_block"],
                    "gathered_measured": mb.get("mixer_input_rows", 0),
                    "gathered_analytic": want["gathered_rows"],
                }
            )
        m, a = summarize(cp_meas, key), summarize(ana, key)
        mismatch = {
            str(k): {"measured": m.get(k), "analytic": a.get(k)}
            for k in set(m) | set(a)
            if m.get(k) != a.get(k)
        }
        fm, fa = summarize(fsdp_meas, ("phase", "collective")), summarize(fsdp_ana, ("phase", "collective"))
        per_layer = defaultdict(lambda: defaultdict(lambda: {"measured": 0, "analytic": 0}))
        for k, v in m.items():
            per_layer[f"{k[0]}:{k[1]}"][f"{k[2]}/{k[3]}"]["measured"] = v["received"]
        for k, v in a.items():
            per_layer[f"{k[0]}:{k[1]}"][f"{k[2]}/{k[3]}"]["analytic"] = v["received"]
        totals = {
            part: {
                "measured": sum(v["received"] for k, v in m.items() if k[1] == part),
                "analytic": sum(v["received"] for k, v in a.items() if k[1] == part),
            }
            for part in ("mixer", "ffn", "head")
        }
        fsdp_cmp = {
            f"{k[0]}/{k[1]}": {"measured": fm.get(k), "analytic": fa.get(k)}
            for k in sorted(set(fm) | set(fa))
        }
        dc = r["dist_calls"]
        dist_ag = sum(dc.get(n, [0, 0])[0] for n in ("all_gather_into_tensor", "all_gather_single"))
        dist_rs = sum(dc.get(n, [0, 0])[0] for n in ("reduce_scatter_tensor", "reduce_scatter_single"))
        out["ranks"].append(
            {
                "rank": r["rank"],
                "cp_rank": r["cp_rank"],
                "microbatches": rows,
                "cp_received_bytes": totals,
                "cp_per_layer_received": {k: dict(v) for k, v in sorted(per_layer.items())},
                "cp_mismatches": mismatch,
                "fsdp": fsdp_cmp,
                "fsdp_agrees": fm == fa,
                "dist_python_calls": r["dist_calls"],
                "dist_calls_agree_with_dispatch": (
                    dist_ag == sum(v["calls"] for k, v in fm.items() if k[1] == "all_gather")
                    and dist_rs == sum(v["calls"] for k, v in fm.items() if k[1] == "reduce_scatter")
                ),
                "loss": r["loss"],
                "seconds": r["seconds"],
            }
        )
        bad_rows = [x for x in rows if x["row_block_measured"] != x["row_block_analytic"] and x["n"]]
        bad_rows += [x for x in rows if c > 1 and x["n"] and x["gathered_measured"] != x["gathered_analytic"]]
        agree = out["ranks"][-1]
        if not (agree["fsdp_agrees"] and agree["dist_calls_agree_with_dispatch"]):
            raise AssertionError(
                f"{case} rank {r['rank']}: FSDP2's collectives differ from the analytic model or the "
                f"torch.distributed calls from the dispatched ones: {json.dumps(fsdp_cmp, default=str)[:2000]}"
            )
        if mismatch or bad_rows:
            raise AssertionError(
                f"{case} rank {r['rank']}: measured CP collectives or rows differ from the analytic "
                f"model: {json.dumps(mismatch, default=str)[:2000]} rows {bad_rows[:3]}"
            )
    return out


def measure(cases) -> dict:
    from harts_runtime.parallel import run_distributed

    out = {}
    states_ok, why = states_mode_available()
    for case in cases:
        name, world, dims_kw, recompute, mode = CASES[case]
        if mode == "states" and not states_ok:
            out[case] = {"mode": mode, "run": False, "reason": why}
            print(f"{case}: not run ({why}): the states-mode count waits for the runtime", flush=True)
            continue
        t0 = time.perf_counter()
        results = run_distributed(_worker, world, name, dims_kw, recompute, mode, timeout=600)
        res = compare(case, results, dims_kw, recompute, name, mode)
        res.update(
            mode=mode,
            run=True,
            model=name,
            world=world,
            dims=dims_kw,
            recompute=recompute,
            config=results[0]["config"],
            wall_s=time.perf_counter() - t0,
        )
        out[case] = res
        tot = res["ranks"][0]["cp_received_bytes"]
        print(
            f"{case}: rank 0 CP bytes received mixer {tot['mixer']['measured']:,} "
            f"(analytic {tot['mixer']['analytic']:,}), log-probs {tot['head']['measured']:,.0f}, "
            f"router {tot['ffn']['measured']:,.0f}; FSDP agrees: {res['ranks'][0]['fsdp_agrees']} "
            f"({res['wall_s']:.1f} s)",
            flush=True,
        )
    return out


# ================================================================================ README table
def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}" if x >= 1e8 else f"{x / 1e9:.2f}"


def _mem(m: dict) -> str:
    return f"{m['memory_GiB']:.0f}" if m["fits"] else f"{m['memory_GiB']:.0f} (over)"


def markdown(pred: dict) -> str:
    """The generated block of ``benchmarks/README.md`` (between :data:`BEGIN` and :data:`END`)."""
    lines = [
        BEGIN,
        "| model | tree rows N | C | link | rows / rank | compute s | heads: CP GB / rank | heads: step s | "
        "heads: GiB / rank | states: CP GB / rank | states: step s (summary pass s) | states: GiB / rank | "
        "auto: step s (layers heads / states) | auto: GiB / rank |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in pred["rows"]:
        h, s, a = (r["modes"][m] for m in ("heads", "states", "auto"))
        hc = (
            f"{_gb(h['cp_bytes_per_rank'])} | {h['step_s']:.1f} | {_mem(h)}"
            if h["possible"]
            else f"n/a: {h['reason']} | | "
        )
        lines.append(
            f"| {r['flavor']} | {r['rows']:,} | {r['cp']} | {r['link']} | {r['rows_per_rank']:,} | "
            f"{r['compute_s']:.1f} | {hc} | {_gb(s['cp_bytes_per_rank'])} | "
            f"{s['step_s']:.1f} ({s['extra_compute_s']:.1f}) | {_mem(s)} | "
            f"**{a['step_s']:.1f}** ({a['layers_heads']} / {a['layers_states']}) | {_mem(a)} |"
        )
    lines += [
        "",
        "First C that fits 139 GiB per H200 (NVLink at C = 8, InfiniBand above; dp_shard = 1), and its "
        "predicted step:",
        "",
        "| model | tree rows N | heads | states | auto |",
        "|---|---:|---|---|---|",
    ]
    ff = {(x["flavor"], x["rows"], x["mode"]): x for x in pred["first_fit"]}
    for flavor in FLAVORS:
        for n in SIZES:
            cells = []
            for mode in ("heads", "states", "auto"):
                x = ff[(flavor, n, mode)]
                cells.append(
                    f"C = {x['cp']}: {x['step_s']:.1f} s, {x['memory_GiB']:.0f} GiB"
                    if x["cp"]
                    else "none up to 64"
                )
            lines.append(f"| {flavor} | {n:,} | " + " | ".join(cells) + " |")
    lines.append(END)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--quick", action="store_true", help="debug model at cp = 2 only (both modes)")
    ap.add_argument("--no-measure", action="store_true", help="the model and the prediction only")
    ap.add_argument(
        "--no-readme", action="store_true", help="do not rewrite the block in benchmarks/README.md"
    )
    ap.add_argument("--readme", type=Path, default=README)
    ap.add_argument("--cases", default=None, help="comma-separated measurement cases")
    args = ap.parse_args(argv)
    if args.cases:
        bad = [c for c in args.cases.split(",") if c not in CASES]
        if bad:
            ap.error(f"--cases: unknown {bad}; choose from {sorted(CASES)}")
    doc = {
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:] if argv is None else argv}
    }
    try:
        import torch

        doc["meta"]["torch"] = torch.__version__
    except ImportError:  # pragma: no cover
        pass
    doc["design_comparison"] = design_comparison()
    doc["prediction"] = prediction_table()
    doc["prediction_markdown"] = markdown(doc["prediction"])
    print(doc["prediction_markdown"])
    if not args.no_measure:
        cases = args.cases.split(",") if args.cases else (QUICK if args.quick else list(CASES))
        doc["measured"] = measure(cases)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"wrote {args.out}")
    if not args.no_readme:
        sys.path.insert(0, HERE)
        from readme_blocks import update_readme

        update_readme(
            args.readme,
            doc["prediction_markdown"],
            BEGIN,
            END,
            "Context parallelism: counted bytes and predicted long trees: `cp_eval.py`",
        )
        print(f"wrote the {BEGIN} block of {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
