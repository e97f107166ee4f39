"""gRPC sidecar overhead over in-process planning on a ``swe-like`` step (issue 5).

One synthetic ``swe-like`` step (preset of ``harts_planner.synth``, Table 2 scale: about 2k
trajectories, 50M+ tokens) is planned by ``Planner.plan_step`` (D = 2, T = 65,536) four ways:

* ``inprocess`` / ``tokens``: packed tokens in memory -> ingestion (compact trie) -> plan;
* ``inprocess`` / ``tree``: the step's compacted segment tree -> batch index -> plan;
* ``grpc`` / ``tokens``: the same through a ``harts-planner serve`` child process on 127.0.0.1
  (int32 tokens + int64 offsets on the wire, about 4 bytes per token);
* ``grpc`` / ``tree``: the compacted tree on the wire (parent, length, trajectory ends: a few KB).

Latency is client-observed per call (``harts_planner.bench.run``: warm-up, then sequential calls by
one client, every plan checked equal to the in-process reference). A second pass runs
``--clients`` concurrent clients against the sidecar for throughput. The target: sidecar p99 within
1.2x of in-process for compacted-tree requests.

    python benchmarks/service.py --out benchmarks/results/service.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from harts_planner import Planner, RolloutBatch, bench, synth
from harts_planner.rpc.server import SidecarProcess


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="swe-like")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--capacity", type=int, default=65536)
    p.add_argument("--requests", type=int, default=40, help="timed sequential requests per tree row")
    p.add_argument("--token-requests", type=int, default=15, help="timed sequential requests per tokens row")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clients", type=int, default=4, help="concurrent clients of the throughput pass")
    p.add_argument("--workers", type=int, default=None, help="sidecar worker threads (default: its default)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "service.json"))
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    syn = synth.generate(args.preset, seed=args.seed)
    batch = RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids)
    print(
        f"{args.preset}/{args.seed}: {batch.num_trajectories:,} trajectories, {batch.semantic_tokens:,} tokens, "
        f"{batch.compact_tokens:,} compact, {batch.num_segments:,} segments ({time.perf_counter() - t0:.1f} s)",
        file=sys.stderr,
    )
    payloads = {kind: bench.payload(batch, kind) for kind in bench.REQUEST_KINDS}
    wire_bytes = {}
    from harts_planner.rpc import codec

    for kind, source in payloads.items():
        wire_bytes[kind] = codec.plan_step_request(
            source, args.dp, args.capacity, 64, {}, False, 4
        ).ByteSize()
    reference = Planner().plan_step(batch, args.dp, args.capacity)
    results = []
    with SidecarProcess(workers=args.workers) as sidecar:
        for kind in bench.REQUEST_KINDS:
            n = args.requests if kind == "tree" else args.token_requests
            for transport in bench.TRANSPORTS:
                make = (lambda: Planner()) if transport == "inprocess" else (lambda: Planner(sidecar.address))
                r = bench.run(
                    make,
                    payloads[kind],
                    args.dp,
                    args.capacity,
                    clients=1,
                    requests=n,
                    warmup=args.warmup,
                    reference=reference,
                )
                results.append({"pass": "latency", "transport": transport, "request": kind, **r})
                print(
                    f"  {transport:<9} {kind:<6} p50 {r['p50_ms']:8.1f}  p95 {r['p95_ms']:8.1f}  "
                    f"p99 {r['p99_ms']:8.1f} ms  mismatches {r['mismatches']}",
                    file=sys.stderr,
                )
        for transport in bench.TRANSPORTS:
            make = (lambda: Planner()) if transport == "inprocess" else (lambda: Planner(sidecar.address))
            r = bench.run(
                make,
                payloads["tree"],
                args.dp,
                args.capacity,
                clients=args.clients,
                requests=args.requests,
                warmup=1,
                reference=reference,
            )
            results.append({"pass": "throughput", "transport": transport, "request": "tree", **r})
            print(
                f"  {transport:<9} tree x{args.clients} clients: {r['throughput_per_s']:.2f} plans/s, "
                f"p99 {r['p99_ms']:.1f} ms",
                file=sys.stderr,
            )
    ratios = {}
    for kind in bench.REQUEST_KINDS:
        by = {r["transport"]: r for r in results if r["pass"] == "latency" and r["request"] == kind}
        ratios[kind] = {q: by["grpc"][f"{q}_ms"] / by["inprocess"][f"{q}_ms"] for q in ("p50", "p95", "p99")}
    report = {
        "benchmark": "service",
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "seed": args.seed,
        "dp_size": args.dp,
        "capacity": args.capacity,
        "trajectories": batch.num_trajectories,
        "semantic_tokens": batch.semantic_tokens,
        "compact_tokens": batch.compact_tokens,
        "segments": batch.num_segments,
        "microbatches": reference.num_microbatches,
        "request_bytes": wire_bytes,
        "results": results,
        "grpc_over_inprocess": ratios,
        "target": {"tree_p99_ratio_max": 1.2, "met": ratios["tree"]["p99"] <= 1.2},
        "machine": bench.machine(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    for kind, q in ratios.items():
        print(
            f"gRPC / in-process ({kind}): p50 {q['p50']:.3f}x  p95 {q['p95']:.3f}x  p99 {q['p99']:.3f}x",
            file=sys.stderr,
        )
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(r["mismatches"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
