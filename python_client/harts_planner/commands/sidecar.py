"""`harts-planner serve` and `harts-planner bench`: the gRPC planner sidecar.

* ``serve``: run the sidecar (:func:`harts_planner.rpc.server.serve`) with the server's limits and
  TLS from the options; SIGTERM drains it.
* ``bench``: planning latency in-process and over gRPC (p50/p95/p99, throughput), N concurrent
  clients, tokens or tree requests; starts a sidecar unless ``--target`` names one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from harts_planner._progress import Progress
from harts_planner.commands.planning import load_batch, tls_client


def cmd_serve(args: argparse.Namespace) -> int:
    from harts_planner.rpc import limits
    from harts_planner.rpc.server import serve

    message = args.max_message_bytes if args.max_message_bytes else args.max_message_mb * limits.MiB
    message = min(message, 2**31 - 1)  # --max-message-mb 2047 is 2^31 - 2^20; gRPC's bound is 2^31 - 1
    bounds = limits.Limits(
        max_rows=args.max_rows,
        max_plan_memory_bytes=args.max_plan_memory_mb * limits.MiB,
        max_response_bytes=args.max_response_mb * limits.MiB,
        max_request_bytes=args.max_request_mb * limits.MiB,
        max_inflight_bytes=args.max_inflight_mb * limits.MiB,
        max_queued=args.max_queued,
        receive_timeout=args.receive_timeout,
        send_timeout=args.send_timeout,
        min_receive_rate=args.min_receive_rate_mb * limits.MiB,
        min_send_rate=args.min_send_rate_mb * limits.MiB,
    )
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError(
            f"{'--tls-key' if args.tls_key is None else '--tls-cert'}: TLS needs both --tls-cert and --tls-key"
        )
    if args.tls_client_ca is not None and args.tls_cert is None:
        raise ValueError("--tls-client-ca: mutual TLS needs the server's --tls-cert and --tls-key too")
    code = serve(
        args.host,
        args.port,
        workers=args.workers,
        max_message_bytes=message,
        grace=args.grace,
        log_format=args.log_format,
        limits=bounds,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        max_connections=args.max_connections,
        health_port=args.health_port,
    )
    if code != 0:  # a cancelled plan did not stop: a normal exit would wait for its thread
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def cmd_bench(args: argparse.Namespace) -> int:
    from harts_planner import bench, synth
    from harts_planner.batch import RolloutBatch
    from harts_planner.planner import Planner

    if args.batch:
        batch, label = load_batch(args.batch), args.batch
    else:
        syn = synth.generate(
            args.preset, seed=args.seed, progress=Progress("generate", enabled=not args.quiet)
        )
        batch, label = (
            RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids),
            f"{args.preset}/{args.seed}",
        )
    kinds = bench.REQUEST_KINDS if args.request == "both" else (args.request,)
    transports = bench.TRANSPORTS if args.transport == "both" else (args.transport,)
    sidecar = None
    if "grpc" in transports and args.target is None:
        from harts_planner.rpc.server import SidecarProcess

        sidecar = SidecarProcess(workers=args.workers)
    target = args.target or (sidecar.address if sidecar else None)
    results = []
    try:
        for kind in kinds:
            request = bench.payload(batch, kind)
            reference = Planner().plan_step(request, args.dp, args.capacity, call_plans=args.call_plans)
            for transport in transports:
                bar = Progress(f"{transport}/{kind}", enabled=not args.quiet)
                make = (
                    (lambda: Planner())
                    if transport == "inprocess"
                    else (lambda: Planner(target, **tls_client(args)))
                )
                r = bench.run(
                    make,
                    request,
                    args.dp,
                    args.capacity,
                    clients=args.clients,
                    requests=args.requests,
                    warmup=args.warmup,
                    reference=reference,
                    progress=bar,
                    call_plans=args.call_plans,
                )
                bar.close()
                results.append({"transport": transport, "request": kind, **r})
    finally:
        if sidecar is not None:
            sidecar.terminate()
    ratios = {}
    for kind in kinds:
        by = {r["transport"]: r for r in results if r["request"] == kind}
        if len(by) == 2:
            ratios[kind] = {
                q: by["grpc"][f"{q}_ms"] / by["inprocess"][f"{q}_ms"] for q in ("p50", "p95", "p99")
            }
    report = {
        "batch": label,
        "trajectories": batch.num_trajectories,
        "semantic_tokens": batch.semantic_tokens,
        "compact_tokens": batch.compact_tokens,
        "segments": batch.num_segments,
        "dp_size": args.dp,
        "capacity": args.capacity,
        "call_plans": args.call_plans,
        "target": args.target,
        "results": results,
        "grpc_over_inprocess": ratios,
        "machine": bench.machine(),
    }
    if args.json is not None:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.json != "-":
        print(
            f"bench {label}: {batch.num_trajectories:,} trajectories, {batch.semantic_tokens:,} tokens, "
            f"D = {args.dp}, T = {args.capacity:,}, {args.clients} client(s), {args.requests} requests each row"
        )
        print(
            f"  {'transport':<10} {'request':<7} {'p50 ms':>9} {'p95 ms':>9} {'p99 ms':>9} {'plans/s':>8} "
            f"{'mismatch':>8}"
        )
        for r in results:
            print(
                f"  {r['transport']:<10} {r['request']:<7} {r['p50_ms']:>9.1f} {r['p95_ms']:>9.1f} "
                f"{r['p99_ms']:>9.1f} {r['throughput_per_s']:>8.2f} {r['mismatches']:>8}"
            )
        for kind, q in ratios.items():
            print(
                f"  gRPC / in-process ({kind}): p50 {q['p50']:.3f}x, p95 {q['p95']:.3f}x, p99 {q['p99']:.3f}x"
            )
    return 1 if any(r["mismatches"] for r in results) else 0


__all__ = ["cmd_bench", "cmd_serve"]
