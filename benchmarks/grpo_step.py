"""The whole GRPO step on a node: ``HartsEngine`` (what ``harts-train`` and the RL loop run) under
FSDP2 + EP (+ CP), HARTS compact execution against the trajectory-wise baseline, with the step's
split (planning, forward / backward, optimizer, weight sync), TFLOP/s per GPU and each rank's busy
time beside the planner's predicted imbalance. Writes JSON.

Runs (every configuration uses every rank of the job; the syntax and predefined names of
``benchmarks/parallel_eval.py``'s ``--configs``, ``cp_mode`` included)::

    # Qwen3.5-35B-A3B at real width, 8 of its 40 layers, agentic trees, 8 GPUs, FSDP2 + EP8
    torchrun --nproc-per-node 8 benchmarks/grpo_step.py --flavor qwen3.5-35b-a3b --layers 8 \\
        --configs 'dp8-ep8' --preset swe-like --out benchmarks/results/grpo_step_8gpu.json
    # recorded agentic trees (a harts-train rollout file, its first step)
    torchrun --nproc-per-node 8 benchmarks/grpo_step.py --rollouts rollouts.jsonl --configs dp8-ep8 ...
    # long trees under CP (one tree of 256k rows per DP replica)
    torchrun --nproc-per-node 8 benchmarks/grpo_step.py --tree-rows 256k --configs 'dp2-cp4-states' ...

CPU smoke run (gloo, the ``debug`` flavor in float32)::

    torchrun --nproc-per-node 2 benchmarks/grpo_step.py --device cpu --flavor debug --preset tiny \\
        --capacity 64 --iters 1 --warmup 0 --configs 'dp_shard=2,ep=2;cp2' --out /tmp/grpo_step.json

Per configuration and mode (``compact``, then ``trajectory``; the same engine, weights and
workload), ``--warmup`` untimed then ``--iters`` timed steps, each:

1. ``engine.forward_backward(step)``: its ``plan_seconds`` (the planner: step plan and this rank's
   call plans) and ``fbg_seconds`` (every microbatch's forward, log-probs, loss, backward, FSDP2's
   reduce-scatters), and each slot's seconds on every rank;
2. ``engine.optimizer_step()``: gradient norm, clipping, AdamW on the sharded state, MoE bias update;
3. weight sync: ``engine.export_weights()`` iterated to the end (every tensor assembled in
   transformers' checkpoint names, what a rollout engine's ``load_weights`` receives; the copy into a
   rollout engine itself is not timed); skipped with the reason when the model has no transformers
   family.

Reported (medians over the timed steps, slowest rank): each part's seconds and the step's;
``speedup`` = trajectory / compact for the whole step and for forward / backward alone; the ideal
work compression (``S / C`` compact rows and the FLOP-based one of ``harts_runtime.flops``) and the
ratio of each speedup to it; TFLOP/s per GPU (model FLOPs, 3 x forward, of the work each mode
executes, over forward / backward seconds and the world size; ``effective``: the trajectory-wise
FLOPs over compact's seconds) beside Megatron-Bridge's published 185.6 (Qwen3.5-35B-A3B, H100,
sequence 4k); per rank its busy seconds (sum of its slot seconds) beside the planner's per-replica
work (slot and step imbalance, Equation 23) and, under CP, each microbatch's split rank costs;
peak memory per rank (CUDA); under CP what ``cp_mode`` chose (``cp_mode_metrics``: the engine's
``cp_states/blocks.i``, the microbatches that ran block i by state passing, of ``microbatches``;
absent when the engine does not report it). Under ``cp_mode=states`` the runtime refuses
trajectory-wise microbatches (their mixers need a compact call plan): the baseline's record then
holds the refusal (compare with the ``heads`` or ``auto`` configuration's baseline).

Every process runs with NVLink multicast off (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``, set before torch.distributed
starts).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's runtime wins over an installed copy
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import parallel_eval as pe  # noqa: E402  (sets NVLS_OFF in os.environ on import)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

#: Megatron-Bridge's published training throughput, the anchor the issue names
MEGATRON_BRIDGE = {
    "model": "Qwen3.5-35B-A3B",
    "gpu": "H100",
    "sequence_length": 4096,
    "model_tflops_per_gpu": 185.6,
}
MODES = ("compact", "trajectory")


def log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[grpo_step {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _PlanLike:
    """Work per microbatch, replica and slot of a plan-like object (``parallel_eval._balance``)."""

    def __init__(self, plan, lengths):
        self.microbatches = [np.asarray(m, dtype=np.int64) for m in plan.microbatches]
        self.replica = np.asarray(plan.replica, dtype=np.int64)
        self.slot = np.asarray(plan.slot, dtype=np.int64)
        work = getattr(plan, "work", None)
        self.work = (
            np.asarray(work, dtype=np.int64)
            if work is not None
            else np.array([int(lengths[m].sum()) for m in self.microbatches], dtype=np.int64)
        )


def _step_of(args, engine, dims, vocab):
    if args.rollouts:
        from harts_runtime.rollout_files import read_rollout_file

        return engine.step_inputs(read_rollout_file(args.rollouts, vocab).steps[0])
    if args.tree_rows is not None:
        return pe.long_tree_step(args.tree_rows, dims.dp, vocab, args.seed)
    from harts_runtime.demo import synthetic_step

    return synthetic_step(args.preset, args.seed, vocab, args.max_len, "grpo")


def _sync_weights(engine) -> tuple[int, int]:
    """Iterate ``export_weights`` to the end: (tensors, bytes)."""
    n = b = 0
    for _, t in engine.export_weights():
        n += 1
        b += t.numel() * t.element_size()
    return n, b


def run_mode(engine, step, mode, args, dev, dims, weight_sync: dict) -> dict:
    """``--warmup`` + ``--iters`` whole steps of one execution mode; per-rank rows gathered."""
    engine.config = engine.config.replace(mode=mode)
    parts, slots, peaks, modes_seen = [], [], [], None
    for it in range(args.warmup + args.iters):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        _sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        out = engine.forward_backward(step)
        _sync(dev)
        t1 = time.perf_counter()
        report = engine.optimizer_step()
        _sync(dev)
        t2 = time.perf_counter()
        sync_s = float("nan")
        if weight_sync.get("ok", True):
            try:
                weight_sync["tensors"], weight_sync["bytes"] = _sync_weights(engine)
                weight_sync["ok"] = True
            except (ValueError, KeyError, NotImplementedError) as e:  # no transformers family (every rank)
                weight_sync.update(ok=False, skipped=f"{type(e).__name__}: {e}")
                log(f"weight sync not timed: {weight_sync['skipped']}")
        _sync(dev)
        t3 = time.perf_counter()
        if weight_sync.get("ok"):
            sync_s = t3 - t2
        m = out.metrics
        # cp_mode's choice (the engine's cp_states/blocks.i: microbatches that ran block i by state passing)
        got = {k: v for k, v in m.items() if k.startswith("cp_states/") or "cp_mode" in k}
        if got:
            modes_seen = dict(got, microbatches=m.get("microbatches"))
        row = [m["plan_seconds"], m["fbg_seconds"], t2 - t1, sync_s, t3 - t0, t1 - t0, report.grad_norm]
        rows = pe._gather_rows(row, dev)
        srows = pe._gather_rows(list(m["slot_seconds"]), dev)
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0
        prow = pe._gather_rows([peak], dev)
        log(
            f"{mode} step {it}: plan {max(r[0] for r in rows) * 1e3:.1f} ms, F/B {max(r[1] for r in rows):.3f} s, "
            f"optimizer {max(r[2] for r in rows):.3f} s, sync {max(r[3] for r in rows):.3f} s, "
            f"step {max(r[4] for r in rows):.3f} s, loss {out.loss:.6g}, grad norm {report.grad_norm:.4g}"
        )
        if it >= args.warmup:
            parts.append(rows)
            slots.append(srows)
            peaks.append(prow)
    a = np.asarray(parts, dtype=np.float64)  # [iter, rank, part]
    with warnings.catch_warnings():  # an untimed weight sync is NaN on every rank
        warnings.simplefilter("ignore", RuntimeWarning)
        slowest = np.nanmax(a, axis=1)  # [iter, part]
    med = np.median(slowest, axis=0)
    names = ("plan_s", "fbg_s", "optimizer_s", "weight_sync_s", "step_s", "fbg_wall_s")
    res = {k: (None if np.isnan(med[i]) else float(med[i])) for i, k in enumerate(names)}
    res["per_iteration"] = [{k: float(s[i]) for i, k in enumerate(names)} for s in slowest]
    res["rank_parts_median"] = np.median(a, axis=0)[:, : len(names)].tolist()
    res["rank_slot_seconds"] = slots
    res["peak_GiB_per_rank"] = (
        np.max(np.asarray(peaks), axis=0)[:, 0].tolist() if dev.type == "cuda" else None
    )
    res["cp_mode_metrics"] = modes_seen
    res["metrics_last"] = {
        k: v for k, v in out.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return res


def run_config(text, kw, dims, args, dev, cfg, mixed) -> dict:
    import harts_planner as hp
    from harts_runtime.engine import EngineConfig, HartsEngine
    from harts_runtime.flops import work_compression

    mesh = dims.build_mesh(dev.type)
    capacity = pe.capacity_for(args, dims, cfg)
    opts = dict(capacity=capacity, recompute=args.recompute, lr=1e-6)
    if args.recompute and args.keep:
        opts["keep"] = tuple(k for k in args.keep.split(",") if k)
    if mixed:
        opts.update(param_dtype="bfloat16", reduce_dtype="float32")
    if "cp_mode" in kw:
        opts["cp_mode"] = kw["cp_mode"]
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    engine = HartsEngine.build(cfg, EngineConfig(**opts), mesh=mesh, device=dev)
    build_s = time.perf_counter() - t0
    step = _step_of(args, engine, dims, cfg.vocab_size)
    b = step.batch
    lengths = np.asarray(b.lengths, dtype=np.int64)
    rank = dist.get_rank()
    weight_sync: dict = {}
    res = {"compact": run_mode(engine, step, "compact", args, dev, dims, weight_sync)}
    try:
        res["trajectory"] = run_mode(engine, step, "trajectory", args, dev, dims, weight_sync)
    except (
        ValueError
    ) as e:  # refused before its first microbatch runs (every rank alike), e.g. cp_mode states
        res["trajectory"] = {"error": f"{type(e).__name__}: {e}"}
        log(
            f"{text}: the trajectory-wise step refused under this configuration: {res['trajectory']['error']}"
        )

    plan = hp.plan_step(b, dims.dp, capacity, cfg.chunk_size, cp_size=dims.cp)
    calls = [
        hp.plan_calls(b, cfg.chunk_size, microbatch=m, conv_width=cfg.conv_size) for m in plan.microbatches
    ]
    work = work_compression(cfg, lengths, [c.position_ids for c in calls])
    from harts_runtime.engine.trajectory_plan import TrajectoryPlan

    tplan = TrajectoryPlan(step, capacity * dims.cp, dims.dp)
    out = {
        "config": text,
        "label": pe.dims_label(dims) + (f",cp_mode={kw['cp_mode']}" if "cp_mode" in kw else ""),
        "dims": pe.dims_dict(dims),
        "capacity": capacity,
        "build_s": build_s,
        "workload": {
            "trajectories": b.num_trajectories,
            "semantic_tokens": b.semantic_tokens,
            "compact_tokens": b.compact_tokens,
            "longest_trajectory": int(lengths.max()),
        },
        "weight_sync": weight_sync,
    }
    if rank == 0:
        c, t = res["compact"], res["trajectory"]
        world = dims.world_size
        compression = b.semantic_tokens / plan.total_work
        ideal_flops = work["ideal_work_compression"]

        t_ok = "error" not in t

        def ratio(x, y):
            return None if x is None or y is None or not y else x / y

        speed = {
            "step": ratio(t.get("step_s"), c["step_s"]),
            "fbg": ratio(t.get("fbg_s"), c["fbg_s"]),
            "step_without_sync": ratio(
                t["plan_s"] + t["fbg_s"] + t["optimizer_s"], c["plan_s"] + c["fbg_s"] + c["optimizer_s"]
            )
            if t_ok
            else None,
        }
        out.update(
            compact=c,
            trajectory=t,
            speedup=speed,
            ideal_work_compression={"rows": compression, "flops": ideal_flops},
            speedup_over_ideal={
                "step_rows": ratio(speed["step"], compression),
                "fbg_rows": ratio(speed["fbg"], compression),
                "step_flops": ratio(speed["step"], ideal_flops),
                "fbg_flops": ratio(speed["fbg"], ideal_flops),
            },
            tflops_per_gpu={
                "compact": work["compact_flops"] / c["fbg_s"] / world / 1e12,
                "trajectory": work["trajectory_flops"] / t["fbg_s"] / world / 1e12 if t_ok else None,
                "compact_effective": work["trajectory_flops"] / c["fbg_s"] / world / 1e12,
                "note": "model FLOPs (3 x forward, harts_runtime.flops; no recomputation counted) of the work "
                "each mode executes / forward-backward seconds / GPUs; effective: the trajectory-wise FLOPs "
                "over compact's seconds",
                "megatron_bridge": MEGATRON_BRIDGE,
            },
            balance={
                "compact": pe._balance(_PlanLike(plan, lengths), c.pop("rank_slot_seconds"), dims),
                "trajectory": pe._balance(_PlanLike(tplan, lengths), t.pop("rank_slot_seconds"), dims)
                if t_ok
                else None,
            },
        )
        out["balance"]["compact"]["predicted"]["plan_metrics"] = {
            k: plan.metrics[k] for k in ("slot_imbalance_p50", "slot_imbalance_p95", "step_imbalance")
        }
        if dims.cp > 1:
            split = []
            for m in plan.microbatches:
                sp = hp.plan_cp(
                    b, np.asarray(m, dtype=np.int64), dims.cp, cfg.chunk_size, conv_width=cfg.conv_size
                )
                cost = [int(x) for x in sp.rank_cost]
                split.append({"rows": sp.num_rows, "rank_cost": cost})
            out["cp_split_predicted"] = split
        bal = out["balance"]["compact"]
        tf = out["tflops_per_gpu"]

        def fmt(x, spec):
            return "-" if x is None else format(x, spec)

        log(
            f"{text}: step {c['step_s']:.3f} s compact (plan {c['plan_s'] * 1e3:.1f} ms, F/B {c['fbg_s']:.3f}, "
            f"optimizer {c['optimizer_s']:.3f}, sync {fmt(c['weight_sync_s'], '.3f')}) vs "
            f"{fmt(t.get('step_s'), '.3f')} s trajectory-wise: speedup {fmt(speed['step'], '.3f')}x "
            f"(F/B {fmt(speed['fbg'], '.3f')}x), ideal {compression:.3f}x rows / {ideal_flops:.3f}x FLOPs; "
            f"TFLOP/s per GPU compact {tf['compact']:.3g}, trajectory {fmt(tf['trajectory'], '.3g')} "
            f"(Megatron-Bridge {MEGATRON_BRIDGE['model_tflops_per_gpu']}); step imbalance predicted "
            f"{bal['predicted']['step_imbalance']:.3f}, measured {bal['measured']['step_imbalance']:.3f}"
        )
    else:
        for m in MODES:
            res[m].pop("rank_slot_seconds", None)
    engine = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=None, help="parallel_eval.py's configurations (';'-separated)")
    ap.add_argument("--config", action="append", default=None, help="one configuration (repeatable)")
    ap.add_argument("--flavor", default="qwen3.5-35b-a3b")
    ap.add_argument("--layers", type=int, default=4, help="first N layers (the depth)")
    ap.add_argument("--preset", default="swe-like", help="harts_planner.synth preset (agentic trees)")
    ap.add_argument(
        "--rollouts", default=None, help="recorded trees: a harts-train rollout file (its first step)"
    )
    ap.add_argument("--tree-rows", default=None, help="long trees (parallel_eval.py's --tree-rows)")
    ap.add_argument("--max-len", type=int, default=16384, help="cap trajectory length (--preset)")
    ap.add_argument(
        "--capacity", type=int, default=None, help="T per rank (default 16384; --tree-rows: rows / C)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--keep", default="", help="kept regions under recomputation: attention,linear_attention")
    ap.add_argument(
        "--param-dtype",
        choices=("auto", "none", "bfloat16"),
        default="auto",
        help="bfloat16: float32 masters, FSDP2 bf16 compute with float32 reduction; auto: when the flavor is bf16",
    )
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--fast-autotune", action="store_true", help="one Triton config per kernel")
    ap.add_argument("--out", default="benchmarks/results/grpo_step.json")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    if args.capacity is not None and args.capacity < 1:
        ap.error(f"--capacity must be >= 1, got {args.capacity}")
    if args.rollouts and args.tree_rows:
        ap.error("--rollouts and --tree-rows: choose one workload")
    if args.rollouts and not os.path.isfile(args.rollouts):
        ap.error(f"--rollouts: no file {args.rollouts}")
    try:
        items = pe.parse_configs(args.configs, args.config)
        if args.tree_rows is not None:
            args.tree_rows = pe.parse_rows(args.tree_rows)
        cfg = pe.resolve_flavor(args.flavor, args.layers)
    except ValueError as e:
        ap.error(str(e))
    if args.fast_autotune:
        from harts_kernels.tuning import use_first_config_only

        use_first_config_only()
    from harts_runtime.parallel import ParallelConfigError

    dev, world, rank = pe.init_distributed(args.device)
    if not items:
        items = pe.predefined_for(world)
    mixed = args.param_dtype == "bfloat16" or (args.param_dtype == "auto" and cfg.dtype == "bfloat16")
    if mixed:
        cfg = cfg.replace(dtype="float32")
    doc = {
        "args": vars(args),
        "environment": {
            "world_size": world,
            "backend": dist.get_backend(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "gpus": world if dev.type == "cuda" else 0,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(),
            "git_commit": pe._git_commit(),
            "nvls_off": {k: os.environ.get(k) for k in pe.NVLS_OFF},
        },
        "model": {
            "flavor": args.flavor,
            "layers": len(cfg.mixers),
            "masters": cfg.dtype,
            "compute": "bfloat16" if mixed else cfg.dtype,
        },
        "results": [],
    }
    log(f"world {world}, {args.flavor} x {len(cfg.mixers)} layers ({doc['model']['compute']} compute)")
    for text, kw in items:
        dims, why = pe.make_dims(kw, world)
        if dims is not None:
            try:
                rec = run_config(text, kw, dims, args, dev, cfg, mixed)
            except ParallelConfigError as e:  # parallelize refused the model (every rank alike)
                why = f"refused: {e}"
        if why is not None:
            rec = {"config": text, "skipped": why}
            log(f"{text}: skipped: {why}")
        doc["results"].append(rec)
        if rank == 0:
            pe._write(args.out, doc)
    if rank == 0:
        log(f"wrote {args.out}")
    # Every rank reaches here before any tears its groups down: a rank destroying its gloo pairs while a
    # peer still uses them can abort the peer at exit (terminate called without an active exception).
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
