"""Connections against the file-descriptor limit (issue 38, item 5): at the usual 1,024 descriptors,
1,100 idle connections locked out every new client, health included; the server neither capped
connections nor raised its limit. Now ``serve`` raises the soft ``RLIMIT_NOFILE`` to fit
``--max-connections`` (as far as the hard limit allows), warns naming the numbers when fewer fit,
and refuses to start when too few do. Issue 47: ``--max-connections`` is a real cap (gRPC's
connection quota: one past it is accepted and closed), and ``--health-port`` keeps health checks a
listener of their own.
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys

from attacks import closed_by_server, idle_connections, open_fds, wait_for
from h2_client import PREFACE, SETTINGS, frame

from harts_planner import Planner
from harts_planner.rpc import connections
from harts_planner.rpc.server import SidecarProcess


def _nofile(soft: int, hard: int) -> list[str]:
    """``python -m harts_planner.cli`` under ``RLIMIT_NOFILE`` (soft, hard), set by the child's own
    Python before it runs the CLI: a ``preexec_fn`` would run Python between ``fork`` and ``exec`` in
    a child of this test process, whose gRPC threads (earlier tests' servers and channels) make that
    unsafe (a sidecar once died of SIGABRT before printing its address, under load in CI)."""
    code = (
        "import resource, runpy, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
        "sys.argv[0] = 'harts-planner'; "
        "runpy.run_module('harts_planner.cli', run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code]


def _limits_of(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
    raise AssertionError("no Max open files line")


def test_a_low_hard_limit_starts_with_a_warning_naming_the_numbers(tmp_path):
    log = tmp_path / "serve.log"
    with SidecarProcess(workers=2, command=_nofile(256, 256), log_path=str(log)) as sidecar:
        assert _limits_of(sidecar.pid) == (256, 256)
        with Planner(sidecar.address) as p:
            assert p.health(timeout=5) == "SERVING"
    text = log.read_text()
    assert "RLIMIT_NOFILE hard 256) leaves 128 connections" in text and "--max-connections 4096" in text
    assert '"max_connections": 128' in text


def test_too_few_descriptors_refuse_to_start():
    proc = subprocess.run(
        [*_nofile(150, 150), "serve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and not proc.stdout
    assert "RLIMIT_NOFILE soft 150, hard 150" in proc.stderr and "fewer than the 64" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_soft_limit_is_raised_and_1100_idle_connections_lock_nobody_out(tmp_path):
    """Soft 1,024 and hard 4,096 (a common default): the server raises its soft limit to fit
    --max-connections; 1,100 idle HTTP/2 connections (preface and settings, no call) then leave
    a new client's health check and plan answered."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        import pytest

        pytest.skip(f"this test needs 1,300 descriptors itself (hard limit {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300), hard))
    socks = []
    try:
        with SidecarProcess(
            workers=2, command=_nofile(1024, 4096), log_path=str(tmp_path / "serve.log")
        ) as sidecar:
            assert _limits_of(sidecar.pid)[0] == 4096  # 4,096 + 128 capped at the hard limit
            host, _, port = sidecar.address.rpartition(":")
            hello = PREFACE + frame(SETTINGS, 0, 0)
            for _ in range(1100):
                s = socket.create_connection((host, int(port)), timeout=10)
                s.sendall(hello)
                socks.append(s)
            with Planner(sidecar.address, timeout=10) as p:
                assert p.health(timeout=10) == "SERVING"
    finally:
        for s in socks:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_fit_file_limit_reports_what_fits():
    fit = connections.fit_file_limit(64)
    assert fit.connections == 64 and fit.warning is None


def test_max_connections_caps_and_the_health_port_stays_answerable(tmp_path):
    """Issue 47: ``--max-connections 100`` capped nothing (only the descriptor limit did). Now 40
    idle connections against ``--max-connections 16``: 24 are accepted and closed at once, the
    server holds no more descriptors than the cap allows, a new planner-port client is refused
    while the idle ones hold the cap (UNAVAILABLE, at once), and the health port (its own cap)
    answers SERVING meanwhile; once the idle ones leave, the planner port serves again."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def health(address: str):
        with grpc.insecure_channel(address) as channel:
            try:
                return (
                    health_pb2_grpc.HealthStub(channel)
                    .Check(health_pb2.HealthCheckRequest(), timeout=5)
                    .status
                )
            except grpc.RpcError as e:
                return e.code()

    log = tmp_path / "serve.log"
    with SidecarProcess(
        workers=2, extra_args=["--max-connections", "16", "--health-port", "0"], log_path=str(log)
    ) as sidecar:
        base = open_fds(sidecar.pid)  # no connection yet (a closed one may count a moment longer)
        socks, _ = idle_connections(sidecar.address, 40)
        try:
            assert closed_by_server(socks, wait=5.0) == 24
            assert open_fds(sidecar.pid) <= base + 16
            assert health(sidecar.address) == grpc.StatusCode.UNAVAILABLE  # the cap holds
            assert health(sidecar.health_address) == health_pb2.HealthCheckResponse.SERVING
        finally:
            for s in socks:
                s.close()
        # The server counts a connection until its event loop sees the close: the slots free a
        # moment after the sockets go (a health check at once was refused once, in a loaded CI run).
        serving = health_pb2.HealthCheckResponse.SERVING
        assert wait_for(lambda: health(sidecar.address) == serving, timeout=20, step=0.2)
        with Planner(sidecar.address, timeout=10) as p:
            assert p.health(timeout=10) == "SERVING"
    text = log.read_text()
    assert '"max_connections": 16' in text and '"health_connections": 32' in text


def test_the_health_port_has_a_cap_of_its_own():
    with SidecarProcess(workers=2, extra_args=["--health-port", "0"]) as sidecar:
        socks, _ = idle_connections(sidecar.health_address, connections.HEALTH_CONNECTIONS + 8)
        try:
            assert closed_by_server(socks, wait=5.0) == 8
            with Planner(sidecar.address, timeout=10) as p:  # the planner port is not touched
                assert p.health(timeout=10) == "SERVING"
        finally:
            for s in socks:
                s.close()


def test_fit_file_limit_counts_the_health_port_and_allows_a_small_cap():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    small = connections.fit_file_limit(8)  # fewer than MIN_CONNECTIONS asked: served as asked
    assert small.connections == 8 and small.warning is None
    reserve = connections.FD_RESERVE + connections.HEALTH_CONNECTIONS
    if hard != resource.RLIM_INFINITY and hard < (1 << 20) + reserve:
        # the descriptors left after the server's own and the health port's
        fit = connections.fit_file_limit(1 << 20, health=True)
        assert fit.connections == fit.soft - reserve
        assert "--max-connections 1048576" in fit.warning
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
