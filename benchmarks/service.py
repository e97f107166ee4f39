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

``--robustness`` measures instead what issue 17 asks of a sidecar that no request can knock over,
each against a fresh ``harts-planner serve`` on 127.0.0.1, and writes
``benchmarks/results/service_robustness.json``:

* ``refusal``: the 26-byte ``PlanCalls`` of one 2^31 - 1 token segment (and one of 2^26 tokens),
  refused by the cost limits: latency from receipt (the server's log) and at the client, and the
  server's memory before and after (VmRSS / VmHWM). Target: within 10 ms at under 50 MB.
* ``invalid_under_load``: ``--load-clients`` clients (default 32) for ``--load-seconds`` (default
  30): three quarters plan the ``swe-like`` tree in a loop, one quarter send invalid requests;
  latency of the invalid ones (before issue 17: ~750 ms p50, they waited behind plans).
* ``deadlines``: two requests for ``--copies`` concatenated ``swe-like`` trees, segment lengths and T
  divided by ``--scale`` (default 1000 and 40: 2.1M trajectories, a step that plans for ~19 s) with
  1 s deadlines on a two-worker server, then a 3-token request: how long it waited and how long the
  workers stayed busy (before issue 17, with 18 copies at full length: 15.3 s and 17 s).
* ``cancel``: one such plan on a one-worker server, cancelled by its client after ``--cancel-after``
  seconds (default 3: past its admission, inside the plan), then a
  3-token request: how long after the cancellation the worker was free (its queue time). Target:
  50 ms.
* ``sigterm``: SIGTERM with ``--grace 1`` while that plan runs and a 3-token request waits: the
  exit code and how long the process took to exit (before: rc 1 after 6.9 s).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "rpc"))

from sidecar_fixtures import memory  # noqa: E402  (the /proc reader service_attacks.py and the tests use)

from harts_planner import DEFAULT_CAPACITY, Planner, RolloutBatch, SegmentTree, bench, synth  # noqa: E402
from harts_planner.rpc.server import SidecarProcess  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="swe-like")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--capacity", type=int, default=DEFAULT_CAPACITY)
    p.add_argument("--requests", type=int, default=40, help="timed sequential requests per tree row")
    p.add_argument("--token-requests", type=int, default=15, help="timed sequential requests per tokens row")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clients", type=int, default=4, help="concurrent clients of the throughput pass")
    p.add_argument("--workers", type=int, default=None, help="sidecar worker threads (default: its default)")
    p.add_argument(
        "--out", default=None, help="JSON report (default results/service.json or service_robustness.json)"
    )
    p.add_argument(
        "--robustness", action="store_true", help="measure refusals, load, deadlines, cancel, SIGTERM"
    )
    p.add_argument(
        "--sections", default="refusal,invalid_under_load,deadlines,cancel,sigterm", help="of --robustness"
    )
    p.add_argument("--load-clients", type=int, default=32)
    p.add_argument("--load-seconds", type=float, default=30.0)
    p.add_argument("--copies", type=int, default=1000, help="swe-like trees per slow request (--robustness)")
    p.add_argument(
        "--scale", type=int, default=40, help="segment lengths and T divided by this in the slow request"
    )
    p.add_argument(
        "--cancel-after", type=float, default=3.0, help="seconds into the slow request to cancel / SIGTERM"
    )
    args = p.parse_args(argv)
    results_dir = os.path.join(os.path.dirname(__file__), "results")
    if args.robustness:
        args.out = args.out or os.path.join(results_dir, "service_robustness.json")
        return robustness(args)
    args.out = args.out or os.path.join(results_dir, "service.json")

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


