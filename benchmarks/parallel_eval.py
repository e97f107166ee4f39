"""Parallel configurations (FSDP2 / HSDP, CP, TP, SP, EP) against the single-device step, and HARTS
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

    # context parallelism in both modes on long agentic trees (one 64k-row tree per DP replica)
    torchrun --nproc-per-node 4 benchmarks/parallel_eval.py --flavor qwen3.5-35b-a3b --layers 4 \\
        --tree-rows 64k --configs 'cp4;cp4-states;cp4-auto;dp2-cp2-states' --out benchmarks/results/pe_cp4.json

``benchmarks/gpu/issue49_runs.sh`` has the runs of 1, 2, 4 and 8 GPUs. CPU smoke run (gloo, the
``debug`` flavor in float32)::

    torchrun --nproc-per-node 2 benchmarks/parallel_eval.py --device cpu --flavor debug --preset tiny \\
        --capacity 512 --iters 1 --configs 'dp_shard=2;tp=2,sp' --out /tmp/parallel_eval.json

(``tests/benchmarks/test_benchmarks_smoke.py`` runs it with ``dp_shard=2,ep=2;tp=2,sp`` at T = 24 and
``cp2;cp2-states`` on a 192-row tree.) Every process runs with NVLink multicast off
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``, set in
``os.environ`` on import, before torch.distributed starts; child processes inherit them).

Configurations
--------------
A configuration is a predefined name (below) or a ``key=value`` list with the keys of
:class:`harts_runtime.parallel.ParallelDims`: ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``ep`` and
the flag ``sp`` (sequence parallelism; ``sp=0`` / ``sp=1`` also accepted), and with ``cp >= 2``
``cp_mode`` (``heads``, ``states`` or ``auto``: ``parallelize(cp_mode=...)``; without it the runtime's
default), e.g. ``dp_shard=2,tp=2,sp,ep=2`` or ``cp=2,cp_mode=states``. Without ``dp_shard`` it is filled in from the world size (``world / (dp_replicate * cp
* tp)``). A configuration whose world size (``dp_replicate * dp_shard * cp * tp``) differs from the job's, or that
:class:`ParallelDims` or :func:`parallelize` refuses (e.g. ``tp`` not dividing the heads), is skipped
with a message (and a ``skipped`` record in the JSON); the others still run. Without
``--configs`` every predefined configuration of the job's world size runs.

Predefined names (world size: names)::

    2: dp2 (dp_shard=2), ep2 (dp_shard=2,ep=2), tp2 (tp=2), tp2-sp (tp=2,sp),
       cp2 (cp=2,cp_mode=heads), cp2-states, cp2-auto
    4: dp4, dp4-ep4, hsdp2x2 (dp_replicate=2,dp_shard=2), dp2-tp2-sp, dp2-tp2-sp-ep2 (alias table4-4gpu),
       cp4, cp4-states, cp4-auto, dp2-cp2-states (dp_shard=2,cp=2,cp_mode=states)
    8: dp8, dp8-ep8, hsdp2x4-ep4 (dp_replicate=2,dp_shard=4,ep=4), dp4-tp2-sp, dp4-tp2-sp-ep4 (alias table4-8gpu),
       cp8, cp8-states, cp8-auto, dp2-cp4-states (dp_shard=2,cp=4,cp_mode=states)

The paper's Megatron configurations DP2/TP2/SP/EP4 (4 GPUs) and DP4/TP2/SP/EP8 (8 GPUs) let the EP
group span the TP ranks too (expert tensor parallelism 1: each of the 4 or 8 ranks holds ``E / 4``
or ``E / 8`` routed experts). Here an EP group is made of ``dp_shard`` ranks at one TP coordinate
(``ep`` divides ``dp_shard``), so the closest are ``table4-4gpu`` = ``dp_shard=2,tp=2,sp,ep=2`` and
``table4-8gpu`` = ``dp_shard=4,tp=2,sp,ep=4``: the same DP, TP and SP degrees, each rank holds
``E / ep`` routed experts, twice the paper's (replicated over the 2 TP ranks), each TP rank routes
its own sequence-parallel row block to its EP group (so every rank still computes about ``1 / world``
of the expert rows), and the all-to-alls span ``ep`` = half the paper's ranks. ``dp8-ep8`` is the
other neighbour of DP4/TP2/SP/EP8: all 8 ranks in one EP group (``E / 8`` experts each), no TP.

Workloads
---------
``--preset`` (``harts_planner.synth``, default ``small``) or ``--tree-rows R`` (``256k``, ``512k``,
``1M`` or a number): one agentic tree of R compact rows per DP replica (:func:`long_tree_step`: a
prompt and first turns of 40% of the rows, two tool branches of 10%, each forking into two answers of
10%: four trajectories of 60% of R, longer than one rank's share of a microbatch at any C >= 2).
``--capacity`` is T per rank (a microbatch holds C x T rows); with ``--tree-rows`` it defaults to R / C,
so each tree is one microbatch of the CP group. ``--flavor`` takes the runtime's flavors and
``cp_eval.py``'s published configs (``kimi-linear-48b-a3b``, ``nemotron-h-8b``), cut to ``--layers``.
``--no-fidelity`` skips the single-device reference (trees one device cannot hold), ``--no-baseline``
the trajectory-wise step.

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

4. Per rank (``per_rank``): its step seconds (HARTS, baseline, planner; median), peak memory (CUDA:
   the first step, HARTS and the baseline), and ``bytes``: every collective of the first step counted
   at dispatch by ``cp_eval.py``'s counter (``--no-count-bytes``: not), per kind (``mixer`` / ``ffn`` /
   ``head`` parts of CP, ``fsdp``) and collective, calls, payload, bytes received and sent, beside
   ``cp_eval``'s counted-bytes model of the same microbatches (each block in the mode the runtime
   chose; FSDP2 over ``dp_shard x cp``) and the error in percent (the model covers ``cp x dp_shard``;
   with ``tp``, ``ep`` or ``dp_replicate`` the prediction says why it is absent). Under CP also the
   mode of every block in each microbatch (``cp_modes_chosen``; ``cp_modes_possible``), the
   planner's CP split of each microbatch (``plan_cp`` rank costs, Equation 23 imbalance) beside each
   CP group's measured per-rank busy seconds (``cp_balance``), and with ``--tree-rows`` on a flavor
   ``cp_eval`` predicts at full depth its predicted step time and memory (``step_prediction``).
   Where ``cp_mode=auto`` ran beside ``heads`` or ``states`` on the same layout, the JSON's
   ``auto_against_modes`` says whether auto's choice was the faster one. Under ``cp_mode=states``
   the runtime refuses trajectory-wise microbatches (their mixers need a compact call plan): the
   baseline is then ``baseline_error``, and its figures come from the ``heads`` / ``auto`` run.

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
    "cp2": "cp=2,cp_mode=heads",
    "cp2-states": "cp=2,cp_mode=states",
    "cp2-auto": "cp=2,cp_mode=auto",
    # world size 4
    "dp4": "dp_shard=4",
    "dp4-ep4": "dp_shard=4,ep=4",
    "hsdp2x2": "dp_replicate=2,dp_shard=2",
    "dp2-tp2-sp": "dp_shard=2,tp=2,sp",
    "dp2-tp2-sp-ep2": "dp_shard=2,tp=2,sp,ep=2",  # the paper's DP2/TP2/SP/EP4 (module docstring)
    "cp4": "cp=4,cp_mode=heads",
    "cp4-states": "cp=4,cp_mode=states",
    "cp4-auto": "cp=4,cp_mode=auto",
    "dp2-cp2-states": "dp_shard=2,cp=2,cp_mode=states",
    # world size 8
    "dp8": "dp_shard=8",
    "dp8-ep8": "dp_shard=8,ep=8",
    "hsdp2x4-ep4": "dp_replicate=2,dp_shard=4,ep=4",
    "dp4-tp2-sp": "dp_shard=4,tp=2,sp",
    "dp4-tp2-sp-ep4": "dp_shard=4,tp=2,sp,ep=4",  # the paper's DP4/TP2/SP/EP8 (module docstring)
    "cp8": "cp=8,cp_mode=heads",
    "cp8-states": "cp=8,cp_mode=states",
    "cp8-auto": "cp=8,cp_mode=auto",
    "dp2-cp4-states": "dp_shard=2,cp=4,cp_mode=states",
}
ALIASES = {"table4-4gpu": "dp2-tp2-sp-ep2", "table4-8gpu": "dp4-tp2-sp-ep4"}
DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "ep")
CP_MODES = ("heads", "states", "auto")
#: NVLink multicast stays off in every process (set before torch.distributed starts; children inherit it)
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NVLS_OFF)
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
        elif key == "cp_mode":
            if val not in CP_MODES:
                raise ConfigSpecError(f"{spec!r}: {part!r}: cp_mode takes one of {'/'.join(CP_MODES)}")
            kw["cp_mode"] = val
        elif key in DEGREES:
            if not eq or not val.isdigit() or int(val) < 1:
                raise ConfigSpecError(f"{spec!r}: {part!r}: {key} needs a positive integer ({key}=N)")
            kw[key] = int(val)
        elif key == "dp":
            raise ConfigSpecError(
                f"{spec!r}: there is no dp=; use dp_shard= (FSDP) and/or dp_replicate= (HSDP): D = their product"
            )
        else:
            raise ConfigSpecError(f"{spec!r}: unknown key {key!r}; keys: {', '.join(DEGREES)}, sp, cp_mode")
    if "cp_mode" in kw and kw.get("cp", 1) < 2:
        raise ConfigSpecError(f"{spec!r}: cp_mode needs cp >= 2 (cp=2,cp_mode=...)")
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
        if kw.get("dp_replicate", 1) * kw.get("dp_shard", 1) * kw.get("cp", 1) * kw.get("tp", 1) == world:
            out.append((name, kw))
    return out


def make_dims(kw: dict, world: int):
    """``(ParallelDims, None)`` or ``(None, why it is skipped)``."""
    from harts_runtime.parallel import ParallelConfigError, ParallelDims

    r, t, c = kw.get("dp_replicate", 1), kw.get("tp", 1), kw.get("cp", 1)
    kw = {k: v for k, v in kw.items() if k != "cp_mode"}
    if "dp_shard" in kw:
        want = r * kw["dp_shard"] * c * t
        if want != world:
            return None, f"needs {want} ranks (dp_replicate * dp_shard * cp * tp), the job has {world}"
    elif world % (r * c * t):
        return None, f"dp_replicate * cp * tp = {r * c * t} does not divide the job's {world} ranks"
    else:
        kw["dp_shard"] = world // (r * c * t)
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
    from harts_runtime.engine import microbatch_call_plan

    model = apply_recompute(_build(cfg, bf16, dev, args.seed), args.recompute, keep=keep).train()
    lp = np.full(step.num_targets, np.nan)
    loss = 0.0
    _sync(dev)
    t = time.perf_counter()
    for mb in plan.microbatches:
        traj = np.asarray(mb, dtype=np.int64)
        calls = microbatch_call_plan(model, step, traj)
        contribution, st = run_microbatch(model, step, traj, "compact", call_plan=calls)
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


# ---------------------------------------------------------------------------------------- long trees
def parse_rows(text: str) -> int:
    """``"256k"`` -> 262,144, ``"1M"`` -> 1,048,576, ``"4096"`` -> 4,096 (``--tree-rows``)."""
    t = str(text).strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit() or int(digits) * mult < 64:
        raise ConfigSpecError(f"--tree-rows: {text!r} is not a row count >= 64 (e.g. 256k, 512k, 1M, 4096)")
    return int(digits) * mult


def long_tree_step(rows: int, trees: int, vocab: int, seed: int, objective: str = "grpo"):
    """``trees`` agentic trees of ``rows`` compact rows each (a :class:`StepInputs`): a prompt and
    first turns of 40% of the rows, two branches of 10% (a tool call each), each forking into two
    answers of 10%: 4 trajectories of 60% of the rows per tree (longer than one rank's share of a
    microbatch at any C >= 2), semantic tokens 2.4x the rows. Siblings and trees start with distinct
    tokens, so the rows shared are exactly the tree's prefixes."""
    from harts_planner import RolloutBatch
    from harts_runtime import StepInputs

    if vocab < 8 * trees:
        raise ConfigSpecError(
            f"--tree-rows: {trees} trees need a vocabulary of >= {8 * trees} tokens, got {vocab}"
        )
    rng = np.random.default_rng(seed)
    root_n = rows - 6 * (rows // 10)
    seg = rows // 10
    paths, tree_ids = [], []
    for t in range(trees):

        def seg_of(n, first):
            x = rng.integers(0, vocab, n)
            x[0] = first
            return x

        root = seg_of(root_n, t)
        for a in range(2):
            mid = seg_of(seg, trees + 2 * t + a)
            for b in range(2):
                paths.append(np.concatenate([root, mid, seg_of(seg, 3 * trees + 2 * t + b)]))
                tree_ids.append(t)
    tokens = np.concatenate(paths).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in paths])]).astype(np.int64)
    batch = RolloutBatch.from_arrays(tokens, offsets, np.asarray(tree_ids, dtype=np.int64))
    if batch.compact_tokens != trees * rows:
        raise AssertionError(f"long_tree_step: {batch.compact_tokens} compact rows, wanted {trees * rows}")
    return StepInputs.synthetic(batch, seed, objective, vocab_size=vocab)


