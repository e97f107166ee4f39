"""The RL loop's step time split (``harts-rl``'s generate / log-probs / train / sync) on a flavor of
real width, random weights, one process.

::

    python benchmarks/rl_loop.py --flavor qwen3.5-35b-a3b --layers 4 --device cuda --steps 4

prints one JSON line per step (the loop's record) and a summary of the mean seconds of each part
over the steps after the first (warm-up). The sync check's tolerance defaults to the weights' dtype
(``--sync-atol`` overrides it: 1.0 for bf16, where the kernels agree to bf16 rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from harts_runtime.rl import RLConfig, RLRun  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="qwen3.5-tiny")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--task", default="token-set")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=65_536)
    ap.add_argument("--sync-atol", type=float, default=None)
    args = ap.parse_args()
    cfg = RLConfig(
        flavor=args.flavor,
        layers=args.layers,
        device=args.device,
        task=args.task,
        steps=args.steps,
        prompts=args.prompts,
        sync_atol=args.sync_atol,
    )
    with tempfile.TemporaryDirectory() as out:
        run = RLRun(cfg, {"lr": 1e-5, "capacity": args.capacity}, out)
        params = sum(p.numel() for p in run.engine.model.parameters())
        print(json.dumps({"flavor": args.flavor, "layers": args.layers, "params": params}), flush=True)
        recs = []
        for _ in range(args.steps):
            rec = run.run_step()
            recs.append(rec)
            print(json.dumps(rec), flush=True)
    parts = ("generate_seconds", "logprobs_seconds", "train_seconds", "sync_seconds", "step_seconds")
    warm = recs[1:] or recs
    print(json.dumps({k: sum(r[k] for r in warm) / len(warm) for k in parts}), flush=True)


if __name__ == "__main__":
    main()
