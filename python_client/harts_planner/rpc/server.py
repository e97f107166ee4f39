"""The planner sidecar's entry points: build and start a server, run one until SIGTERM, run one as a
child process.

* :func:`create_server`: a started grpcio server on ``host:port`` (port 0 picks a free one, as tests
  use): ``harts.planner.v1.PlannerService`` (PlanStep, PlanCalls and their ``*Stream`` forms), the
  stock health service (``grpc.health.v1``; service ``""`` and the planner's full name) and server
  reflection; optionally TLS (:mod:`harts_planner.rpc.tls`).
* :func:`serve`: ``harts-planner serve``: logging, signals, the drain.
* :class:`SidecarProcess`: ``harts-planner serve`` as a child process on a free port.

The server is split the way grpc's examples split one, one job per module:

========================================  ==================================================================
module                                    job
========================================  ==================================================================
:mod:`~harts_planner.rpc.interceptor`     routing each call to its pool, bounding each class of calls
                                          (:class:`~.interceptor.Guard`)
:mod:`~harts_planner.rpc.ledger`          what calls hold, the planner threads they wait for
                                          (:class:`~.ledger.Budget`)
:mod:`~harts_planner.rpc.request_reader`  reading request messages under a reservation and the receive
                                          timeout (:class:`~.request_reader.GuardedReader`)
:mod:`~harts_planner.rpc.admission`       the checks and costs of a request (:class:`~.admission.Admission`)
:mod:`~harts_planner.rpc.servicer`        the handlers: receive, admit, queue, plan, encode, send
:mod:`~harts_planner.rpc.wire`            wire bytes of large messages without holding the GIL
:mod:`~harts_planner.rpc.control`         how a call stops (:class:`~.control.RequestControl`), the
                                          watchdog of stalled transfers, the drain
:mod:`~harts_planner.rpc.logs`            one structured record per call and per lifecycle event
:mod:`~harts_planner.rpc.limits`          the limits and the cost model
:mod:`~harts_planner.rpc.tls`             TLS credentials from PEM files, the certificate checked
:mod:`~harts_planner.rpc.connections`     the file-descriptor limit fitted to the connection cap
this module                               the server's options, pools and entry points
========================================  ==================================================================

What the server does against hostile or careless clients (measured: ``benchmarks/service.py
--attacks``; tests ``tests/rpc/test_sidecar_attacks.py``):

* Every call runs on a pool of its class (planner calls; health and reflection), bounded on arrival
  by the :class:`~.interceptor.Guard`, so no number of planner calls, stalled or not, delays a health
  check; a call over its class's bound is refused at once.
* A stream reserves what its next message may hold (``--max-message-mb``, twice: gRPC's buffer and
  Python's copy) against ``--max-inflight-mb`` before it reads it, and must receive it within
  ``--receive-timeout``: a partial or withheld upload holds at most that, for at most that long.
  HTTP/2 flow control keeps a stream that is not being read at 64 KiB (the server's BDP probing is
  off, so the window does not grow by itself), and a connection opens at most
  :data:`MAX_STREAMS_PER_CONNECTION` streams at once.
* Requests held while queued count their bytes and what admission built for them against
  ``--max-inflight-mb``; plans count against ``--max-plan-memory-mb`` until their response is
  delivered, and a response the client does not read for ``--send-timeout`` seconds is cut off.
* Responses are sent from the plan's own arrays, copied outside the GIL (:mod:`~.wire`); large ones
  through the ``*Stream`` methods in 1 MiB chunks (a unary response is at most one message).
* At most ``--max-connections`` connections (gRPC's connection quota: one past the cap is accepted
  and closed at once); connections idle for :data:`MAX_CONNECTION_IDLE_MS`, or still without their
  HTTP/2 handshake after :data:`HANDSHAKE_TIMEOUT_MS`, are closed; keepalive pings find dead peers;
  :func:`serve` fits the file-descriptor limit to the cap before it serves; ``--health-port`` serves
  health checks on a listener of their own, with its own cap
  (:mod:`~harts_planner.rpc.connections`).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from harts_planner import checks
from harts_planner.call_plan import set_max_plan_bytes
from harts_planner.rpc import codec, connections, control, tls, wire
from harts_planner.rpc import limits as _limits
from harts_planner.rpc.control import CANCEL_WAIT_SECONDS, DrainResult, RequestControl
from harts_planner.rpc.interceptor import Guard
from harts_planner.rpc.ledger import Budget
from harts_planner.rpc.limits import DEFAULT_MAX_MESSAGE_BYTES
from harts_planner.rpc.logs import LOGGER, JsonFormatter, TextFormatter, configure_logging
from harts_planner.rpc.servicer import PlannerServicer

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_GRACE_SECONDS = 300.0
#: Planner calls sending their responses at once, beyond those planning, queued and receiving.
SEND_CALLS = 32
#: Streams one connection may have open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS; RFC 9113
#: recommends no less than 100: gRPC clients share one connection between channels to a target,
#: and the server counts a call the client cancelled until its handler has let go of it).
MAX_STREAMS_PER_CONNECTION = 100
#: Connections without a call for this long are closed.
MAX_CONNECTION_IDLE_MS = 300_000
#: Connections that have not finished the HTTP/2 handshake (TLS, the client's preface and SETTINGS)
#: within this are closed (gRPC's default is 120 s: they count against the connection cap meanwhile).
HANDSHAKE_TIMEOUT_MS = 10_000
#: Threads answering the health port's calls.
HEALTH_THREADS = 4
#: Keepalive pings on connections quiet for this long; a peer that does not answer within the
#: timeout is dropped with its calls.
KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS = 60_000, 20_000
#: Most streams receiving at once (each reserves its next message against --max-inflight-mb).
MAX_RECEIVING = 256


def default_workers() -> int:
    """Planner threads: one per core (planning is CPU-bound and runs without the GIL), at least 2."""
    return max(2, os.cpu_count() or 2)


def planner_calls(workers: int, limits: _limits.Limits, max_message_bytes: int) -> int:
    """Planner calls the server handles at once: planning, queued, receiving (as many as
    ``--max-inflight-mb`` has room to reserve for, at most :data:`MAX_RECEIVING`) and sending."""
    receiving = limits.max_inflight_bytes // limits.receive_reservation(max_message_bytes)
    return workers + limits.max_queued + min(max(receiving, 8), MAX_RECEIVING) + SEND_CALLS


class PlannerServer:
    """A started planner server: ``.port``, ``.address``, :meth:`drain`, :meth:`stop`."""

    def __init__(
        self,
        server,
        servicer,
        health_servicer,
        host,
        port,
        *,
        guard=None,
        pool=None,
        tls=False,
        health_server=None,
        health_port=None,
        max_connections=None,
    ):
        self.server = server
        self.health_server = health_server
        #: The health port's number (``--health-port``; None without one).
        self.health_port = health_port
        #: The planner port's connection cap.
        self.max_connections = max_connections
        self.servicer = servicer
        self.health = health_servicer
        self.host = host
        self.port = port
        self.guard = guard
        self.tls = tls
        self._pool = pool
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        """``host:port`` to give clients (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    def drain(
        self, grace: float = DEFAULT_GRACE_SECONDS, *, cut: threading.Event | None = None
    ) -> DrainResult:
        """Graceful shutdown (:func:`harts_planner.rpc.control.drain`): health NOT_SERVING; queued
        and new calls get UNAVAILABLE at once; calls planning or sending get ``grace`` seconds (fewer
        when ``cut`` is set meanwhile: a second signal), then are cut off; then the server stops.
        Truthy when every call finished (every response logged OK was delivered)."""
        return control.drain(self, grace, cut=cut)

    @property
    def health_address(self) -> str | None:
        """``host:port`` of the health port, or None."""
        if self.health_port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.health_port}"

    def stop(self, grace: float | None = None) -> None:
        """Stop now (calls in flight get ``grace`` seconds)."""
        if self.health_server is not None:
            self.health_server.stop(None)
        self.server.stop(grace).wait()
        self.servicer.watchdog.stop()
        self.servicer.planner_pool.shutdown(wait=False, cancel_futures=True)
        if self.guard is not None:
            self.guard.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> PlannerServer:
        return self

    def __exit__(self, *exc) -> None:
        if not self._stopped.is_set():
            self.stop(grace=None)


