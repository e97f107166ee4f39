"""The sidecar under hostile and careless clients (issue 25): each attack of the issue against a fresh
``harts-planner serve`` on 127.0.0.1, with a prober in its own process asking the health service and
planning a 9-token PlanCalls every 10 ms meanwhile.

Targets: the server's resident memory stays under its configured budget whatever clients send or fail
to read; a health check and a tiny valid request are answered within 50 ms p99 under every attack;
deadlines and cancels stop the sending of a response; a drain delivers every response it logs OK (or
logs what it did not deliver); the cost estimate bounds the measured peak.

Sections (``--sections``; sizes are the issue's scaled down to a shared 2-core, 24 GB machine, see
each one's ``sizes``):

* ``stalled``: streams that send their headers and nothing else (the issue: 74 made every call,
  health included, answer "Concurrent RPC limit exceeded").
* ``queued``: legal requests whose segment trees the server indexes at admission, sent while both
  planner threads run slow plans (the issue: 16 requests of 32 MB held 10 GB uncounted).
* ``partial``: streams that announce 1 GiB and stop after 200 MiB (the issue: 8 x 400 MiB reached
  3.26 GB against a 2 GiB --max-inflight-mb, 3.1 GB still held after they closed).
* ``never_read``: valid 22-byte requests for large responses from clients that read none of them
  (the issue: six held 3.1 GB and were logged OK).
* ``encoding``: one 22-byte request for a large response, read by a normal client (the issue:
  health stalled for 27.7 s).
* ``deadline``: the same with a 1 s deadline: how long the server stays busy past it (the issue:
  4.7 s, a minute for a 1 GB response).
* ``drain``: SIGTERM while large responses are being read: what the clients got, what the log says
  (the issue: logged OK, the client got UNAVAILABLE, 6 of 6 runs).
* ``estimate``: a packed-tokens request: the server's estimate (request held + plan memory) against
  its measured peak (the issue: 5.32 GB estimated, 8.56 GB peak for 1.06 GB of tokens).
* ``field_bombs`` (issue 38): legal (a 9-token tree and ``chunk_size`` repeated) and zero-byte
  requests, 64 MiB streamed and 8 MiB unary, one client then four at once (the issue: 4.1 GB and
  6.4 GB peaks, ``std::bad_alloc``).
* ``trickled``: four streams announcing 493 MiB that send an empty chunk every 0.2 s (the issue:
  every planner call refused for 120 s).
* ``slow_readers``: four clients reading 30 MB responses at 20 KB/s (the issue: plan memory held
  indefinitely).
* ``shutdown_uploads``: SIGTERM (grace 300 s) with two trickling uploads (the issue: 300 s).
* ``connections``: 1,100 idle connections against a server started at 1,024 descriptors (the issue:
  new clients, health included, locked out).
* ``repeated_fields`` (issue 47): a streamed ``--repeat-mb`` (512) MiB PlanCalls whose
  ``trajectories.packed.tokens`` is sent 63 times (within the 64-field cap; the issue: it went to
  protobuf's parser, 2,450 MiB peak, health stalled ~10 s).
* ``connection_cap`` (issue 47): ``--connections`` idle connections against ``--max-connections
  --cap`` (100) and a ``--health-port`` (the issue: the flag capped nothing); how many the server
  closed, the descriptors it held, a health check on each port.
* ``drain_uploads`` (issue 47): SIGTERM while two gRPC clients upload; the status each client got
  (the issue: CANCELLED, while the log said UNAVAILABLE).

``--launcher SCRIPT`` runs another ``harts-planner`` (a script that imports an older checkout's
``harts_planner.cli``): the figures before the change come from the commit before it. Flags the older
server lacks are left out; it gets the unary methods (it has no ``*Stream`` ones). With
``--launcher-streams`` the older server is one that has the ``*Stream`` methods and the timeouts
(issue 35 on, e.g. the round-3 "before" at 0f58c33): it gets both, and only the flags of issue 38
are left out. A launcher may cap the old server's memory (``RLIMIT_AS``) so that an attack that
would exhaust the machine fails it instead; a server that died is reported (``server_exit``), its
peak the last one sampled.

    python benchmarks/service_attacks.py --out benchmarks/results/service_attacks.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "rpc"))

from attacks import (  # noqa: E402
    Probe,
    Trickle,
    closed_by_server,
    idle_connections,
    never_read,
    open_fds,
    partial_uploads,
    records,
    stalled_streams,
)
from h2_client import PREFACE, SETTINGS, frame  # noqa: E402
from sidecar_fixtures import TREE, Raw, calls_request, copies_tree, memory, one_segment  # noqa: E402

from harts_planner import PackedTokens, RolloutBatch, bench, estimate_cost, synth  # noqa: E402
from harts_planner.rpc import codec, limits  # noqa: E402
from harts_planner.rpc.server import SidecarProcess  # noqa: E402

MiB = 1 << 20


class Server:
    """A ``serve`` process: the new one, or ``--launcher``'s (``old``)."""

    def __init__(
        self,
        args,
        log_dir: str,
        name: str,
        flags=(),
        new_flags=(),
        workers: int = 2,
        grace: float = 30.0,
        preexec_fn=None,
    ):
        self.old = args.launcher is not None
        self.streams = not self.old or args.launcher_streams  # has the *Stream methods
        command = [sys.executable, args.launcher] if self.old else None
        self.log = os.path.join(log_dir, f"{name}.log")
        extra = list(flags) + (list(new_flags) if self.streams else [])
        self.proc = SidecarProcess(
            workers=workers,
            grace=grace,
            log_path=self.log,
            extra_args=extra,
            command=command,
            env=_env(),
            preexec_fn=preexec_fn,
        )
        self.address = self.proc.address
        self.health_address = self.proc.health_address
        self.idle = memory(self.proc.pid)
        self._hwm = self.idle["VmHWM"]  # sampled, so that a server that died still has a peak
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while self.proc.proc.poll() is None:
            try:
                self._hwm = max(self._hwm, memory(self.proc.pid)["VmHWM"])
            except (OSError, KeyError):
                return
            time.sleep(0.05)

    def stream(self, method: str) -> str:
        """The method to plan big responses with: the streamed one (unary on an old server without)."""
        return method + "_STREAM" if self.streams else method

    def exit_code(self) -> int | None:
        """None while the server runs; else how it ended (negative: the signal that killed it)."""
        return self.proc.proc.poll()

    def peak_mb(self) -> float:
        if self.exit_code() is None:
            self._hwm = max(self._hwm, memory(self.proc.pid)["VmHWM"])
        return round(self._hwm / MiB, 1)

    def rss_mb(self) -> float:
        return round(memory(self.proc.pid)["VmRSS"] / MiB, 1)

    def close(self) -> int:
        try:
            return self.proc.terminate(120)
        except Exception:
            self.proc.proc.kill()
            return -9


