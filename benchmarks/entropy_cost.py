"""The entropy pass's cost (issue 46 item 2): the LM head's mapped log-probs alone against the
log-probs plus the full-vocabulary entropy of every row (``harts_runtime.loss.logprobs``), forward
and backward. Each case runs ``--repeat`` times, the fastest kept.

For ``--rows`` hidden rows of width ``--hidden`` and a ``--vocab`` head (``--dtype``), with one
target per row:

* ``logprobs``: ``lm_head_logprobs`` (the fused chunked head; fla's kernels on CUDA), forward and
  backward of ``sum(lp)``;
* ``logprobs+entropy``: the same plus ``lm_head_entropy`` (its own chunked pass, recomputed in
  backward), backward of ``sum(lp) + sum(H)``;

and records wall time (the cases interleaved) and on CUDA ``max_memory_allocated``.

    python benchmarks/entropy_cost.py                                   # CPU, ~20 s
    python benchmarks/entropy_cost.py --device cuda --rows 16384 --hidden 4096 --vocab 151936 \\
        --dtype bfloat16 --out benchmarks/results/entropy_cost_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


def main(argv=None) -> dict:
    import torch

    from harts_runtime.layout.rows import lm_chunks
    from harts_runtime.loss.logprobs import lm_head_entropy, lm_head_logprobs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunk-rows", type=int, default=1024)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev, dt = torch.device(a.device), getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(a.rows, a.hidden, generator=g).to(dev, dt)
    weight = (torch.randn(a.vocab, a.hidden, generator=g) / a.hidden**0.5).to(dev, dt)
    rows = torch.arange(a.rows, device=dev)
    labels = torch.randint(0, a.vocab, (a.rows,), generator=g).to(dev)
    chunks = lm_chunks(rows.cpu().numpy(), a.rows, a.chunk_rows)
    fla = dev.type == "cuda"

    def run(entropy: bool) -> float:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        loss = lm_head_logprobs(h, w, rows, labels, chunks, a.chunk_rows, fla_kernels=fla).sum()
        if entropy:
            loss = loss + lm_head_entropy(h, w, rows, a.chunk_rows).sum()
        loss.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    cases = {"logprobs": {"seconds": float("inf")}, "logprobs+entropy": {"seconds": float("inf")}}
    for _ in range(a.repeat):  # interleaved, so that a busy machine's drift hits both alike
        for name, ent in (("logprobs", False), ("logprobs+entropy", True)):
            cases[name]["seconds"] = min(cases[name]["seconds"], run(ent))
            if dev.type == "cuda":
                cases[name]["peak_bytes"] = int(torch.cuda.max_memory_allocated(dev))
    for name, c in cases.items():
        print(f"{name:18s} {c['seconds'] * 1e3:9.1f} ms", flush=True)
    ratio = cases["logprobs+entropy"]["seconds"] / cases["logprobs"]["seconds"]
    print(f"entropy pass: x{ratio:.2f} the head's forward + backward")
    out = {
        "benchmark": "entropy_cost",
        "args": vars(a),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "cases": cases,
        "ratio": ratio,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
