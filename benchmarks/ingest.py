"""Ingestion throughput and peak memory on the `swe-like` preset (issue: Foundation).

Each measurement runs in a fresh subprocess pinned to one core: it generates the step,
records peak RSS, ingests it (best of --repeats), and records peak RSS again; the
difference is the ingestion's peak memory above the input arrays.

    python benchmarks/ingest.py --seeds 0 1 2 --out benchmarks/results/ingest.json

``--input array`` (default) ingests the step's writable int32 array, which the batch copies;
``--input bytes`` an immutable array over ``bytes`` (``np.frombuffer``), which it keeps without a
copy: the difference is the cost of the copy that makes ``from_arrays`` safe against a caller
refilling its buffer.
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


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(preset: str, seed: int, repeats: int, kind: str = "array") -> dict:
    """Runs inside the child process."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    import numpy as np

    from harts_planner import RolloutBatch, synth

    syn = synth.generate(preset, seed=seed)
    tokens = syn.tokens if kind == "array" else np.frombuffer(syn.tokens.tobytes(), dtype=np.int32)
    rss_before = _peak_rss_bytes()
    times = []
    batch = None
    for _ in range(repeats):
        del batch
        t0 = time.perf_counter()
        batch = RolloutBatch.from_arrays(tokens, syn.offsets, syn.tree_ids)
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {
        "preset": preset,
        "seed": seed,
        "input": kind,
        "tokens_copied": not np.shares_memory(batch.tokens, tokens),
        "trajectories": batch.num_trajectories,
        "semantic_tokens": batch.semantic_tokens,
        "compact_tokens": batch.compact_tokens,
        "compression": batch.compression,
        "segments": batch.num_segments,
        "ingest_seconds_best": best,
        "ingest_seconds_all": times,
        "tokens_per_second": batch.semantic_tokens / best,
        "input_bytes": syn.tokens.nbytes + syn.offsets.nbytes,
        "peak_rss_before_bytes": rss_before,
        "peak_rss_after_bytes": _peak_rss_bytes(),
        "ingest_peak_extra_bytes": _peak_rss_bytes() - rss_before,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="swe-like")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--input", choices=["array", "bytes"], default="array")
    p.add_argument("--out", default="benchmarks/results/ingest.json")
    p.add_argument("--child", nargs=2, metavar=("PRESET", "SEED"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.repeats, args.input)))
        return
    runs = []
    for seed in args.seeds:
        out = subprocess.run(
            [sys.executable, __file__, "--child", args.preset, str(seed), "--repeats", str(args.repeats)]
            + ["--input", args.input],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            sys.exit(f"seed {seed}: measurement failed:\n{out.stderr}")
        r = json.loads(out.stdout)
        runs.append(r)
        print(
            f"seed {seed}: N={r['trajectories']:,} S={r['semantic_tokens']:,} C={r['compact_tokens']:,} "
            f"S/C={r['compression']:.2f} ingest={r['ingest_seconds_best']:.3f}s "
            f"({r['tokens_per_second'] / 1e6:.0f}M tok/s) peak+{r['ingest_peak_extra_bytes'] / 2**20:.0f} MiB"
            f" tokens {'copied' if r['tokens_copied'] else 'kept'}",
            flush=True,
        )
    result = {
        "benchmark": "ingest",
        "machine": {"platform": platform.platform(), "cores_used": 1, "python": platform.python_version()},
        "runs": runs,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