def _env() -> dict:
    return {**os.environ, "MALLOC_ARENA_MAX": "2"}


def _codes(log: str) -> dict:
    out: dict[str, int] = {}
    for r in records(log):
        out[r["code"]] = out.get(r["code"], 0) + 1
    return out


def _slow_step(swe, copies: int = 300, scale: int = 40) -> bytes:
    """A valid PlanStep that plans for seconds (many swe-like trees, lengths / scale)."""
    return codec.serialize_plan_step_request(
        copies_tree(swe, copies, scale), 1, 65536 // scale, 64, {}, False, 4
    )


# ---------------------------------------------------------------------------------- attacks
def stalled(args, log_dir, swe) -> dict:
    srv = Server(args, log_dir, "stalled")
    try:
        conns = stalled_streams(srv.address, args.stalled)
        conns += stalled_streams(srv.address, 20, path="/grpc.health.v1.Health/Check")
        time.sleep(0.5)
        probe = Probe(srv.address, args.probe_seconds).result()
        for c in conns:
            c.close()
        return {
            "sizes": {"stalled_planner_streams": args.stalled, "stalled_health_streams": 20},
            "probe": probe,
        }
    finally:
        srv.close()


def _in_threads(n: int, fn) -> tuple[list, list]:
    """Start ``n`` threads running ``fn()``; returns (threads, results list filled as they end)."""
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(fn())) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, results