def capacity_for(args, dims, cfg) -> int:
    """T, the per-rank capacity: ``--capacity``, or with ``--tree-rows`` the tree's rows over C
    (rounded up to the chunk size), so that one tree is one microbatch of the CP group."""
    if args.capacity is not None:
        return args.capacity
    if args.tree_rows is None:
        return 16384
    b = cfg.chunk_size
    per_rank = -(-args.tree_rows // dims.cp)
    return -(-per_rank // b) * b


# ---------------------------------------------------------------------------------------- counted bytes
def _cp_eval():
    """``benchmarks/cp_eval.py`` (its collective counter and its counted-bytes model), or None and why."""
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import cp_eval

        return cp_eval, ""
    except Exception as e:  # the model lives beside this file; a checkout without it still runs
        return None, f"benchmarks/cp_eval.py did not import ({type(e).__name__}: {e})"


def counter_class(cpe):
    """``cp_eval``'s collective counter, each record also with the bytes this rank *sent*: an
    all-to-all's input splits for the other ranks; for the symmetric collectives (all-gather,
    reduce-scatter, ring all-reduce) what a rank sends equals what it receives."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    base = cpe._counter_class()

    class Counter(base):
        def _measure(self, ns, op, args, out):
            rec = super()._measure(ns, op, args, out)
            if rec is None:
                return rec
            if ns != "c10d" and op == "all_to_all_single":
                ins, group = [int(x) for x in args[2]], _resolve_process_group(args[3])
                me = dist.get_rank(group)
                row = args[0].numel() * args[0].element_size() // max(1, sum(ins)) if sum(ins) else 0
                rec["sent"] = (sum(ins) - ins[me]) * row
            else:
                rec["sent"] = rec["received"]
            return rec

    return Counter


def _kind_totals(records, key) -> dict:
    out: dict = {}
    for r in records:
        k = key(r)
        o = out.setdefault(k, {"calls": 0, "payload": 0, "received": 0, "sent": 0})
        for f in o:
            o[f] += r.get(f, r.get("received", 0) if f == "sent" else 0)
    return out


def _group_of(r) -> str:
    return "fsdp" if r.get("source") == "c10d" else r.get("part", "?")


def fixed_modes(model) -> list:
    """Each block's CP mode when it is fixed at parallelization (``model._harts_cp_modes``: a mode
    or a tuple of the possible ones per block; absent: head-parallel CP), None where the runtime
    chooses per microbatch (``cp_mode="auto"`` with both possible)."""
    got = getattr(model, "_harts_cp_modes", None)
    if got is None:
        return ["heads" if b.mixer is not None else "none" for b in model.blocks]
    return [m if isinstance(m, str) else (m[0] if len(m) == 1 else None) for m in got]


def chosen_modes(mb) -> list | None:
    """The mode of each block in this microbatch's CP plan (``cp_mode`` states / auto), or None."""
    info = getattr(getattr(mb, "layout", None), "info", None) or {}
    got = getattr(info.get("cp_rows"), "modes", None)
    return list(got) if got is not None else None


def predicted_collectives(cpe, cfg, dims, mixed, recompute, possible, units, mbs, batch, cp_rank) -> tuple:
    """``cp_eval``'s counted-bytes model of this rank's first step: the CP collectives of every
    microbatch it ran (per layer in the mode the runtime chose) and FSDP2's over ``dp_shard x cp``.
    ``(records, None)``, or ``(None, why)`` outside the model's scope."""
    if dims.tp > 1 or dims.ep > 1 or dims.dp_replicate > 1:
        return None, "cp_eval's model covers cp x dp_shard (no tp, ep or dp_replicate)"
    act = 2 if mixed else 4
    md = cpe.dims_of(cfg, act)
    c = dims.cp
    out = []
    for mb in mbs:
        if not mb["n"]:
            continue
        modes = mb.get("modes") or possible or ["none"] * len(cfg.mixers)
        if None in modes:
            return None, "the runtime chose modes per microbatch but the microbatch does not say which"
        recs = cpe.microbatch_collectives(md, mb["n"], mb["p"], c, cp_rank, recompute, "heads")
        if c > 1 and "states" in modes:
            sp = cpe.states_split(batch, mb["traj"], c, cfg.chunk_size, cfg.conv_size)
            if hasattr(cpe, "rank_split"):  # with the rows other ranks fetch from this one (the backward's)
                rs = cpe.rank_split(sp, cp_rank)
            else:
                mine = sp["ranks"][cp_rank]
                rs = cpe.RankSplit(sp["pieces"], mine["halo_rows"], mine["attention_rows"], sp["rank_rows"])
            st = cpe.microbatch_collectives(md, mb["n"], mb["p"], c, cp_rank, recompute, "states", rs)
            recs = [r for r in recs if r["part"] != "mixer" or modes[r["layer"]] != "states"]
            recs += [r for r in st if r["part"] == "mixer" and modes[r["layer"]] == "states"]
        out += [dict(r, source="functional") for r in recs]
        out += [dict(r, source="c10d") for r in cpe.fsdp_microbatch(units, dims.dp_shard * c, act, 4)]
    return out, None


def bytes_record(measured: list, predicted: list | None, why: str | None) -> dict:
    """Per collective kind (``mixer`` / ``ffn`` / ``head`` parts of CP, ``fsdp``): calls, payload,
    bytes received and sent, measured beside the prediction and its error in percent."""

    def key(r):
        return f"{_group_of(r)}/{r['collective']}"

    meas = _kind_totals(
        [r for r in measured if not (r.get("source") == "c10d" and r["collective"] == "all_reduce")], key
    )
    out = {"measured": meas}
    if predicted is None:
        out["predicted"], out["prediction_skipped"] = None, why
        return out
    pred = _kind_totals(predicted, key)
    out["predicted"] = pred
    err = {}
    for k in sorted(set(meas) | set(pred)):
        m, p = meas.get(k, {}).get("received", 0), pred.get(k, {}).get("received", 0)
        err[k] = 100.0 * (m - p) / p if p else (0.0 if not m else None)
    out["received_error_pct"] = err
    tm = sum(v["received"] for v in meas.values())
    tp_ = sum(v["received"] for v in pred.values())
    out["total_received"] = {
        "measured": tm,
        "predicted": tp_,
        "error_pct": 100.0 * (tm - tp_) / tp_ if tp_ else None,
    }
    return out


def step_prediction(cpe, flavor: str, cfg, n: int, dims) -> dict:
    """``cp_eval.predict`` (H200 anchors, the full-depth model) of one ``n``-row tree at this C, or
    why it does not apply."""
    if cpe is None:
        return {"skipped": "no cp_eval"}
    if flavor not in cpe.FLAVORS:
        return {"skipped": f"cp_eval predicts {', '.join(cpe.FLAVORS)} only"}
    full = cpe.config_of(flavor)
    if len(full.mixers) != len(cfg.mixers):
        return {
            "skipped": f"cp_eval predicts the full-depth model ({len(full.mixers)} layers), this runs {len(cfg.mixers)}"
        }
    try:
        return cpe.predict(flavor, n, dims.cp, "nvlink", dims.dp_shard)
    except Exception as e:  # an anchor file missing in this checkout
        return {"skipped": f"{type(e).__name__}: {e}"}


def _cp_balance(dims, slot_runs, predicted) -> dict:
    """Each CP group's measured per-rank busy seconds (median over the timed iterations) beside the
    planner's CP split (each microbatch's rank costs, max / mean). Wall times: the ranks of a group
    meet at every collective, so a light rank's wait shows in its time."""
    from harts_planner.step_plan import imbalance

    sec = np.median(np.asarray(slot_runs, dtype=np.float64), axis=0).sum(axis=1)  # [rank]
    groups: dict = {}
    for r in range(dims.world_size):
        co = dims.coords(r)
        groups.setdefault((co["replica"], co["tp"]), []).append(float(sec[r]))
    measured = [
        {"replica": k[0], "tp": k[1], "rank_busy_s": v, "imbalance": imbalance(v)} for k, v in groups.items()
    ]
    pred = [m["imbalance"] for m in predicted or []]
    return {
        "predicted_split": predicted,
        "predicted_imbalance_max": max(pred, default=None),
        "predicted_imbalance_mean": float(np.mean(pred)) if pred else None,
        "measured": measured,
        "measured_imbalance_max": max(m["imbalance"] for m in measured),
    }


def run_config(
    text: str, dims, args, dev, step, cfg, mixed: bool, ref_cache: dict, cp_mode: str | None = None
) -> dict:
    import harts_planner as hp
    from harts_planner.step_plan import imbalance
    from harts_runtime import run_microbatch
    from harts_runtime.engine import microbatch_call_plan
    from harts_runtime.flops import work_compression
    from harts_runtime.microbatch import make_microbatch
    from harts_runtime.parallel import parallelize, replica_schedule, run_replica_step, sync_expert_load

    rank = dist.get_rank()
    keep = tuple(k for k in args.keep.split(",") if k) if args.recompute else ()
    mesh = dims.build_mesh(dev.type)
    replica = mesh.replica
    cp_rank = mesh.cp.get_local_rank() if dims.cp > 1 else 0
    lengths = np.asarray(step.batch.lengths, dtype=np.int64)
    capacity = capacity_for(args, dims, cfg)
    t0 = time.perf_counter()
    plan = hp.plan_step(step.batch, dims.dp, capacity, cfg.chunk_size, cp_size=dims.cp)
    plan_step_s = time.perf_counter() - t0

    # the parallel model first: a configuration that parallelize refuses is skipped before the reference
    model = _build(cfg, False, dev, args.seed)
    cpe, cpe_why = _cp_eval() if args.count_bytes else (None, "--no-count-bytes")
    units = cpe._fsdp_units(model) if cpe is not None else None
    bf16 = torch.bfloat16 if mixed else None
    parallelize(
        model,
        mesh,
        recompute=args.recompute,
        keep=keep,
        param_dtype=bf16,
        reduce_dtype=torch.float32 if mixed else None,
        **({"cp_mode": cp_mode} if cp_mode is not None else {}),
    )
    model.train()
    possible = (
        fixed_modes(model) if dims.cp > 1 else None
    )  # per block: its mode, or None (chosen per microbatch)

    # ---- fidelity: single-device reference(s) on rank 0 (gradients through files on the local disk),
    # one per distinct step plan: configurations of the same D share them
    refs = {}
    if rank == 0 and args.fidelity:
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
    ref_loss = _max([refs["ref"]["loss"] if refs else -float("inf")], dev)[0] if args.fidelity else None

    num_targets = step.num_targets
    lp_sum = torch.zeros(num_targets, dtype=torch.float64, device=dev)
    lp_cnt = torch.zeros(num_targets, dtype=torch.float64, device=dev)

    first_mbs = []  # (rows, targets, trajectories) of each microbatch this rank ran in the counted step

    def fidelity_mb(slot, traj):
        traj = np.asarray(traj, dtype=np.int64)
        mb = make_microbatch(model, step, traj, "compact", microbatch_call_plan(model, step, traj))
        first_mbs.append(
            {
                "n": int(mb.num_rows),
                "p": int(mb.target_index.shape[0]),
                "traj": traj,
                "modes": chosen_modes(mb),
            }
        )
        loss, st = run_microbatch(model, step, microbatch=mb)
        ti = torch.as_tensor(st["target_index"], device=dev)
        lp_sum.index_add_(0, ti, st["logprobs"].to(dev, torch.float64))
        lp_cnt.index_add_(0, ti, torch.ones(ti.numel(), dtype=torch.float64, device=dev))
        return loss

    # the first step runs under cp_eval's collective counter (bytes per rank and collective kind);
    # the timed steps below run without it
    counter = counter_class(cpe)() if cpe is not None else None
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    _sync(dev)
    t = time.perf_counter()
    if counter is not None:
        with counter:
            res = run_replica_step(plan, mesh, fidelity_mb)
    else:
        res = run_replica_step(plan, mesh, fidelity_mb)
    _sync(dev)
    first_step_s = _max([time.perf_counter() - t], dev)[0]
    first_peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    sync_expert_load(model, mesh)
    dist.all_reduce(lp_sum)
    dist.all_reduce(lp_cnt)
    if counter is not None:
        pred, why = predicted_collectives(
            cpe, cfg, dims, mixed, args.recompute, possible, units, first_mbs, step.batch, cp_rank
        )
        mine = bytes_record(counter.records, pred, why)
    else:
        mine = {"measured": None, "prediction_skipped": cpe_why}
    per_rank_bytes = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank_bytes, {"rank": rank, "coords": mesh.coords, **mine})
    cp_pred = None
    if dims.cp > 1:  # the planner's CP split of each microbatch: predicted rank costs (states mode's split)
        cp_pred = []
        for m in plan.microbatches:
            sp = hp.plan_cp(
                step.batch, np.asarray(m, dtype=np.int64), dims.cp, cfg.chunk_size, conv_width=cfg.conv_size
            )
            cost = [int(x) for x in sp.rank_cost]
            cp_pred.append({"rows": sp.num_rows, "rank_cost": cost, "imbalance": imbalance(cost)})
    out = {
        "config": text,
        "label": dims_label(dims) + (f",cp_mode={cp_mode or 'default'}" if dims.cp > 1 else ""),
        "dims": dims_dict(dims),
        "cp_mode": cp_mode if dims.cp > 1 else None,
        "cp_modes_possible": [list(m) for m in getattr(model, "_harts_cp_modes", None) or []] or None,
        "cp_modes_chosen": [m["modes"] or possible for m in first_mbs] if dims.cp > 1 else None,
        "capacity": capacity,
        "first_step_peak_GiB": first_peak,
        "bytes_per_rank": per_rank_bytes,
        "cp_split_predicted": cp_pred,
        "step_prediction": step_prediction(cpe, args.flavor, cfg, args.tree_rows, dims)
        if args.tree_rows is not None and dims.cp > 1
        else None,
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
        "loss_rel_diff": abs(res.loss - ref_loss) / max(abs(ref_loss), 1e-12) if args.fidelity else None,
        "parallel_step_s_cold": first_step_s,
    }
    grads = _compare_grads(model, refs, rank) if args.fidelity else None
    if rank == 0 and args.fidelity:
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
    # (the baseline's microbatches hold C x T rows of expanded trajectories, as the engine's)
    base_plan = BaselinePlan(_baseline_schedule(lengths, capacity * dims.cp, dims.dp), lengths)
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

    harts_t, base_t, plan_t, harts_slots, base_slots, rank_t = [], [], [], [], [], []
    run_base, base_error = args.baseline, None
    peak = {"compact": 0.0, "trajectory": 0.0}
    for it in range(args.warmup + args.iters):
        t = time.perf_counter()
        p = hp.plan_step(step.batch, dims.dp, capacity, cfg.chunk_size, cp_size=dims.cp)
        calls = [
            hp.plan_calls(step.batch, cfg.chunk_size, microbatch=m, conv_width=cfg.conv_size)
            for m in replica_schedule(p, replica)
        ]
        pt = time.perf_counter() - t
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        hr, ht = timed(p, "compact", calls)
        if dev.type == "cuda":
            peak["compact"] = max(peak["compact"], torch.cuda.max_memory_allocated(dev) / 2**30)
            torch.cuda.reset_peak_memory_stats(dev)
        br, bt = None, float("nan")
        if run_base:
            try:
                br, bt = timed(base_plan, "trajectory")
            except ValueError as e:  # refused when its microbatch is laid out (every rank alike)
                run_base, base_error = False, f"{type(e).__name__}: {e}"
                log(f"{text}: trajectory baseline refused under this configuration: {base_error}")
        if dev.type == "cuda":
            peak["trajectory"] = max(peak["trajectory"], torch.cuda.max_memory_allocated(dev) / 2**30)
        rows = _gather_rows([ht, bt, pt], dev)  # every rank's wall seconds of the step
        ht, bt, pt = (max(r[i] for r in rows) for i in range(3))
        hs = _gather_rows(hr.slot_seconds, dev)
        bs = _gather_rows(br.slot_seconds, dev) if br is not None else None
        log(f"{text}: iteration {it}: HARTS {ht:.3f} s, baseline {bt:.3f} s, planner {pt * 1e3:.1f} ms")
        if it >= args.warmup:
            harts_t.append(ht)
            base_t.append(bt)
            plan_t.append(pt)
            harts_slots.append(hs)
            base_slots.append(bs)
            rank_t.append(rows)
    peaks = _gather_rows([peak["compact"], peak["trajectory"], first_peak or 0.0], dev)
    if rank == 0:
        med = np.median(np.asarray(rank_t, dtype=np.float64), axis=0)  # [rank, (harts, baseline, planner)]
        out["per_rank"] = [
            {
                "rank": r,
                "coords": dims.coords(r),
                "harts_step_s": float(med[r, 0]),
                "baseline_step_s": float(med[r, 1]) if run_base else None,
                "planner_s": float(med[r, 2]),
                "peak_GiB": {"compact": peaks[r][0], "trajectory": peaks[r][1], "first_step": peaks[r][2]}
                if dev.type == "cuda"
                else None,
                "bytes": per_rank_bytes[r],
            }
            for r in range(dims.world_size)
        ]
        if dims.cp > 1:
            out["cp_balance"] = _cp_balance(dims, harts_slots, cp_pred)
    if rank == 0:
        h, pl = statistics.median(harts_t), statistics.median(plan_t)
        b = statistics.median(base_t) if run_base else float("nan")
        out["baseline_error"] = base_error
        all_calls = [
            hp.plan_calls(step.batch, cfg.chunk_size, microbatch=m, conv_width=cfg.conv_size)
            for m in p.microbatches
        ]
        work = work_compression(cfg, lengths, [c.position_ids for c in all_calls])
        compression = step.batch.semantic_tokens / p.total_work
        out.update(
            harts_fbg_s=h,
            planner_s=pl,
            step_compression=compression,
            ideal_work_compression_flops=work["ideal_work_compression"],
            balance=_balance(p, harts_slots, dims),
        )
        if run_base:
            out.update(
                baseline_fbg_s=b,
                fbg_speedup=b / h,
                core_speedup=b / (h + pl),
                fbg_speedup_over_ideal=b / h / compression,
                fbg_speedup_over_ideal_flops=b / h / work["ideal_work_compression"],
                baseline_microbatches=len(base_plan.microbatches),
                baseline_balance=_balance(base_plan, base_slots, dims),
            )
        out["timings"] = {
            "harts_fbg_s": harts_t,
            "baseline_fbg_s": base_t if run_base else None,
            "planner_s": plan_t,
        }
        out["balance"]["predicted"]["plan_metrics"] = {
            k: p.metrics[k] for k in ("slot_imbalance_p50", "slot_imbalance_p95", "step_imbalance")
        }
        bal = out["balance"]
        if run_base:
            log(
                f"{text}: F/B/Grad speedup {out['fbg_speedup']:.3f}x (ideal S/C {compression:.3f}x, ratio "
                f"{out['fbg_speedup_over_ideal']:.3f}), core {out['core_speedup']:.3f}x; step imbalance "
                f"predicted {bal['predicted']['step_imbalance']:.3f}, measured {bal['measured']['step_imbalance']:.3f}"
            )
        _log_rank_records(text, out)
    model = params = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()
    return out


