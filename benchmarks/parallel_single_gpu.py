"""The parallel engine on one device (issue 23's single-GPU figures). Writes JSON.

Two sections, each its own sub-command:

* ``overhead``: the FSDP2 path at world size 1 (NCCL on CUDA) against the unparallelised model on
  the same compact microbatch (train_eval's median slice of the swe-like step, one microbatch of
  about 65k rows at T = 65,536). The model is timed plain first (``--repeats`` warm F/B/Grad runs
  after ``--warmup``), then parallelised in place (``parallelize``: recomputation with the same
  kept regions, FSDP2 over a one-rank mesh, gradients summed) and timed again; the report gives
  both medians and their ratio, and the peak memory of each.
* ``offload``: the largest model this device trains with ``CPUOffloadPolicy``: a random-weight
  ``--flavor`` (default Qwen3.5-35B-A3B's text shape) of ``--layers`` layers with float32 master
  weights on the host, bf16 compute (``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``), one compact microbatch (F/B/Grad) and one AdamW step (on the host, where
  FSDP2 keeps the offloaded state); reports the step's parts, the device peak and the host's.
  ``--search L1,L2,...`` runs each depth in its own process (a host out-of-memory kill ends only
  that depth) and records which trained.

Runs::

    python3 benchmarks/parallel_single_gpu.py overhead --layers 24 --fast-autotune --out $OUT/ws1.json
    python3 benchmarks/parallel_single_gpu.py offload --search 4,6,7 --out $OUT/offload.json
    python3 benchmarks/parallel_single_gpu.py overhead --device cpu --tiny --out /tmp/ws1.json   # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)


def log(msg: str) -> None:
    print(f"[parallel_single_gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _init(dev: torch.device):
    from harts_runtime.parallel import ParallelDims
    from harts_runtime.parallel.launch import free_port

    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if dev.type == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=600),
        )
    return ParallelDims(world_size=1).build_mesh(dev.type)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _slice(args, cfg):
    from train_eval import make_slice

    targs = SimpleNamespace(tiny=args.tiny, preset=args.preset, chunk_size=cfg.chunk_size)
    return make_slice(targs, args.capacity, args.max_len, 1, args.seed, cfg.vocab_size)


def _config(args):
    from train_eval import tiny_config

    from harts_runtime import model_config

    cfg = model_config(args.flavor, args.layers)
    if args.tiny:
        cfg = tiny_config(cfg)
    return cfg


def _timed(dev, fn, warmup: int, repeats: int) -> list[float]:
    out = []
    for i in range(warmup + repeats):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        if i >= warmup:
            out.append(time.perf_counter() - t)
    return out


def _peak(dev) -> float:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0


def section_overhead(args, dev) -> dict:
    from harts_runtime import HybridModel, apply_recompute, make_microbatch, run_microbatch
    from harts_runtime.engine import microbatch_call_plan
    from harts_runtime.parallel import parallelize

    if args.fast_autotune:
        from harts_kernels.tuning import use_first_config_only

        use_first_config_only()
    mesh = _init(dev)
    cfg = _config(args)
    keep = tuple(k for k in args.keep.split(",") if k)
    torch.manual_seed(args.seed)
    model = HybridModel(cfg, device=dev).train()
    apply_recompute(model, keep=keep)
    step = _slice(args, cfg)
    traj = np.arange(step.batch.num_trajectories)
    mb = make_microbatch(model, step, traj, "compact", microbatch_call_plan(model, step, traj))
    log(f"microbatch: {mb.stats}")

    def fbg():
        for p in model.parameters():
            p.grad = None
        return run_microbatch(model, step, microbatch=mb)[0]

    def measure(label):
        """(first loss, warm F/B/Grad seconds, peak GiB of the timed runs)."""
        loss = float(fbg())
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        times = _timed(dev, fbg, args.warmup, args.repeats)
        log(f"{label}: {times}")
        return loss, times, _peak(dev)

    loss_plain, plain, peak_plain = measure("plain")
    apply_recompute(model, False)
    parallelize(model, mesh, recompute=True, keep=keep)
    loss_par, par, peak_par = measure("parallel (FSDP2, world size 1)")
    mp, mq = statistics.median(plain), statistics.median(par)
    return {
        "section": "overhead",
        "flavor": args.flavor,
        "layers": cfg.num_layers,
        "keep": list(keep),
        "microbatch": {k: int(v) for k, v in mb.stats.items()},
        "plain_fbg_s": plain,
        "parallel_fbg_s": par,
        "plain_median_s": mp,
        "parallel_median_s": mq,
        "overhead": mq / mp - 1.0,
        "loss_plain": loss_plain,
        "loss_parallel": loss_par,
        "peak_gib_plain": peak_plain,
        "peak_gib_parallel": peak_par,
        "backend": dist.get_backend(),
    }


def section_offload_one(args, dev) -> dict:
    from harts_runtime import HybridModel, make_microbatch, run_microbatch
    from harts_runtime.engine import microbatch_call_plan
    from harts_runtime.parallel import parallelize

    if args.fast_autotune:
        from harts_kernels.tuning import use_first_config_only

        use_first_config_only()
    mesh = _init(dev)
    cfg = _config(args).replace(dtype="float32")  # float32 masters on the host
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    model = HybridModel(cfg, device="cpu").train()
    n_params = sum(p.numel() for p in model.parameters())
    build_s = time.perf_counter() - t0
    log(f"{cfg.num_layers} layers, {n_params / 1e9:.2f}B parameters built in {build_s:.1f} s")
    t0 = time.perf_counter()
    parallelize(
        model,
        mesh,
        recompute=True,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        cpu_offload=dev.type == "cuda",
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    shard_s = time.perf_counter() - t0
    step = _slice(args, cfg)
    traj = np.arange(step.batch.num_trajectories)
    mb = make_microbatch(model, step, traj, "compact", microbatch_call_plan(model, step, traj))
    times = []
    for _ in range(args.repeats):
        opt.zero_grad(set_to_none=True)
        _sync(dev)
        t = time.perf_counter()
        loss = run_microbatch(model, step, microbatch=mb)[0]
        _sync(dev)
        t1 = time.perf_counter()
        opt.step()
        _sync(dev)
        times.append({"fbg_s": t1 - t, "optimizer_s": time.perf_counter() - t1, "loss": float(loss)})
        log(f"step: {times[-1]}")
    return {
        "section": "offload",
        "flavor": args.flavor,
        "layers": cfg.num_layers,
        "parameters": n_params,
        "build_s": build_s,
        "shard_s": shard_s,
        "microbatch": {k: int(v) for k, v in mb.stats.items()},
        "steps": times,
        "peak_gib_device": _peak(dev),
        "peak_gib_host": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "cpu_offload": dev.type == "cuda",
    }


def section_offload(args, dev) -> dict:
    if not args.search:
        return section_offload_one(args, dev)
    runs = []
    for layers in [int(x) for x in args.search.split(",")]:
        out = f"{args.out}.L{layers}.json"
        cmd = [sys.executable, os.path.abspath(__file__), "offload", "--layers", str(layers), "--out", out]
        for name in ("flavor", "preset", "capacity", "seed", "repeats", "device"):
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        cmd += ["--fast-autotune"] if args.fast_autotune else []
        cmd += ["--tiny"] if args.tiny else []
        cmd += ["--max-len", str(args.max_len)] if args.max_len else []
        t = time.perf_counter()
        rc = subprocess.run(cmd).returncode
        rec = {"layers": layers, "returncode": rc, "seconds": time.perf_counter() - t}
        if rc == 0 and os.path.exists(out):
            rec.update(json.load(open(out)))
        runs.append(rec)
        log(f"depth {layers}: returncode {rc}")
        if rc != 0:
            break
    trained = [r["layers"] for r in runs if r["returncode"] == 0]
    return {"section": "offload_search", "runs": runs, "largest_trained": max(trained, default=None)}


def main(argv=None) -> int:
    from harts_planner import DEFAULT_CAPACITY

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("section", choices=("overhead", "offload"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--flavor", default=None, help="default: ling-tiny (overhead), qwen3.5-35b-a3b (offload)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--preset", default="swe-like")
    ap.add_argument("--capacity", type=int, default=DEFAULT_CAPACITY)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", default="attention,linear_attention", help="kept regions (overhead)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--search", default="", help="offload: comma list of depths, one process each")
    ap.add_argument("--fast-autotune", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke sizes (preset tiny, T = 64)")
    args = ap.parse_args(argv)
    if args.flavor is None:
        args.flavor = "ling-tiny" if args.section == "overhead" else "qwen3.5-35b-a3b"
    if args.tiny:
        args.preset, args.capacity = "tiny", min(args.capacity, 64)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index or 0)
        torch.cuda.set_device(dev)
    res = (section_overhead if args.section == "overhead" else section_offload)(args, dev)
    res.update(
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    log(f"wrote {args.out}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
