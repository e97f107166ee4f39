"""`harts-planner`: command-line entry point.

Subcommands
-----------
demo    generate the built-in SWE-like synthetic step, ingest it and print what was found.
synth   write a synthetic batch to a file (``.hrb`` binary or ``.jsonl``).
plan    plan a saved batch (in-process or on a sidecar); a summary table, or the full plan as JSON.
serve   run the gRPC planner sidecar (SIGTERM drains it).
bench   planning latency in-process and over gRPC, N concurrent clients, tokens or tree requests.
show    render a plan as a self-contained HTML/SVG page (trees coloured by call round).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from harts_planner._progress import Progress


def _ingest_with_progress(tokens, offsets, tree_ids, quiet: bool):
    from harts_planner.batch import RolloutBatch

    bar = Progress("ingest", enabled=not quiet)
    bar(0, 1)
    batch = RolloutBatch.from_arrays(tokens, offsets, tree_ids)
    bar(1, 1)
    return batch, bar.close()


def _demo_plans(batch, args) -> dict:
    """Step plan (Section 3.2) and per-microbatch minimum-call plans (Section 3.3) of the demo step."""
    from harts_planner.step_plan import plan_step

    longest = int(np.max(batch.lengths))
    capacity = max(args.capacity, longest)  # small presets: T never below one trajectory
    bar = Progress("step plan", enabled=not args.quiet)
    bar(0, 1)
    plan = plan_step(batch, args.dp, capacity, args.chunk_size)
    bar(1, 1)
    step_s = bar.close()
    bar = Progress("call plans", enabled=not args.quiet)
    call_plans = plan.call_plans(progress=bar)
    calls_s = bar.close()
    calls = [int(cp.num_calls) for cp in call_plans]
    replay = sum(int(cp.replay_tokens) for cp in call_plans)
    m = plan.metrics
    return {
        "dp_size": args.dp,
        "capacity": capacity,
        "chunk_size": args.chunk_size,
        "microbatches": plan.num_microbatches,
        "slots": plan.num_slots,
        "step_compact_tokens": plan.total_work,
        "step_compression": batch.semantic_tokens / plan.total_work,
        "slot_critical_work": plan.slot_critical_work,
        "max_replica_work": plan.max_replica_work,
        "slot_imbalance_p95": m.get("slot_imbalance_p95"),
        "step_imbalance": plan.step_imbalance,
        "step_plan_seconds": step_s,
        "kda_calls_total": int(sum(calls)),
        "kda_calls_max": max(calls),
        "replay_tokens": replay,
        "call_plan_seconds": calls_s,
    }


def _demo_model(args) -> None:
    """Training steps of the `debug` hybrid model on a few trees, compact and trajectory-wise side by
    side from the same weights, then the GPU speedup measured on an H200 (``harts_runtime.model_demo``;
    seconds on a CPU; needs the runtime extra: torch)."""
    try:
        from harts_runtime import model_demo
    except ImportError as e:  # the base install has no torch: say how to get the model step
        print(
            f"model step skipped ({e.name or e} is not installed): pip install '.[runtime]' torch==2.13.0, "
            "then harts-planner demo or harts-train"
        )
        return
    sys.stdout.flush()
    preset = "tiny" if args.preset == "tiny" else "demo"  # CPU-sized: a few trees (DEMO_TREES)
    model_demo(preset=preset, steps=args.model_steps, seed=0)


def cmd_demo(args: argparse.Namespace) -> int:
    from harts_planner import synth

    t0 = time.perf_counter()
    bar = Progress("generate", enabled=not args.quiet)
    syn = synth.generate(args.preset, seed=args.seed, progress=bar)
    gen_s = bar.close()
    batch, ingest_s = _ingest_with_progress(syn.tokens, syn.offsets, syn.tree_ids, args.quiet)
    stats = batch.stats()
    stats.update(
        preset=args.preset,
        seed=args.seed,
        generate_seconds=gen_s,
        ingest_seconds=ingest_s,
        ingest_tokens_per_second=batch.semantic_tokens / ingest_s if ingest_s else None,
    )
    plans = _demo_plans(batch, args)
    stats["plan"] = plans
    stats["total_seconds"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        p = plans
        rows = [
            ("preset", f"{args.preset} (seed {args.seed})"),
            ("trajectories", f"{stats['trajectories']:,}"),
            ("rollout trees", f"{stats['trees']:,}"),
            ("semantic tokens S", f"{stats['semantic_tokens']:,}"),
            ("compact tokens C", f"{stats['compact_tokens']:,}"),
            ("compression S/C", f"{stats['compression']:.2f}x"),
            ("segments", f"{stats['segments']:,}"),
            (
                "tree depth",
                f"{stats['max_depth_segments']} segments max, "
                f"{stats['max_trajectory_tokens']:,} tokens max "
                f"({stats['mean_trajectory_tokens']:,.0f} mean per trajectory)",
            ),
            (
                "fan-out",
                f"{stats['forks']:,} forks, max {stats['max_fanout']}, "
                f"mean {stats['mean_fanout_at_forks']:.2f} at forks",
            ),
            (
                "step plan",
                f"D = {p['dp_size']}, T = {p['capacity']:,}: {p['microbatches']} microbatches in "
                f"{p['slots']} slots, {p['step_compact_tokens']:,} compact tokens "
                f"(S / work = {p['step_compression']:.2f}x), step imbalance {p['step_imbalance']:.2%}",
            ),
            (
                "KDA call plans",
                f"chunk {p['chunk_size']}: {p['kda_calls_total']:,} calls in all, at most "
                f"{p['kda_calls_max']} per microbatch, replay {p['replay_tokens']:,} tokens "
                f"({p['replay_tokens'] / max(p['step_compact_tokens'], 1):.3%} of the work)",
            ),
            (
                "time",
                f"generate {gen_s:.2f}s, ingest {ingest_s:.2f}s "
                f"({stats['ingest_tokens_per_second'] / 1e6:.1f}M tokens/s), step plan "
                f"{p['step_plan_seconds']:.2f}s, call plans {p['call_plan_seconds']:.2f}s",
            ),
        ]
        width = max(len(k) for k, _ in rows)
        print("HARTS demo: synthetic rollout step -> compact trie -> step plan -> KDA call plans")
        for k, v in rows:
            print(f"  {k:<{width}}  {v}")
    if args.model_steps > 0 and not args.json:
        sys.stdout.flush()
        _demo_model(args)
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from harts_planner import synth
    from harts_planner.batch_io import save_batch

    bar = Progress("generate", enabled=not args.quiet)
    syn = synth.generate(args.preset, seed=args.seed, progress=bar)
    bar.close()
    save_batch(args.output, syn.tokens, syn.offsets, syn.tree_ids)
    print(f"wrote {args.output}: {len(syn.offsets) - 1:,} trajectories, {len(syn.tokens):,} tokens")
    return 0


def _load_batch(path: str):
    from harts_planner.batch import RolloutBatch

    return RolloutBatch.load(path)


def _tls_client(args: argparse.Namespace) -> dict:
    """The Planner's TLS arguments of a command with --target (``--tls-ca`` / ``--tls-cert`` /
    ``--tls-key``)."""
    return {
        "tls_ca": getattr(args, "tls_ca", None),
        "tls_cert": getattr(args, "tls_cert", None),
        "tls_key": getattr(args, "tls_key", None),
    }


def _plan_file(args: argparse.Namespace, call_plans: bool):
    """Plan args.file with the step arguments of ``plan`` / ``show``."""
    from harts_planner.bench import payload
    from harts_planner.planner import Planner

    batch = _load_batch(args.file)
    with Planner(args.target, **_tls_client(args)) as planner:
        source = batch if args.target is None else payload(batch, args.request)
        return batch, planner.plan_step(
            source, args.dp, args.capacity, args.chunk_size, call_plans=call_plans
        )


def cmd_plan(args: argparse.Namespace) -> int:
    batch, plan = _plan_file(args, call_plans=args.call_plans)
    if args.json:
        out = plan.to_dict()
        if args.call_plans:
            out["call_plans"] = [c.to_dict(segments=False) for c in plan.call_plans()]
        print(json.dumps(out, indent=2))
        return 0
    j, m = plan.objective, plan.metrics
    where = f"sidecar {args.target} ({args.request} request)" if args.target else "in-process"
    print(
        f"HARTS step plan of {args.file}: {batch.num_trajectories:,} trajectories, "
        f"{batch.semantic_tokens:,} tokens, {batch.compact_tokens:,} compact ({where})"
    )
    rows = [
        ("D / T / B", f"{plan.dp_size} / {plan.capacity:,} / {plan.chunk_size}"),
        ("microbatches K (slots)", f"{plan.num_microbatches} ({plan.num_slots})"),
        ("J (total, slot-critical, max replica)", f"({j[0]:,}, {j[1]:,}, {j[2]:,})"),
        ("total work / batch compact tokens", f"{j[0] / plan.compact_tokens:.4f}"),
        ("slot imbalance P50 / P95", f"{m['slot_imbalance_p50']:.3%} / {m['slot_imbalance_p95']:.3%}"),
        ("step imbalance", f"{m['step_imbalance']:.3%}"),
        ("selected candidate", f"{plan.source} ({len(plan.candidates)} compared)"),
        ("time", f"{plan.wall_seconds * 1e3:.1f} ms (planner {plan.planning_seconds * 1e3:.1f} ms)"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    calls = plan.call_plans() if args.call_plans else None
    print(
        f"\n  {'mb':>4} {'replica':>7} {'slot':>5} {'traj':>6} {'work':>10} {'of T':>6}"
        + (f" {'calls':>5} {'replay':>8}" if calls else "")
    )
    for i in range(plan.num_microbatches):
        line = (
            f"  {i:>4} {int(plan.replica[i]):>7} {int(plan.slot[i]):>5} {len(plan.microbatches[i]):>6} "
            f"{int(plan.work[i]):>10,} {int(plan.work[i]) / plan.capacity:>6.1%}"
        )
        if calls:
            line += f" {calls[i].num_calls:>5} {calls[i].replay_tokens:>8,}"
        print(line)
    return 0


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
        batch, label = _load_batch(args.batch), args.batch
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
                    else (lambda: Planner(target, **_tls_client(args)))
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


def cmd_show(args: argparse.Namespace) -> int:
    from harts_planner import viewer

    _, plan = _plan_file(args, call_plans=True)
    html = viewer.render_step_plan(
        plan, title=args.title or f"HARTS plan of {args.file}", max_segments=args.max_segments
    )
    output = args.output or (str(args.file).rsplit(".", 1)[0] + ".html")
    with open(output, "w", encoding="utf-8") as f:
        f.write(html)
    k, segments = plan.num_microbatches, sum(c.num_segments for c in plan.call_plans())
    print(
        f"wrote {output}: {k} microbatch{'' if k == 1 else 'es'}, "
        f"{segments:,} segment{'' if segments == 1 else 's'}"
    )
    return 0


# ---------------------------------------------------------------------------------- argument types
# Every option value is checked where it is given (argparse ``type=``): a bad one ends the command
# before any work with one line, ``harts-planner <command>: error: argument --dp: must be >= 1, got 0``.
INT64_MAX = 2**63 - 1


def _range_text(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"must be in [{lo}, {hi}]"
    return f"must be >= {lo}" if lo is not None else f"must be <= {hi}"


def int_arg(lo: int | None = None, hi: int | None = INT64_MAX):
    """An argparse type: a decimal integer in ``[lo, hi]`` (int64 unless ``hi`` says otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{_range_text(lo, hi)}, got {value}")
        return value

    return parse


def float_arg(lo: float = 0.0, hi: float = 1e9):
    """An argparse type: a finite number in ``[lo, hi]``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not lo <= value <= hi:  # also NaN
            raise argparse.ArgumentTypeError(f"must be in [{lo:g}, {hi:g}], got {text}")
        return value

    return parse


def _batch_formats() -> tuple[str, ...]:
    from harts_planner.batch_io import FORMATS

    return tuple(FORMATS)


def _suffix_of(text: str) -> str:
    return os.path.splitext(text)[1].lower()


def input_batch(text: str) -> str:
    """An argparse type: an existing, readable batch file (``.hrb`` or ``.jsonl``)."""
    if _suffix_of(text) not in _batch_formats():
        raise argparse.ArgumentTypeError(
            f"{text!r}: not a batch file; the name must end in {' or '.join(_batch_formats())}"
        )
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text!r}: no such file")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r}: is a directory, not a batch file")
    if not os.path.isfile(text):  # a FIFO, socket or device: reading it could wait forever
        raise argparse.ArgumentTypeError(
            f"{text!r}: not a regular file (a FIFO, socket or device); save the batch to a file"
        )
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: not readable")
    return text


def input_file(text: str) -> str:
    """An argparse type: an existing, readable regular file (a certificate or key)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: no such file" if not os.path.exists(text) else f"{text!r}: not a regular file"
        )
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: not readable")
    return text


