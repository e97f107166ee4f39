"""Asynchronous ``harts-rl`` (``max_staleness`` K): seconds per step and their generate / train split,
the reward at the end and the train / rollout mismatch per version lag, for K = 0, 1, 2 (with and
without importance correction), one process, CPU by default.

::

    OMP_NUM_THREADS=1 python benchmarks/async_rl.py --flavor kimi-linear-tiny --steps 20 \\
        --out benchmarks/results/async_rl_cpu.json

Every run goes through :class:`~harts_runtime.rl.async_source.AsyncSource` (K = 0 included: it
equals the synchronous loop record for record, ``tests/rl/test_async_source.py``, and reports the
mismatch the synchronous loop does not carry). Per run: ``wall_per_step`` (wall seconds of the
steps after the first), the means over those steps of the record's ``generate_seconds`` (the
sampler thread's sampling), ``train_seconds``, ``logprobs_seconds``, ``sync_seconds`` and
``wait_seconds`` (the trainer waiting for its batch), ``reward_last3`` / ``reward_first3`` (mean
reward of the first and last three steps) and the means of every ``mismatch/*`` metric.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from harts_runtime.rl import RLConfig  # noqa: E402
from harts_runtime.rl.async_source import AsyncSource  # noqa: E402
from harts_runtime.rl.run import RLRun  # noqa: E402

PARTS = ("generate_seconds", "logprobs_seconds", "train_seconds", "sync_seconds", "wait_seconds")


def one_run(args, k: int, correction: str, seed: int) -> dict:
    cfg = RLConfig(
        flavor=args.flavor,
        layers=args.layers,
        device=args.device,
        task=args.task,
        steps=args.steps,
        prompts=args.prompts,
        seed=seed,
        max_staleness=k,
    )
    loss = {"kl_coef": 0.0, "loss_agg_mode": "token-mean", "is_correction": correction}
    with tempfile.TemporaryDirectory() as out:
        run = RLRun(cfg, {"lr": args.lr, "loss_config": loss}, out)
        if not isinstance(run.source, AsyncSource):  # K = 0: the same loop, with the versions
            src = AsyncSource(cfg)
            src.trained_chunk_size = run.source.trained_chunk_size
            src.attach(run.engine)
            run.source = src
        recs, walls = [], []
        try:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                recs.append(run.run_step())
                walls.append(time.perf_counter() - t0)
        finally:
            run.source.close()
    warm = recs[1:] or recs
    mean = lambda key: sum(r[key] for r in warm if key in r) / max(1, sum(1 for r in warm if key in r))  # noqa: E731
    out = {
        "max_staleness": k,
        "is_correction": correction,
        "seed": seed,
        "steps": args.steps,
        "wall_per_step": sum(walls[1:] or walls) / len(walls[1:] or walls),
        **{k_: mean(k_) for k_ in PARTS},
        "reward_first3": sum(r["reward_mean"] for r in recs[:3]) / min(3, len(recs)),
        "reward_last3": sum(r["reward_mean"] for r in recs[-3:]) / min(3, len(recs)),
        "staleness_max": max(r["staleness_max"] for r in recs),
        "rewards": [r["reward_mean"] for r in recs],
    }
    keys = sorted({key for r in warm for key in r if key.startswith("mismatch/")})
    out.update({key: mean(key) for key in keys})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="kimi-linear-tiny")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--task", default="token-set")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--corrections", nargs="+", default=["none", "token-tis"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    runs = []
    for seed in args.seeds:
        for k in args.staleness:
            for corr in args.corrections:
                r = one_run(args, k, corr, seed)
                runs.append(r)
                print(json.dumps({k_: v for k_, v in r.items() if k_ != "rewards"}), flush=True)
    result = {
        "flavor": args.flavor,
        "layers": args.layers,
        "device": args.device,
        "task": args.task,
        "prompts": args.prompts,
        "lr": args.lr,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "runs": runs,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
