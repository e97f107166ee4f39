"""Total receive and send deadlines, and a drain during uploads (issue 38, items 2-4), against a real
``harts-planner serve`` on 127.0.0.1.

* A stream that announces a large request and trickles empty chunks (the issue: four of them locked
  every planner call out for 120 s) is evicted when a live call needs its room, and cut off once its
  request arrives slower than ``--min-receive-rate-mb`` after ``--receive-timeout``.
* A client that reads its response slower than ``--min-send-rate-mb`` after ``--send-timeout`` is
  cut off (the issue: readers at 17-25 KB/s held plan memory indefinitely).
* SIGTERM cuts uploads at once (the issue: two trickling uploads held the drain for its whole 300 s).
"""

from __future__ import annotations

import os
import resource
import signal
import time

import grpc
from attacks import TINY, Trickle, never_read, records, wait_for
from sidecar_fixtures import Raw, calls_request, one_segment

from harts_planner.rpc import limits
from harts_planner.rpc.server import SidecarProcess

MiB = 1 << 20


def _serve(tmp_path, *flags, grace: float = 30.0, name: str = "serve") -> SidecarProcess:
    def limit_address_space() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    return SidecarProcess(
        workers=2,
        grace=grace,
        extra_args=list(flags),
        preexec_fn=limit_address_space,
        env={**os.environ, "MALLOC_ARENA_MAX": "2"},
        log_path=str(tmp_path / f"{name}.log"),
    )


def test_transfer_deadline_is_timeout_plus_bytes_over_rate():
    bounds = limits.Limits(receive_timeout=2.0, send_timeout=5.0, min_receive_rate=MiB, min_send_rate=2 * MiB)
    assert bounds.transfer_deadline(10 * MiB, "receive") == 12.0
    assert bounds.transfer_deadline(10 * MiB, "send") == 10.0
    assert limits.Limits(min_receive_rate=None).transfer_deadline(MiB, "receive") is None


def test_trickled_streams_lock_nobody_out_and_are_cut_off(tmp_path):
    """Four streams announcing 493 MiB that send an empty chunk every 0.2 s: tiny planner calls are
    answered meanwhile (the tricklers, below the minimum rate, are evicted to make room), and every
    trickler is gone within its total receive deadline (--receive-timeout 1 at 1 MiB/s: 1 s + its
    first bytes' worth)."""
    log = tmp_path / "serve.log"
    with _serve(tmp_path, "--receive-timeout", "1") as sidecar, Raw(sidecar.address) as raw:
        trickle = Trickle(sidecar.address, 4, 493 * MiB)
        try:
            time.sleep(0.5)
            codes = [raw.code("PLAN_CALLS", TINY, timeout=5)[0] for _ in range(10)]
            assert codes == [grpc.StatusCode.OK] * 10
            assert wait_for(lambda: trickle.alive() == 0, 10), trickle.alive()
        finally:
            trickle.close()
    cut = [r for r in records(log) if r["method"] == "PlanCallsStream"]
    assert len(cut) == 4 and all(r["code"] == "CANCELLED" and r["field"] == "request" for r in cut)
    assert not any(r.get("delivered") for r in cut)
    assert all(r["receive_deadline_s"] > 490 for r in cut)  # 1 s + 493 MiB at 1 MiB/s: logged
    assert all(("minimum rate" in r["error"]) or ("needed the call's slot" in r["error"]) for r in cut)
    assert all(r["total_ms"] < 5000 for r in cut)


def test_a_trickle_alone_is_cut_at_its_minimum_rate(tmp_path):
    """Nobody needs the room: the trickler is cut off by the rate rule, its error naming the flag."""
    log = tmp_path / "serve.log"
    with _serve(tmp_path, "--receive-timeout", "1", "--min-receive-rate-mb", "4") as sidecar:
        trickle = Trickle(sidecar.address, 1, 100 * MiB)
        try:
            assert wait_for(lambda: trickle.alive() == 0, 10)
        finally:
            trickle.close()
    (r,) = records(log)
    assert r["code"] == "CANCELLED" and r["field"] == "request"
    assert "below the server's minimum rate (--min-receive-rate-mb, after --receive-timeout)" in r["error"]
    assert 900 < r["total_ms"] < 4000


def test_a_slow_reader_is_cut_at_the_minimum_send_rate(tmp_path):
    """A client reading a 30 MB response at 512 KB/s, a 1 MiB chunk every 2 s (the issue: readers at
    17-25 KB/s held plan memory indefinitely, the send timeout being per chunk): with --send-timeout 3
    it is never stalled that long, and it is cut off once below 2 MiB/s (about 4 s), not delivered."""
    log = tmp_path / "serve.log"
    with _serve(tmp_path, "--send-timeout", "3", "--min-send-rate-mb", "2") as sidecar:
        request_ = calls_request(one_segment(1_000_000))
        ((conn, sid),) = never_read(sidecar.address, [request_], read_rate=512 << 10)
        try:
            assert conn.wait(lambda c: c.finished(sid), 30)
        finally:
            conn.close()
    (r,) = records(log)
    assert r["code"] == "CANCELLED" and r["field"] == "response" and r["delivered"] is False
    assert "below the server's minimum rate (--min-send-rate-mb, after --send-timeout)" in r["error"]
    assert r["send_deadline_s"] > 3.0 and 3_000 < r["total_ms"] < 10_000


