"""Mapped log-probs vs the expanded path at the real vocabulary size V = 157,184 (issue 7).

For each rollout-tree case and logits dtype, runs forward + backward of

* ``mapped``: ``harts_runtime.loss.logprobs.mapped_logprobs`` on the C compact logit rows (per-row max
  and sum-exp once, one target logit per semantic position; gradient only for compact rows);
* ``expanded``: the trajectory-wise path: gather P = S - N rows of logits, float32
  ``log_softmax``, gather targets (what a trainer does without prefix sharing);

and records median time, peak memory above the inputs (CPU: peak RSS of a fresh subprocess per
measurement; CUDA: ``max_memory_allocated``) and the largest tensor any op produced (a
TorchDispatchMode watcher, as in ``tests/runtime/loss/test_logprobs.py``).

    python benchmarks/logprob_memory.py                          # CPU, ~2-4 min
    python benchmarks/logprob_memory.py --device cuda --out benchmarks/results/logprob_memory_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

VOCAB = 157_184
CASES = {  # harts_runtime.testing.synthetic_tree_batch arguments
    "tree-C528-P2557": {
        "seed": 3,
        "prompt": 60,
        "turns": 3,
        "turn_len": (5, 20),
        "fork_prob": 0.8,
        "fanout": 3,
    },
    "tree-C1061-P4188": {
        "seed": 0,
        "prompt": 150,
        "turns": 3,
        "turn_len": (15, 50),
        "fork_prob": 0.8,
        "fanout": 3,
    },
    "tree-C4240-P25419": {
        "seed": 0,
        "prompt": 300,
        "turns": 4,
        "turn_len": (20, 80),
        "fork_prob": 0.8,
        "fanout": 3,
    },
}
DEFAULT_CPU_CASES = ["tree-C528-P2557", "tree-C1061-P4188"]
DEFAULT_CUDA_CASES = list(CASES)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(case: str, dtype_name: str, path: str, device_name: str, repeats: int) -> dict:
    """One measurement, in a fresh process."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from harts_runtime.loss.logprobs import expanded_logprobs, mapped_logprobs, targets_from_batch
    from harts_runtime.testing import synthetic_tree_batch

    class MaxNumel(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.max_numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.max_numel = max(self.max_numel, t.numel())
            return out

    device = torch.device(device_name)
    dtype = getattr(torch, dtype_name)
    batch = synthetic_tree_batch(**CASES[case])
    targets = targets_from_batch(batch).to(device)
    c, p = batch.compact_tokens, targets.row_index.numel()
    gen = torch.Generator(device=device).manual_seed(0)
    # Drawn directly in the target dtype: no float32 temporary that would raise the RSS peak first.
    logits = torch.randn(c, VOCAB, device=device, generator=gen, dtype=dtype).requires_grad_()
    weights = torch.randn(p, device=device, generator=gen)
    fn = mapped_logprobs if path == "mapped" else expanded_logprobs

    def step():
        logits.grad = None
        (fn(logits, targets) * weights).sum().backward()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    rss_before = _peak_rss_bytes()
    step()  # first run: the peak measurement
    sync()
    peak = (
        (torch.cuda.max_memory_allocated() - base)
        if device.type == "cuda"
        else _peak_rss_bytes() - rss_before
    )
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    with torch.no_grad():
        lp_sum = float(fn(logits, targets).double().sum())
    watcher = MaxNumel()
    with watcher:
        step()
    return {
        "case": case,
        "dtype": dtype_name,
        "path": path,
        "device": device_name,
        "trajectories": batch.num_trajectories,
        "semantic_tokens": batch.semantic_tokens,
        "compact_tokens": c,
        "logprob_positions": p,
        "vocab": VOCAB,
        "fwd_bwd_s_median": times[len(times) // 2],
        "fwd_bwd_s_all": times,
        "peak_extra_bytes": int(peak),
        "peak_extra_gib": peak / 2**30,
        "compact_logits_bytes": logits.numel() * logits.element_size(),
        "largest_tensor_numel": watcher.max_numel,
        "largest_tensor_over_CxV": watcher.max_numel / (c * VOCAB),
        "any_tensor_with_PxV_elements": watcher.max_numel >= p * VOCAB,
        "logprob_sum": lp_sum,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cases", nargs="*", default=None)
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "logprob_memory.json"))
    ap.add_argument("--child", nargs=4, metavar=("CASE", "DTYPE", "PATH", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, repeats=args.repeats)))
        return

    cases = args.cases or (DEFAULT_CUDA_CASES if args.device.startswith("cuda") else DEFAULT_CPU_CASES)
    import torch

    doc = {
        "benchmark": "logprob_memory",
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": args.device,
            "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
        },
        "settings": {
            "vocab": VOCAB,
            "cases": {c: CASES[c] for c in cases},
            "dtypes": args.dtypes,
            "repeats": args.repeats,
        },
        "results": [],
        "summary": [],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for case in cases:
        for dtype in args.dtypes:
            pair = {}
            for path in ("mapped", "expanded"):
                print(f"[{time.strftime('%H:%M:%S')}] {case} {dtype} {path} ...", flush=True)
                proc = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--repeats",
                        str(args.repeats),
                        "--child",
                        case,
                        dtype,
                        path,
                        args.device,
                    ],
                    check=False,
                    capture_output=True,
                    text=True,
                )
                if proc.returncode != 0:
                    rec = {"case": case, "dtype": dtype, "path": path, "error": proc.stderr[-3000:]}
                else:
                    rec = json.loads(proc.stdout.strip().splitlines()[-1])
                    pair[path] = rec
                    print(
                        f"    {rec['fwd_bwd_s_median'] * 1e3:.1f} ms, peak +{rec['peak_extra_gib']:.3f} GiB, "
                        f"largest tensor {rec['largest_tensor_over_CxV']:.2f} x C*V",
                        flush=True,
                    )
                doc["results"].append(rec)
                with open(args.out, "w") as f:
                    json.dump(doc, f, indent=1)
            if len(pair) == 2:
                m, e = pair["mapped"], pair["expanded"]
                doc["summary"].append(
                    {
                        "case": case,
                        "dtype": dtype,
                        "C": m["compact_tokens"],
                        "P": m["logprob_positions"],
                        "S": m["semantic_tokens"],
                        "V": VOCAB,
                        "mapped_ms": m["fwd_bwd_s_median"] * 1e3,
                        "expanded_ms": e["fwd_bwd_s_median"] * 1e3,
                        "speedup": e["fwd_bwd_s_median"] / m["fwd_bwd_s_median"],
                        "mapped_peak_gib": m["peak_extra_gib"],
                        "expanded_peak_gib": e["peak_extra_gib"],
                        "memory_ratio": e["peak_extra_bytes"] / max(m["peak_extra_bytes"], 1),
                        "logprob_sum_abs_diff": abs(m["logprob_sum"] - e["logprob_sum"]),
                    }
                )
                with open(args.out, "w") as f:
                    json.dump(doc, f, indent=1)
    print(json.dumps(doc["summary"], indent=1))


if __name__ == "__main__":
    main()