def queued(args, log_dir, swe) -> dict:
    budget = limits.DEFAULT.max_inflight_bytes // MiB
    srv = Server(args, log_dir, "queued")
    try:
        slow = _slow_step(swe, copies=300)
        tree = copies_tree(swe, args.queued_copies, 40)
        request_ = codec.serialize_plan_step_request(tree, 1, 65536 // 40, 64, {}, False, 4)
        with Raw(srv.address) as raw:
            holds, _ = _in_threads(2, lambda: raw.code(srv.stream("PLAN_STEP"), slow, timeout=300)[0].name)
            time.sleep(2.0)
            waiting, codes = _in_threads(
                args.queued, lambda: raw.code(srv.stream("PLAN_STEP"), request_, timeout=300)[0].name
            )
            time.sleep(1.0)
            probe = Probe(srv.address, args.probe_seconds).result()
            peak = srv.peak_mb()
            for t in holds + waiting:
                t.join(600)
        return {
            "sizes": {
                "queued_requests": args.queued,
                "request_mb": round(len(request_) / MiB, 1),
                "tree_segments": tree.num_segments,
                "batch_mb_each": round(estimate_cost(tree, request="step").ingest_bytes / MiB, 1),
                "max_inflight_mb": budget,
            },
            "idle_mb": round(srv.idle["VmRSS"] / MiB, 1),
            "peak_mb": peak,
            "client_codes": {c: codes.count(c) for c in set(codes)},
            "probe": probe,
        }
    finally:
        srv.close()


def partial(args, log_dir, swe) -> dict:
    budget = limits.DEFAULT.max_inflight_bytes // MiB
    srv = Server(args, log_dir, "partial")
    try:
        out = {}
        holder = {}
        attack = threading.Thread(
            target=lambda: holder.setdefault(
                "r",
                partial_uploads(
                    srv.address,
                    args.partial,
                    1 << 30,
                    args.partial_mb * MiB,
                    stream_method=srv.streams,
                    timeout=5,
                ),
            )
        )
        attack.start()
        probe = Probe(srv.address, args.probe_seconds)
        attack.join()
        conns, accepted = holder["r"]
        out["during_mb"] = srv.rss_mb()
        out["probe"] = probe.result()
        out["peak_mb"] = srv.peak_mb()
        for c in conns:
            c.close()
        time.sleep(2.0)
        out["after_close_mb"] = srv.rss_mb()
        out["accepted_mb"] = [round(a / MiB, 1) for a in accepted]
        out["sizes"] = {
            "streams": args.partial,
            "claimed_mb": 1024,
            "sent_mb": args.partial_mb,
            "max_inflight_mb": budget,
        }
        out["idle_mb"] = round(srv.idle["VmRSS"] / MiB, 1)
        return out
    finally:
        srv.close()


def _big_calls(segment_tokens: int) -> bytes:
    return calls_request(one_segment(segment_tokens))


def never_read_attack(args, log_dir, swe) -> dict:
    srv = Server(args, log_dir, "never_read", new_flags=["--send-timeout", str(args.send_timeout)])
    try:
        request_ = _big_calls(args.big_tokens)
        path = codec.PLAN_CALLS_STREAM if srv.streams else codec.PLAN_CALLS
        held = never_read(srv.address, [request_] * args.never_read, path=path)
        probe = Probe(srv.address, args.probe_seconds)
        time.sleep(1.0)
        during = srv.rss_mb()
        result = probe.result()
        peak = srv.peak_mb()
        wait = args.send_timeout + 5 - args.probe_seconds
        time.sleep(max(wait, 1.0))
        after = srv.rss_mb()
        codes = _codes(srv.log)
        for conn, _ in held:
            conn.close()
        return {
            "sizes": {
                "clients": args.never_read,
                "request_bytes": len(request_),
                "response_mb": round(_response_mb(args.big_tokens), 1),
                "send_timeout_s": args.send_timeout if srv.streams else None,
            },
            "idle_mb": round(srv.idle["VmRSS"] / MiB, 1),
            "during_mb": during,
            "peak_mb": peak,
            "after_send_timeout_mb": after,
            "logged_codes": codes,
            "logged_delivered": sum(bool(r.get("delivered")) for r in records(srv.log)),
            "probe": result,
        }
    finally:
        srv.close()


def _response_mb(tokens: int) -> float:
    return estimate_cost(one_segment(tokens)).response_bytes / MiB


def encoding(args, log_dir, swe) -> dict:
    srv = Server(args, log_dir, "encoding")
    try:
        request_ = _big_calls(args.big_tokens)
        with Raw(srv.address) as raw:
            probe = Probe(srv.address, args.probe_seconds)
            t0 = time.perf_counter()
            times = []
            while time.perf_counter() - t0 < args.probe_seconds - 1:
                t1 = time.perf_counter()
                data = raw.call(srv.stream("PLAN_CALLS"), request_, timeout=120)
                times.append(time.perf_counter() - t1)
                size = len(data)
                del data
            result = probe.result()
        return {
            "sizes": {
                "request_bytes": len(request_),
                "response_mb": round(size / MiB, 1),
                "method": srv.stream("PlanCalls"),
            },
            "responses": len(times),
            "response_seconds": [round(t, 2) for t in times],
            "probe": result,
            "peak_mb": srv.peak_mb(),
        }
    finally:
        srv.close()


def deadline(args, log_dir, swe) -> dict:
    srv = Server(args, log_dir, "deadline")
    try:
        request_ = _big_calls(2 * args.big_tokens)
        out = []
        with Raw(srv.address) as raw:
            for d in (0.3, 0.6):
                n = len(records(srv.log))
                t0 = time.monotonic()
                code, _ = raw.code(srv.stream("PLAN_CALLS"), request_, timeout=d)
                while len(records(srv.log)) == n and time.monotonic() < t0 + 300:  # logged when it ends
                    time.sleep(0.005)
                busy = time.monotonic() - t0 - d
                out.append(
                    {"deadline_s": d, "code": code.name, "server_busy_past_deadline_s": round(busy, 3)}
                )
        return {
            "sizes": {
                "request_bytes": len(request_),
                "response_mb": round(_response_mb(2 * args.big_tokens), 1),
            },
            "runs": out,
            "logged": [{k: r.get(k) for k in ("code", "error", "total_ms")} for r in records(srv.log)],
        }
    finally:
        srv.close()


def drain(args, log_dir, swe) -> dict:
    """SIGTERM while clients read large responses at ``--drain-rate`` MB/s: did each client get its
    whole response, and what did the log say?"""
    runs = []
    request_ = _big_calls(args.big_tokens)
    size = estimate_cost(one_segment(args.big_tokens)).response_bytes
    for grace in (60.0, 0.5):
        srv = Server(args, log_dir, f"drain_{grace}", grace=grace)
        path = codec.PLAN_CALLS_STREAM if srv.streams else codec.PLAN_CALLS
        held = never_read(
            srv.address, [request_] * args.drain_clients, path=path, read_rate=args.drain_rate * MiB
        )
        time.sleep(args.drain_after)
        srv.proc.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.proc.wait(300)
        for conn, sid in held:
            conn.wait(lambda c, sid=sid: c.finished(sid), 120)
        got = [conn.streams[sid].received for conn, sid in held]
        whole = [n >= 0.999 * size for n in got]  # its bytes, give or take the chunks' framing
        for conn, _ in held:
            conn.close()
        logged = [{"code": r["code"], "delivered": r.get("delivered")} for r in records(srv.log)]
        runs.append(
            {
                "grace_s": grace,
                "exit_code": rc,
                "clients_got_whole_response": whole,
                "client_mb": [round(n / MiB, 1) for n in got],
                "logged": logged,
                "logged_ok_but_not_delivered": max(0, sum(r["code"] == "OK" for r in logged) - sum(whole)),
            }
        )
    return {
        "sizes": {
            "clients": args.drain_clients,
            "response_mb": round(size / MiB, 1),
            "read_rate_mb_s": args.drain_rate,
            "sigterm_after_s": args.drain_after,
        },
        "runs": runs,
    }


def _wait_log(log: str, needle: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with open(log) as f:
            if needle in f.read():
                return
        time.sleep(0.05)


def estimate(args, log_dir, swe) -> dict:
    runs = []
    syn = synth.generate("swe-like", seed=0)
    batch = RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids)
    k = args.estimate_copies
    n = len(batch.offsets) - 1
    offsets = np.concatenate(
        [batch.offsets[:-1] + i * len(batch.tokens) for i in range(k)] + [[k * len(batch.tokens)]]
    )
    tokens = PackedTokens(
        np.tile(batch.tokens, k), offsets, np.concatenate([batch.tree_ids + i * n for i in range(k)])
    )
    for _ in (1,):
        request_ = codec.serialize_plan_step_request(tokens, 2, 65536, 64, {}, False, 4)
        for concurrent in (1, 2) if k == 1 else (1,):
            srv = Server(args, log_dir, f"estimate_{concurrent}", new_flags=["--max-message-mb", "8"])
            try:
                idle = memory(srv.proc.pid)["VmHWM"]
                with Raw(srv.address) as raw:
                    method = srv.stream("PLAN_STEP")
                    threads = [
                        threading.Thread(target=raw.call, args=(method, request_, 600))
                        for _ in range(concurrent)
                    ]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                peak = memory(srv.proc.pid)["VmHWM"] - idle
                rec = records(srv.log)
                est = sum(
                    r.get("estimate", {}).get("memory_bytes", 0) + r.get("request_held_bytes", 0) for r in rec
                )
                if srv.old:  # the old server's estimate: the plan's, from its log
                    est = sum(r.get("estimate", {}).get("memory_bytes", 0) for r in rec)
                runs.append(
                    {
                        "request_mb": round(len(request_) / MiB, 1),
                        "concurrent": concurrent,
                        "estimate_mb": round(est / MiB, 1),
                        "peak_above_idle_mb": round(peak / MiB, 1),
                        "bound_holds": peak <= est,
                    }
                )
            finally:
                srv.close()
    return {"runs": runs}


def _bomb(size: int, number: int = 3) -> bytes:
    """A legal request: a 9-token tree and varint field ``number`` (chunk_size) repeated to ``size``."""
    base = calls_request(TREE)
    one = codec.varint(number << 3) + codec.varint(64)
    return base + one * ((size - len(base)) // len(one))


def field_bombs(args, log_dir, swe) -> dict:
    """Legal and zero-byte bombs, unary and streamed, one client then ``--bomb-clients`` at once."""
    srv = Server(args, log_dir, "field_bombs")
    try:
        cases = {
            "legal_stream": (srv.stream("PLAN_CALLS"), _bomb(args.bomb_mb * MiB)),
            "zeros_stream": (srv.stream("PLAN_CALLS"), bytes(args.bomb_mb * MiB)),
            "legal_unary": ("PLAN_CALLS", _bomb(8 * MiB - 64, 4)),
            "zeros_unary": ("PLAN_CALLS", bytes(8 * MiB - 64)),
        }
        out: dict = {"sizes": {"stream_mb": args.bomb_mb, "unary_mb": 8, "clients": args.bomb_clients}}
        with Raw(srv.address) as raw:
            probe = Probe(srv.address, args.probe_seconds)
            for name, (method, data) in cases.items():
                t0 = time.perf_counter()
                code, details = raw.code(method, data, timeout=120)
                out[name] = {
                    "code": code.name,
                    "details": details[:100],
                    "s": round(time.perf_counter() - t0, 2),
                }
            method, data = cases["legal_stream"]
            threads, codes = _in_threads(
                args.bomb_clients, lambda: raw.code(method, data, timeout=120)[0].name
            )
            for t in threads:
                t.join(300)
            out["many_clients_codes"] = {c: codes.count(c) for c in set(codes)}
            out["probe"] = probe.result()
        out["idle_mb"] = round(srv.idle["VmRSS"] / MiB, 1)
        out["peak_mb"] = srv.peak_mb()
        out["server_exit"] = srv.exit_code()
        return out
    finally:
        srv.close()


def trickled(args, log_dir, swe) -> dict:
    """Four streams announcing 493 MiB that send an empty chunk every 0.2 s (the issue: every planner
    call refused for 120 s)."""
    srv = Server(args, log_dir, "trickled")
    try:
        t0 = time.monotonic()
        trickle = Trickle(srv.address, 4, 493 * MiB)
        probe = Probe(srv.address, args.probe_seconds).result()
        alive_after_probe = trickle.alive()
        while trickle.alive() and time.monotonic() - t0 < 150:
            time.sleep(0.1)
        lived = round(time.monotonic() - t0, 1)
        trickle.close()
        return {
            "sizes": {"streams": 4, "claimed_mb": 493, "every_s": 0.2},
            "probe": probe,
            "alive_after_probe": alive_after_probe,
            "tricklers_gone_after_s": lived,
            "peak_mb": srv.peak_mb(),
            "server_exit": srv.exit_code(),
            "logged_codes": _codes(srv.log),
        }
    finally:
        srv.close()


def slow_readers(args, log_dir, swe) -> dict:
    """Clients reading a large response at ``--slow-rate`` KB/s (the issue: 17-25 KB/s held plan
    memory indefinitely)."""
    srv = Server(args, log_dir, "slow_readers", new_flags=["--send-timeout", str(args.send_timeout)])
    try:
        request_ = _big_calls(1_000_000)
        path = codec.PLAN_CALLS_STREAM if srv.streams else codec.PLAN_CALLS
        t0 = time.monotonic()
        held = never_read(srv.address, [request_] * 4, path=path, read_rate=args.slow_rate * 1024)
        probe = Probe(srv.address, args.probe_seconds).result()
        for conn, sid in held:
            conn.wait(lambda c, sid=sid: c.finished(sid), max(1.0, 90 - (time.monotonic() - t0)))
        done = [conn.finished(sid) for conn, sid in held]
        lived = round(time.monotonic() - t0, 1)
        for conn, _ in held:
            conn.close()
        return {
            "sizes": {
                "clients": 4,
                "read_kb_s": args.slow_rate,
                "response_mb": round(_response_mb(1_000_000), 1),
            },
            "probe": probe,
            "ended": done,
            "ended_within_s": lived,
            "peak_mb": srv.peak_mb(),
            "server_exit": srv.exit_code(),
            "logged": [{k: r.get(k) for k in ("code", "delivered", "error")} for r in records(srv.log)],
        }
    finally:
        srv.close()


def shutdown_uploads(args, log_dir, swe) -> dict:
    """SIGTERM (grace 300 s) with two trickling uploads (the issue: the drain waited the whole 300 s)."""
    srv = Server(args, log_dir, "shutdown_uploads", grace=300.0, new_flags=["--receive-timeout", "60"])
    trickle = Trickle(srv.address, 2, 200 * MiB)
    try:
        time.sleep(1.0)
        t0 = time.monotonic()
        srv.proc.proc.send_signal(signal.SIGTERM)
        try:
            rc = srv.proc.proc.wait(args.shutdown_wait)
        except Exception:
            rc = None
        return {
            "sizes": {"uploads": 2, "grace_s": 300},
            "exit_code": rc,
            "exit_after_s": round(time.monotonic() - t0, 2) if rc is not None else f">{args.shutdown_wait}",
            "peak_mb": srv.peak_mb(),
            "logged_codes": _codes(srv.log),
        }
    finally:
        trickle.close()
        srv.close()


def _nofile(soft: int):
    def limit() -> None:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return limit


def connections(args, log_dir, swe) -> dict:
    """``--connections`` idle HTTP/2 connections against a server started at a soft limit of 1,024
    descriptors (the issue: new clients, health included, locked out)."""
    import resource
    import socket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.connections + 512), hard))
    srv = Server(args, log_dir, "connections", preexec_fn=_nofile(1024))
    socks = []
    try:
        host, _, port = srv.address.rpartition(":")
        hello = PREFACE + frame(SETTINGS, 0, 0)
        refused = 0
        for _ in range(args.connections):
            try:
                s = socket.create_connection((host, int(port)), timeout=5)
                s.sendall(hello)
                socks.append(s)
            except OSError:
                refused += 1
        time.sleep(1.0)
        try:
            probe = Probe(srv.address, args.probe_seconds).result()
        except Exception as e:  # the prober could not connect
            probe = {"error": f"{type(e).__name__}: {e}"}
        return {
            "sizes": {"connections": args.connections, "server_soft_nofile": 1024},
            "refused": refused,
            "probe": probe,
            "peak_mb": srv.peak_mb(),
            "server_exit": srv.exit_code(),
        }
    finally:
        for s in socks:
            s.close()
        srv.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _field(number: int, data: bytes) -> bytes:
    return codec.header(number, len(data)) + data