def _log_rank_records(text: str, out: dict) -> None:
    """One line per rank: step time, peak memory, CP bytes received against cp_eval's prediction."""
    for j, m in enumerate(out.get("cp_modes_chosen") or []):
        log(f"{text}: microbatch {j} CP mode per block: {','.join(str(x) for x in m)}")
    for r in out.get("per_rank", []):
        b = r["bytes"] or {}
        tot = b.get("total_received")
        pk = r["peak_GiB"]
        log(
            f"{text}: rank {r['rank']}: HARTS {r['harts_step_s']:.3f} s, peak "
            f"{'-' if pk is None else format(pk['compact'], '.2f') + ' GiB'}, bytes received "
            + (
                f"{tot['measured']:,.0f} (predicted {tot['predicted']:,.0f}, error "
                f"{'-' if tot['error_pct'] is None else format(tot['error_pct'], '+.2f') + '%'})"
                if tot
                else f"{sum(v['received'] for v in (b.get('measured') or {}).values()):,} "
                f"(no prediction: {b.get('prediction_skipped')})"
            )
        )


def auto_against_modes(results: list[dict]) -> list[dict]:
    """Per parallel layout (the same dims) that ran ``cp_mode=auto`` beside a fixed mode: what auto
    chose per block, each mode's F/B/Grad seconds, the fastest fixed mode and auto's time over it."""
    groups: dict = {}
    for r in results:
        if "skipped" in r or not r.get("cp_mode") or "harts_fbg_s" not in r:
            continue
        key = json.dumps(r["dims"], sort_keys=True)
        groups.setdefault(key, {})[r["cp_mode"]] = r
    out = []
    for key, by in groups.items():
        fixed = {m: r["harts_fbg_s"] for m, r in by.items() if m != "auto"}
        if "auto" not in by or not fixed:
            continue
        fastest = min(fixed, key=fixed.get)
        auto = by["auto"]
        out.append(
            {
                "dims": json.loads(key),
                "auto_chose": auto.get("cp_modes_chosen"),
                "fbg_s": {"auto": auto["harts_fbg_s"], **fixed},
                "fastest_fixed_mode": fastest,
                "auto_over_fastest": auto["harts_fbg_s"] / fixed[fastest],
            }
        )
    return out


