"""SIGTERM of a real ``harts-planner serve`` process (issue 17): health NOT_SERVING, queued and new
requests answered UNAVAILABLE at once, in-flight plans given ``--grace`` seconds and then cancelled
through their tokens, exit code 0; a second signal ends the grace at once; a plan that ignores its
token cannot hold the process (exit code 1 after the cancel wait). Long plans are the stand-in of
``slow_sidecar.py`` (15 s unless cancelled), so the tests do not depend on the planner's speed; the
bounds on how long things take are generous (seconds against a 15 s plan)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import grpc
import pytest
from sidecar_fixtures import Raw, future_code, queued_request, step_request, wait_until

from harts_planner import Planner, SegmentTree
from harts_planner.rpc.client import SidecarUnavailableError
from harts_planner.rpc.server import SidecarProcess

LAUNCHER = [sys.executable, os.path.join(os.path.dirname(__file__), "slow_sidecar.py")]
SLOW = queued_request(capacity=8888)  # slow_sidecar.SLOW_CAPACITY: 15 s unless cancelled, on a planner thread
UNAVAILABLE, OK = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK


def _sidecar(tmp_path, grace: float, **env) -> tuple[SidecarProcess, object]:
    log = tmp_path / "serve.log"
    environment = {**os.environ, **{k: str(v) for k, v in env.items()}}
    sidecar = SidecarProcess(workers=1, grace=grace, log_path=str(log), command=LAUNCHER, env=environment)
    return sidecar, log


def _records(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def _started(log) -> bool:
    return "slow plan started" in log.read_text()


def test_sigterm_answers_queued_requests_at_once_then_cancels_after_the_grace(tmp_path):
    sidecar, log = _sidecar(tmp_path, grace=1.0)
    try:
        with Raw(sidecar.address) as raw:
            slow = raw.future("PLAN_STEP", SLOW, timeout=60)
            assert wait_until(lambda: _started(log))
            queued = raw.future("PLAN_STEP", queued_request(), timeout=60)
            time.sleep(0.3)  # let it reach the queue (if not, it is refused on arrival: the same answer)
            sent = time.monotonic()
            sidecar.proc.send_signal(signal.SIGTERM)
            assert future_code(queued) == UNAVAILABLE
            assert not slow.done()  # answered while the plan still ran
            code, details = raw.code("PLAN_STEP", step_request())
            assert code == UNAVAILABLE, details
            assert future_code(slow) == UNAVAILABLE  # cut off after the grace, through its token
            assert sidecar.proc.wait(30) == 0
            took = time.monotonic() - sent
    finally:
        if sidecar.proc.poll() is None:
            sidecar.proc.kill()
    assert took < 10.0, took  # the grace (1 s) and the cut-off, not the 15 s plan
    records = _records(log)
    drain = next(r for r in records if r.get("event") == "drain")
    assert drain["inflight"] == 1 and drain["grace_s"] == 1.0
    rpcs = [r for r in records if r.get("event") == "rpc"]
    assert any("shut down before the plan finished" in r.get("error", "") for r in rpcs)
    assert [r["code"] for r in rpcs].count("UNAVAILABLE") >= 3
    assert records[-1] == {
        **records[-1],
        "event": "stopped",
        "drained": False,
        "cancelled": 1,
        "stuck": False,
    }


def test_sigterm_lets_in_flight_plans_finish_within_the_grace(tmp_path):
    sidecar, log = _sidecar(tmp_path, grace=60.0, HARTS_TEST_SLOW_SECONDS=1.5)
    try:
        with Planner(sidecar.address, timeout=60) as p, Raw(sidecar.address) as raw:
            slow = raw.future("PLAN_STEP", SLOW, timeout=60)
            assert wait_until(lambda: _started(log))
            sidecar.proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: p.health() == "NOT_SERVING", timeout=10)
            with pytest.raises(SidecarUnavailableError, match="shutting down"):
                p.plan_step(SegmentTree([-1], [2], [0]), 1, 4)
            assert future_code(slow) == OK
            assert sidecar.proc.wait(60) == 0
    finally:
        if sidecar.proc.poll() is None:
            sidecar.proc.kill()
    records = _records(log)
    ok = [r for r in records if r.get("event") == "rpc" and r["code"] == "OK"]
    assert ok and ok[0]["input"] == "tree" and ok[0]["trajectories"] == 200  # queued_request()
    expected = {"plan_ms", "ingest_ms", "decode_ms", "queue_ms", "total_ms", "microbatches", "request_bytes"}
    assert expected <= ok[0].keys()
    assert records[-1]["event"] == "stopped" and records[-1]["drained"] is True


def test_a_second_signal_ends_the_grace(tmp_path):
    sidecar, log = _sidecar(tmp_path, grace=300.0)
    try:
        with Raw(sidecar.address) as raw:
            slow = raw.future("PLAN_STEP", SLOW, timeout=60)
            assert wait_until(lambda: _started(log))
            sidecar.proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: any(r.get("event") == "drain" for r in _records(log)))
            sidecar.proc.send_signal(signal.SIGINT)
            assert future_code(slow) == UNAVAILABLE
            assert sidecar.proc.wait(30) == 0
    finally:
        if sidecar.proc.poll() is None:
            sidecar.proc.kill()


def test_a_plan_that_ignores_its_token_cannot_hold_the_process(tmp_path):
    sidecar, log = _sidecar(tmp_path, grace=0.5, HARTS_TEST_SLOW_POLLS=0, HARTS_TEST_CANCEL_WAIT=1.0)
    try:
        with Raw(sidecar.address) as raw:
            slow = raw.future("PLAN_STEP", SLOW, timeout=60)
            assert wait_until(lambda: _started(log))
            sent = time.monotonic()
            sidecar.proc.send_signal(signal.SIGTERM)
            assert sidecar.proc.wait(30) == 1
            assert future_code(slow) != OK
            took = time.monotonic() - sent
    finally:
        if sidecar.proc.poll() is None:
            sidecar.proc.kill()
    assert took < 10.0, took  # grace + cancel wait, not the 15 s plan
    stopped = _records(log)[-1]
    assert stopped["event"] == "stopped" and stopped["stuck"] is True


def test_sigterm_during_uploads_answers_the_uploaders_unavailable(tmp_path):
    """Issue 47: SIGTERM while two clients upload (a first chunk, then nothing): each client gets
    the UNAVAILABLE the log records ("retry on another planner"), not a bare CANCELLED."""
    import threading

    from harts_planner.rpc import codec

    log = tmp_path / "serve.log"
    sidecar = SidecarProcess(workers=1, grace=300.0, log_path=str(log))
    stop = threading.Event()
    first = codec.varint(2 << 3) + codec.varint(64 << 20) + codec.header(1, 16) + bytes(16)

    def chunks():
        yield first
        stop.wait(30)  # the rest never comes (bounded: the test sets it at the end)

    got: list = []

    def upload() -> None:
        with grpc.insecure_channel(sidecar.address) as channel:
            call = channel.stream_stream(
                codec.PLAN_CALLS_STREAM, request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            try:
                list(call(chunks(), timeout=30))
                got.append((OK, ""))
            except grpc.RpcError as e:
                got.append((e.code(), e.details() or ""))

    threads = [threading.Thread(target=upload) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.5)  # both first chunks in (the drain's record below counts the uploads it cut)
        sidecar.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(20)
        assert sidecar.proc.wait(30) == 0
    finally:
        stop.set()
        if sidecar.proc.poll() is None:
            sidecar.proc.kill()
    assert [code for code, _ in got] == [UNAVAILABLE, UNAVAILABLE], got
    assert all("retry on another planner" in details for _, details in got), got
    records = _records(log)
    assert next(r for r in records if r.get("event") == "drain")["uploads_cut"] == 2
    rpcs = [r for r in records if r.get("event") == "rpc"]
    assert [r["code"] for r in rpcs] == ["UNAVAILABLE", "UNAVAILABLE"], rpcs
