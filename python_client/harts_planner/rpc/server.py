"""The planner sidecar: a grpcio server around the C++ planner core.

* ``harts.planner.v1.PlannerService`` (``PlanStep``, ``PlanCalls``); the core releases the GIL,
  so ``workers`` threads plan concurrently.
* The stock health service (``grpc.health.v1``; service ``""`` and the planner's full name) and
  server reflection.
* Limits: messages up to ``max_message_bytes`` each way (1 GiB by default; a larger request is
  refused by gRPC with RESOURCE_EXHAUSTED before it is parsed), and the planner's own limits.
* Errors: bad requests get INVALID_ARGUMENT / RESOURCE_EXHAUSTED / FAILED_PRECONDITION with a
  message and a google.rpc detail naming the request field (the table of
  :mod:`harts_planner.rpc.status`); unparsable bytes are
  INVALID_ARGUMENT on field ``request``; anything unexpected is INTERNAL and logged. The server
  keeps serving either way.
* Deadlines: checked before and between the phases of a plan (DEADLINE_EXCEEDED).
* Logging: one structured record per RPC (logger ``harts_planner.rpc``; JSON lines with
  ``serve(log_format="json")``): method, peer, status, input kind, sizes, phase times.
* Graceful shutdown (:meth:`PlannerServer.drain`, run by ``serve`` on SIGTERM/SIGINT): health goes
  NOT_SERVING, new plans get UNAVAILABLE, in-flight plans finish (up to ``grace`` seconds), then
  the server stops.

``create_server("127.0.0.1:0")`` gives a started server on a free port (``.port``), as tests use.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from harts_planner.call_plan import plan_calls
from harts_planner.errors import HartsError
from harts_planner.rpc import codec, status
from harts_planner.rpc import planner_pb2 as pb
from harts_planner.rpc.client import DEFAULT_MAX_MESSAGE_BYTES
from harts_planner.step_plan import plan_step_with_calls

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_GRACE_SECONDS = 300.0
LOGGER = logging.getLogger("harts_planner.rpc")
LOGGER.addHandler(logging.NullHandler())  # a library logs nothing unless configured (serve() does)


def default_workers() -> int:
    """Planner threads: one per core (planning is CPU-bound and runs without the GIL), at least 2."""
    return max(2, os.cpu_count() or 2)


# ---------------------------------------------------------------------------------- errors
class _AbortRpcError(Exception):
    """Ends an RPC with a status (raised inside a handler, turned into context.abort)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None):
        super().__init__(message)
        self.code, self.message, self.field = code, message, field


def _from_harts(err: HartsError) -> _AbortRpcError:
    return _AbortRpcError(status.for_error(err).code, str(err), getattr(err, "field", None) or "request")


def _rich_status(abort: _AbortRpcError) -> grpc.Status:
    return status.rich_status(abort.code, abort.message, abort.field)


@dataclass
class _Unparsable:
    """What the request deserializer returns for bytes that are not a valid message."""

    type_name: str
    error: str