# ---------------------------------------------------------------------------------------- main
def resolve_flavor(flavor: str, layers: int | None):
    """A runtime flavor (``model_config``) or one of ``cp_eval``'s published configs (e.g.
    ``kimi-linear-48b-a3b``, its real widths), cut to its first ``layers`` layers."""
    from harts_runtime import model_config
    from harts_runtime.models import FLAVORS

    if flavor in FLAVORS:
        return model_config(flavor, layers)
    cpe, why = _cp_eval()
    if cpe is None or flavor not in cpe.PUBLISHED:
        raise ConfigSpecError(
            f"--flavor: unknown {flavor!r}; choose one of {sorted(FLAVORS)}"
            + ("" if cpe is None else f" or {sorted(cpe.PUBLISHED)}")
        )
    cfg = cpe.config_of(flavor)
    n = layers or len(cfg.mixers)
    return cfg.replace(mixers=cfg.mixers[:n], ffns=cfg.ffns[:n])


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

        def f(key, spec, r=r):
            v = r.get(key)
            return "-" if v is None else format(v, spec)

        lines.append(
            f"| {r['config']} | {r['label']} | {f('step_compression', '.3f')}x | {f('fbg_speedup', '.3f')}x | "
            f"{f('fbg_speedup_over_ideal', '.3f')} | {f('core_speedup', '.3f')}x | {f('loss_rel_diff', '.2e')} | "
            f"{f('grad_max_rel_err', '.2e')} | {f('grad_min_cos', '.6f')} | {r.get('bf16_ok', '-')} | "
            f"{bal['predicted']['step_imbalance']:.3f} / {bal['measured']['step_imbalance']:.3f} |"
        )
    cp = [r for r in results if r.get("per_rank") and r.get("dims", {}).get("cp", 1) > 1]
    if cp:
        lines += [
            "",
            "| config | rank | step s | peak GiB | CP+FSDP bytes received | predicted | error % | modes |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in cp:
            modes = ",".join(sorted({str(x) for m in r.get("cp_modes_chosen") or [] for x in m} - {"none"}))
            for x in r["per_rank"]:
                tot = (x["bytes"] or {}).get("total_received") or {}
                pk = x["peak_GiB"]
                err = tot.get("error_pct")
                lines.append(
                    f"| {r['config']} | {x['rank']} | {x['harts_step_s']:.3f} | "
                    f"{'-' if pk is None else format(pk['compact'], '.2f')} | "
                    f"{'-' if not tot else format(tot['measured'], ',.0f')} | "
                    f"{'-' if not tot else format(tot['predicted'], ',.0f')} | "
                    f"{'-' if err is None else format(err, '+.2f')} | {modes} |"
                )
    return "\n".join(lines)


def init_distributed(device: str):
    """This process's device (``LOCAL_RANK`` of torchrun) and the default process group (NCCL on
    CUDA, gloo on the CPU); returns ``(device, world size, rank)``."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=30))
    return dev, dist.get_world_size(), dist.get_rank()


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
    ap.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="T, compact rows per microbatch and CP rank (a microbatch holds C x T rows). Default 16384; "
        "with --tree-rows the tree's rows / C",
    )
    ap.add_argument(
        "--tree-rows",
        default=None,
        help="long-tree workload instead of --preset: one agentic tree per DP replica of this many compact "
        "rows (256k, 512k, 1M, or a number), trajectories of 60%% of it (longer than T at C >= 2)",
    )
    ap.add_argument(
        "--fidelity",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare against one device holding every whole microbatch (off for trees one device cannot hold)",
    )
    ap.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the trajectory-wise baseline",
    )
    ap.add_argument(
        "--count-bytes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="count every collective of the first step per rank (benchmarks/cp_eval.py's counter) and "
        "compare with its counted-bytes model",
    )
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
    if args.capacity is not None and args.capacity < 1:
        ap.error(f"--capacity must be >= 1, got {args.capacity}")
    try:
        items = parse_configs(args.configs, args.config)
        if args.tree_rows is not None:
            args.tree_rows = parse_rows(args.tree_rows)
    except ConfigSpecError as e:
        ap.error(str(e))
    try:
        cfg = resolve_flavor(args.flavor, args.layers)
    except (ConfigSpecError, ValueError) as e:
        ap.error(str(e))
    if args.fast_autotune:  # before fla and our kernels are imported
        from harts_kernels.tuning import use_first_config_only

        use_first_config_only()

    from harts_runtime.demo import synthetic_step
    from harts_runtime.parallel import ParallelConfigError

    dev, world, rank = init_distributed(args.device)
    if not items:
        items = predefined_for(world)
        if not items:
            log(f"no predefined configuration has world size {world}; pass --configs")
    mixed = args.param_dtype == "bfloat16" or (args.param_dtype == "auto" and cfg.dtype == "bfloat16")
    if mixed:
        cfg = cfg.replace(dtype="float32")
    if args.tree_rows is not None:
        steps: dict = {}  # DP degree -> one long tree per replica

        def step_for(dp):
            if dp not in steps:
                steps.clear()
                steps[dp] = long_tree_step(args.tree_rows, dp, cfg.vocab_size, args.seed)
            return steps[dp]

        step = step_for(1)
    else:
        step = synthetic_step(args.preset, args.seed, cfg.vocab_size, args.max_len, "grpo")

        def step_for(dp):
            return step

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
            "preset": args.preset if args.tree_rows is None else f"long trees of {args.tree_rows:,} rows",
            "trajectories": b.num_trajectories,
            "semantic_tokens": b.semantic_tokens,
            "compact_tokens": b.compact_tokens,
            "capacity": args.capacity,
            "tree_rows": args.tree_rows,
        },
        "results": [],
    }
    log(
        f"world {world}, {args.flavor} x {cfg.num_layers} layers ({doc['model']['compute']} compute), "
        f"{b.num_trajectories} trajectories, S = {b.semantic_tokens:,}, C = {b.compact_tokens:,}"
    )
    os.makedirs(args.scratch, exist_ok=True)
    ref_cache: dict = {}  # rank 0: step plan -> reference results and gradient files
    try:
        for text, kw in items:
            dims, why = make_dims(kw, world)
            if dims is not None:
                try:
                    rec = run_config(
                        text, dims, args, dev, step_for(dims.dp), cfg, mixed, ref_cache, kw.get("cp_mode")
                    )
                except ParallelConfigError as e:  # parallelize or the runtime refused it (every rank alike)
                    why = f"refused: {e}"
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
        doc["auto_against_modes"] = auto_against_modes(doc["results"])
        for a in doc["auto_against_modes"]:
            log(
                f"cp_mode auto at {a['dims']['cp']} ranks: {a['auto_over_fastest']:.3f}x the time of the fastest "
                f"fixed mode ({a['fastest_fixed_mode']}); chose {a['auto_chose']}"
            )
        _write(args.out, doc)
        print(_table(doc["results"]), flush=True)
        log(f"wrote {args.out}")
    # Every rank reaches here before any tears its groups down: a rank destroying its gloo pairs while a
    # peer still uses them can abort the peer at exit (terminate called without an active exception).
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
