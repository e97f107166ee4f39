"""Connections against the file-descriptor limit (issue 38, item 5): at the usual 1,024 descriptors,
1,100 idle connections locked out every new client, health included; the server neither capped
connections nor raised its limit. Now ``serve`` raises the soft ``RLIMIT_NOFILE`` to fit
``--max-connections`` (as far as the hard limit allows), warns naming the numbers when fewer fit,
and refuses to start when too few do.
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys

from h2_client import PREFACE, SETTINGS, frame

from harts_planner import Planner
from harts_planner.rpc import connections
from harts_planner.rpc.server import SidecarProcess


def _nofile(soft: int, hard: int):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return limit


def _limits_of(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
    raise AssertionError("no Max open files line")


def test_a_low_hard_limit_starts_with_a_warning_naming_the_numbers(tmp_path):
    log = tmp_path / "serve.log"
    with SidecarProcess(workers=2, preexec_fn=_nofile(256, 256), log_path=str(log)) as sidecar:
        assert _limits_of(sidecar.pid) == (256, 256)
        with Planner(sidecar.address) as p:
            assert p.health(timeout=5) == "SERVING"
    text = log.read_text()
    assert "RLIMIT_NOFILE hard 256) leaves 128 connections" in text and "--max-connections 4096" in text
    assert '"max_connections": 128' in text


def test_too_few_descriptors_refuse_to_start():
    proc = subprocess.run(
        [sys.executable, "-m", "harts_planner.cli", "serve", "--port", "0"],
        preexec_fn=_nofile(150, 150),
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
            workers=2, preexec_fn=_nofile(1024, 4096), log_path=str(tmp_path / "serve.log")
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
