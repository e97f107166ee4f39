"""The parser of `harts-planner`: its subcommands, their options and the command each runs.

:func:`build_parser` gives the parser; each subcommand's ``func`` default is its ``cmd_*`` function
(:mod:`~harts_planner.commands.synthetic`, :mod:`~harts_planner.commands.planning`,
:mod:`~harts_planner.commands.sidecar`); option values are checked by the types of
:mod:`~harts_planner.commands.arg_types`. A usage error is one line (:class:`_Parser`).
"""

from __future__ import annotations

import argparse

from harts_planner.commands.arg_types import (
    float_arg,
    host_arg,
    input_batch,
    input_file,
    int_arg,
    json_destination,
    output_file,
    target_arg,
)
from harts_planner.commands.planning import cmd_plan, cmd_show
from harts_planner.commands.sidecar import cmd_bench, cmd_serve
from harts_planner.commands.synthetic import cmd_demo, cmd_synth
from harts_planner.step_plan import DEFAULT_CAPACITY

#: ``harts-planner --help``'s description: the subcommands.
DESCRIPTION = """`harts-planner`: command-line entry point.

Subcommands
-----------
demo    generate the built-in SWE-like synthetic step, ingest it and print what was found.
synth   write a synthetic batch to a file (``.hrb`` binary or ``.jsonl``).
plan    plan a saved batch (in-process or on a sidecar); a summary table, or the full plan as JSON.
serve   run the gRPC planner sidecar (SIGTERM drains it).
bench   planning latency in-process and over gRPC, N concurrent clients, tokens or tree requests.
show    render a plan as a self-contained HTML/SVG page (trees coloured by call round).
"""


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
        "--capacity",
        type=int_arg(1),
        default=DEFAULT_CAPACITY,
        help=f"compact tokens per microbatch T (default {DEFAULT_CAPACITY})",
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
        prog="harts-planner", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
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
        "--capacity",
        type=int_arg(1),
        default=DEFAULT_CAPACITY,
        help="microbatch capacity T in compact tokens",
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
        "--min-receive-rate-mb",
        type=float_arg(0.001, 1e6),
        default=limits.DEFAULT_MIN_RATE / limits.MiB,
        help="MiB/s a request must arrive at once --receive-timeout has passed: a request of N MiB has "
        "--receive-timeout + N / this seconds in all, however steadily it trickles "
        f"(default {limits.DEFAULT_MIN_RATE / limits.MiB:g})",
    )
    sv.add_argument(
        "--send-timeout",
        type=float_arg(0.001, 1e6),
        default=limits.DEFAULT.send_timeout,
        help="seconds a response may go unread by its client before the call is cut off "
        f"(default {limits.DEFAULT.send_timeout:g})",
    )
    sv.add_argument(
        "--min-send-rate-mb",
        type=float_arg(0.001, 1e6),
        default=limits.DEFAULT_MIN_RATE / limits.MiB,
        help="MiB/s a client must read its response at once --send-timeout has passed: a response of "
        "N MiB has --send-timeout + N / this seconds in all "
        f"(default {limits.DEFAULT_MIN_RATE / limits.MiB:g})",
    )
    sv.add_argument(
        "--max-connections",
        type=int_arg(1, 1 << 20),
        default=4096,
        help="most client connections at once: one more is accepted and closed at once (idle ones "
        "close after 300 s); the server raises its file-descriptor limit (RLIMIT_NOFILE) to fit them, "
        "warns when the hard limit leaves fewer (and caps there) and refuses to start below 64 "
        "(default 4096)",
    )
    sv.add_argument(
        "--health-port",
        type=int_arg(0, 65535),
        default=None,
        help="also serve the health service alone on this port of --host, with its own 32 connections "
        "(a reserve no planner-port client can take; 0 picks a free one; default: none)",
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
    b.add_argument(
        "--capacity", type=int_arg(1), default=DEFAULT_CAPACITY, help=f"T (default {DEFAULT_CAPACITY})"
    )
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


__all__ = ["DESCRIPTION", "build_parser"]
