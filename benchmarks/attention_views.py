"""Full attention on compact tokens: ancestor-KV views vs FlexAttention tree mask (issue 7).

For each rollout-tree case and attention shape, times forward and forward+backward of
``harts_runtime.ops.attention.compact_attention`` with every available GPU backend:

* view-based: ``varlen`` (torch varlen_attn), ``flash_attn``, ``te`` — gather packed Q / ancestor KV
  views, packed kernel with bottom-right causal alignment, scatter back;
* ``flex_tree``: FlexAttention over the compact rows with the tree-ancestor mask (no K/V copies);
* ``trajectory_varlen``: the trajectory-wise baseline without prefix sharing: every trajectory
  expanded (S rows) and run causally with varlen_attn.

Recorded per (case, shape, backend): median forward and forward+backward milliseconds, peak extra
CUDA memory, setup time (block-mask creation / first-call compile), the gather time of the views,
and the relative error of the output against ``varlen`` (or the first backend that ran). Every
measurement is in its own try/except; progress goes to stdout and the JSON file is rewritten after
every record, so a crash or a timeout keeps what ran.

    python benchmarks/attention_views.py                 # H200: all cases, ~5-10 min
    python benchmarks/attention_views.py --quick         # one small case, a few iterations
    python benchmarks/attention_views.py --out /tmp/x.json --cases agentic-20k --shapes mla

Without CUDA it runs a tiny CPU smoke test (reference / sdpa / dense_tree backends) so the script
itself can be checked anywhere; use ``--out`` to keep that away from the results file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from harts_runtime.ops.attention import available_backends, compact_attention
from harts_runtime.testing import synthetic_tree_batch, views_from_batch

CASES = {  # synthetic_tree_batch arguments; sizes (C, S/C) as generated with these seeds
    "agentic-20k": {
        "seed": 0,
        "prompt": 1500,
        "turns": 5,
        "turn_len": (100, 500),
        "fork_prob": 0.45,
        "fanout": 3,
    },
    "agentic-54k": {
        "seed": 1,
        "prompt": 4000,
        "turns": 7,
        "turn_len": (200, 900),
        "fork_prob": 0.4,
        "fanout": 3,
    },
    "wide-prompt": {
        "seed": 2,
        "prompt": 6000,
        "turns": 2,
        "turn_len": (100, 400),
        "fork_prob": 1.0,
        "fanout": 6,
    },
    "deep-chain": {
        "seed": 3,
        "prompt": 2000,
        "turns": 12,
        "turn_len": (300, 900),
        "fork_prob": 0.12,
        "fanout": 2,
    },
    "small": {"seed": 4, "prompt": 300, "turns": 3, "turn_len": (50, 200), "fork_prob": 0.6, "fanout": 3},
    "cpu-smoke": {
        "seed": 5,
        "prompt": 20,
        "turns": 3,
        "turn_len": (3, 10),
        "fork_prob": 0.6,
        "fanout": 2,
        "vocab": 50,
    },
}
SHAPES = {  # Hq, Hkv, Dqk, Dv
    "mla": (16, 16, 192, 128),  # Ling-3.0-tiny MLA: 16 heads, qk 128 + 64 rope, v 128
    "gqa": (16, 4, 128, 128),
}
GPU_BACKENDS = ["varlen", "fa4", "flash_attn", "te", "flex_tree", "trajectory_varlen"]
CPU_BACKENDS = ["reference", "sdpa", "dense_tree"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def environment() -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "available_backends": available_backends("cuda" if torch.cuda.is_available() else "cpu"),
    }
    for mod in ("flash_attn", "transformer_engine"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional packages, any failure means "absent"
            env[mod] = None
    return env


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()``."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def trajectory_varlen(q, k, v, batch, scale):
    """Trajectory-wise baseline: expand to S rows, each trajectory a causal varlen sequence."""
    from torch.nn.attention.varlen import varlen_attn

    from harts_runtime.ops.attention_kernels import _pad_head_dims, _repeat_kv

    sem = batch_tensors(batch, q.device)
    qs, ks, vs = q.index_select(0, sem["map"]), k.index_select(0, sem["map"]), v.index_select(0, sem["map"])
    groups = q.shape[1] // k.shape[1]
    ks, vs = _repeat_kv(ks, groups), _repeat_kv(vs, groups)
    qs, ks, vs, dv = _pad_head_dims(qs, ks, vs)
    out = varlen_attn(
        qs, ks, vs, sem["cu"], sem["cu"], sem["max_len"], sem["max_len"], scale=scale, window_size=(-1, 0)
    )
    return out[..., :dv]


_SEM: dict = {}


def batch_tensors(batch, device):
    key = (id(batch), str(device))
    if key not in _SEM:
        import numpy as np

        _SEM[key] = {
            "map": torch.from_numpy(batch.compact_map.astype(np.int64)).to(device),
            "cu": torch.from_numpy(batch.offsets.astype(np.int32)).to(device),
            "max_len": int(np.diff(batch.offsets).max()),
        }
    return _SEM[key]


def measure(backend, batch, views, shape, device, warmup, iters):
    hq, hkv, dqk, dv = shape
    c = batch.compact_tokens
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (
        torch.randn(c, h, d, device=device, generator=gen).to(dtype).requires_grad_()
        for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv))
    )
    scale = dqk**-0.5
    if backend == "trajectory_varlen":

        def run():
            return trajectory_varlen(q, k, v, batch, scale)
    else:

        def run():
            return compact_attention(q, k, v, views, backend=backend, scale=scale)

    rec = {}
    sync(device)
    t0 = time.perf_counter()
    out = run()  # first call: block mask, compile, autotune
    grad = torch.randn_like(out)
    out.backward(grad)
    sync(device)
    rec["setup_ms"] = (time.perf_counter() - t0) * 1e3
    rec["fwd_ms"] = timed(run, device, warmup, iters)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        run().backward(grad)

    rec["fwd_bwd_ms"] = timed(fwd_bwd, device, warmup, iters)
    if device.type == "cuda":
        q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd()
        torch.cuda.synchronize()
        rec["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    if backend in ("varlen", "fa4", "flash_attn", "te"):

        def gather():
            return (
                q.index_select(0, views.q_index),
                k.index_select(0, views.kv_index),
                v.index_select(0, views.kv_index),
            )

        rec["gather_ms"] = timed(gather, device, 1, iters)
    with torch.no_grad():
        o = run()
        if backend == "trajectory_varlen":
            # Compare at compact rows: the first semantic position of each row.
            import numpy as np

            first = np.full(c, -1, dtype=np.int64)
            m = batch.compact_map.astype(np.int64)
            first[m[::-1]] = np.arange(len(m))[::-1]
            o = o[torch.from_numpy(first).to(device)]
    return rec, o.float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention_views.json"),
    )
    ap.add_argument("--cases", nargs="*", default=None)
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--backends", nargs="*", default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="the small case, 1 warmup, 3 iterations")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        import torch._dynamo as dynamo

        dynamo.config.cache_size_limit = 256  # one flex compile per (case, shape)
        if hasattr(dynamo.config, "recompile_limit"):
            dynamo.config.recompile_limit = 256
    default_cases = ["small"] if args.quick else ["agentic-20k", "wide-prompt", "deep-chain", "agentic-54k"]
    cases = args.cases or (default_cases if cuda else ["cpu-smoke"])
    shapes = args.shapes or list(SHAPES)
    backends = args.backends or (GPU_BACKENDS if cuda else CPU_BACKENDS)
    warmup, iters = (1, 3) if args.quick or not cuda else (args.warmup, args.iters)
    if not cuda:
        SHAPES.update({"mla": (4, 4, 24, 16), "gqa": (4, 2, 16, 16)})
    avail = set(available_backends(device)) | ({"trajectory_varlen"} if cuda else set())

    doc = {
        "benchmark": "attention_views",
        "environment": environment(),
        "settings": {
            "cases": cases,
            "shapes": {s: SHAPES[s] for s in shapes},
            "backends": backends,
            "warmup": warmup,
            "iters": iters,
            "dtype": "bfloat16" if cuda else "float32",
        },
        "cases": {},
        "results": [],
    }
    write_json(args.out, doc)
    log(f"device={doc['environment']['device']} backends={sorted(avail)} -> {args.out}")
    for case in cases:
        try:
            t0 = time.perf_counter()
            batch = synthetic_tree_batch(**CASES[case])
            t1 = time.perf_counter()
            views = views_from_batch(batch)
            t2 = time.perf_counter()
            views = views.to(device)
            doc["cases"][case] = {
                "params": CASES[case],
                "trajectories": batch.num_trajectories,
                "semantic_tokens": batch.semantic_tokens,
                "compact_tokens": batch.compact_tokens,
                "compression": batch.compression,
                "views": views.stats(),
                "batch_build_s": t1 - t0,
                "views_build_ms": (t2 - t1) * 1e3,
            }
            write_json(args.out, doc)
            log(f"case {case}: C={batch.compact_tokens} S={batch.semantic_tokens} views={views.stats()}")
        except Exception as err:  # noqa: BLE001
            doc["cases"][case] = {"error": repr(err), "traceback": traceback.format_exc()[-2000:]}
            write_json(args.out, doc)
            log(f"case {case}: FAILED {err!r}")
            continue
        for shape in shapes:
            ref_out, ref_name = None, None
            for backend in backends:
                rec = {"case": case, "shape": shape, "backend": backend}
                if backend not in avail:
                    rec["status"] = "unavailable"
                    doc["results"].append(rec)
                    write_json(args.out, doc)
                    log(f"{case}/{shape}/{backend}: unavailable")
                    continue
                log(f"{case}/{shape}/{backend}: running")
                try:
                    stats, out = measure(backend, batch, views, SHAPES[shape], device, warmup, iters)
                    rec.update(stats, status="ok")
                    if ref_out is None:
                        ref_out, ref_name = out, backend
                    else:
                        rec["rel_err_vs"] = ref_name
                        rec["rel_err"] = float((out - ref_out).norm() / ref_out.norm())
                    del out
                    log(
                        f"{case}/{shape}/{backend}: "
                        + ", ".join(
                            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()
                        )
                    )
                except Exception as err:  # noqa: BLE001 - keep going; the record says what failed
                    rec.update(
                        status="error", error=repr(err)[:1000], traceback=traceback.format_exc()[-3000:]
                    )
                    log(f"{case}/{shape}/{backend}: FAILED {err!r}"[:500])
                doc["results"].append(rec)
                write_json(args.out, doc)
                if cuda:
                    torch.cuda.empty_cache()
    log("done")


if __name__ == "__main__":
    main()