def test_sigterm_cuts_uploads_at_once(tmp_path):
    """Two trickling uploads under a 300 s grace: SIGTERM ends them at once (logged UNAVAILABLE,
    "before the request arrived") and the server exits in seconds."""
    log = tmp_path / "serve.log"
    sidecar = _serve(tmp_path, "--receive-timeout", "60", grace=300.0)
    trickle = Trickle(sidecar.address, 2, 200 * MiB)
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        sidecar.proc.send_signal(signal.SIGTERM)
        assert sidecar.proc.wait(30) == 0
        assert time.monotonic() - t0 < 10
    finally:
        trickle.close()
        if sidecar.proc.poll() is None:
            sidecar.proc.kill()
    cut = records(log)
    assert len(cut) == 2 and all(r["code"] == "UNAVAILABLE" for r in cut)
    assert all("before the request arrived" in r["error"] for r in cut)
    (drain,) = records(log, "drain")
    assert drain["uploads_cut"] == 2


def test_a_cancel_after_the_last_chunk_is_not_logged_delivered(tmp_path):
    """Clients that reset their stream once they hold 80-99% of a 3-chunk response (the issue: 7
    of 36 that cancelled after 25-30 of 31 chunks were logged ``OK delivered: true``): no record
    says OK unless its client got the whole response."""
    from harts_planner import estimate_cost

    log = tmp_path / "serve.log"
    tokens = 80_000
    size = estimate_cost(one_segment(tokens)).response_bytes
    got = []
    with _serve(tmp_path) as sidecar:
        for share in (0.8, 0.9, 0.95, 0.99):
            ((conn, sid),) = never_read(
                sidecar.address, [calls_request(one_segment(tokens))], read_rate=8 * MiB
            )
            try:
                assert conn.wait(
                    lambda c, s=sid, x=share: c.streams[s].received >= x * size or c.finished(s), 30
                )
                if not conn.finished(sid):
                    conn.reset(sid)
                time.sleep(0.2)
                got.append(conn.streams[sid].received >= 0.999 * size and not conn.streams[sid].reset)
            finally:
                conn.close()
        assert wait_for(lambda: len(records(log)) >= 4, 10)
    logged = records(log)
    assert len(logged) == 4
    ok = [r for r in logged if r["code"] == "OK"]
    assert all(r["delivered"] is True for r in ok) and len(ok) <= sum(got), (logged, got)


def test_a_unary_call_cancelled_before_its_reply_is_not_logged_delivered(records):
    """PlanCalls (unary) with a 2.5 MB reply: the handler hands it to gRPC, whose buffers take it
    while the client reads none of it (or part); the client then resets the call. The record is
    written once gRPC ended the call: CANCELLED, ``delivered: false``, naming both causes grpcio
    cannot tell apart, never ``OK delivered: true`` (it was, when unary calls were logged as their
    handler returned)."""
    from harts_planner import estimate_cost
    from harts_planner.rpc import codec
    from harts_planner.rpc.server import create_server

    tokens = 80_000
    size = estimate_cost(one_segment(tokens)).response_bytes
    server = create_server("127.0.0.1:0", workers=1, limits=limits.Limits(send_timeout=30.0))
    with server as srv:
        for n, read_rate in enumerate((None, 4 * MiB), 1):  # reads nothing / reads 80%, then resets
            ((conn, sid),) = never_read(
                srv.address, [calls_request(one_segment(tokens))], path=codec.PLAN_CALLS, read_rate=read_rate
            )
            try:
                assert wait_for(lambda: srv.servicer.counts()["sending"] == 1, 10)
                if read_rate is None:
                    time.sleep(0.3)  # the handler waits on gRPC; the client reads nothing
                else:
                    assert conn.wait(
                        lambda c, s=sid: c.streams[s].received >= 0.8 * size or c.finished(s), 10
                    )
                got_all = conn.streams[sid].received >= 0.999 * size
                conn.reset(sid)
                logged = records.wait_for(n, timeout=10)
                assert len(logged) == n
            finally:
                conn.close()
            r = logged[-1]
            assert r["method"] == "PlanCalls" and not got_all
            assert r["code"] == "CANCELLED" and r["delivered"] is False, r
            assert "client cancelled or message refused by gRPC for size" in r["error"]