def _bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound (a name that does not resolve, an address in use or of no
    interface here), found with a plain socket before gRPC tries (whose failure is a log line on
    stderr and no reason); None when some address of it binds."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        return f"cannot resolve host {host!r} ({getattr(e, 'strerror', None) or e})"
    problem = "no address to bind"
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listener
                probe.bind(sockaddr)
            return None
        except OSError as e:
            problem = e.strerror or str(e)
    return problem


def is_loopback(host: str) -> bool:
    """True when every address ``host`` stands for is a loopback address (127.0.0.0/8, ::1)."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def server_options(
    max_message_bytes: int, chunk_bytes: int, max_connections: int = connections.DEFAULT_MAX_CONNECTIONS
) -> list[tuple[str, int]]:
    """The gRPC channel arguments of the server (see the module docstring)."""
    return [
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max(max_message_bytes, chunk_bytes + 64)),
        ("grpc.so_reuseport", 0),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ]


def create_server(
    address: str = f"{DEFAULT_HOST}:0",
    *,
    workers: int | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    limits: _limits.Limits = _limits.DEFAULT,
    credentials: grpc.ServerCredentials | None = None,
    max_connections: int = connections.DEFAULT_MAX_CONNECTIONS,
    health_port: int | None = None,
) -> PlannerServer:
    """Build and start a planner server on ``address`` (``host:port``; port 0 picks a free one).

    ``workers`` planner threads (default :func:`default_workers`); ``max_message_bytes`` the largest
    gRPC message either way (a unary request or response; a ``*Stream`` call's chunk);
    ``credentials`` from :func:`harts_planner.rpc.tls.server_credentials` serve TLS (default:
    plaintext). Planner calls beyond :func:`planner_calls` at once, and health or reflection calls
    beyond :data:`~harts_planner.rpc.interceptor.SERVICE_CALLS`, are refused (RESOURCE_EXHAUSTED).
    At most ``max_connections`` connections at once (more are accepted and closed at once).
    ``health_port`` (0 picks a free one) also serves the health service alone on the same host, with
    its own cap of :data:`~harts_planner.rpc.connections.HEALTH_CONNECTIONS` connections and the
    same credentials. Raises ValueError for a bad argument, ``RuntimeError`` when an address cannot
    be bound.
    """
    max_connections = checks.integer(max_connections, "max_connections", 1, 1 << 30)
    workers = default_workers() if workers is None else checks.integer(workers, "workers", 1, 1 << 16)
    max_message_bytes = checks.integer(max_message_bytes, "max_message_bytes", 1)
    if max_message_bytes > 2**31 - 1:
        raise ValueError(f"max_message_bytes: must be <= {2**31 - 1} (gRPC's limit), got {max_message_bytes}")
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"address: must be HOST:PORT with a port in [0, 65535], got {address!r}")
    problem = _bind_problem(host.strip("[]"), int(port_text))
    if problem is not None:
        raise RuntimeError(f"cannot bind {address}: {problem}")
    health_address = None
    if health_port is not None:
        health_port = checks.integer(health_port, "health_port", 0, 65535)
        health_address = f"{host}:{health_port}"
        problem = _bind_problem(host.strip("[]"), health_port)
        if problem is not None:
            raise RuntimeError(f"cannot bind the health port {health_address}: {problem}")
    chunk_bytes = max(1, min(wire.CHUNK_BYTES, max_message_bytes - 64))
    budget = Budget(workers, limits, max_message_bytes)
    watchdog = control.Watchdog()
    calls = planner_calls(workers, limits, max_message_bytes)
    pool = futures.ThreadPoolExecutor(max_workers=calls, thread_name_prefix="harts-planner")
    guard = Guard(budget, watchdog, pool, calls)
    servicer = PlannerServicer(budget, watchdog, chunk_bytes=chunk_bytes)
    server = grpc.server(
        guard.refusals,
        options=server_options(max_message_bytes, chunk_bytes, max_connections),
        interceptors=[guard],
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(codec.SERVICE_NAME, servicer.handlers(pool)),)
    )
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            codec.SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    port = _bind(server, address, credentials)
    if port <= 0:
        watchdog.stop()
        guard.shutdown()
        pool.shutdown(wait=False)
        raise RuntimeError(
            f"cannot bind {address}: the address is in use, not an address of this machine, or not valid"
        )
    health_server = bound_health = None
    if health_address is not None:
        health_server, bound_health = _health_server(health_servicer, health_address, credentials)
        if bound_health <= 0:
            server.stop(None)
            watchdog.stop()
            guard.shutdown()
            pool.shutdown(wait=False)
            raise RuntimeError(f"cannot bind the health port {health_address}")
        health_server.start()
    server.start()
    for service in ("", codec.SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return PlannerServer(
        server,
        servicer,
        health_servicer,
        host.strip("[]") or DEFAULT_HOST,
        port,
        guard=guard,
        pool=pool,
        tls=credentials is not None,
        health_server=health_server,
        health_port=bound_health,
        max_connections=max_connections,
    )


def _health_server(health_servicer, address: str, credentials) -> tuple[grpc.Server, int]:
    """A second gRPC server answering the health service alone (the same servicer: a drain's
    NOT_SERVING shows on both) on ``address``, capped at ``HEALTH_CONNECTIONS`` connections; returns
    it and its bound port (<= 0: not bound)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(HEALTH_THREADS, thread_name_prefix="harts-health"),
        options=[
            ("grpc.max_allowed_incoming_connections", connections.HEALTH_CONNECTIONS),
            ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
            ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
            ("grpc.max_receive_message_length", 1 << 16),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=4 * HEALTH_THREADS,
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = _bind(server, address, credentials)
    return server, port


def _bind(server, address: str, credentials) -> int:
    """``server`` on ``address`` (TLS with ``credentials``, else plaintext): the bound port, 0 when
    the address cannot be bound."""
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError:
        return 0


def cap_malloc_arenas(arenas: int) -> bool:
    """Cap glibc's malloc arenas (``mallopt(M_ARENA_MAX)``, as ``MALLOC_ARENA_MAX`` does) unless the
    environment sets them: the sidecar's many RPC threads would otherwise each get an arena and hold
    freed request buffers apart (a 16-client load peaked at 1.0-1.15 GB instead of 0.64 GB). True
    when capped (glibc only)."""
    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-8, max(1, int(arenas))))  # M_ARENA_MAX
    except (OSError, AttributeError):
        return False


