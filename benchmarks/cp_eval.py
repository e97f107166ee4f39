"""Counted communication and memory of context parallelism (issue 35 item 5).

Three parts, each usable alone:

* **The analytic model** (pure functions, no torch needed): the bytes every collective of a CP
  step moves, per layer, per pass and per rank, for the design the runtime implements
  (*head-parallel*, ``harts_runtime/parallel/context.py``: each mixer all-gathers its normed input
  rows ``[N, D]`` over the CP group and reduce-scatters its partial output; MLA all-gathers its
  ``r_kv + rope`` latent and moves queries / outputs rows <-> heads by all-to-all; the log-probs
  and the MoE router statistics are all-reduced) and for the alternative (*state passing*,
  fla-style: per-rank affine summaries ``H (K K + K V)`` fp32 all-gathered and folded, the short
  convolution's halo rows, and for attention the ancestor K/V or the MLA latent gathered), plus
  FSDP2's parameter all-gathers and gradient reduce-scatters over ``dp_shard x cp`` and the
  activation rows each rank holds. Conventions: *payload* is the collective's full tensor (the
  all-gather's output, the reduce-scatter's input, the all-reduce's tensor, the all-to-all's
  output); *received* is what one rank receives from the others: ``(C - 1) ceil(N / C) w s`` for an
  all-gather or reduce-scatter of ``[N, w]`` rows (DTensor pads every shard to ``ceil(N / C)``
  rows), the other ranks' splits for an all-to-all, ``2 (C - 1) / C`` of the tensor for an
  all-reduce (a ring's; NCCL's bus-bandwidth convention).
* **The measurement** (``--measure``, CPU gloo, ``run_distributed``): one training step of the
  ``debug`` model at 4 heads (and of ``ling-tiny``'s layer pattern at tiny widths, 4 heads) under
  ``cp = 2``, ``cp = 4`` (block recomputation) and ``cp = 2 x dp_shard = 2``, on trees whose
  trajectories are longer than the per-rank capacity T. A ``TorchDispatchMode`` sees every
  collective: the DTensor / functional ones (``_c10d_functional.*``, the ops
  ``torch.distributed.tensor.debug.CommDebugMode`` counts) and FSDP2's ``c10d`` ones
  (``_allgather_base_``, ``_reduce_scatter_base_``), attributed to layers by torch's
  ``ModTracker`` (``CommDebugMode``'s own module tracker fails on a module called twice in one
  step: ``IndexError`` in ``_fw_set_module_hook``). The ``torch.distributed`` Python calls are
  wrapped as well and their counts checked against the dispatch-level ones. Every rank's row block
  and the gathered N are recorded per microbatch. Measured and analytic bytes (calls, payload and
  received, per rank, layer, phase and collective) must agree exactly for the mixer, log-prob and
  router collectives and for FSDP2's (per phase and collective), and the Python-level call counts
  with the dispatched ones (an ``AssertionError`` otherwise).
* **The prediction** (marked *predicted* everywhere): step time and memory per rank of a
  256k-row and a 1M-row agentic tree on the 24-layer ``ling-tiny`` and on Qwen3.5-35B-A3B at
  C = 2, 4, 8, from the analytic bytes and the H200 measurements in ``benchmarks/results/`` (one
  GPU: the one-process step time and peak memory of a 65,303-row microbatch), with every
  assumption (NVLink bandwidth, no overlap of the CP collectives, the tree's attention keys, the
  usable HBM) written into the JSON.

``python benchmarks/cp_eval.py`` (about a minute on 2 cores) writes ``benchmarks/results/cp_eval.json``;
``--quick`` runs the ``debug`` model at ``cp = 2`` only; ``--no-measure`` only the model and the
prediction. ``tests/runtime/test_cp_eval.py`` checks the model's identities (fast) and runs
``--quick`` (slow).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
OUT = os.path.join(RESULTS, "cp_eval.json")

FP32 = 4
LOGPROB_BYTES = FP32  # the [P] log-probs are float32
ROUTER_BYTES = FP32  # the 2E + 2 router statistics are float32
MLA_LATENT_DEEPSEEK = 576  # kv_lora_rank 512 + rope 64 (DeepSeek-V3 / Ling)


# ================================================================================ analytic model
@dataclasses.dataclass(frozen=True)
class Mixer:
    """What the collectives of one mixer layer depend on (from a model config, :func:`dims_of`).

    ``kind``: ``kda`` / ``gdn`` (linear attention), ``mla``, ``gqa`` / ``gated_attention``
    (softmax attention over K/V heads). ``heads``: the heads CP splits (query heads; GDN's key
    heads). ``state_heads``, ``k``, ``v``: a linear layer's state ``[state_heads, k, v]``;
    ``conv_channels``: its short convolutions' channels; ``conv_size``: their width. MLA:
    ``latent`` (``r_kv + rope``), ``q_head`` (``nope + rope``), ``v_head``. Attention: ``kv_heads``,
    ``head_dim``."""

    kind: str
    heads: int
    state_heads: int = 0
    k: int = 0
    v: int = 0
    conv_channels: int = 0
    conv_size: int = 4
    latent: int = 0
    q_head: int = 0
    v_head: int = 0
    kv_heads: int = 0
    head_dim: int = 0


@dataclasses.dataclass(frozen=True)
class ModelDims:
    hidden: int
    mixers: tuple  # Mixer or None per layer
    experts: tuple  # E per layer (0: dense FFN)
    act_bytes: int  # bytes per element of the rows the mixers exchange (2 in bf16, 4 in float32)


def dims_of(cfg, act_bytes: int | None = None) -> ModelDims:
    """:class:`ModelDims` of a ``harts_runtime`` ``ModelConfig`` (duck-typed: only its fields)."""
    d, h = cfg.hidden_size, cfg.num_heads
    mixers = []
    for m in cfg.mixers:
        if m == "kda":
            hk = cfg.kda.num_heads or h
            k, v = cfg.kda.head_k_dim, cfg.kda.head_v_dim
            mixers.append(Mixer("kda", hk, hk, k, v, hk * (2 * k + v), cfg.conv_size))
        elif m == "gdn":
            g = cfg.gdn
            k, v = g.head_k_dim, g.head_v_dim
            ch = 2 * g.num_k_heads * k + g.num_v_heads * v
            mixers.append(Mixer("gdn", g.num_k_heads, g.num_v_heads, k, v, ch, cfg.conv_size))
        elif m == "mla":
            a = cfg.mla
            q = a.qk_nope_head_dim + a.qk_rope_head_dim
            mixers.append(
                Mixer("mla", h, latent=a.kv_lora_rank + a.qk_rope_head_dim, q_head=q, v_head=a.v_head_dim)
            )
        elif m in ("gqa", "gated_attention"):
            sub = cfg.gqa if m == "gqa" else cfg.gated_attention
            hd = getattr(sub, "head_dim", None) or d // h
            mixers.append(Mixer(m, h, kv_heads=cfg.num_kv_heads or h, head_dim=hd))
        elif m in (None, "none"):
            mixers.append(None)
        else:
            mixers.append(Mixer(m, h))  # no head plan (Mamba2): refused under CP
    experts = tuple(cfg.moe.num_experts if f == "moe" else 0 for f in cfg.ffns)
    if act_bytes is None:
        act_bytes = 2 if str(cfg.dtype) in ("bfloat16", "float16") else 4
    return ModelDims(d, tuple(mixers), experts, act_bytes)


def row_block(n: int, c: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s rows (``harts_runtime.parallel.tensor.row_block``:
    ``torch.chunk``'s ``ceil(n / c)`` rows per rank, the last ones fewer or none)."""
    per = -(-n // c) if n else 0
    start = min(n, rank * per)
    return start, min(n, start + per)


def rows_of(n: int, c: int, rank: int) -> int:
    s, e = row_block(n, c, rank)
    return e - s


def _rec(collective: str, payload: float, received: float, calls: int = 1) -> dict:
    return {"collective": collective, "calls": calls, "payload": payload, "received": received}


def gather_rows(n: int, c: int, width: int, s: int) -> dict:
    """All-gather of ``[n, width]`` rows split ``Shard(0)`` (each shard padded to ``ceil(n / c)``)."""
    per = -(-n // c) if n else 0
    return _rec("all_gather", c * per * width * s, (c - 1) * per * width * s)


def scatter_rows(n: int, c: int, width: int, s: int) -> dict:
    """Reduce-scatter of partial ``[n, width]`` rows to ``Shard(0)`` (input padded to ``c ceil(n / c)``)."""
    per = -(-n // c) if n else 0
    return _rec("reduce_scatter", c * per * width * s, (c - 1) * per * width * s)


def all_reduce(numel: int, c: int, s: int) -> dict:
    return _rec("all_reduce", numel * s, 2 * (c - 1) * numel * s / c)


def rows_to_heads(n: int, c: int, rank: int, width: int, s: int) -> dict:
    """``[n_c, H, d]`` row blocks -> ``[n, H / C, d]`` (``width = H d``): rank ``rank`` receives every
    other rank's rows of its heads."""
    w = width // c
    return _rec("all_to_all", n * w * s, (n - rows_of(n, c, rank)) * w * s)


def heads_to_rows(n: int, c: int, rank: int, width: int, s: int) -> dict:
    """The inverse: rank ``rank`` receives its own rows of the other ranks' heads."""
    w = width // c
    mine = rows_of(n, c, rank)
    return _rec("all_to_all", mine * c * w * s, (c - 1) * mine * w * s)


def head_parallel_mixer(mix: Mixer, d: int, n: int, c: int, rank: int, s: int) -> dict:
    """The collectives of one mixer layer and microbatch of ``n`` rows under head-parallel CP, by
    pass (``forward``, ``backward``; recomputation repeats ``forward``)."""
    if mix.kind == "mla":
        q, o = mix.heads * mix.q_head, mix.heads * mix.v_head
        fwd = [
            gather_rows(n, c, mix.latent, s),
            rows_to_heads(n, c, rank, q, s),
            heads_to_rows(n, c, rank, o, s),
        ]
        bwd = [
            scatter_rows(n, c, mix.latent, s),  # d(latent) partial rows -> blocks
            heads_to_rows(n, c, rank, q, s),  # d(queries) heads -> rows
            rows_to_heads(n, c, rank, o, s),  # d(outputs) rows -> heads
        ]
    else:
        fwd = [gather_rows(n, c, d, s), scatter_rows(n, c, d, s)]
        bwd = [scatter_rows(n, c, d, s), gather_rows(n, c, d, s)]
    return {"forward": fwd, "backward": bwd}


def state_passing_mixer(
    mix: Mixer, d: int, n: int, c: int, s: int, pieces: int = 1, replay_rows: int = 0
) -> dict:
    """The alternative (not implemented in the runtime): one mixer layer under state passing.

    Linear layers: every rank's ``pieces`` affine summaries (state ``K x V`` and transition
    ``K x K`` per state head, fp32) all-gathered, the short convolution's ``conv_size - 1`` halo
    rows (plus ``replay_rows`` of replay) from the previous rank; backward: the transposed fold's
    summaries and the halo's gradient. Attention: the ancestor rows' latent (MLA) or K/V (GQA)
    gathered (a chain's last rank needs all earlier rows: the all-gather bound), their gradient
    reduce-scattered in backward."""
    if mix.kind in ("kda", "gdn"):
        summary = mix.state_heads * (mix.k * mix.k + mix.k * mix.v)
        halo = (mix.conv_size - 1 + replay_rows) * mix.conv_channels
        per_rank = summary * pieces * FP32
        fwd = [
            _rec("all_gather", c * per_rank, (c - 1) * per_rank),
            _rec("send_recv", halo * s, halo * s if c > 1 else 0),
        ]
        return {"forward": fwd, "backward": [dict(r) for r in fwd]}
    width = mix.latent if mix.kind == "mla" else 2 * mix.kv_heads * mix.head_dim
    return {"forward": [gather_rows(n, c, width, s)], "backward": [scatter_rows(n, c, width, s)]}


def microbatch_collectives(
    dims: ModelDims,
    n: int,
    p: int,
    c: int,
    rank: int = 0,
    recompute: bool = False,
    design: str = "head_parallel",
    pieces: int = 1,
) -> list[dict]:
    """Every CP collective of one microbatch (``n`` rows, ``p`` targets) on CP rank ``rank``: a list
    of records ``{layer, part, phase, pass, collective, calls, payload, received}``. ``phase``:
    ``forward`` or ``backward`` (what runs during ``loss.backward()``: the backward pass, and the
    recomputed forward when ``recompute``); ``part``: ``mixer``, ``ffn`` (router statistics) or
    ``head`` (log-probs, ``layer = -1``)."""
    out = []
    s = dims.act_bytes
    for i, (mix, e) in enumerate(zip(dims.mixers, dims.experts)):
        if mix is not None and c > 1:
            if design == "head_parallel":
                by = head_parallel_mixer(mix, dims.hidden, n, c, rank, s)
            else:
                by = state_passing_mixer(mix, dims.hidden, n, c, s, pieces)
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
        rest = math.prod(shape[1:])
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
        ag = _rec("all_gather", world * shard * s, (world - 1) * shard * s)
        rs = _rec("reduce_scatter", world * shard * grad_s, (world - 1) * shard * grad_s)
        out += [dict(ag, unit=name, phase="forward"), dict(ag, unit=name, phase="backward")]
        out.append(dict(rs, unit=name, phase="backward"))
    return out


def activation_rows(n: int, c: int, rank: int, dims: ModelDims) -> dict:
    """Rows of activations rank ``rank`` holds for a microbatch of ``n`` rows (head-parallel):
    its row block for everything row-local, all ``n`` rows at each mixer for the gathered input
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


def step_bytes(
    dims: ModelDims, n: int, p: int, c: int, recompute: bool = True, design: str = "head_parallel"
) -> dict:
    """Bytes one rank receives per microbatch (rank 0, the one with the most rows): mixer, router,
    log-prob totals; per layer kind."""
    recs = microbatch_collectives(dims, n, p, c, 0, recompute, design)
    by_part = defaultdict(float)
    by_kind = defaultdict(float)
    for r in recs:
        by_part[r["part"]] += r["received"]
        if r["part"] == "mixer":
            by_kind[dims.mixers[r["layer"]].kind] += r["received"]
    return {"total": sum(by_part.values()), "by_part": dict(by_part), "mixer_by_kind": dict(by_kind)}


def crossover_rows(mix: Mixer, d: int, c: int, s: int, pieces: int = 1) -> float:
    """The microbatch rows above which state passing moves fewer bytes per linear layer than
    head-parallel (forward; the backward and the recomputation scale alike): head-parallel
    receives ``2 (C - 1) / C N D s``, state passing ``(C - 1) pieces H (K K + K V) 4`` plus the
    halo, so ``N* = C (pieces H (K K + K V) 4 + halo) / (2 D s)``. For attention there is no
    crossover: head-parallel moves ``2 D`` (GQA) or ``latent + H (Dqk + Dv) / C`` (MLA) values per
    row, state passing ``2 H_kv d_h`` or ``latent``."""
    sp = state_passing_mixer(mix, d, 1, c, s, pieces)["forward"]
    fixed = sum(r["received"] for r in sp)
    return fixed * c / ((c - 1) * 2 * d * s)


# ================================================================================ prediction
ASSUMPTIONS = {
    "nvlink_GBps": 360.0,
    "nvlink_note": (
        "per-rank receive rate of an all-gather / reduce-scatter / all-to-all inside one 8-GPU "
        "H200 NVSwitch node at messages of 100s of MB: NVLink 4 is 450 GB/s per direction, "
        "nccl-tests bus bandwidth about 360 GB/s; assumed, not measured (no multi-GPU machine lent)"
    ),
    "latency_s_per_collective": 30e-6,
    "overlap": (
        "the CP collectives run on the compute stream between a mixer's projections (DTensor "
        "redistribute): not overlapped, added to the step time; FSDP2's all-gathers are prefetched "
        "and its reduce-scatters run beside the next unit's backward: overlapped, reported apart"
    ),
    "hbm_GiB": 139.0,
    "tree_keys": (
        "attention keys of the tree's compact rows = keys_fraction x N^2; keys_fraction = 0.2947, "
        "that of the measured 65,303-row swe-like microbatch (1,256,935,920 keys); a single chain "
        "would be 0.5"
    ),
    "keys_fraction": 1_256_935_920 / 65_303**2,
    "targets_fraction": "P = N (every compact row a target: an upper bound for the log-prob all-reduce)",
    "compute_scaling": (
        "one-process F/B/Grad time on the H200 scaled by the model FLOPs "
        "(harts_runtime.flops.model_flops of N rows and keys_fraction N^2 keys) and divided by C "
        "(head-parallel splits every mixer's heads and every row-local op's rows evenly); kernel "
        "efficiency at H/C heads and N/C rows assumed equal to the measured one"
    ),
    "memory": (
        "per rank: bf16 parameters + gradients sharded over C (FSDP2, dp_shard = 1), plus two "
        "unsharded blocks (all-gather and prefetch), plus the measured activation bytes per row "
        "(one-process peak minus its parameters and gradients, at 65,303 rows) x ceil(N / C), plus "
        "4 transient [N, D] tensors at the mixer (gathered input, partial output, and in backward "
        "the gathered output gradient and the partial input gradient). fp32 AdamW state (masters, "
        "m, v: 12 bytes per parameter / C) reported apart: the measured recipe held bf16 weights only"
    ),
    "transient_nd": 4,
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


ANCHORS = {
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


def _embedding_params(cfg) -> int:
    """The embedding and the LM head (untied)."""
    return 2 * cfg.vocab_size * cfg.hidden_size


def anchor(flavor: str) -> dict:
    """The one-process H200 time and activation bytes per row of ``flavor``'s full depth, from the
    measured runs (Qwen3.5-35B-A3B: 4 and 8 layers measured, the 40-layer step extrapolated by
    layer groups, linear in the groups: ``t40 = t4 + 9 (t8 - t4)``, the same for the peak)."""
    from harts_runtime import model_config
    from harts_runtime.flops import model_flops

    spec = ANCHORS[flavor]
    runs = [_compact_run(_load(f)) for f in spec["files"]]
    cfg = model_config(flavor)
    full = len(cfg.mixers)
    groups = 0
    if len(runs) == 1:
        t, peak = runs[0]["fbg_s"], runs[0]["peak_GiB"]
    else:
        (a, la), (b, lb) = zip(runs, spec["layers"])
        groups = (full - la) / (lb - la)
        t = a["fbg_s"] + groups * (b["fbg_s"] - a["fbg_s"])
        peak = a["peak_GiB"] + groups * (b["peak_GiB"] - a["peak_GiB"])
    # parameters from the runs' own records (train_eval's meta.params); the 40-layer count by the
    # same extrapolation; the largest block ~ the per-layer share of what is not embedding / head
    counts = [_load(f)["meta"]["params"] for f in spec["files"]]
    if len(counts) == 1:
        params = counts[0]
    else:
        params = int(counts[0] + groups * (counts[1] - counts[0]))
    block = int((params - _embedding_params(cfg)) / full)
    static = params * 4 / 2**30  # bf16 parameters and gradients
    rows, keys = runs[0]["rows"], runs[0]["keys"]
    return {
        "flavor": flavor,
        "layers": full,
        "measured": runs,
        "one_process_fbg_s": t,
        "one_process_peak_GiB": peak,
        "rows": rows,
        "keys": keys,
        "params": params,
        "largest_block_params": block,
        "static_GiB": static,
        "activation_bytes_per_row": (peak - static) * 2**30 / rows,
        "flops": model_flops(cfg, rows, keys),
        "extrapolated": len(runs) > 1,
    }


def predict(flavor: str, n: int, c: int, anc: dict | None = None, a: dict = ASSUMPTIONS) -> dict:
    """Predicted step time and memory per rank of one ``n``-row tree on ``c`` CP ranks (H200)."""
    from harts_runtime import model_config
    from harts_runtime.flops import layer_costs, model_flops

    anc = anc or anchor(flavor)
    cfg = model_config(flavor)
    dims = dims_of(cfg, 2)
    keys = int(a["keys_fraction"] * n * n)
    t1 = anc["one_process_fbg_s"] * model_flops(cfg, n, keys) / anc["flops"]
    compute = t1 / c
    hp = step_bytes(dims, n, n, c, recompute=True, design="head_parallel")
    sp = step_bytes(dims, n, n, c, recompute=True, design="state_passing")
    ncoll = sum(r["calls"] for r in microbatch_collectives(dims, n, n, c, 0, True))
    bw = a["nvlink_GBps"] * 1e9
    comm = hp["total"] / bw + ncoll * a["latency_s_per_collective"]
    fsdp_bytes = 3 * (c - 1) / c * anc["params"] * 2  # 2 all-gathers + 1 reduce-scatter, bf16
    per_rank = rows_of(n, c, 0)
    act = anc["activation_bytes_per_row"] * per_rank / 2**30
    transient = a["transient_nd"] * n * dims.hidden * 2 / 2**30 if c > 1 else 0.0
    static = anc["static_GiB"] / c + 2 * anc["largest_block_params"] * 2 / 2**30
    adam = anc["params"] * 12 / c / 2**30
    total = static + act + transient
    costs = layer_costs(cfg)
    linear_share = 3 * costs["linear_core"] * n / model_flops(cfg, n, keys)
    return {
        "predicted": True,
        "flavor": flavor,
        "rows": n,
        "cp": c,
        "rows_per_rank": per_rank,
        "compute_s": compute,
        "cp_comm_bytes_per_rank": hp["total"],
        "cp_comm_by_part": hp["by_part"],
        "cp_comm_s": comm,
        "step_s": compute + comm,
        "comm_share": comm / (compute + comm),
        "fsdp_bytes_per_rank": fsdp_bytes,
        "fsdp_s_if_not_overlapped": fsdp_bytes / bw,
        "state_passing_bytes_per_rank": sp["total"],
        "state_passing_extra_compute_s": linear_share * t1 / c,
        "activation_GiB": act,
        "transient_GiB": transient,
        "static_GiB": static,
        "memory_GiB": total,
        "fits": total <= a["hbm_GiB"],
        "adamw_fp32_GiB": adam,
        "max_rows_per_rank": max(
            0, int((a["hbm_GiB"] - static - transient) * 2**30 / anc["activation_bytes_per_row"])
        ),
    }


def prediction_table(sizes=(262_144, 1_048_576), cps=(2, 4, 8)) -> dict:
    out = {"predicted": True, "assumptions": ASSUMPTIONS, "anchors": {}, "rows": []}
    for flavor in ANCHORS:
        anc = anchor(flavor)
        out["anchors"][flavor] = anc
        for n in sizes:
            for c in cps:
                out["rows"].append(predict(flavor, n, c, anc))
    return out


def design_comparison(cps=(2, 4, 8), rows=(65_536, 262_144, 1_048_576)) -> dict:
    """Bytes per rank and microbatch, head-parallel against state passing, per mixer kind of the two
    models (forward + backward + recomputation), and the crossover rows of the linear layers."""
    from harts_runtime import model_config

    out = {}
    for flavor in ANCHORS:
        dims = dims_of(model_config(flavor), 2)
        kinds = {}
        for mix in dims.mixers:
            if mix is None or mix.kind in kinds:
                continue
            per = {}
            for c in cps:
                for n in rows:
                    hp = sum(
                        r["received"]
                        for p in ("forward", "backward", "forward")
                        for r in head_parallel_mixer(mix, dims.hidden, n, c, 0, 2)[p]
                    )
                    sp = sum(
                        r["received"]
                        for p in ("forward", "backward", "forward")
                        for r in state_passing_mixer(mix, dims.hidden, n, c, 2)[p]
                    )
                    per[f"C={c},N={n}"] = {"head_parallel": hp, "state_passing": sp}
            entry = {"mixer": dataclasses.asdict(mix), "bytes": per}
            if mix.kind in ("kda", "gdn"):
                entry["crossover_rows"] = {c: crossover_rows(mix, dims.hidden, c, 2) for c in cps}
            kinds[mix.kind] = entry
        out[flavor] = {"hidden": dims.hidden, "kinds": kinds}
    return out


# ================================================================================ measurement
CASES = {
    # name: (model, world, dims, recompute)
    "debug-cp2": ("debug", 2, {"cp": 2}, False),
    "debug-cp4-recompute": ("debug", 4, {"cp": 4}, True),
    "debug-cp2-dp_shard2": ("debug", 4, {"cp": 2, "dp_shard": 2}, False),
    "ling-tiny-cp2-recompute": ("ling-tiny", 2, {"cp": 2}, True),
}
QUICK = ("debug-cp2",)
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
                    return _rec("all_gather", nbytes(o), (w - 1) * nbytes(i)) | {"world": w}
                if op == "_reduce_scatter_base_":
                    o, i = args[0], args[1]
                    w = i.numel() // max(1, o.numel())
                    return _rec("reduce_scatter", nbytes(i), (w - 1) * nbytes(o)) | {"world": w}
                if op == "allreduce_":
                    t = args[0][0]
                    return _rec("all_reduce", nbytes(t), 0) | {"world": 0}
                return _rec(op, 0, 0)
            t = args[0]
            if op == "all_gather_into_tensor":
                c = int(args[1])
                return _rec("all_gather", c * nbytes(t), (c - 1) * nbytes(t)) | {"world": c}
            if op == "reduce_scatter_tensor":
                c = int(args[2])
                return _rec("reduce_scatter", nbytes(t), (c - 1) * nbytes(t) // c) | {"world": c}
            if op == "all_reduce":
                g = _resolve_process_group(args[2])
                c = g.size()
                return _rec("all_reduce", nbytes(t), 2 * (c - 1) * nbytes(t) / c) | {"world": c}
            if op == "all_to_all_single":
                out_splits, group = list(args[1]), _resolve_process_group(args[3])
                me = dist.get_rank(group)
                row = nbytes(out) // max(1, sum(out_splits)) if sum(out_splits) else 0
                recv = (sum(out_splits) - out_splits[me]) * row
                return _rec("all_to_all", nbytes(out), recv) | {"world": group.size()}
            return _rec(op, nbytes(t), 0)

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


def _worker(rank, world, name, dims_kw, recompute):
    import numpy as np

    import harts_planner as hp
    from harts_runtime import StepInputs, run_microbatch
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
    parallelize(model, mesh, recompute=recompute)
    model.train()
    cp_rank = mesh.cp.get_local_rank()
    counter = _counter_class()()
    mbs = []

    def microbatch(slot, traj):
        mb = make_microbatch(model, step, np.asarray(traj, dtype=np.int64), "compact")
        n = mb.num_rows
        rows = {"n": n, "p": int(mb.target_index.shape[0]), "row_block": list(row_block(n, dims.cp, cp_rank))}
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


def compare(case: str, results: list, dims_kw: dict, recompute: bool, name: str) -> dict:
    """Measured against analytic, per rank: the CP collectives per (layer, part, phase, collective)
    (must agree exactly), FSDP2's per (phase, collective), and the rows."""
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
            ana += microbatch_collectives(md, n, p, c, r["cp_rank"], recompute)
            fsdp_ana += fsdp_microbatch(r["units"], world_fsdp, 4)
            want = activation_rows(n, c, r["cp_rank"], md)
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
    for case in cases:
        name, world, dims_kw, recompute = CASES[case]
        t0 = time.perf_counter()
        results = run_distributed(_worker, world, name, dims_kw, recompute, timeout=600)
        res = compare(case, results, dims_kw, recompute, name)
        res.update(
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
def markdown(pred: dict) -> str:
    lines = [
        "| model | tree rows N | C | rows / rank | compute s (predicted) | CP bytes / rank | "
        "CP comm s (predicted) | step s (predicted) | memory / rank GiB (predicted) | fits 139 GiB | "
        "state passing bytes / rank |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in pred["rows"]:
        lines.append(
            f"| {r['flavor']} | {r['rows']:,} | {r['cp']} | {r['rows_per_rank']:,} | "
            f"{r['compute_s']:.1f} | {r['cp_comm_bytes_per_rank'] / 1e9:.1f} GB | {r['cp_comm_s']:.2f} | "
            f"**{r['step_s']:.1f}** | {r['memory_GiB']:.0f} | {'yes' if r['fits'] else 'no (max ' + format(r['max_rows_per_rank'], ',') + ' rows / rank)'} | "
            f"{r['state_passing_bytes_per_rank'] / 1e9:.2f} GB |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--quick", action="store_true", help="debug model at cp = 2 only")
    ap.add_argument("--no-measure", action="store_true", help="the model and the prediction only")
    ap.add_argument("--cases", default=None, help="comma-separated measurement cases")
    args = ap.parse_args(argv)
    doc = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:]}}
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