# ---------------------------------------------------------------------------------- robustness
def _records(log_path: str) -> list[dict]:
    with open(log_path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def _rpc_records(log_path: str) -> list[dict]:
    return [r for r in _records(log_path) if r.get("event") == "rpc"]


#: The robustness sections send their slow 32 MB requests to the unary methods (one message each).
UNARY_ARGS = ["--max-message-mb", "64"]


def _raw(address: str):
    import grpc

    from harts_planner.rpc import codec

    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 2**31 - 1)])
    stubs = {
        name: channel.unary_unary(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        for name, path in (("step", codec.PLAN_STEP), ("calls", codec.PLAN_CALLS))
    }
    return channel, stubs


def _timed(stub, data: bytes, timeout: float) -> tuple[str, float]:
    import grpc

    t0 = time.perf_counter()
    try:
        stub(data, timeout=timeout)
        code = "OK"
    except grpc.RpcError as e:
        code = e.code().name
    return code, time.perf_counter() - t0


def copies_tree(tree: SegmentTree, copies: int, scale: int = 1) -> SegmentTree:
    """``copies`` disjoint copies of a segment tree (a step of ``copies`` times the trajectories),
    segment lengths divided by ``scale`` (at least 1; to stay under 2^31 semantic tokens)."""
    v = tree.num_segments
    parent = np.concatenate([np.where(tree.parent < 0, -1, tree.parent + i * v) for i in range(copies)])
    ends = np.concatenate([tree.trajectory_end + i * v for i in range(copies)])
    length = np.tile(np.maximum(tree.length // scale, 1), copies)
    return SegmentTree(parent.astype(np.int32), length.astype(np.int32), ends.astype(np.int32))


def _refusal(log: str) -> dict:
    from harts_planner.rpc import codec

    requests = {
        "plan_calls_2^31-1_tokens": codec.plan_calls_request(
            SegmentTree([-1], [2**31 - 1], [0]), None, 64, 4
        ),
        "plan_calls_2^26_tokens": codec.plan_calls_request(SegmentTree([-1], [2**26], [0]), None, 64, 4),
    }
    out = {}
    with SidecarProcess(workers=2, log_path=log, extra_args=UNARY_ARGS) as sidecar:
        channel, stubs = _raw(sidecar.address)
        idle = memory(sidecar.pid)
        for name, message in requests.items():
            data = message.SerializeToString()
            before = len(_rpc_records(log))
            seen = [_timed(stubs["calls"], data, 30) for _ in range(200)]
            time.sleep(0.2)  # the last log lines
            server = [r["total_ms"] for r in _rpc_records(log)[before:]]
            out[name] = {
                "request_bytes": len(data),
                "codes": sorted({c for c, _ in seen}),
                "server_ms": bench.percentiles([ms / 1e3 for ms in server]),
                "client": bench.percentiles([t for _, t in seen]),
            }
        after = memory(sidecar.pid)
        channel.close()
    details = next(r["error"] for r in _rpc_records(log) if r["code"] == "RESOURCE_EXHAUSTED")
    return {
        **out,
        "message": details,
        "server_memory_idle": idle,
        "server_memory_after": after,
        "peak_growth_mb": (after["VmHWM"] - idle["VmHWM"]) / 2**20,
        "target": {"server_p99_ms_max": 10.0, "peak_growth_mb_max": 50.0},
    }


def _invalid_requests() -> list[bytes]:
    from harts_planner import PackedTokens
    from harts_planner.rpc import codec
    from harts_planner.rpc import planner_pb2 as pb

    tree = SegmentTree([-1, 0, 0], [3, 2, 4], [1, 2])
    bad = [
        pb.PlanStepRequest(trajectories=codec.encode_trajectories(tree), capacity=10),  # no dp_size
        codec.plan_step_request(SegmentTree([-1, 2, 1], [1, 1, 1], [0]), 1, 10, 64, {}, False, 4),  # cycle
        codec.plan_step_request(PackedTokens([1, -2, 3], [0, 3]), 1, 10, 64, {}, False, 4),  # token < 0
        codec.plan_step_request(tree, 1, 5, 64, {}, False, 4),  # a trajectory over T
    ]
    return [m.SerializeToString() for m in bad]


def _invalid_under_load(args, tree: SegmentTree, log: str) -> dict:
    from harts_planner.rpc import codec

    valid = codec.serialize_plan_step_request(tree, args.dp, args.capacity, 64, {}, False, 4)
    invalid = _invalid_requests()
    rows: list[tuple[str, str, float]] = []
    lock = threading.Lock()
    with SidecarProcess(workers=args.workers, log_path=log, extra_args=UNARY_ARGS) as sidecar:
        stop = time.monotonic() + args.load_seconds

        def client(i: int) -> None:
            channel, stubs = _raw(sidecar.address)
            n = 0
            while time.monotonic() < stop:
                kind = "invalid" if i % 4 == 0 else "valid"
                data = invalid[n % len(invalid)] if kind == "invalid" else valid
                code, seconds = _timed(stubs["step"], data, 120)
                n += 1
                with lock:
                    rows.append((kind, code, seconds))
            channel.close()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.load_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        peak = memory(sidecar.pid)["VmHWM"]
    out = {"clients": args.load_clients, "seconds": args.load_seconds, "server_peak_mb": peak / 2**20}
    for kind in ("valid", "invalid"):
        mine = [r for r in rows if r[0] == kind]
        out[kind] = {
            "requests": len(mine),
            "codes": sorted({r[1] for r in mine}),
            **bench.percentiles([r[2] for r in mine]),
        }
    out["before_issue_17"] = {"invalid_p50_ms": 750}
    return out


def _tiny_request() -> bytes:
    from harts_planner.rpc import codec

    return codec.plan_step_request(SegmentTree([-1], [3], [0]), 1, 10, 64, {}, False, 4).SerializeToString()


def _queued_request() -> bytes:
    """A step of 200 trajectories: big enough to wait for a planner thread (a 3-token request is
    planned at once since issue 25, without one)."""
    from harts_planner.rpc import codec

    parent = np.array([-1] + [0] * 200, dtype=np.int32)
    length = np.array([10] + [5] * 200, dtype=np.int32)
    tree = SegmentTree(parent, length, np.arange(1, 201, dtype=np.int32))
    return codec.plan_step_request(tree, 1, 100, 64, {}, False, 4).SerializeToString()


def _slow_request(big: SegmentTree, dp: int, scale: int) -> bytes:
    from harts_planner.rpc import codec

    return codec.serialize_plan_step_request(big, dp, 65536 // scale, 64, {}, False, 4)


def _deadlines(args, big: SegmentTree, log: str) -> dict:
    slow = _slow_request(big, 2, args.scale)
    with SidecarProcess(workers=2, log_path=log, extra_args=UNARY_ARGS) as sidecar:
        channel, stubs = _raw(sidecar.address)
        start = time.perf_counter()
        futures = [stubs["step"].future(slow, timeout=1.0) for _ in range(2)]
        time.sleep(0.1)
        code, waited = _timed(stubs["step"], _tiny_request(), 120)
        slow_codes = []
        for f in futures:
            try:
                f.result()
                slow_codes.append("OK")
            except Exception as e:  # grpc.RpcError
                slow_codes.append(e.code().name)
        # The workers are busy until the two slow requests' log lines.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            slow_records = [r for r in _rpc_records(log) if r.get("request_bytes", 0) >= len(slow) - 64]
            if len(slow_records) == 2:
                break
            time.sleep(0.05)
        busy_s = max(r["total_ms"] for r in slow_records) / 1e3
        channel.close()
        total = time.perf_counter() - start
    return {
        "slow_request_bytes": len(slow),
        "trajectories": big.num_trajectories,
        "segments": big.num_segments,
        "slow_codes_at_client": slow_codes,
        "slow_codes_logged": [r["code"] for r in slow_records],
        "tiny_request_code": code,
        "tiny_request_wait_s": waited,
        "workers_busy_s": busy_s,
        "scenario_s": total,
        "before_issue_17": {"tiny_request_wait_s": 15.3, "workers_busy_s": 17.0},
    }


def _plan_seconds(big: SegmentTree, dp: int, scale: int) -> float:
    batch = RolloutBatch.from_segment_tree(big)
    t0 = time.perf_counter()
    Planner().plan_step(batch, dp, 65536 // scale)
    return time.perf_counter() - t0


def _cancel(args, big: SegmentTree, log: str) -> dict:
    slow = _slow_request(big, 1, args.scale)
    with SidecarProcess(workers=1, log_path=log, extra_args=UNARY_ARGS) as sidecar:
        channel, stubs = _raw(sidecar.address)
        future = stubs["step"].future(slow, timeout=600)
        time.sleep(args.cancel_after)  # past admission (validation, estimate, the tree's index): planning
        cancelled_at = time.perf_counter()
        future.cancel()
        code, waited = _timed(stubs["step"], _tiny_request(), 600)
        freed = time.perf_counter() - cancelled_at
        channel.close()
    tiny = [r for r in _rpc_records(log) if r.get("request_bytes") == len(_tiny_request())]
    slow_logged = [r for r in _rpc_records(log) if r.get("request_bytes", 0) >= len(slow) - 64]
    return {
        "tiny_request_code": code,
        "worker_freed_after_cancel_ms": tiny[0]["queue_ms"] if tiny else None,
        "tiny_request_total_s_at_client": waited,
        "cancel_to_tiny_answer_s": freed,
        "slow_code_logged": slow_logged[0]["code"] if slow_logged else None,
        "slow_total_ms_logged": slow_logged[0]["total_ms"] if slow_logged else None,
        "target": {"worker_freed_ms_max": 50.0},
    }


def _sigterm(args, big: SegmentTree, log: str) -> dict:
    slow = _slow_request(big, 1, args.scale)
    sidecar = SidecarProcess(workers=1, grace=1.0, log_path=log, extra_args=UNARY_ARGS)
    channel, stubs = _raw(sidecar.address)
    future = stubs["step"].future(slow, timeout=600)
    time.sleep(args.cancel_after)  # planning by now
    queued = stubs["step"].future(_queued_request(), timeout=600)
    time.sleep(0.2)
    sent = time.perf_counter()
    sidecar.proc.send_signal(signal.SIGTERM)
    queued_code = "OK"
    try:
        queued.result()
    except Exception as e:  # grpc.RpcError
        queued_code = e.code().name
    queued_answer_s = time.perf_counter() - sent
    try:
        rc = sidecar.proc.wait(600)
    finally:
        if sidecar.proc.poll() is None:
            sidecar.proc.kill()
    exit_s = time.perf_counter() - sent
    try:
        future.result()
        slow_code = "OK"
    except Exception as e:  # grpc.RpcError
        slow_code = e.code().name
    channel.close()
    stopped = [r for r in _records(log) if r.get("event") == "stopped"]
    return {
        "grace_s": 1.0,
        "exit_code": rc,
        "exit_after_sigterm_s": exit_s,
        "queued_code": queued_code,
        "queued_answered_after_s": queued_answer_s,
        "in_flight_code": slow_code,
        "stopped": stopped[-1] if stopped else None,
        "before_issue_17": {"exit_code": 1, "exit_after_sigterm_s": 6.9},
    }


def robustness(args) -> int:
    import tempfile

    t0 = time.perf_counter()
    syn = synth.generate(args.preset, seed=args.seed)
    batch = RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids)
    tree = batch.segment_tree()
    big = copies_tree(tree, args.copies, args.scale)
    plan_s = _plan_seconds(big, 1, args.scale)
    print(
        f"{args.preset}/{args.seed}: {batch.num_trajectories:,} trajectories; x{args.copies}: "
        f"{big.num_trajectories:,} trajectories, {big.num_segments:,} segments, plan_step {plan_s:.2f} s "
        f"in-process ({time.perf_counter() - t0:.1f} s)",
        file=sys.stderr,
    )
    sections = [s for s in args.sections.split(",") if s]
    report = {
        "benchmark": "service_robustness",
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "copies": args.copies,
        "scale": args.scale,
        "slow_step": {
            "trajectories": big.num_trajectories,
            "segments": big.num_segments,
            "plan_step_seconds_in_process": plan_s,
        },
        "machine": bench.machine(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in sections:
            log = os.path.join(tmp, f"{name}.log")
            t = time.perf_counter()
            if name == "refusal":
                report[name] = _refusal(log)
            elif name == "invalid_under_load":
                report[name] = _invalid_under_load(args, tree, log)
            elif name == "deadlines":
                report[name] = _deadlines(args, big, log)
            elif name == "cancel":
                report[name] = _cancel(args, big, log)
            elif name == "sigterm":
                report[name] = _sigterm(args, big, log)
            else:
                raise SystemExit(f"unknown section {name!r}")
            print(f"  {name} ({time.perf_counter() - t:.1f} s): {json.dumps(report[name])}", file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