def _deserializer(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return _Unparsable(cls.DESCRIPTOR.full_name, str(e))

    return parse


# ---------------------------------------------------------------------------------- servicer
class PlannerServicer:
    """Handlers of PlanStep and PlanCalls; tracks in-flight plans for draining."""

    def __init__(
        self, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, logger: logging.Logger = LOGGER
    ):
        self.max_message_bytes = max_message_bytes
        self.logger = logger
        self._lock = threading.Condition()
        self._inflight = 0
        self._draining = False

    # ------------------------------------------------------------------ draining
    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def begin_drain(self) -> None:
        """Refuse new plans (UNAVAILABLE) from now on."""
        with self._lock:
            self._draining = True

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no plan is in flight; False when ``timeout`` passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: self._inflight == 0, timeout)

    # ------------------------------------------------------------------ RPCs
    def PlanStep(self, request, context):  # noqa: N802 (gRPC method name)
        return self._serve("PlanStep", request, context, self._plan_step)

    def PlanCalls(self, request, context):  # noqa: N802
        return self._serve("PlanCalls", request, context, self._plan_calls)

    def _serve(self, method: str, request, context, body):
        start = time.perf_counter()
        record: dict = {"event": "rpc", "method": method, "peer": context.peer()}
        with self._lock:
            if self._draining:
                record.update(code="UNAVAILABLE", total_ms=0.0)
                self.logger.info("rpc", extra={"fields": record})
                context.abort(
                    grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another planner"
                )
            self._inflight += 1
        try:
            if isinstance(request, _Unparsable):
                raise _AbortRpcError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"request: not a valid {request.type_name} message ({request.error})",
                    "request",
                )
            record["request_bytes"] = request.ByteSize()
            response = body(request, context, record)
            record["response_bytes"] = size = response.ByteSize()
            if size > self.max_message_bytes:
                field = "include_call_plans" if getattr(request, "include_call_plans", False) else "response"
                raise _AbortRpcError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{field}: the response would be {size} bytes, over the server's message limit of "
                    f"{self.max_message_bytes} bytes"
                    + (
                        "; plan the microbatches' calls with PlanCalls"
                        if field == "include_call_plans"
                        else ""
                    ),
                    field,
                )
            record["code"] = "OK"
            return response
        except _AbortRpcError as a:
            record.update(code=a.code.name, field=a.field, error=a.message)
            context.abort_with_status(_rich_status(a))
        except HartsError as e:
            a = _from_harts(e)
            record.update(code=a.code.name, field=a.field, error=a.message)
            context.abort_with_status(_rich_status(a))
        except Exception as e:  # a bug: report INTERNAL, keep serving
            record.update(code="INTERNAL", error=f"{type(e).__name__}: {e}")
            self.logger.exception("unexpected error in %s", method)
            context.abort(grpc.StatusCode.INTERNAL, f"internal planner error: {type(e).__name__}: {e}")
        finally:
            record["total_ms"] = round((time.perf_counter() - start) * 1e3, 3)
            level = logging.INFO if record.get("code") == "OK" else logging.WARNING
            self.logger.log(level, "rpc", extra={"fields": record})
            with self._lock:
                self._inflight -= 1
                self._lock.notify_all()

    @staticmethod
    def _check_deadline(context, phase: str) -> None:
        remaining = context.time_remaining()
        if (remaining is not None and remaining <= 0) or not context.is_active():
            raise _AbortRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded before {phase}")

    def _ingest(self, request, context, record):
        self._check_deadline(context, "decoding")
        t0 = time.perf_counter()
        source = codec.decode_trajectories(request.trajectories)
        record["input"] = "tree" if isinstance(source, codec.SegmentTree) else "tokens"
        t1 = time.perf_counter()
        batch = codec.ingest(source, wire=True)
        t2 = time.perf_counter()
        record.update(
            trajectories=batch.num_trajectories,
            semantic_tokens=batch.semantic_tokens,
            compact_tokens=batch.compact_tokens,
            segments=batch.num_segments,
            decode_ms=round((t1 - t0) * 1e3, 3),
            ingest_ms=round((t2 - t1) * 1e3, 3),
        )
        return batch, t1 - t0, t2 - t1

    def _plan_step(self, request, context, record):
        args = codec.decode_plan_step_request(request)
        batch, decode_s, ingest_s = self._ingest(request, context, record)
        self._check_deadline(context, "planning")
        t0 = time.perf_counter()
        try:
            plan = plan_step_with_calls(
                batch,
                args["dp_size"],
                args["capacity"],
                args["chunk_size"],
                args["options"],
                args["call_plans"],
                args["conv_width"],
                debug=args["debug"],
                check=lambda: self._check_deadline(context, "the next call plan"),
            )
        except HartsError as e:
            raise codec.renamed(e, codec.OPTION_FIELDS) from None
        t1 = time.perf_counter()
        self._check_deadline(context, "encoding")
        response = pb.PlanStepResponse(plan=codec.encode_step_plan(plan))
        if args["call_plans"]:
            response.call_plans.extend(codec.encode_call_plan(c) for c in plan.call_plans())
        _finish(
            response,
            record,
            batch,
            (decode_s, ingest_s, t1 - t0, time.perf_counter() - t1),
            dp_size=args["dp_size"],
            capacity=args["capacity"],
            microbatches=plan.num_microbatches,
            total_work=plan.total_work,
            call_plans=args["call_plans"],
        )
        return response

    def _plan_calls(self, request, context, record):
        args = codec.decode_plan_calls_request(request)
        batch, decode_s, ingest_s = self._ingest(request, context, record)
        self._check_deadline(context, "planning")
        t0 = time.perf_counter()
        try:
            plan = plan_calls(
                batch, args["chunk_size"], trajectories=args["microbatch"], conv_width=args["conv_width"]
            )
        except HartsError as e:
            raise codec.renamed(e, {"trajectories": "microbatch"}) from None
        t1 = time.perf_counter()
        self._check_deadline(context, "encoding")
        response = pb.PlanCallsResponse(plan=codec.encode_call_plan(plan, debug=args["debug"]))
        _finish(
            response,
            record,
            batch,
            (decode_s, ingest_s, t1 - t0, time.perf_counter() - t1),
            chunk_size=args["chunk_size"],
            calls=plan.num_calls,
            replay_tokens=plan.replay_tokens,
        )
        return response


