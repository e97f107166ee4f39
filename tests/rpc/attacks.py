"""Hostile and careless clients of the sidecar (issue 25), for the attack tests
(``test_sidecar_attacks.py``) and ``benchmarks/service.py --attacks``.

* :class:`Probe`: a separate process that asks the server's health service and plans a 9-token
  PlanCalls in turn, each with a deadline, and reports how long each answer took (so the prober's
  own GIL and threads are not the server's or the attacker's).
* Attacks, each on its own connections (:mod:`h2_client`), each returning what it holds so that the
  caller can end it: :func:`stalled_streams` (streams that never send their request),
  :func:`partial_uploads` (requests that stop half way), :class:`Trickle` (uploads that announce a
  large request and send an empty chunk every 0.2 s), :func:`never_read` (valid requests whose
  responses are never read: no flow-control credit is returned; or read slowly).
* :func:`records` of a ``serve`` log (a process's memory: ``sidecar_fixtures.memory``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
from h2_client import H2Connection
from sidecar_fixtures import TREE, calls_request

from harts_planner.rpc import codec, wire
from harts_planner.rpc.client import request_chunks

TINY = calls_request(TREE)  # a valid 9-token PlanCalls

_PROBE = textwrap.dedent(
    """
    import json, sys, time, grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    address, seconds, tiny = sys.argv[1], float(sys.argv[2]), bytes.fromhex(sys.argv[3])
    channel = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(channel)
    calls = channel.unary_unary(
        "/harts.planner.v1.PlannerService/PlanCalls",
        request_serializer=lambda b: b, response_deserializer=lambda b: b,
    )
    grpc.channel_ready_future(channel).result(timeout=30)  # connected
    print("ready", flush=True)
    out = {"health": [], "tiny": []}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for kind, call in (
            ("health", lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5)),
            ("tiny", lambda: calls(tiny, timeout=5)),
        ):
            t0 = time.perf_counter()
            try:
                call()
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            out[kind].append((time.perf_counter() - t0, code))
        time.sleep(0.01)
    print(json.dumps(out), flush=True)
    """
)


class Probe:
    """``Probe(address, seconds)``: starts probing at once (after its first health check answers);
    :meth:`result` waits for the end and summarizes each kind: count, codes, p50 / p99 / max ms."""

    def __init__(self, address: str, seconds: float):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PROBE, address, str(seconds), TINY.hex()],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout.readline().strip() == "ready"

    def result(self, timeout: float = 120.0) -> dict:
        out, _ = self.proc.communicate(timeout=timeout)
        raw = json.loads(out)
        summary = {}
        for kind, rows in raw.items():
            ms = np.array([r[0] for r in rows]) * 1e3
            codes: dict[str, int] = {}
            for _, code in rows:
                codes[code] = codes.get(code, 0) + 1
            summary[kind] = {
                "count": len(rows),
                "codes": codes,
                "p50_ms": float(np.percentile(ms, 50)) if len(ms) else None,
                "p99_ms": float(np.percentile(ms, 99)) if len(ms) else None,
                "max_ms": float(ms.max()) if len(ms) else None,
            }
        return summary


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def stalled_streams(address: str, streams: int, per_connection: int = 90, path: str = codec.PLAN_CALLS):
    """``streams`` streams of ``path`` that send their headers and nothing else, on connections of
    ``per_connection`` streams. Returns the connections (close them to end the attack)."""
    conns = []
    host, port = _host_port(address)
    while streams > 0:
        conn = H2Connection(host, port)
        for _ in range(min(per_connection, streams)):
            conn.open(path)
        streams -= per_connection
        conns.append(conn)
    return conns


def partial_uploads(
    address: str, streams: int, claimed: int, sent: int, *, stream_method: bool = True, timeout: float = 30.0
):
    """``streams`` requests that each announce ``claimed`` bytes and send about ``sent`` of them, then
    stop. ``stream_method``: PlanCallsStream, whose first chunk announces the size
    (``total_bytes``), then 1 MiB chunks; else unary PlanCalls, whose gRPC message prefix claims it.
    Returns (connections, bytes each stream got out before the server stopped taking them)."""
    host, port = _host_port(address)
    conns, accepted = [], []
    piece = bytes(wire.CHUNK_BYTES)
    for _ in range(streams):
        conn = H2Connection(host, port)
        conns.append(conn)
        if stream_method:
            sid = conn.open(codec.PLAN_CALLS_STREAM)
            announce = wire.varint(2 << 3) + wire.varint(claimed)
            total = 0
            while total < sent:
                chunk = announce + wire.header(1, len(piece)) + piece
                announce = b""
                n = conn.send_message(sid, chunk, end_stream=False, timeout=timeout)
                if n < len(chunk) + 5:  # the server stopped taking bytes (or cut the stream off)
                    break
                total += len(piece)
        else:
            sid = conn.open(codec.PLAN_CALLS)
            total = max(
                conn.send_message(sid, bytes(sent), claimed=claimed, end_stream=False, timeout=timeout) - 5, 0
            )
        accepted.append(total)
    return conns, accepted


class Trickle:
    """``streams`` PlanCallsStream uploads, one connection each, whose first chunk announces
    ``claimed`` bytes and that then send an empty chunk every ``every`` seconds, forever (a thread
    keeps them going until :meth:`close`). ``alive()``: the streams the server has not ended."""

    def __init__(self, address: str, streams: int, claimed: int, every: float = 0.2):
        import threading

        host, port = _host_port(address)
        self.conns, self.sids = [], []
        self._stop = threading.Event()
        first = wire.varint(2 << 3) + wire.varint(claimed) + wire.header(1, 16) + bytes(16)
        for _ in range(streams):
            conn = H2Connection(host, port)
            sid = conn.open(codec.PLAN_CALLS_STREAM)
            conn.send_message(sid, first, end_stream=False, timeout=5)
            self.conns.append(conn)
            self.sids.append(sid)
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            for conn, sid in zip(self.conns, self.sids):
                s = conn.streams[sid]
                if not (conn.closed or s.reset or s.ended):
                    try:
                        conn.send_message(sid, b"", end_stream=False, timeout=0.1)
                    except OSError:
                        pass

    def alive(self) -> int:
        return sum(
            not (c.closed or c.streams[sid].reset or c.streams[sid].ended)
            for c, sid in zip(self.conns, self.sids)
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in self.conns:
            c.close()


def never_read(
    address: str,
    requests: list[bytes],
    path: str = codec.PLAN_CALLS_STREAM,
    window: int = 65535,
    read_rate: float | None = None,
):
    """Valid requests whose responses are never read: a connection each that advertises ``window``
    bytes of flow-control credit per stream and returns none (with ``read_rate``: reads them, no
    faster than that many bytes per second). Returns the (connection, stream id) pairs."""
    host, port = _host_port(address)
    out = []
    for request_ in requests:
        conn = H2Connection(host, port, read=read_rate is not None, window=window, read_rate=read_rate)
        sid = conn.open(path)
        if path.endswith("Stream"):
            for chunk in request_chunks(request_):
                conn.send_message(sid, chunk, end_stream=False)
            conn.send_data(sid, b"", end_stream=True)
        else:
            conn.send_message(sid, request_)
        out.append((conn, sid))
    return out


def idle_connections(address: str, n: int, timeout: float = 10.0) -> tuple[list, int]:
    """``n`` idle HTTP/2 connections to ``address`` (preface and SETTINGS, no call): the sockets,
    and how many could not connect at all."""
    import socket

    from h2_client import PREFACE, SETTINGS, frame

    host, port = _host_port(address)
    hello = PREFACE + frame(SETTINGS, 0, 0)
    socks, refused = [], 0
    for _ in range(n):
        try:
            s = socket.create_connection((host, port), timeout=timeout)
            s.sendall(hello)
            socks.append(s)
        except OSError:
            refused += 1
    return socks, refused


def closed_by_server(socks: list, wait: float = 2.0) -> int:
    """How many of ``socks`` the server has closed (EOF or reset) within ``wait`` seconds."""
    deadline = time.monotonic() + wait
    closed: set[int] = set()
    while time.monotonic() < deadline and len(closed) < len(socks):
        for i, s in enumerate(socks):
            if i in closed:
                continue
            s.settimeout(0.001)
            try:
                while True:
                    if s.recv(65536) == b"":
                        closed.add(i)
                        break
            except TimeoutError:
                pass
            except OSError:
                closed.add(i)
    return len(closed)


def open_fds(pid: int) -> int:
    """Descriptors process ``pid`` holds."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def records(log_path, event: str = "rpc") -> list[dict]:
    """The JSON records of a ``serve`` log with ``event``."""
    out = []
    with open(log_path) as f:
        for line in f:
            if line.startswith("{"):
                r = json.loads(line)
                if r.get("event") == event:
                    out.append(r)
    return out


def wait_for(predicate, timeout: float, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(step)
    return True


def bounded_env() -> dict:
    """The environment of a sidecar under a memory limit: glibc reserves 64 MB of address space per
    malloc arena."""
    return {**os.environ, "MALLOC_ARENA_MAX": "2"}


__all__ = [
    "Probe",
    "TINY",
    "Trickle",
    "bounded_env",
    "closed_by_server",
    "idle_connections",
    "never_read",
    "open_fds",
    "partial_uploads",
    "records",
    "stalled_streams",
    "wait_for",
]
