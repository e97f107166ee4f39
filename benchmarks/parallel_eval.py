"""Parallel configurations (FSDP2 / HSDP, TP, SP, EP) against the single-device step, and HARTS
against the trajectory baseline under each one (paper Table 4 style). Writes JSON.

Runs (one node, every configuration uses every rank of the job; ``--configs`` separates
configurations with ``;``, ``--config`` may also be repeated)::

    # every predefined configuration of the job's size (here the 8-GPU ones), reduced ling-tiny
    torchrun --nproc-per-node 8 benchmarks/parallel_eval.py --layers 4 --fast-autotune \\
        --out benchmarks/results/parallel_eval_8gpu.json
    torchrun --nproc-per-node 4 benchmarks/parallel_eval.py --configs 'dp2-tp2-sp-ep2;hsdp2x2;dp4-ep4' \\
        --out benchmarks/results/parallel_eval_4gpu.json
    torchrun --nproc-per-node 2 benchmarks/parallel_eval.py --configs 'dp_shard=2;tp=2,sp;dp_shard=2,ep=2' \\
        --out benchmarks/results/parallel_eval_2gpu.json

CPU smoke run (gloo, the ``debug`` flavor in float32)::

    torchrun --nproc-per-node 2 benchmarks/parallel_eval.py --device cpu --flavor debug --preset tiny \\
        --capacity 512 --iters 1 --configs 'dp_shard=2;tp=2,sp' --out /tmp/parallel_eval.json

(``tests/runtime/test_benchmarks_smoke.py`` runs it with ``dp_shard=2,ep=2;tp=2,sp`` at T = 24.)

Configurations
--------------
A configuration is a predefined name (below) or a ``key=value`` list with the keys of
:class:`harts_runtime.parallel.ParallelDims`: ``dp_replicate``, ``dp_shard``, ``tp``, ``ep`` and the
flag ``sp`` (sequence parallelism; ``sp=0`` / ``sp=1`` also accepted), e.g. ``dp_shard=2,tp=2,sp,ep=2``.
Without ``dp_shard`` it is filled in from the world size (``world / (dp_replicate * tp)``). A
configuration whose world size (``dp_replicate * dp_shard * tp``) differs from the job's, or that
:class:`ParallelDims` or :func:`parallelize` refuses (e.g. ``tp`` not dividing the heads), is skipped
with a message (and a ``skipped`` record in the JSON); the others still run. Without
``--configs`` every predefined configuration of the job's world size runs.

Predefined names (world size: names)::

    2: dp2 (dp_shard=2), ep2 (dp_shard=2,ep=2), tp2 (tp=2), tp2-sp (tp=2,sp)
    4: dp4, dp4-ep4, hsdp2x2 (dp_replicate=2,dp_shard=2), dp2-tp2-sp, dp2-tp2-sp-ep2 (alias table4-4gpu)
    8: dp8, dp8-ep8, hsdp2x4-ep4 (dp_replicate=2,dp_shard=4,ep=4), dp4-tp2-sp, dp4-tp2-sp-ep4 (alias table4-8gpu)

The paper's Megatron configurations DP2/TP2/SP/EP4 (4 GPUs) and DP4/TP2/SP/EP8 (8 GPUs) let the EP
group span the TP ranks too (expert tensor parallelism 1: each of the 4 or 8 ranks holds ``E / 4``
or ``E / 8`` routed experts). Here an EP group is made of ``dp_shard`` ranks at one TP coordinate
(``ep`` divides ``dp_shard``), so the closest are ``table4-4gpu`` = ``dp_shard=2,tp=2,sp,ep=2`` and
``table4-8gpu`` = ``dp_shard=4,tp=2,sp,ep=4``: the same DP, TP and SP degrees, each rank holds
``E / ep`` routed experts, twice the paper's (replicated over the 2 TP ranks), each TP rank routes
its own sequence-parallel row block to its EP group (so every rank still computes about ``1 / world``
of the expert rows), and the all-to-alls span ``ep`` = half the paper's ranks. ``dp8-ep8`` is the
other neighbour of DP4/TP2/SP/EP8: all 8 ranks in one EP group (``E / 8`` experts each), no TP.

Per configuration
-----------------
1. Fidelity. Every rank builds the model (same seed) and parallelises it
   (``parallelize(model, mesh, recompute=, keep=, param_dtype=, reduce_dtype=)``); rank 0 then runs
   the same step plan (``plan_step`` at the configuration's D, so the same microbatches) on a second,
   unparallelised copy (with the same recomputation), writes its gradients to a file on the local
   disk (``--scratch``) and frees the copy (configurations with the same step plan, i.e. the same D,
   share that reference; the files are removed at the end); then every rank runs the parallel step
   (``run_replica_step`` + ``sync_expert_load``). Reported: the two losses and their relative
   difference, the largest absolute difference of the per-token log-probs (every target scored;
   ``logprob_coverage_ok``), over all parameters (gradients gathered with ``full_tensor()``, compared on
   rank 0 against the file) the largest relative gradient error ``||g - g_ref|| / ||g_ref||`` and
   ``max |g - g_ref| / max |g_ref|``, the smallest cosine, and the expert-load counts' largest
   difference. ``bf16_ok``: loss within 1e-2 relative and every gradient's relative error below
   ``--grad-tol``; per-parameter errors of tiny, cancelling gradients (a KDA layer's ``A_log``) can
   exceed it under bf16 alone, so ``grad_worst`` lists the five worst parameters with their share of
   the gradient norm, and ``grad_global_rel_err`` / ``grad_global_cos`` compare the whole gradient
   vector. With ``--param-dtype bfloat16`` (``auto``: when the flavor is bf16) the masters are float32
   and FSDP2 computes in bf16 with float32 reduction; the reference is the same float32
   initialisation cast to bf16 parameters (what FSDP2's ``param_dtype`` computes with), and with
   ``--fp32-reference`` (default) rank 0 also runs the float32 step: ``vs_fp32_reference`` (the
   parallel bf16 step against it) next to ``bf16_noise_floor`` (the single-device bf16 step against
   it) tells parallel error from bf16's own.
2. Speed. F/B/Grad seconds (layout materialisation, forward, log-probs, loss, backward, FSDP2's
   gradient reduce-scatter, the loss all-reduce; no optimizer update) of the slowest rank, median of
   ``--iters`` after ``--warmup`` iterations, for HARTS compact execution (the step plan's
   microbatches with their precomputed call plans) and for the trajectory baseline under the same
   configuration (expanded trajectories packed first-fit-decreasing at ``--capacity``, the packs
   LPT-assigned to the replicas by raw tokens with equal counts, splitting the largest pack when
   needed; :func:`_baseline_schedule`). ``fbg_speedup`` = baseline / HARTS; ``step_compression`` = S / C
   (semantic tokens over the executed plan's compact work, the ideal F/B/Grad speedup) and
   ``fbg_speedup_over_ideal``; ``planner_s`` (slowest rank: ``plan_step`` + ``plan_calls`` of its
   replica's microbatches) and ``core_speedup`` = baseline / (HARTS + planner). Also the FLOP-based
   ideal (``harts_runtime.flops.work_compression``, as ``train_eval.py`` reports it).
3. Balance. The planner's prediction (per replica and per slot compact work from ``plan.work``,
   ``plan.replica``, ``plan.slot``; slot imbalance P50 / P95 and step imbalance, Equation 23) next to
   the measured per-rank times (``ReplicaStepResult.slot_seconds`` of every rank, gathered to rank 0,
   median per slot over the timed iterations; each slot ends with a device synchronisation). Slot
   times are wall times: FSDP2's per-layer all-gathers and EP's all-to-alls make a lighter replica
   wait for the heaviest inside each slot, so the measured per-rank imbalance understates the compute
   imbalance; what the planner minimises, the slot's critical work, shows as the slot's time.

The JSON (rank 0, rewritten after every configuration so a failure keeps the finished ones) holds
the arguments, the environment (world size, torch, device name, date) and one record per
configuration.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's runtime wins over an installed copy

PREDEFINED = {
    # world size 2
    "dp2": "dp_shard=2",
    "ep2": "dp_shard=2,ep=2",
    "tp2": "tp=2",
    "tp2-sp": "tp=2,sp",
    # world size 4
    "dp4": "dp_shard=4",
    "dp4-ep4": "dp_shard=4,ep=4",
    "hsdp2x2": "dp_replicate=2,dp_shard=2",
    "dp2-tp2-sp": "dp_shard=2,tp=2,sp",
    "dp2-tp2-sp-ep2": "dp_shard=2,tp=2,sp,ep=2",  # the paper's DP2/TP2/SP/EP4 (module docstring)
    # world size 8
    "dp8": "dp_shard=8",
    "dp8-ep8": "dp_shard=8,ep=8",
    "hsdp2x4-ep4": "dp_replicate=2,dp_shard=4,ep=4",
    "dp4-tp2-sp": "dp_shard=4,tp=2,sp",
    "dp4-tp2-sp-ep4": "dp_shard=4,tp=2,sp,ep=4",  # the paper's DP4/TP2/SP/EP8 (module docstring)
}
ALIASES = {"table4-4gpu": "dp2-tp2-sp-ep2", "table4-8gpu": "dp4-tp2-sp-ep4"}
DEGREES = ("dp_replicate", "dp_shard", "tp", "ep")
TRUE, FALSE = ("", "1", "true", "yes", "on"), ("0", "false", "no", "off")


class ConfigSpecError(ValueError):
    """A configuration that cannot be parsed (a typo: the run stops before any work)."""


def log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[parallel_eval {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------- configs
def parse_kv(spec: str) -> dict:
    """``"dp_shard=2,tp=2,sp"`` -> ``{"dp_shard": 2, "tp": 2, "sequence_parallel": True}``."""
    kw: dict = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        key, eq, val = part.partition("=")
        key, val = key.strip().replace("-", "_"), val.strip().lower()
        if key in ("sp", "sequence_parallel"):
            if val not in TRUE + FALSE:
                raise ConfigSpecError(f"{spec!r}: {part!r}: sp takes no value or one of 0/1/true/false")
            kw["sequence_parallel"] = val in TRUE
        elif key in DEGREES:
            if not eq or not val.isdigit() or int(val) < 1:
                raise ConfigSpecError(f"{spec!r}: {part!r}: {key} needs a positive integer ({key}=N)")
            kw[key] = int(val)
        elif key == "dp":
            raise ConfigSpecError(
                f"{spec!r}: there is no dp=; use dp_shard= (FSDP) and/or dp_replicate= (HSDP): D = their product"
            )
        else:
            raise ConfigSpecError(f"{spec!r}: unknown key {key!r}; keys: {', '.join(DEGREES)}, sp")
    return kw


def parse_configs(configs: str | None, config: list[str] | None) -> list[tuple[str, dict]]:
    """``(name as given, parsed keys)`` of every configuration of ``--configs`` (``;``-separated)
    and the repeated ``--config``, in order (empty: none requested). Raises
    :class:`ConfigSpecError` for a name or key it does not know."""
    items = []
    for text in (configs or "").split(";") + list(config or []):
        text = text.strip()
        if not text:
            continue
        names = [t.strip() for t in text.split(",")]
        if "=" not in text and len(names) > 1 and all(ALIASES.get(n, n) in PREDEFINED for n in names):
            items += [(n, parse_kv(PREDEFINED[ALIASES.get(n, n)])) for n in names]  # "dp2,tp2" (old style)
        elif ALIASES.get(text, text) in PREDEFINED:
            items.append((text, parse_kv(PREDEFINED[ALIASES.get(text, text)])))
        elif "=" in text or text in ("sp", "sequence_parallel"):
            items.append((text, parse_kv(text)))
        else:
            raise ConfigSpecError(
                f"unknown configuration {text!r}: a key=value list (dp_shard=2,tp=2,sp,...) or one of "
                f"{', '.join(list(PREDEFINED) + list(ALIASES))}"
            )
    return items


def predefined_for(world: int) -> list[tuple[str, dict]]:
    out = []
    for name, spec in PREDEFINED.items():
        kw = parse_kv(spec)
        if kw.get("dp_replicate", 1) * kw.get("dp_shard", 1) * kw.get("tp", 1) == world:
            out.append((name, kw))
    return out


def make_dims(kw: dict, world: int):
    """``(ParallelDims, None)`` or ``(None, why it is skipped)``."""
    from harts_runtime.parallel import ParallelConfigError, ParallelDims

    r, t = kw.get("dp_replicate", 1), kw.get("tp", 1)
    kw = dict(kw)
    if "dp_shard" in kw:
        want = r * kw["dp_shard"] * t
        if want != world:
            return None, f"needs {want} ranks (dp_replicate * dp_shard * tp), the job has {world}"
    elif world % (r * t):
        return None, f"dp_replicate * tp = {r * t} does not divide the job's {world} ranks"
    else:
        kw["dp_shard"] = world // (r * t)
    try:
        return ParallelDims(world_size=world, **kw), None
    except ParallelConfigError as e:
        return None, f"invalid: {e}"


def dims_label(dims) -> str:
    parts = [f"{k}={getattr(dims, k)}" for k in DEGREES if getattr(dims, k) > 1]
    if dims.sequence_parallel:
        parts.insert(parts.index(f"tp={dims.tp}") + 1, "sp")
    return ",".join(parts) or "single"


def dims_dict(dims) -> dict:
    return {k: getattr(dims, k) for k in (*DEGREES, "sequence_parallel", "world_size")} | {"dp": dims.dp}


# ---------------------------------------------------------------------------------------- helpers
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _max(values, dev) -> list[float]:
    """Element-wise maximum over the ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _gather_rows(values, dev) -> list[list[float]]:
    """Every rank's equally long list of floats, in rank order."""
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def _baseline_schedule(lengths: np.ndarray, capacity: int, dp: int) -> list[list[np.ndarray]]:
    """Trajectory baseline: first-fit-decreasing packs of expanded trajectories, splits of the largest
    pack until every replica can get the same count (a pack of one trajectory is never split: the
    short replicas then pad with an empty microbatch), LPT to replicas by raw tokens with equal
    counts."""
    from harts_runtime import pack_trajectories

    packs = [np.asarray(p, dtype=np.int64) for p in pack_trajectories(lengths, capacity)]
    while len(packs) % dp or len(packs) < dp:
        packs.sort(key=lambda p: -int(lengths[p].sum()))
        if len(packs[0]) < 2:
            break
        big = packs.pop(0)
        packs += [big[: len(big) // 2], big[len(big) // 2 :]]
    packs.sort(key=lambda p: -int(lengths[p].sum()))
    per_replica = -(-len(packs) // dp)
    per = [[] for _ in range(dp)]
    load = [0] * dp
    for p in packs:  # LPT with (nearly) equal counts
        d = min((d for d in range(dp) if len(per[d]) < per_replica), key=lambda d: load[d])
        per[d].append(p)
        load[d] += int(lengths[p].sum())
    return per


class BaselinePlan:
    """The baseline's schedule in the shape ``run_replica_step`` reads (``dp_size``,
    ``microbatches``, ``replica``, ``slot``)."""

    def __init__(self, per_replica: list[list[np.ndarray]], lengths: np.ndarray):
        self.dp_size = len(per_replica)
        self.microbatches, replica, slot = [], [], []
        for d, packs in enumerate(per_replica):
            for j, p in enumerate(packs):
                self.microbatches.append(p)
                replica.append(d)
                slot.append(j)
        self.replica, self.slot = np.array(replica, dtype=np.int64), np.array(slot, dtype=np.int64)
        self.work = np.array([int(lengths[p].sum()) for p in self.microbatches], dtype=np.int64)


def _grid(work, replica, slot, dp: int) -> np.ndarray:
    """Work per (slot, replica)."""
    slots = int(np.max(slot)) + 1 if len(slot) else 0
    grid = np.zeros((slots, dp), dtype=np.int64)
    grid[np.asarray(slot), np.asarray(replica)] = np.asarray(work)
    return grid


def _balance(plan_like, slot_runs: list[list[list[float]]], dims) -> dict:
    """Predicted work per replica / slot next to the measured per-rank slot seconds (median per
    slot over the timed iterations; ``slot_runs[iteration][rank][slot]``)."""
    from harts_planner.step_plan import imbalance

    dp, world = dims.dp, dims.world_size
    grid = _grid(plan_like.work, plan_like.replica, plan_like.slot, dp)
    sec = np.median(np.asarray(slot_runs, dtype=np.float64), axis=0) if slot_runs else np.zeros((world, 0))
    rank_replica = [dims.coords(r)["replica"] for r in range(world)]
    per_replica = np.zeros((dp, sec.shape[1]))
    for r in range(world):  # a replica's time: its slowest TP rank
        per_replica[rank_replica[r]] = np.maximum(per_replica[rank_replica[r]], sec[r])
    busy = per_replica.sum(axis=1)
    slot_imb = [imbalance(row) for row in grid]
    return {
        "predicted": {
            "replica_work": grid.sum(axis=0).tolist(),
            "slot_work": grid.tolist(),
            "slot_imbalance": slot_imb,
            "slot_imbalance_p50": float(np.percentile(slot_imb, 50)) if slot_imb else 0.0,
            "slot_imbalance_p95": float(np.percentile(slot_imb, 95)) if slot_imb else 0.0,
            "step_imbalance": imbalance(grid.sum(axis=0)),
            "slot_critical_work": int(grid.max(axis=1).sum()) if len(grid) else 0,
        },
        "measured": {
            "rank_replica": rank_replica,
            "rank_slot_seconds": sec.tolist(),
            "rank_busy_seconds": sec.sum(axis=1).tolist(),
            "replica_seconds": busy.tolist(),
            "slot_imbalance": [imbalance(per_replica[:, j]) for j in range(per_replica.shape[1])],
            "step_imbalance": imbalance(busy),
            "slot_seconds_max": per_replica.max(axis=0).tolist() if dp else [],
        },
    }


# ---------------------------------------------------------------------------------------- one config
def _build(cfg, bf16: bool, dev, seed: int):
    from harts_runtime import HybridModel

    torch.manual_seed(seed)
    model = HybridModel(cfg, device=dev)
    if bf16:  # the reference computes with what FSDP2's param_dtype casts the float32 masters to
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    return model


def _reference(args, cfg, bf16: bool, dev, step, plan, keep, path) -> dict:
    """Rank 0: the step plan's microbatches on one unparallelised copy (float32, or its parameters
    cast to bf16); the gradients go to the file ``path``, the rest is returned."""
    from harts_runtime import apply_recompute, run_microbatch

    model = apply_recompute(_build(cfg, bf16, dev, args.seed), args.recompute, keep=keep).train()
    lp = np.full(step.num_targets, np.nan)
    loss = 0.0
    _sync(dev)
    t = time.perf_counter()
    for mb in plan.microbatches:
        contribution, st = run_microbatch(model, step, np.asarray(mb, dtype=np.int64), "compact")
        loss += float(contribution)
        lp[st["target_index"].cpu().numpy()] = st["logprobs"].double().cpu().numpy()
    _sync(dev)
    seconds = time.perf_counter() - t
    torch.save({n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}, path)
    counts = {
        n: b.detach().cpu().clone() for n, b in model.named_buffers() if n.endswith("local_tokens_per_expert")
    }
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"loss": loss, "logprobs": lp, "counts": counts, "seconds": seconds, "path": path}


class GradStats:
    """Gradient agreement accumulated parameter by parameter: per parameter ``||g - g_ref|| /
    ||g_ref||``, ``max |g - g_ref| / max |g_ref|`` and the cosine; over the whole gradient vector the
    same norm ratio and cosine."""

    def __init__(self):
        self.rows, self.zero_ref_nonzero = [], 0
        self.diff2 = self.ref2 = self.got2 = self.dot = 0.0

    def add(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        got = got.detach().double()  # on got's device (the GPU in a GPU run)
        want = want.detach().to(got.device, torch.float64)
        n, d, m = float(want.norm()), float((got - want).norm()), float(got.norm())
        self.diff2 += d * d
        self.ref2 += n * n
        self.got2 += m * m
        self.dot += float((got * want).sum())
        if n == 0.0:
            self.zero_ref_nonzero += int(m > 0)
            return
        cos = float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0))
        self.rows.append((d / n, float((got - want).abs().max() / want.abs().max()), cos, n, name))

    def result(self, top: int = 5) -> dict:
        rows = sorted(self.rows, key=lambda r: -r[0])
        total = max(self.ref2**0.5, 1e-300)
        return {
            "grad_max_rel_err": rows[0][0] if rows else 0.0,
            "grad_max_abs_rel_err": max((r[1] for r in rows), default=0.0),
            "grad_min_cos": min((r[2] for r in rows), default=1.0),
            "grad_worst_param": rows[0][4] if rows else "",
            "grad_worst": [
                {
                    "param": r[4],
                    "rel_err": r[0],
                    "abs_rel_err": r[1],
                    "cos": r[2],
                    "ref_norm_share": r[3] / total,
                }
                for r in rows[:top]
            ],
            "grad_global_rel_err": (self.diff2 / self.ref2) ** 0.5 if self.ref2 else 0.0,
            "grad_global_cos": self.dot / max((self.ref2 * self.got2) ** 0.5, 1e-300),
            "grad_params_compared": len(rows),
            "grad_zero_ref_nonzero": self.zero_ref_nonzero,
        }


def _compare_grads(model, refs: dict[str, dict], rank: int) -> dict[str, GradStats]:
    """Every gradient gathered (``full_tensor``, collective: every rank walks the same parameters)
    and compared on rank 0 with each reference's gradient file (memory-mapped)."""
    from torch.distributed.tensor import DTensor

    files = {k: torch.load(r["path"], mmap=True) for k, r in refs.items()} if rank == 0 else {}
    stats = {k: GradStats() for k in refs}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:  # FSDP2 gives every rank of a unit a gradient or none
            continue
        full = g.full_tensor() if isinstance(g, DTensor) else g
        for k, grads in files.items():
            if name in grads:
                stats[k].add(name, full, grads[name])
        del full
    return stats


def _noise_floor(ref: dict, ref32: dict) -> dict:
    """The bf16 single-device step against the float32 one (rank 0): how far bf16 alone moves."""
    a, b = torch.load(ref["path"], mmap=True), torch.load(ref32["path"], mmap=True)
    stats = GradStats()
    for name, want in b.items():
        if name in a:
            stats.add(name, a[name], want)
    return {
        "loss_rel_diff": abs(ref["loss"] - ref32["loss"]) / max(abs(ref32["loss"]), 1e-12),
        "logprob_max_abs_diff": float(np.nanmax(np.abs(ref["logprobs"] - ref32["logprobs"]))),
        **stats.result(),
    }


def run_config(text: str, dims, args, dev, step, cfg, mixed: bool, ref_cache: dict) -> dict:
    import harts_planner as hp
    from harts_runtime import run_microbatch
    from harts_runtime.flops import work_compression
    from harts_runtime.parallel import parallelize, replica_schedule, run_replica_step, sync_expert_load

    rank = dist.get_rank()
    keep = tuple(k for k in args.keep.split(",") if k) if args.recompute else ()
    mesh = dims.build_mesh(dev.type)
    replica = mesh.replica
    lengths = np.asarray(step.batch.lengths, dtype=np.int64)
    t0 = time.perf_counter()
    plan = hp.plan_step(step.batch, dims.dp, args.capacity, cfg.chunk_size)
    plan_step_s = time.perf_counter() - t0

    # the parallel model first: a configuration that parallelize refuses is skipped before the reference
    model = _build(cfg, False, dev, args.seed)
    bf16 = torch.bfloat16 if mixed else None
    parallelize(
        model,
        mesh,
        recompute=args.recompute,
        keep=keep,
        param_dtype=bf16,
        reduce_dtype=torch.float32 if mixed else None,
    )
    model.train()

    # ---- fidelity: single-device reference(s) on rank 0 (gradients through files on the local disk),
    # one per distinct step plan: configurations of the same D share them
    refs = {}
    if rank == 0:
        key = (dims.dp, tuple(tuple(np.asarray(m).tolist()) for m in plan.microbatches))
        reused = key in ref_cache
        if not reused:
            base = os.path.join(args.scratch, f"parallel_eval_ref_{os.getpid()}_{len(ref_cache)}")
            ref_cache[key] = {"ref": _reference(args, cfg, mixed, dev, step, plan, keep, base + ".pt")}
            if mixed and args.fp32_reference:
                ref_cache[key]["fp32"] = _reference(
                    args, cfg, False, dev, step, plan, keep, base + "_fp32.pt"
                )
        refs = ref_cache[key]
    ref_loss = _max([refs["ref"]["loss"] if rank == 0 else -float("inf")], dev)[0]

    num_targets = step.num_targets
    lp_sum = torch.zeros(num_targets, dtype=torch.float64, device=dev)
    lp_cnt = torch.zeros(num_targets, dtype=torch.float64, device=dev)

    def fidelity_mb(slot, traj):
        loss, st = run_microbatch(model, step, traj, "compact")
        ti = torch.as_tensor(st["target_index"], device=dev)
        lp_sum.index_add_(0, ti, st["logprobs"].to(dev, torch.float64))
        lp_cnt.index_add_(0, ti, torch.ones(ti.numel(), dtype=torch.float64, device=dev))
        return loss

    _sync(dev)
    t = time.perf_counter()
    res = run_replica_step(plan, mesh, fidelity_mb)
    _sync(dev)
    first_step_s = _max([time.perf_counter() - t], dev)[0]
    sync_expert_load(model, mesh)
    dist.all_reduce(lp_sum)
    dist.all_reduce(lp_cnt)
    out = {
        "config": text,
        "label": dims_label(dims),
        "dims": dims_dict(dims),
        "plan": {
            "dp_size": plan.dp_size,
            "num_microbatches": plan.num_microbatches,
            "num_slots": plan.num_slots,
            "total_work": plan.total_work,
            "compact_tokens": plan.compact_tokens,
            "source": plan.source,
            "plan_step_s": plan_step_s,
        },
        "loss_single": ref_loss,
        "loss_parallel": res.loss,
        "loss_rel_diff": abs(res.loss - ref_loss) / max(abs(ref_loss), 1e-12),
    }
    grads = _compare_grads(model, refs, rank)
    if rank == 0:
        ref = refs["ref"]
        lp = (lp_sum / lp_cnt.clamp_min(1)).cpu().numpy()
        covered = lp_cnt.cpu().numpy() > 0
        counts = {
            n: b.detach().cpu() for n, b in model.named_buffers() if n.endswith("local_tokens_per_expert")
        }
        count_err = max(
            (
                float((counts[n] - c).abs().max()) / max(float(c.abs().max()), 1.0)
                for n, c in ref["counts"].items()
            ),
            default=0.0,
        )

        def lp_diff(want):
            d = np.abs(lp - want)[covered]
            return (float(d.max()), float(d.mean())) if d.size else (0.0, 0.0)

        out.update(
            logprob_coverage_ok=bool(covered.all()),
            logprob_max_abs_diff=lp_diff(ref["logprobs"])[0],
            logprob_mean_abs_diff=lp_diff(ref["logprobs"])[1],
            expert_load_max_rel_diff=count_err,
            reference_step_s_cold=ref["seconds"],
            reference_reused=reused,
            parallel_step_s_cold=first_step_s,
            **grads["ref"].result(),
        )
        out["bf16_ok"] = bool(
            out["loss_rel_diff"] < 1e-2
            and out["grad_max_rel_err"] < args.grad_tol
            and out["logprob_coverage_ok"]
        )
        if "fp32" in refs:  # the parallel bf16 step and the single-device bf16 step, each against float32
            r32 = refs["fp32"]
            out["vs_fp32_reference"] = {
                "loss_rel_diff": abs(res.loss - r32["loss"]) / max(abs(r32["loss"]), 1e-12),
                "logprob_max_abs_diff": lp_diff(r32["logprobs"])[0],
                **grads["fp32"].result(),
            }
            out["bf16_noise_floor"] = _noise_floor(ref, r32)
        log(
            f"{text}: loss {res.loss:.6g} vs {ref_loss:.6g} (rel {out['loss_rel_diff']:.2e}), grad rel err "
            f"{out['grad_max_rel_err']:.2e} ({out['grad_worst_param']}), min cos {out['grad_min_cos']:.6f}, "
            f"global {out['grad_global_rel_err']:.2e}, log-prob max diff {out['logprob_max_abs_diff']:.2e}"
        )
        if "fp32" in refs:
            v, f = out["vs_fp32_reference"], out["bf16_noise_floor"]
            log(
                f"{text}: against float32: parallel bf16 grad global rel err {v['grad_global_rel_err']:.2e}, "
                f"single-device bf16 {f['grad_global_rel_err']:.2e} (noise floor)"
            )
    refs = grads = lp_sum = lp_cnt = None  # (closures hold some: rebinding frees them)

    # ---- speed: HARTS compact execution and the trajectory baseline, same configuration
    base_plan = BaselinePlan(_baseline_schedule(lengths, args.capacity, dims.dp), lengths)
    params = list(model.parameters())

    def timed(plan_like, mode, calls=None):
        for p in params:
            p.grad = None

        def mb(j, traj):
            cp = calls[j] if calls is not None and j < len(calls) else None
            loss = run_microbatch(model, step, traj, mode, call_plan=cp)[0]
            _sync(dev)  # the slot's seconds include its device work
            return loss

        _sync(dev)
        dist.barrier()
        t = time.perf_counter()
        r = run_replica_step(plan_like, mesh, mb)
        _sync(dev)
        return r, time.perf_counter() - t

    harts_t, base_t, plan_t, harts_slots, base_slots = [], [], [], [], []
    for it in range(args.warmup + args.iters):
        t = time.perf_counter()
        p = hp.plan_step(step.batch, dims.dp, args.capacity, cfg.chunk_size)
        calls = [
            hp.plan_calls(step.batch, cfg.chunk_size, microbatch=m, conv_width=cfg.conv_size)
            for m in replica_schedule(p, replica)
        ]
        pt = time.perf_counter() - t
        hr, ht = timed(p, "compact", calls)
        br, bt = timed(base_plan, "trajectory")
        ht, bt, pt = _max([ht, bt, pt], dev)
        hs, bs = _gather_rows(hr.slot_seconds, dev), _gather_rows(br.slot_seconds, dev)
        log(f"{text}: iteration {it}: HARTS {ht:.3f} s, baseline {bt:.3f} s, planner {pt * 1e3:.1f} ms")
        if it >= args.warmup:
            harts_t.append(ht)
            base_t.append(bt)
            plan_t.append(pt)
            harts_slots.append(hs)
            base_slots.append(bs)
    if rank == 0:
        h, b, pl = statistics.median(harts_t), statistics.median(base_t), statistics.median(plan_t)
        all_calls = [
            hp.plan_calls(step.batch, cfg.chunk_size, microbatch=m, conv_width=cfg.conv_size)
            for m in p.microbatches
        ]
        work = work_compression(cfg, lengths, [c.position_ids for c in all_calls])
        compression = step.batch.semantic_tokens / p.total_work
        out.update(
            harts_fbg_s=h,
            baseline_fbg_s=b,
            planner_s=pl,
            fbg_speedup=b / h,
            core_speedup=b / (h + pl),
            step_compression=compression,
            fbg_speedup_over_ideal=b / h / compression,
            ideal_work_compression_flops=work["ideal_work_compression"],
            fbg_speedup_over_ideal_flops=b / h / work["ideal_work_compression"],
            baseline_microbatches=len(base_plan.microbatches),
            timings={"harts_fbg_s": harts_t, "baseline_fbg_s": base_t, "planner_s": plan_t},
            balance=_balance(p, harts_slots, dims),
            baseline_balance=_balance(base_plan, base_slots, dims),
        )
        out["balance"]["predicted"]["plan_metrics"] = {
            k: p.metrics[k] for k in ("slot_imbalance_p50", "slot_imbalance_p95", "step_imbalance")
        }
        bal = out["balance"]
        log(
            f"{text}: F/B/Grad speedup {out['fbg_speedup']:.3f}x (ideal S/C {compression:.3f}x, ratio "
            f"{out['fbg_speedup_over_ideal']:.3f}), core {out['core_speedup']:.3f}x; step imbalance predicted "
            f"{bal['predicted']['step_imbalance']:.3f}, measured {bal['measured']['step_imbalance']:.3f}"
        )
    model = params = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()
    return out


# ---------------------------------------------------------------------------------------- main
def _git_commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def _write(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)


def _table(results: list[dict]) -> str:
    lines = [
        "| config | dims | S/C | F/B/Grad speedup | / ideal | Core speedup | loss rel diff | max grad rel err "
        "| min grad cos | bf16 ok | imbalance predicted / measured |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['config']} | skipped: {r['skipped']} |||||||||")
            continue
        bal = r["balance"]
        lines.append(
            f"| {r['config']} | {r['label']} | {r['step_compression']:.3f}x | {r['fbg_speedup']:.3f}x | "
            f"{r['fbg_speedup_over_ideal']:.3f} | {r['core_speedup']:.3f}x | {r['loss_rel_diff']:.2e} | "
            f"{r['grad_max_rel_err']:.2e} | {r['grad_min_cos']:.6f} | {r['bf16_ok']} | "
            f"{bal['predicted']['step_imbalance']:.3f} / {bal['measured']['step_imbalance']:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--configs",
        default=None,
        help="';'-separated configurations: predefined names or key=value lists "
        "(dp_replicate, dp_shard, tp, ep, sp), e.g. 'dp_shard=2;tp=2,sp'. Default: every predefined "
        f"one of the job's world size ({', '.join(PREDEFINED)})",
    )
    ap.add_argument("--config", action="append", default=None, help="one configuration (repeatable)")
    ap.add_argument("--flavor", default="ling-tiny")
    ap.add_argument("--layers", type=int, default=4, help="first N layers of the flavor (reduced model)")
    ap.add_argument("--preset", default="small", help="harts_planner.synth preset")
    ap.add_argument("--max-len", type=int, default=4096, help="cap trajectory length")
    ap.add_argument("--capacity", type=int, default=16384, help="T, compact rows per microbatch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=2, help="timed iterations (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    ap.add_argument(
        "--recompute",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="block recomputation (Table 4 enables it)",
    )
    ap.add_argument("--keep", default="", help="kept regions under recomputation: attention,linear_attention")
    ap.add_argument(
        "--param-dtype",
        choices=("auto", "none", "bfloat16"),
        default="auto",
        help="bfloat16: float32 masters, FSDP2 bf16 compute with float32 reduction; none: the flavor's "
        "dtype throughout; auto: bfloat16 when the flavor is bf16",
    )
    ap.add_argument(
        "--fp32-reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with bf16 compute, also a float32 single-device step: the parallel step's error against "
        "it next to the bf16 single-device step's (the noise floor)",
    )
    ap.add_argument("--grad-tol", type=float, default=5e-2, help="bf16 relative gradient error bound")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--fast-autotune", action="store_true", help="one Triton config per kernel (short leases)"
    )
    ap.add_argument("--scratch", default="/tmp", help="local directory for the reference gradients")
    ap.add_argument("--out", default="benchmarks/results/parallel_eval.json")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    try:
        items = parse_configs(args.configs, args.config)
    except ConfigSpecError as e:
        ap.error(str(e))
    if args.fast_autotune:  # before fla and our kernels are imported
        from harts_kernels.tuning import use_first_config_only

        use_first_config_only()

    from harts_runtime import model_config
    from harts_runtime.demo import synthetic_step
    from harts_runtime.parallel import ParallelConfigError

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=30))
    world, rank = dist.get_world_size(), dist.get_rank()
    if not items:
        items = predefined_for(world)
        if not items:
            log(f"no predefined configuration has world size {world}; pass --configs")
    cfg = model_config(args.flavor, args.layers)
    mixed = args.param_dtype == "bfloat16" or (args.param_dtype == "auto" and cfg.dtype == "bfloat16")
    if mixed:
        cfg = cfg.replace(dtype="float32")
    step = synthetic_step(args.preset, args.seed, cfg.vocab_size, args.max_len, "grpo")
    b = step.batch
    doc = {
        "args": vars(args),
        "environment": {
            "world_size": world,
            "backend": dist.get_backend(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(),
            "git_commit": _git_commit(),
        },
        "model": {
            "flavor": args.flavor,
            "layers": cfg.num_layers,
            "masters": cfg.dtype,
            "compute": "bfloat16" if mixed else cfg.dtype,
        },
        "step": {
            "preset": args.preset,
            "trajectories": b.num_trajectories,
            "semantic_tokens": b.semantic_tokens,
            "compact_tokens": b.compact_tokens,
            "capacity": args.capacity,
        },
        "results": [],
    }
    log(
        f"world {world}, {args.flavor} x {cfg.num_layers} layers ({doc['model']['compute']} compute), "
        f"{b.num_trajectories} trajectories, S = {b.semantic_tokens:,}, C = {b.compact_tokens:,}"
    )
    ref_cache: dict = {}  # rank 0: step plan -> reference results and gradient files
    try:
        for text, kw in items:
            dims, why = make_dims(kw, world)
            if dims is not None:
                try:
                    rec = run_config(text, dims, args, dev, step, cfg, mixed, ref_cache)
                except ParallelConfigError as e:  # parallelize refused the model (every rank alike)
                    why = f"parallelize: {e}"
            if why is not None:
                rec = {"config": text, "skipped": why}
                log(f"{text}: skipped: {why}")
            doc["results"].append(rec)
            if rank == 0:
                _write(args.out, doc)
    finally:
        for refs in ref_cache.values():
            for r in refs.values():
                if os.path.exists(r["path"]):
                    os.remove(r["path"])
    if rank == 0:
        _write(args.out, doc)
        print(_table(doc["results"]), flush=True)
        log(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
