"""MoE routing replay: the trainer's log-prob mismatch against a rollout engine, with and without
replay (issue 45 item 4).

The "rollout engine" is the same model with its weights rounded to bf16 (computed in float32): it
scores random rollout trees trajectory-wise and its MoE layers' own top-k become the rollouts'
``routes``. The trainer (the float32 weights) then scores the same trees with
``EngineConfig(routing_replay=False)`` and ``True``; per case: mean and max ``|lambda - mu|`` over
the targets and the share of (token, MoE layer) routes that differ from the rollout engine's.

    python benchmarks/routing_replay.py                 # CPU, debug flavor, ~20 s
    python benchmarks/routing_replay.py --flavor qwen3.5-35b-a3b --layers 2 --device cuda \\
        --out benchmarks/results/routing_replay_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


def _score(model, trajs, routes, replay, device):
    """``(logprobs [P], routes used [S, M, k])`` of a trajectory-wise pass (one microbatch)."""
    import numpy as np
    import torch

    from harts_runtime.engine import EngineConfig, HartsEngine
    from harts_runtime.loss.objectives import PolicyLossConfig
    from harts_runtime.rollouts import Rollouts

    lengths = [len(t) for t in trajs]
    parts = np.split(routes.cpu().numpy(), np.cumsum(lengths)[:-1])
    ro = Rollouts.from_lists(trajs, routes=list(parts))
    seen = []
    hooks = [
        m.register_forward_hook(lambda mod, a, out: seen.append(out.topk_idx)) for m in model.moe_layers()
    ]
    cfg = EngineConfig(
        capacity=sum(lengths), mode="trajectory", routing_replay=replay, loss_config=PolicyLossConfig()
    )
    try:
        lp = HartsEngine(model, cfg).logprobs(ro)
    finally:
        for h in hooks:
            h.remove()
    return lp.double(), torch.stack(seen, 1).cpu()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="debug")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--trajectories", type=int, default=16)
    p.add_argument("--out", default=None, help="JSON file (default: print only)")
    a = p.parse_args(argv)

    import numpy as np
    import torch

    from harts_runtime import HybridModel, model_config
    from harts_runtime.testing import random_batch

    device = torch.device(a.device)
    cfg = model_config(a.flavor, a.layers).replace(dtype="float32")
    m, k = sum(f == "moe" for f in cfg.ffns), cfg.moe.top_k
    rows = []
    for seed in range(a.seeds):
        torch.manual_seed(0)
        trainer = HybridModel(cfg, device=device)
        rollout = HybridModel(cfg, device=device)
        with torch.no_grad():
            for q, r in zip(trainer.parameters(), rollout.parameters()):
                r.copy_(q.bfloat16().float())
        batch = random_batch(seed, num=a.trajectories, vocab=cfg.vocab_size, max_new=24)
        tok, off = np.asarray(batch.tokens), np.asarray(batch.offsets)
        trajs = [tok[off[i] : off[i + 1]].tolist() for i in range(len(off) - 1)]
        unknown = torch.full((int(off[-1]), m, k), -1, dtype=torch.int64)
        mu, routes = _score(rollout, trajs, unknown, False, device)
        row = {"seed": seed, "tokens": int(off[-1]), "targets": int(mu.numel())}
        for replay in (False, True):
            lp, used = _score(trainer, trajs, routes, replay, device)
            d = (lp - mu).abs()
            flips = (used.sort(-1).values != routes.sort(-1).values).any(-1).double().mean()
            key = "replay" if replay else "no_replay"
            row[key] = {"mean_abs": float(d.mean()), "max_abs": float(d.max()), "route_flips": float(flips)}
        rows.append(row)
        print(json.dumps(row))
    out = {
        "benchmark": "routing_replay",
        "flavor": a.flavor,
        "layers": a.layers,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "host": platform.node(),
        "rows": rows,
    }
    if a.out:
        with open(a.out, "w") as f:
            f.write(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