def _repeated_tokens(size: int, copies: int = 63) -> bytes:
    """A PlanCalls of packed tokens whose tokens field is sent ``copies`` times, ``size`` bytes in all."""
    one = bytes(size // copies // 4 * 4)
    offsets = np.array([0, len(one) // 4], dtype="<i8").tobytes()
    packed = b"".join(_field(1, one) for _ in range(copies)) + _field(2, offsets)
    return _field(1, _field(1, packed)) + codec.varint(3 << 3) + codec.varint(64)


def repeated_fields(args, log_dir, swe) -> dict:
    """A ``--repeat-mb`` MiB streamed request of one array repeated (within the 64-field cap)."""
    srv = Server(args, log_dir, "repeated_fields")
    try:
        data = _repeated_tokens(args.repeat_mb * MiB)
        out: dict = {
            "sizes": {"request_mb": round(len(data) / MiB, 1), "copies": 63},
            "max_inflight_mb": limits.DEFAULT.max_inflight_bytes // MiB,
        }
        with Raw(srv.address) as raw:
            probe = Probe(srv.address, args.probe_seconds)
            t0 = time.perf_counter()
            code, details = raw.code(srv.stream("PLAN_CALLS"), data, timeout=120)
            out["code"], out["details"], out["s"] = (
                code.name,
                details[:160],
                round(time.perf_counter() - t0, 2),
            )
            out["probe"] = probe.result()
        del data
        out["idle_mb"] = round(srv.idle["VmRSS"] / MiB, 1)
        out["peak_mb"] = srv.peak_mb()
        out["server_exit"] = srv.exit_code()
        return out
    finally:
        srv.close()


def _health(address: str, n: int) -> dict:
    """``n`` health checks, each on a new channel (a new connection, as a prober makes): codes and ms."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    codes: dict[str, int] = {}
    ms = []
    for _ in range(n):
        t0 = time.perf_counter()
        with grpc.insecure_channel(address) as channel:
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
        ms.append((time.perf_counter() - t0) * 1e3)
        codes[code] = codes.get(code, 0) + 1
    return {
        "count": n,
        "codes": codes,
        "p50_ms": round(float(np.percentile(ms, 50)), 1),
        "max_ms": round(max(ms), 1),
    }


def connection_cap(args, log_dir, swe) -> dict:
    """``--connections`` idle connections against ``--max-connections --cap`` and a health port
    (an old server gets the cap flag only), at a soft limit of 1,024 descriptors."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.connections + 512), hard))
    flags = ["--max-connections", str(args.cap)] + ([] if args.launcher else ["--health-port", "0"])
    srv = Server(args, log_dir, "connection_cap", flags=flags, preexec_fn=_nofile(1024))
    socks: list = []
    try:
        base = open_fds(srv.proc.pid)
        socks, refused = idle_connections(srv.address, args.connections, timeout=5)
        closed = closed_by_server(socks, wait=3.0)
        out = {
            "sizes": {
                "connections": args.connections,
                "max_connections": args.cap,
                "server_soft_nofile": 1024,
            },
            "refused_at_connect": refused,
            "closed_by_server": closed,
            "server_fds_above_idle": open_fds(srv.proc.pid) - base,
            "health_planner_port": _health(srv.address, 5),
            "health_port": _health(srv.health_address, 50) if srv.health_address else None,
        }
        for s in socks:
            s.close()
        socks = []
        time.sleep(1.0)
        out["health_planner_port_after_close"] = _health(srv.address, 5)
        out["peak_mb"] = srv.peak_mb()
        out["server_exit"] = srv.exit_code()
        return out
    finally:
        for s in socks:
            s.close()
        srv.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def drain_uploads(args, log_dir, swe) -> dict:
    """SIGTERM while two gRPC clients are uploading (a first chunk, then nothing): what each client
    got, what the log says."""
    import grpc

    srv = Server(args, log_dir, "drain_uploads", grace=300.0)
    stop = threading.Event()
    first = codec.varint(2 << 3) + codec.varint(64 * MiB) + codec.header(1, 16) + bytes(16)
    got: list = []

    def upload() -> None:
        def chunks():
            yield first
            stop.wait(60)

        with grpc.insecure_channel(srv.address) as channel:
            call = channel.stream_stream(
                codec.PLAN_CALLS_STREAM, request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            try:
                list(call(chunks(), timeout=60))
                got.append({"code": "OK"})
            except grpc.RpcError as e:
                got.append({"code": e.code().name, "details": (e.details() or "")[:120]})

    threads = [threading.Thread(target=upload) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.5)
        t0 = time.monotonic()
        srv.proc.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        try:
            rc = srv.proc.proc.wait(args.shutdown_wait)
        except Exception:
            rc = None
        return {
            "sizes": {"uploads": 2, "grace_s": 300},
            "clients": got,
            "logged": [{k: r.get(k) for k in ("code", "error")} for r in records(srv.log)],
            "exit_code": rc,
            "exit_after_s": round(time.monotonic() - t0, 2),
        }
    finally:
        stop.set()
        srv.close()


SECTIONS = {
    "stalled": stalled,
    "queued": queued,
    "partial": partial,
    "never_read": never_read_attack,
    "encoding": encoding,
    "deadline": deadline,
    "drain": drain,
    "estimate": estimate,
    "field_bombs": field_bombs,
    "trickled": trickled,
    "slow_readers": slow_readers,
    "shutdown_uploads": shutdown_uploads,
    "connections": connections,
    "repeated_fields": repeated_fields,
    "connection_cap": connection_cap,
    "drain_uploads": drain_uploads,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "service_attacks.json")
    )
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--launcher", default=None, help="a script running an older harts-planner CLI")
    p.add_argument(
        "--launcher-streams",
        action="store_true",
        help="the --launcher server has the *Stream methods and the timeouts (issue 35 on)",
    )
    p.add_argument("--probe-seconds", type=float, default=8.0)
    p.add_argument("--stalled", type=int, default=180, help="stalled planner streams")
    p.add_argument("--queued", type=int, default=16)
    p.add_argument(
        "--queued-copies",
        type=int,
        default=100,
        help="swe-like trees (lengths / 40) per queued request (3.6 MB)",
    )
    p.add_argument("--partial", type=int, default=8)
    p.add_argument("--partial-mb", type=int, default=200)
    p.add_argument("--never-read", type=int, default=6)
    p.add_argument(
        "--big-tokens", type=int, default=5_000_000, help="one-segment PlanCalls: a 153 MB response"
    )
    p.add_argument("--send-timeout", type=float, default=10.0)
    p.add_argument("--drain-clients", type=int, default=3)
    p.add_argument(
        "--estimate-copies", type=int, default=1, help="swe-like token batches in the estimate request"
    )
    p.add_argument("--drain-after", type=float, default=3.0)
    p.add_argument("--drain-rate", type=float, default=40.0, help="MB/s the drain's clients read at")
    p.add_argument("--bomb-mb", type=int, default=64, help="streamed field bombs' size (MiB)")
    p.add_argument("--bomb-clients", type=int, default=4, help="clients sending a streamed bomb at once")
    p.add_argument("--slow-rate", type=float, default=20.0, help="KB/s the slow readers read at")
    p.add_argument("--shutdown-wait", type=float, default=60.0, help="seconds to wait for the exit")
    p.add_argument("--connections", type=int, default=1100, help="idle connections")
    p.add_argument("--cap", type=int, default=100, help="connection_cap's --max-connections")
    p.add_argument("--repeat-mb", type=int, default=512, help="repeated_fields' request size (MiB)")
    args = p.parse_args(argv)
    syn = synth.generate("swe-like", seed=0)
    swe = RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids).segment_tree()
    report = {
        "benchmark": "service_attacks",
        "date": time.strftime("%Y-%m-%d"),
        "server": "before (--launcher)" if args.launcher else "this checkout",
        "machine": bench.machine(),
        "load_average": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in [s for s in args.sections.split(",") if s]:
            t = time.perf_counter()
            try:
                report[name] = SECTIONS[name](args, tmp, swe)
            except Exception as e:  # an attack that breaks the server is a result too
                report[name] = {"error": f"{type(e).__name__}: {e}"}
            print(
                f"{name} ({time.perf_counter() - t:.1f} s): {json.dumps(report[name])[:2000]}",
                file=sys.stderr,
                flush=True,
            )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