def exposure_warning(host: str, tls_on: bool, mutual: bool) -> str | None:
    """What to tell the operator of a server bound to ``host``: None on a loopback address (or with
    mutual TLS), else a warning that other machines can reach it."""
    if is_loopback(host) or mutual:
        return None
    if tls_on:
        return (
            f"serving on {host} with TLS but without client certificates: any client that can reach "
            "this port and trusts the certificate can use the planner; add --tls-client-ca for mutual TLS"
        )
    return (
        f"serving on {host} without TLS or authentication: any host that can reach this port can use the "
        "planner and read its plans; bind 127.0.0.1, or use --tls-cert / --tls-key with --tls-client-ca"
    )


def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    workers: int | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    grace: float = DEFAULT_GRACE_SECONDS,
    log_format: str = "json",
    limits: _limits.Limits = _limits.DEFAULT,
    tls_cert=None,
    tls_key=None,
    tls_client_ca=None,
    max_connections: int = connections.DEFAULT_MAX_CONNECTIONS,
    health_port: int | None = None,
) -> int:
    """Run a sidecar until SIGTERM or SIGINT, then drain (see :meth:`PlannerServer.drain`; a second
    signal ends the grace period at once).

    ``tls_cert`` / ``tls_key`` (PEM files) serve TLS; ``tls_client_ca`` also requires client
    certificates signed by it. A ``host`` other than a loopback address prints a warning (unless
    mutual TLS is on). ``max_connections`` caps the connections (fitted to the file-descriptor
    limit); ``health_port`` serves health checks on a port of their own (see :func:`create_server`).
    Prints ``harts-planner: serving on HOST:PORT`` to stdout once it accepts requests (and
    ``harts-planner: health on HOST:PORT`` after it with a health port). Returns 0 once nothing is left running (every call finished, or was cut off and
    stopped), 1 when a cancelled plan did not stop (the caller should then end the process with
    ``os._exit``, as ``harts-planner serve`` does: a normal exit would wait for it). Raises
    ValueError / RuntimeError (cannot bind) before serving.
    """
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    # ValueError when too few connections fit
    files = connections.fit_file_limit(max_connections, health=health_port is not None)
    credentials = None
    if tls_cert is not None or tls_key is not None or tls_client_ca is not None:
        credentials = tls.server_credentials(tls_cert, tls_key, tls_client_ca)
    # The planner's own backstop (max_plan_bytes) at the plan-memory budget: a plan whose estimate
    # was admitted but whose arrays would still outgrow the budget stops with RESOURCE_EXHAUSTED.
    set_max_plan_bytes(limits.max_plan_memory_bytes)
    cap_malloc_arenas((default_workers() if workers is None else workers) + 1)
    server = create_server(
        address,
        workers=workers,
        max_message_bytes=max_message_bytes,
        limits=limits,
        credentials=credentials,
        max_connections=files.connections,
        health_port=health_port,
    )
    configure_logging(log_format)
    from harts_planner.rpc import logs

    for warning in (
        exposure_warning(host, credentials is not None, tls_client_ca is not None),
        files.warning,
    ):
        if warning is not None:
            print(f"harts-planner: warning: {warning}", file=sys.stderr, flush=True)
            logs.event("warning", level=30, message=warning)
    stop, cut = threading.Event(), threading.Event()

    def on_signal(signum, frame) -> None:
        (cut if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    budget = server.servicer.budget
    guard = server.guard
    assert guard is not None  # create_server gives every server its guard
    logs.event(
        "serving",
        address=server.address,
        tls="mutual" if tls_client_ca is not None else ("server" if credentials is not None else "off"),
        workers=budget.workers,
        max_message_bytes=budget.max_message_bytes,
        limits={
            "max_rows": limits.max_rows,
            "max_plan_memory_bytes": limits.max_plan_memory_bytes,
            "max_response_bytes": limits.response_limit(budget.max_message_bytes, stream=True),
            "max_request_bytes": limits.request_limit(budget.max_message_bytes, stream=True),
            "max_inflight_bytes": limits.max_inflight_bytes,
            "max_queued": limits.max_queued,
            "receive_timeout_s": limits.receive_timeout,
            "send_timeout_s": limits.send_timeout,
            "min_receive_rate_bytes_s": limits.min_receive_rate,
            "min_send_rate_bytes_s": limits.min_send_rate,
            "planner_calls": guard.planner_calls,
            "max_connections": files.connections,
            "health_connections": connections.HEALTH_CONNECTIONS if health_port is not None else None,
            "nofile_soft": files.soft,
            "nofile_hard": files.hard,
        },
        grace_s=grace,
        health_address=server.health_address,
        pid=os.getpid(),
    )
    print(f"harts-planner: serving on {server.address}", flush=True)
    if server.health_address is not None:
        print(f"harts-planner: health on {server.health_address}", flush=True)
    while not stop.wait(0.5):
        pass
    return server.drain(grace, cut=cut).exit_code


class SidecarProcess:
    """A ``harts-planner serve`` child process on a free port (for tests and benchmarks).

    ``with SidecarProcess(workers=2) as sidecar: Planner(sidecar.address)``; leaving the block
    sends SIGTERM and waits for the drain. ``extra_args`` are more ``serve`` flags
    (``["--max-rows", "1000"]``); ``preexec_fn`` runs in the child before it starts (e.g. an
    address-space limit); ``env`` replaces its environment; ``command`` replaces
    ``python -m harts_planner.cli`` (a test's launcher).
    """

    def __init__(
        self,
        *,
        workers: int | None = None,
        max_message_bytes: int | None = None,
        grace: float = 30.0,
        log_path: str | None = None,
        startup_timeout: float = 60.0,
        extra_args: list[str] | None = None,
        preexec_fn=None,
        env: dict | None = None,
        command: list[str] | None = None,
    ):
        cmd = list(command or [sys.executable, "-m", "harts_planner.cli"])
        cmd += ["serve", "--port", "0", "--grace", str(grace)]
        if workers is not None:
            cmd += ["--workers", str(workers)]
        if max_message_bytes is not None:
            cmd += ["--max-message-bytes", str(max_message_bytes)]
        cmd += list(extra_args or [])
        self._log = open(log_path, "w") if log_path else None
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self._log if self._log is not None else subprocess.DEVNULL,
            text=True,
            preexec_fn=preexec_fn,
            env=env,
        )
        self.address = self._read_address(startup_timeout)
        #: The health port's ``host:port`` (with ``--health-port`` in ``extra_args``), else None.
        self.health_address = None
        if "--health-port" in cmd:
            self.health_address = self._read_address(startup_timeout, "harts-planner: health on ")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_address(self, timeout: float, prefix: str = "harts-planner: serving on ") -> str:
        result: list[str] = []
        stdout = self.proc.stdout
        assert stdout is not None  # started with stdout=PIPE
        reader = threading.Thread(target=lambda: result.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        line = result[0] if result else ""
        if not line.startswith(prefix):
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"sidecar did not start (exit code {self.proc.poll()}, said {line!r})")
        return line[len(prefix) :].strip()

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the drain; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self._log is not None:
                self._log.close()

    def __enter__(self) -> SidecarProcess:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.terminate()
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


__all__ = [
    "CANCEL_WAIT_SECONDS",
    "DEFAULT_HOST",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_PORT",
    "DrainResult",
    "JsonFormatter",
    "LOGGER",
    "PlannerServer",
    "PlannerServicer",
    "RequestControl",
    "SidecarProcess",
    "TextFormatter",
    "configure_logging",
    "create_server",
    "default_workers",
    "exposure_warning",
    "is_loopback",
    "serve",
]
