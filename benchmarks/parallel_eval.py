"""DP2 / TP2 / EP2 (and TP2 + SP, ``--configs tp2-sp``) of a reduced ``ling-tiny`` vs the single-GPU step, and speedup over the
trajectory baseline under each configuration (paper Table 4 style). Writes JSON.

Run on a 2-GPU host (each configuration uses both ranks)::

    torchrun --nproc-per-node 2 benchmarks/parallel_eval.py --layers 4 \\
        --out benchmarks/results/parallel_eval.json

CPU smoke run (gloo, the ``debug`` flavor)::

    torchrun --nproc-per-node 2 benchmarks/parallel_eval.py --device cpu --flavor debug --preset tiny \\
        --capacity 512 --iters 1 --out /tmp/parallel_eval.json

Per configuration:

* fidelity: rank 0 runs the single-device step (``train_step`` over the same step plan, so the same
  microbatches) on a second copy of the model; then both ranks run the parallel step
  (``parallelize`` + ``run_replica_step``). Reported: relative loss difference, and over all
  parameters the largest relative gradient error ``||g - g_ref|| / ||g_ref||`` and the smallest cosine
  (TP/EP shards are compared with the matching slice). ``bf16_ok``: loss within 1e-2 relative and every
  gradient's relative error below ``--grad-tol``.
* speed: F/B/Grad seconds (forward, backward, gradient all-reduce; no optimizer update; the slowest
  rank) of HARTS compact execution and of the trajectory baseline (packed expanded trajectories, the
  same per-replica equal microbatch counts), median of ``--iters`` after one warm-up; Core adds the
  HARTS planner time (``plan_step`` + ``plan_calls`` of the replica's microbatches).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

CONFIGS = {
    "dp2": dict(dp=2),
    "tp2": dict(tp=2),
    "ep2": dict(dp=2, ep=2),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
}


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _baseline_schedule(lengths: np.ndarray, capacity: int, dp: int) -> list[list[np.ndarray]]:
    """Trajectory baseline: first-fit-decreasing packs of expanded trajectories, LPT to replicas by
    raw tokens, then splits of the largest pack until every replica has the same count."""
    from harts_runtime import pack_trajectories

    packs = [np.asarray(p) for p in pack_trajectories(lengths, capacity)]
    while len(packs) % dp or len(packs) < dp:
        packs.sort(key=lambda p: -int(lengths[p].sum()))
        big = packs.pop(0)
        if len(big) < 2:
            raise SystemExit("baseline: cannot split a single-trajectory pack to equalise replicas")
        packs += [big[: len(big) // 2], big[len(big) // 2 :]]
    packs.sort(key=lambda p: -int(lengths[p].sum()))
    per = [[] for _ in range(dp)]
    load = [0] * dp
    for p in packs:  # LPT with equal counts
        cands = [d for d in range(dp) if len(per[d]) < len(packs) // dp]
        d = min(cands, key=lambda d: load[d])
        per[d].append(p)
        load[d] += int(lengths[p].sum())
    return per


def _grad_report(model, ref_grads, groups) -> dict:
    worst_rel, worst_cos, worst = 0.0, 1.0, ""
    for name, p in model.named_parameters():
        want = ref_grads.get(name.replace(".block.", "."))
        if want is None or p.grad is None:
            continue
        got = p.grad.float()
        want = want.to(got.device).float()
        if hasattr(p, "_harts_vocab_range"):  # vocabulary shard (embedding / LM head)
            a, b = p._harts_vocab_range
            want = want[a:b]
        elif got.shape != want.shape:
            dim = next(i for i in range(got.dim()) if got.shape[i] != want.shape[i])
            idx = groups.ep_rank if getattr(p, "_harts_expert", False) else groups.tp_rank
            want = want.narrow(dim, idx * got.shape[dim], got.shape[dim])
        n = want.norm()
        if n == 0:
            continue
        rel = float((got - want).norm() / n)
        cos = float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0))
        if rel > worst_rel:
            worst_rel, worst = rel, name
        worst_cos = min(worst_cos, cos)
    t = torch.tensor([worst_rel, -worst_cos], dtype=torch.float64, device=next(model.parameters()).device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"grad_max_rel_err": float(t[0]), "grad_min_cos": float(-t[1]), "worst_param_rank_local": worst}


def run_config(name, args, dev, step, world) -> dict:
    import harts_planner as hp
    from harts_runtime import HybridModel, apply_recompute, model_config, run_microbatch, train_step
    from harts_runtime.parallel import ParallelDims, parallelize, run_replica_step

    dims = ParallelDims(world_size=world, **CONFIGS[name])
    groups = dims.build_groups()
    rank = dist.get_rank()
    cfg = model_config(args.flavor, args.layers)
    t0 = time.perf_counter()
    plan = hp.plan_step(step.batch, dims.dp, args.capacity, cfg.chunk_size)
    plan_step_s = time.perf_counter() - t0

    # ---- single-device reference on rank 0
    # Reference gradients go through a file on the local disk (the ranks share the host), so the
    # other rank can slice its TP/EP shards without a multi-GB object broadcast.
    ref_path = os.path.join(args.scratch, f"parallel_eval_ref_{name}.pt")
    ref_loss = torch.zeros((), dtype=torch.float64, device=dev)
    if rank == 0:
        torch.manual_seed(args.seed)
        ref = HybridModel(cfg, device=dev).train()
        ref_loss += train_step(apply_recompute(ref, args.recompute), None, step, step_plan=plan).loss
        torch.save(
            {n: p.grad.detach().cpu() for n, p in ref.named_parameters() if p.grad is not None}, ref_path
        )
        del ref
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    dist.broadcast(ref_loss, src=0)
    ref_loss = float(ref_loss)
    dist.barrier()
    ref_grads = torch.load(ref_path, mmap=True)
    dist.barrier()
    if rank == 0:
        os.remove(ref_path)

    torch.manual_seed(args.seed)
    model = HybridModel(cfg, device=dev).train()
    parallelize(model, dims, groups, recompute=args.recompute)
    params = list(model.parameters())

    def step_once(mode, schedule_plan=None, baseline=None):
        for p in params:
            p.grad = None
        _sync(dev)
        dist.barrier()
        t = time.perf_counter()
        if mode == "compact":
            res = run_replica_step(
                schedule_plan,
                groups.dp_rank,
                lambda j, traj: run_microbatch(model, step, traj, "compact")[0],
                params=params,
                groups=groups,
                backward=False,
            )
        else:

            class _P:  # the baseline's schedule in StepPlan's shape
                dp_size, num_slots = dims.dp, len(baseline[0])

                @staticmethod
                def microbatch_at(d, j):
                    return baseline[d][j]

            res = run_replica_step(
                _P,
                groups.dp_rank,
                lambda j, traj: run_microbatch(model, step, traj, "trajectory")[0],
                params=params,
                groups=groups,
                backward=False,
            )
        _sync(dev)
        el = torch.tensor([time.perf_counter() - t], dtype=torch.float64, device=dev)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        return res, float(el)

    res, _ = step_once("compact", plan)
    out = {
        "config": name,
        "dims": CONFIGS[name],
        "num_microbatches": plan.num_microbatches,
        "num_slots": plan.num_slots,
        "loss_single": ref_loss,
        "loss_parallel": res.loss,
        "loss_rel_diff": abs(res.loss - ref_loss) / max(abs(ref_loss), 1e-12),
    }
    out.update(_grad_report(model, ref_grads, groups))
    out["bf16_ok"] = out["loss_rel_diff"] < 1e-2 and out["grad_max_rel_err"] < args.grad_tol

    baseline = _baseline_schedule(np.asarray(step.batch.lengths, dtype=np.int64), args.capacity, dims.dp)
    harts_t, base_t, plan_t = [], [], []
    for it in range(args.iters + 1):
        t = time.perf_counter()
        p = hp.plan_step(step.batch, dims.dp, args.capacity, cfg.chunk_size)
        for m in [p.microbatch_at(groups.dp_rank, j) for j in range(p.num_slots)]:
            hp.plan_calls(step.batch, cfg.chunk_size, trajectories=np.asarray(m), conv_width=cfg.conv_size)
        pt = time.perf_counter() - t
        _, ht = step_once("compact", p)
        _, bt = step_once("trajectory", baseline=baseline)
        if it:  # iteration 0 is the warm-up
            harts_t.append(ht)
            base_t.append(bt)
            plan_t.append(pt)
    h, b, pl = statistics.median(harts_t), statistics.median(base_t), statistics.median(plan_t)
    out.update(
        harts_fbg_s=h,
        baseline_fbg_s=b,
        planner_s=pl,
        plan_step_s=plan_step_s,
        fbg_speedup=b / h,
        core_speedup=b / (h + pl),
        compression=step.batch.semantic_tokens / step.batch.compact_tokens,
    )
    model = None  # free before the next configuration
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="dp2,tp2,ep2", help=f"comma list of {sorted(CONFIGS)}")
    ap.add_argument("--flavor", default="ling-tiny")
    ap.add_argument("--layers", type=int, default=4, help="first N layers of the flavor (reduced model)")
    ap.add_argument("--preset", default="small", help="harts_planner.synth preset")
    ap.add_argument("--max-len", type=int, default=4096, help="cap trajectory length")
    ap.add_argument("--capacity", type=int, default=16384, help="T, compact rows per microbatch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument(
        "--recompute",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="full-layer activation recomputation (Table 4 enables it)",
    )
    ap.add_argument("--grad-tol", type=float, default=5e-2, help="bf16 relative gradient error bound")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scratch", default="/tmp", help="local directory for the reference gradients")
    ap.add_argument("--out", default="benchmarks/results/parallel_eval.json")
    args = ap.parse_args(argv)

    from harts_runtime import model_config
    from harts_runtime.demo import synthetic_step

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10))
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = model_config(args.flavor, args.layers)
    step = synthetic_step(args.preset, args.seed, cfg.vocab_size, args.max_len, "grpo")
    results = []
    for name in args.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"--configs: unknown {name!r}; choose from {sorted(CONFIGS)}")
        r = run_config(name, args, dev, step, world)
        results.append(r)
        if rank == 0:
            print(json.dumps(r), file=sys.stderr, flush=True)
    if rank == 0:
        b = step.batch
        doc = {
            "flavor": args.flavor,
            "layers": args.layers,
            "preset": args.preset,
            "seed": args.seed,
            "capacity": args.capacity,
            "recompute": args.recompute,
            "world_size": world,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "trajectories": b.num_trajectories,
            "semantic_tokens": b.semantic_tokens,
            "compact_tokens": b.compact_tokens,
            "results": results,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
        print(
            "| config | compression | F/B/Grad speedup | Core speedup | loss rel diff | max grad rel err | bf16 ok |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in results:
            print(
                f"| {r['config']} | {r['compression']:.3f}x | {r['fbg_speedup']:.3f}x | {r['core_speedup']:.3f}x | "
                f"{r['loss_rel_diff']:.2e} | {r['grad_max_rel_err']:.2e} | {r['bf16_ok']} |"
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