def _finish(response, record: dict, batch, seconds: tuple, **fields) -> None:
    """Both RPCs' epilogue: the response's PlanStats (``seconds`` = decode, ingest, plan, encode)
    and the request's log record (its ``fields`` plus plan and encode milliseconds)."""
    decode_s, ingest_s, plan_s, encode_s = seconds
    response.stats.CopyFrom(
        codec.stats_message(
            batch,
            decode_seconds=decode_s,
            ingest_seconds=ingest_s,
            plan_seconds=plan_s,
            encode_seconds=encode_s,
        )
    )
    record.update(fields, plan_ms=round(plan_s * 1e3, 3), encode_ms=round(encode_s * 1e3, 3))


# ---------------------------------------------------------------------------------- server
class PlannerServer:
    """A started planner server: ``.port``, ``.address``, :meth:`drain`, :meth:`stop`."""

    def __init__(
        self,
        server: grpc.Server,
        servicer: PlannerServicer,
        health_servicer: health.HealthServicer,
        host: str,
        port: int,
    ):
        self.server = server
        self.servicer = servicer
        self.health = health_servicer
        self.host = host
        self.port = port
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        """``host:port`` to give clients (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    def drain(self, grace: float = DEFAULT_GRACE_SECONDS) -> bool:
        """Graceful shutdown: health NOT_SERVING, refuse new plans, wait up to ``grace`` seconds for
        in-flight plans, then stop. Returns True when every in-flight plan finished."""
        self.health.enter_graceful_shutdown()
        self.servicer.begin_drain()
        LOGGER.info(
            "drain",
            extra={"fields": {"event": "drain", "inflight": self.servicer.inflight, "grace_s": grace}},
        )
        finished = self.servicer.wait_idle(grace)
        self.stop(grace=1.0)
        LOGGER.info("stopped", extra={"fields": {"event": "stopped", "drained": finished}})
        return finished

    def stop(self, grace: float | None = None) -> None:
        """Stop now (in-flight RPCs get ``grace`` seconds)."""
        self.server.stop(grace).wait()
        self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> PlannerServer:
        return self

    def __exit__(self, *exc) -> None:
        if not self._stopped.is_set():
            self.stop(grace=None)


def create_server(
    address: str = f"{DEFAULT_HOST}:0",
    *,
    workers: int | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> PlannerServer:
    """Build and start a planner server on ``address`` (``host:port``; port 0 picks a free one).

    Raises ``RuntimeError`` when the address cannot be bound.
    """
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers: must be >= 1, got {workers}")
    if max_message_bytes < 1:
        raise ValueError(f"max_message_bytes: must be >= 1, got {max_message_bytes}")
    max_message_bytes = min(int(max_message_bytes), 2**31 - 1)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="harts-planner"),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    servicer = PlannerServicer(max_message_bytes=max_message_bytes)
    handlers = {
        "PlanStep": grpc.unary_unary_rpc_method_handler(
            servicer.PlanStep,
            request_deserializer=_deserializer(pb.PlanStepRequest),
            response_serializer=pb.PlanStepResponse.SerializeToString,
        ),
        "PlanCalls": grpc.unary_unary_rpc_method_handler(
            servicer.PlanCalls,
            request_deserializer=_deserializer(pb.PlanCallsRequest),
            response_serializer=pb.PlanCallsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(codec.SERVICE_NAME, handlers),))
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
    host, _, port_text = address.rpartition(":")
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise RuntimeError(f"cannot bind {address}: {e}") from None
    if port == 0 and port_text != "0":
        raise RuntimeError(f"cannot bind {address}")
    server.start()
    for service in ("", codec.SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return PlannerServer(server, servicer, health_servicer, host.strip("[]") or DEFAULT_HOST, port)


# ---------------------------------------------------------------------------------- logging
class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, message and the record's ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``time level key=value ...`` lines."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        body = " ".join(f"{k}={v}" for k, v in fields.items()) if fields else record.getMessage()
        text = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname} {body}"
        return text + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


def configure_logging(log_format: str = "json", level: int = logging.INFO, stream=None) -> None:
    """Send ``harts_planner.rpc`` records to ``stream`` (stderr) as JSON lines or text."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    LOGGER.handlers[:] = [handler]
    LOGGER.setLevel(level)
    LOGGER.propagate = False