def output_file(suffixes: tuple[str, ...] | None = None):
    """An argparse type: a file path to write (its directory exists, it is not a directory, and its
    name ends in one of ``suffixes`` when given)."""

    def parse(text: str) -> str:
        choices = _batch_formats() if suffixes is None else suffixes
        if choices and _suffix_of(text) not in choices:
            raise argparse.ArgumentTypeError(f"{text!r}: the name must end in {' or '.join(choices)}")
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"{text!r}: is a directory")
        parent = os.path.dirname(os.path.abspath(text))
        if not os.path.isdir(parent):
            raise argparse.ArgumentTypeError(f"{text!r}: directory {parent!r} does not exist")
        return text

    return parse


def json_destination(text: str) -> str:
    """``-`` (stdout) or a file path to write."""
    return text if text == "-" else output_file(())(text)


def target_arg(text: str) -> str:
    """An argparse type: a sidecar address ``host:port`` (``[v6]:port``), or a gRPC target with a
    scheme (``unix:PATH``, ``dns:///host:port``)."""
    if text.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or host in ("[", "[]"):
        raise argparse.ArgumentTypeError(f"must be HOST:PORT, got {text!r}")
    try:
        number = int(port, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port of {text!r} must be an integer, got {port!r}") from None
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port of {text!r} must be in [1, 65535], got {number}")
    return text


def host_arg(text: str) -> str:
    """An argparse type: a host name or address to bind (no port, no spaces)."""
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if not bare or any(c.isspace() for c in bare) or ("/" in bare):
        raise argparse.ArgumentTypeError(f"must be a host name or address, got {text!r}")
    return bare


def _presets() -> list[str]:
    from harts_planner.synth import PRESETS

    return sorted(PRESETS)


# ---------------------------------------------------------------------------------- the parser
class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``PROG: error: MESSAGE (see PROG --help)``."""

    def error(self, message: str):  # noqa: D102 (argparse API)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _step_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=input_batch, help="a batch file (.hrb or .jsonl, see `harts-planner synth`)")
    p.add_argument("--dp", type=int_arg(1), default=1, help="DP degree D (default 1)")
    p.add_argument(
        "--capacity", type=int_arg(1), default=65536, help="compact tokens per microbatch T (default 65536)"
    )
    p.add_argument(
        "--chunk-size",
        type=int_arg(1, 1 << 20),
        default=64,
        help="linear-attention chunk size B in [1, 2^20] (default 64)",
    )
    p.add_argument("--target", type=target_arg, help="host:port of a sidecar (default: plan in-process)")
    p.add_argument(
        "--request",
        choices=("tree", "tokens"),
        default="tree",
        help="what to send a sidecar: the compacted tree (default) or the tokens",
    )
    _tls_client_args(p)


def _tls_client_args(p: argparse.ArgumentParser) -> None:
    """TLS to a --target sidecar (serve --tls-cert / --tls-key [--tls-client-ca])."""
    p.add_argument("--tls-ca", type=input_file, help="CA certificates (PEM) of the sidecar's TLS certificate")
    p.add_argument("--tls-cert", type=input_file, help="this client's certificate (PEM), for mutual TLS")
    p.add_argument("--tls-key", type=input_file, help="this client's private key (PEM), for mutual TLS")


def build_parser() -> argparse.ArgumentParser:
    from harts_planner.rpc import limits

    p = _Parser(
        prog="harts-planner", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    presets = _presets()

    d = sub.add_parser("demo", help="generate a SWE-like synthetic step, ingest it, print a summary")
    d.add_argument(
        "--preset", default="swe-like", choices=presets, help="synthetic preset (default: swe-like)"
    )
    d.add_argument("--seed", type=int_arg(0), default=0, help="generator seed >= 0 (default 0)")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    d.add_argument("--dp", type=int_arg(1), default=2, help="DP degree D of the step plan (default 2)")
    d.add_argument(
        "--capacity", type=int_arg(1), default=65_536, help="microbatch capacity T in compact tokens"
    )
    d.add_argument("--chunk-size", type=int_arg(1, 1 << 20), default=64, help="KDA chunk size B")
    d.add_argument(
        "--model-steps",
        type=int_arg(0, 1_000_000),
        default=1,
        help="training steps of the debug model, compact vs trajectory (needs torch; 0 = skip; "
        "not with --json)",
    )
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("synth", help="write a synthetic batch (.hrb or .jsonl)")
    s.add_argument("output", type=output_file(), help="file to write, OUT.hrb or OUT.jsonl")
    s.add_argument(
        "--preset", default="swe-like", choices=presets, help="synthetic preset (default swe-like)"
    )
    s.add_argument("--seed", type=int_arg(0), default=0, help="generator seed >= 0 (default 0)")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_synth)

    pl = sub.add_parser("plan", help="plan a saved batch; print a summary table (or --json)")
    _step_args(pl)
    pl.add_argument("--call-plans", action="store_true", help="also plan every microbatch's calls")
    pl.add_argument("--json", action="store_true", help="print the full plan as JSON")
    pl.set_defaults(func=cmd_plan)

    sv = sub.add_parser("serve", help="run the gRPC planner sidecar")
    sv.add_argument(
        "--host",
        type=host_arg,
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; 0.0.0.0 for all)",
    )
    sv.add_argument(
        "--port",
        type=int_arg(0, 65535),
        default=50051,
        help="port in [0, 65535] (default 50051; 0 picks a free one)",
    )
    sv.add_argument(
        "--workers", type=int_arg(1, 1024), default=None, help="planner threads (default: one per core, >= 2)"
    )
    sv.add_argument(
        "--max-message-mb",
        type=int_arg(1, limits.MAX_MESSAGE_MB),
        default=limits.DEFAULT_MAX_MESSAGE_BYTES >> 20,
        help=f"largest gRPC message in MiB, at most {limits.MAX_MESSAGE_MB}: a unary PlanStep / PlanCalls "
        "request or response, one chunk of a *Stream call; each stream reserves twice this against "
        f"--max-inflight-mb while it receives (default {limits.DEFAULT_MAX_MESSAGE_BYTES >> 20})",
    )
    sv.add_argument(
        "--max-request-mb",
        type=int_arg(1, 1 << 20),
        default=limits.DEFAULT_MAX_TRANSFER_BYTES >> 20,
        help="largest request of a *Stream call, whole (default "
        f"{limits.DEFAULT_MAX_TRANSFER_BYTES >> 20}: a 59M-token step is 236 MB)",
    )
    sv.add_argument("--max-message-bytes", type=int_arg(1, 2**31 - 1), default=None, help=argparse.SUPPRESS)
    sv.add_argument(
        "--max-rows",
        type=int_arg(1, 2**40),
        default=limits.DEFAULT.max_rows,
        help="most rows (compact + replay) of the call plans one request may ask for "
        f"(default {limits.DEFAULT.max_rows:,})",
    )
    sv.add_argument(
        "--max-plan-memory-mb",
        type=int_arg(1, 1 << 30),
        default=limits.DEFAULT.max_plan_memory_bytes >> 20,
        help="most server memory the plans running at once may need, estimated before planning; "
        "a request over it alone is refused, one that fits waits for room; also the planner's "
        "max_plan_bytes backstop for any one plan "
        f"(default {limits.DEFAULT.max_plan_memory_bytes >> 20})",
    )
    sv.add_argument(
        "--max-response-mb",
        type=int_arg(1, 1 << 20),
        default=limits.DEFAULT_MAX_TRANSFER_BYTES >> 20,
        help="largest response, estimated before planning (a unary call's also at most --max-message-mb; "
        f"default {limits.DEFAULT_MAX_TRANSFER_BYTES >> 20})",
    )
    sv.add_argument(
        "--max-inflight-mb",
        type=int_arg(1, 1 << 30),
        default=limits.DEFAULT.max_inflight_bytes >> 20,
        help="most request bytes held at once: being received (reserved), queued or planning, with "
        f"what admission built for them (default {limits.DEFAULT.max_inflight_bytes >> 20})",
    )
    sv.add_argument(
        "--max-queued",
        type=int_arg(0, 4096),
        default=limits.DEFAULT.max_queued,
        help=f"requests that may wait for a planner thread (default {limits.DEFAULT.max_queued}); "
        "more get RESOURCE_EXHAUSTED",
    )
    sv.add_argument(
        "--grace",
        type=float_arg(0.0, 1e6),
        default=300.0,
        help="seconds in-flight plans get to finish after SIGTERM before they are cancelled (default 300)",
    )
    sv.add_argument(
        "--receive-timeout",
        type=float_arg(0.001, 1e6),
        default=limits.DEFAULT.receive_timeout,
        help="seconds a request message (or one chunk) may take to arrive before the call is cut off "
        f"(default {limits.DEFAULT.receive_timeout:g})",
    )
    sv.add_argument(
        "--send-timeout",
        type=float_arg(0.001, 1e6),
        default=limits.DEFAULT.send_timeout,
        help="seconds a response may go unread by its client before the call is cut off "
        f"(default {limits.DEFAULT.send_timeout:g})",
    )
    sv.add_argument("--tls-cert", type=input_file, help="serve TLS: the server's certificate chain (PEM)")
    sv.add_argument("--tls-key", type=input_file, help="serve TLS: the server's private key (PEM)")
    sv.add_argument(
        "--tls-client-ca",
        type=input_file,
        help="mutual TLS: CA certificates (PEM) that must sign every client's certificate",
    )
    sv.add_argument("--log-format", choices=("json", "text"), default="json", help="log lines on stderr")
    sv.set_defaults(func=cmd_serve)

    b = sub.add_parser(
        "bench",
        help="planning latency in-process and over gRPC (p50/p95/p99, throughput)",
        description="Planning latency in-process and over gRPC. The default is a quick run (tree "
        "requests, 10 per row: seconds); the full comparison, as benchmarks/service.py reports it, is "
        "--request both --requests 20 (tokens requests move 229 MB each: about 10 minutes on 2 cores).",
    )
    b.add_argument(
        "--preset", default="swe-like", choices=presets, help="synthetic preset (default swe-like)"
    )
    b.add_argument("--seed", type=int_arg(0), default=0, help="generator seed >= 0 (default 0)")
    b.add_argument("--batch", type=input_batch, help="plan this batch file instead of a synthetic one")
    b.add_argument("--dp", type=int_arg(1), default=2, help="DP degree D (default 2)")
    b.add_argument("--capacity", type=int_arg(1), default=65536, help="T (default 65536)")
    b.add_argument(
        "--request",
        choices=("tokens", "tree", "both"),
        default="tree",
        help="what to send: the compacted segment tree (default: 49 KB for swe-like, seconds in all), "
        "the packed tokens (229 MB per swe-like request: minutes) or both",
    )
    b.add_argument("--transport", choices=("inprocess", "grpc", "both"), default="both", help="how to plan")
    b.add_argument("--target", type=target_arg, help="host:port of a running sidecar (default: start one)")
    _tls_client_args(b)
    b.add_argument(
        "--workers", type=int_arg(1, 1024), default=None, help="worker threads of the started sidecar"
    )
    b.add_argument("--clients", type=int_arg(1, 1024), default=1, help="concurrent clients (default 1)")
    b.add_argument(
        "--requests", type=int_arg(1, 10**9), default=10, help="timed requests per row (default 10)"
    )
    b.add_argument(
        "--warmup", type=int_arg(0, 10**6), default=1, help="untimed requests per client first (default 1)"
    )
    b.add_argument("--call-plans", action="store_true", help="also plan every microbatch's calls")
    b.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        type=json_destination,
        metavar="PATH",
        help="write the report as JSON to PATH (or stdout with no PATH)",
    )
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.set_defaults(func=cmd_bench)

    sh = sub.add_parser("show", help="render a plan as a self-contained HTML/SVG page")
    _step_args(sh)
    sh.add_argument(
        "-o", "--output", type=output_file(()), help="HTML file to write (default: FILE with .html)"
    )
    sh.add_argument("--title", help="page title")
    sh.add_argument(
        "--max-segments", type=int_arg(0, 10**9), default=5000, help="largest tree drawn per microbatch"
    )
    sh.set_defaults(func=cmd_show)
    return p


# ---------------------------------------------------------------------------------- errors
def _fail(message: str, code: int) -> int:
    """One line on stderr, then the exit code."""
    text = " ".join(str(message).split()) or "unknown error"
    print(f"harts-planner: error: {text}", file=sys.stderr)
    return code


def _os_error(e: OSError) -> str:
    where = f"{e.filename!r}: " if getattr(e, "filename", None) else ""
    return f"{where}{e.strerror or e}"


def _stdout_gone() -> int:
    """The reader of our stdout went away (``plan --json | head``): stop quietly, as a killed
    ``yes | head`` does (exit 128 + SIGPIPE), without Python's 'Exception ignored' at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 128 + 13


def run(args: argparse.Namespace) -> int:
    """Run a parsed command; every failure becomes one line on stderr and a non-zero exit code:
    2 for bad input (any ValueError: HartsError, BatchFormatError, ...), 1 for everything else
    (a file that cannot be read or written, an unreachable sidecar, a server that cannot bind, and,
    set HARTS_TRACEBACK=1 to see where, an internal error), 130 for Ctrl-C."""
    from harts_planner.rpc.client import SidecarError

    try:
        code = args.func(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _stdout_gone()
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except SidecarError as e:  # before OSError: SidecarUnavailableError is a ConnectionError
        return _fail(str(e), 1)
    except RecursionError as e:  # deeply nested input: a ValueError in spirit, a RuntimeError in type
        return _fail(f"input nested too deeply ({e})", 2)
    except ValueError as e:  # HartsError and friends: the message names the field
        return _fail(str(e), 2)
    except OSError as e:
        return _fail(_os_error(e), 1)
    except MemoryError:
        return _fail("out of memory", 1)
    except RuntimeError as e:  # a sidecar that cannot bind or start
        return _fail(str(e), 1)
    except Exception as e:
        if os.environ.get("HARTS_TRACEBACK"):
            raise
        return _fail(f"internal error: {type(e).__name__}: {e} (set HARTS_TRACEBACK=1 for the traceback)", 1)


def main(argv: list[str] | None = None) -> int:
    """The ``harts-planner`` entry point: the exit code (0 for ``--help``, 2 for a usage error,
    already printed as one line; else :func:`run`'s)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