# ---------------------------------------------------------------------------------- entry points
def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    workers: int | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    grace: float = DEFAULT_GRACE_SECONDS,
    log_format: str = "json",
) -> int:
    """Run a sidecar until SIGTERM or SIGINT, then drain (see :meth:`PlannerServer.drain`).

    Prints ``harts-planner: serving on HOST:PORT`` to stdout once it accepts requests. Returns 0
    after a complete drain, 1 when in-flight plans were cut off after ``grace`` seconds.
    """
    configure_logging(log_format)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    server = create_server(address, workers=workers, max_message_bytes=max_message_bytes)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    LOGGER.info(
        "serving",
        extra={
            "fields": {
                "event": "serving",
                "address": server.address,
                "workers": workers or default_workers(),
                "max_message_bytes": server.servicer.max_message_bytes,
                "pid": os.getpid(),
            }
        },
    )
    print(f"harts-planner: serving on {server.address}", flush=True)
    while not stop.wait(0.5):
        pass
    return 0 if server.drain(grace) else 1


class SidecarProcess:
    """A ``harts-planner serve`` child process on a free port (for tests and benchmarks).

    ``with SidecarProcess(workers=2) as sidecar: Planner(sidecar.address)``; leaving the block
    sends SIGTERM and waits for the drain.
    """

    def __init__(
        self,
        *,
        workers: int | None = None,
        max_message_bytes: int | None = None,
        grace: float = 30.0,
        log_path: str | None = None,
        startup_timeout: float = 60.0,
    ):
        cmd = [sys.executable, "-m", "harts_planner.cli", "serve", "--port", "0", "--grace", str(grace)]
        if workers is not None:
            cmd += ["--workers", str(workers)]
        if max_message_bytes is not None:
            cmd += ["--max-message-bytes", str(max_message_bytes)]
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.address = self._read_address(startup_timeout)

    def _read_address(self, timeout: float) -> str:
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        line = result[0] if result else ""
        prefix = "harts-planner: serving on "
        if not line.startswith(prefix):
            self.proc.kill()
            raise RuntimeError(f"sidecar did not start (exit code {self.proc.poll()}, said {line!r})")
        return line[len(prefix) :].strip()

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the drain; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self._log is not subprocess.DEVNULL:
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
    "PlannerServer",
    "PlannerServicer",
    "SidecarProcess",
    "create_server",
    "serve",
    "configure_logging",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_MAX_MESSAGE_BYTES",
]
