"""The planner sidecar: a grpcio server around the C++ planner core.

* ``harts.planner.v1.PlannerService`` (``PlanStep``, ``PlanCalls``) and the stock health service
  (``grpc.health.v1``; service ``""`` and the planner's full name) and server reflection.
* Two stages per request. *Admission*, on the RPC's own thread and before any planner thread is
  taken: parse and check the scalars (packed tokens also get the vectorized checks ingestion starts
  with); estimate from the request alone what the plan will need (:func:`harts_planner.estimate_cost`,
  which validates a segment tree in O(V + N): rows, memory, response bytes) and refuse it when that
  exceeds the server's :mod:`~harts_planner.rpc.limits`, before any other work; then index a segment
  tree (O(V + N log N)) and run the step planner's up-front checks. A bad request is answered here,
  without waiting behind running plans; an unaffordable one is refused with RESOURCE_EXHAUSTED naming
  the field and the limit. *Planning*, on one of ``workers`` planner threads (the core releases the
  GIL): ingestion of packed tokens, the plan, the response. A request waits for a planner thread, and
  for room in the plan-memory budget the plans running at once share, first come first served and for
  as long as its deadline allows; at most ``max_queued`` wait (more get RESOURCE_EXHAUSTED).
* Limits (:class:`harts_planner.rpc.limits.Limits`): messages up to ``max_message_bytes`` each way
  (1 GiB by default; gRPC refuses a larger request with RESOURCE_EXHAUSTED before it is parsed), the
  cost limits, and at most ``max_inflight_bytes`` of requests held at once (RESOURCE_EXHAUSTED).
* Errors: bad requests get INVALID_ARGUMENT / RESOURCE_EXHAUSTED / FAILED_PRECONDITION with a
  message and a google.rpc detail naming the request field (the table of
  :mod:`harts_planner.rpc.status`); unparsable bytes are INVALID_ARGUMENT on field ``request``;
  anything unexpected is INTERNAL and logged. The server keeps serving either way.
* Deadlines and cancellation: each request has a cancel token (:class:`RequestControl`) that expires
  with the RPC's deadline and is cancelled when the client cancels; it is checked while the request
  waits for a planner thread and between phases, and the planner polls it inside its loops
  (``cancel=``), so an abandoned plan frees its thread within milliseconds. The log line then says
  DEADLINE_EXCEEDED or CANCELLED.
* Logging: one structured record per RPC (logger ``harts_planner.rpc``; JSON lines with
  ``serve(log_format="json")``): method, peer, status, input kind, sizes, estimates, phase times.
* Graceful shutdown (:meth:`PlannerServer.drain`, run by ``serve`` on SIGTERM/SIGINT): health goes
  NOT_SERVING; queued and new requests get UNAVAILABLE at once; in-flight plans get ``grace`` seconds,
  then are cancelled through their tokens (UNAVAILABLE); then the server stops.

``create_server("127.0.0.1:0")`` gives a started server on a free port (``.port``), as tests use.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np
from google.protobuf.message import DecodeError, EncodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from harts_planner import checks
from harts_planner.call_plan import plan_calls, set_max_plan_bytes
from harts_planner.errors import CancelToken, HartsError, PlanCancelledError
from harts_planner.rpc import codec, status
from harts_planner.rpc import limits as _limits
from harts_planner.rpc import planner_pb2 as pb
from harts_planner.rpc.client import DEFAULT_MAX_MESSAGE_BYTES
from harts_planner.rpc.codec import PackedTokens, SegmentTree
from harts_planner.step_plan import estimate_call_plans, estimate_cost, plan_step

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_GRACE_SECONDS = 300.0
#: After the grace period: how long cancelled plans get to stop before the server gives up on them.
CANCEL_WAIT_SECONDS = 5.0
#: RPC threads beyond the planner threads and the queue (health checks, admission of new requests).
SPARE_THREADS = 8
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


def _serialized(data: bytes) -> bytes:
    """The response serializer: handlers return their response serialized already."""
    return data


def _deserializer(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except (DecodeError, RecursionError) as e:
            return _Unparsable(cls.DESCRIPTOR.full_name, str(e) or type(e).__name__)

    return parse


# ---------------------------------------------------------------------------------- one request
class RequestControl:
    """Cancellation of one RPC: a deadline (the RPC's), a cancelled flag and the
    :class:`harts_planner.CancelToken` the planner polls inside its loops.

    The token is cancelled when the RPC terminates early (the client cancelled, or its deadline
    passed: gRPC calls back) and when the server cuts the plan off (:meth:`cancel` at the end of a
    drain's grace). ``wake`` is called on every cancellation (the servicer wakes waiting requests).
    """

    def __init__(self, context, wake=None):
        self.context = context
        self._wake = wake
        self._lock = threading.Lock()
        self.reason: str | None = None  # "client", "deadline" or "shutdown" once cancelled
        self.waiter = None  # while it waits for a planner thread (the servicer's)
        self.grant = None  # while it holds one
        self._done = False
        remaining = context.time_remaining() if context is not None else None
        self.deadline = None if remaining is None else time.monotonic() + max(remaining, 0.0)
        self.token = CancelToken()
        if remaining is not None:
            self.token.set_deadline(max(remaining, 0.0))
        if context is not None and not context.add_callback(self._terminated):
            self._terminated()  # the RPC has already ended

    def _terminated(self) -> None:
        """gRPC's callback: the RPC ended (completed, cancelled by the client, or past its deadline;
        gRPC's clock may run a little ahead of ours, hence the margin)."""
        if not self._done:
            remaining = self.remaining()
            self.cancel("deadline" if remaining is not None and remaining < 0.05 else "client")

    def cancel(self, reason: str) -> None:
        """Stop this request's plan (the planner stops at its next poll); thread-safe."""
        with self._lock:
            if self.reason is None:
                self.reason = reason
        self.token.cancel()
        if self._wake is not None:
            self._wake(self)

    def finish(self) -> None:
        """The handler is done: later callbacks are not cancellations."""
        self._done = True

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def stop_status(self) -> _AbortRpcError | None:
        """Why this request must stop now (DEADLINE_EXCEEDED, CANCELLED, UNAVAILABLE), or None."""
        if self.reason == "deadline" or self.expired():
            return _AbortRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", "deadline")
        if self.reason == "shutdown":
            return _AbortRpcError(
                grpc.StatusCode.UNAVAILABLE,
                "the server shut down before the plan finished; retry on another planner",
            )
        if self.reason is not None or (self.context is not None and not self.context.is_active()):
            return _AbortRpcError(grpc.StatusCode.CANCELLED, "the client cancelled the request")
        return None

    def check(self, phase: str) -> None:
        """Raise the stop status (its message says which phase was next), if any."""
        stop = self.stop_status()
        if stop is not None:
            stop.message = f"{stop.message} before {phase}"
            raise stop

    def from_cancelled(self, err: PlanCancelledError) -> _AbortRpcError:
        """The status of a plan the planner stopped (``PlanCancelledError``)."""
        stop = self.stop_status()
        if stop is None:  # the token's own clock ran out first
            stop = _AbortRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", "deadline")
        stop.message = f"{stop.message} ({err})"
        return stop


@dataclass
class _Job:
    """An admitted request: its arguments, its trajectories and what is known of its batch."""

    args: dict
    source: object
    batch: object | None  # the batch of a segment tree (built at admission), None for tokens
    cost: _limits.Cost
    decode_s: float = 0.0  # request -> arrays
    ingest_s: float = 0.0  # arrays -> batch (a tree: at admission; tokens: on a planner thread)


class _Waiter:
    """A request's claim on a planner thread and ``memory`` bytes of the plan-memory budget: set
    ``event`` to wake it; ``granted`` once it holds them."""

    __slots__ = ("event", "granted", "memory")

    def __init__(self, memory: int):
        self.event = threading.Event()
        self.granted = False
        self.memory = memory


def _unavailable() -> _AbortRpcError:
    return _AbortRpcError(grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another planner")


# ---------------------------------------------------------------------------------- servicer
class PlannerServicer:
    """Handlers of PlanStep and PlanCalls: admission, planner threads, draining."""

    def __init__(
        self,
        *,
        workers: int | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        limits: _limits.Limits = _limits.DEFAULT,
        logger: logging.Logger = LOGGER,
    ):
        self.workers = default_workers() if workers is None else workers
        self.max_message_bytes = max_message_bytes
        self.limits = limits
        self.logger = logger
        self._lock = threading.Condition()
        self._active = 0  # RPCs inside a handler
        self._planning = 0  # RPCs holding a planner thread
        self._reserved = 0  # their estimated memory (bytes), at most max_plan_memory_bytes unless alone
        self._queued = 0  # RPCs waiting for one
        self._inflight_bytes = 0
        self._draining = False
        self._controls: set[RequestControl] = set()
        # Requests waiting for a planner thread, first come first served; a finished plan hands its
        # thread to the first one directly (no thundering herd of wake-ups).
        self._waiters: collections.deque[_Waiter] = collections.deque()

    # ------------------------------------------------------------------ state
    @property
    def inflight(self) -> int:
        """Requests inside a handler (admission, queued or planning)."""
        with self._lock:
            return self._active

    def counts(self) -> dict:
        with self._lock:
            return {
                "active": self._active,
                "planning": self._planning,
                "reserved_bytes": self._reserved,
                "queued": self._queued,
                "inflight_bytes": self._inflight_bytes,
            }

    def _wake(self, control: RequestControl) -> None:
        """A request was cancelled: wake it if it waits for a planner thread."""
        with self._lock:
            if control.waiter is not None:
                control.waiter.event.set()

    def begin_drain(self) -> None:
        """Refuse new plans (UNAVAILABLE) from now on; requests waiting for a planner thread get
        UNAVAILABLE at once."""
        with self._lock:
            self._draining = True
            for waiter in self._waiters:
                waiter.event.set()
            self._lock.notify_all()

    def cancel_inflight(self) -> int:
        """Cancel every request in a handler through its token (UNAVAILABLE); returns how many."""
        with self._lock:
            controls = list(self._controls)
        for c in controls:
            c.cancel("shutdown")
        return len(controls)

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is in a handler; False when ``timeout`` passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: self._active == 0, timeout)

    # ------------------------------------------------------------------ RPCs
    def PlanStep(self, request, context):  # noqa: N802 (gRPC method name)
        return self._serve("PlanStep", request, context, self._admit_step, self._plan_step)

    def PlanCalls(self, request, context):  # noqa: N802
        return self._serve("PlanCalls", request, context, self._admit_calls, self._plan_calls)

    def _enter(self, size: int, context) -> RequestControl:
        """Count the request in (its bytes against the in-flight bound) and make its control."""
        with self._lock:
            if self._draining:
                raise _unavailable()
            bound = self.limits.max_inflight_bytes
            if self._inflight_bytes + size > bound and self._inflight_bytes > 0:
                raise _AbortRpcError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"request: {size:,} bytes would bring the requests this server holds to "
                    f"{self._inflight_bytes + size:,} bytes, over its limit of {bound:,} (--max-inflight-mb); "
                    "retry later or on another planner",
                    "request",
                )
            self._inflight_bytes += size
        control = RequestControl(context, self._wake)
        with self._lock:
            self._controls.add(control)
        return control

    def _leave(self, size: int, control: RequestControl | None) -> None:
        with self._lock:
            self._inflight_bytes -= size
            self._active -= 1
            if control is not None:
                self._controls.discard(control)
            self._lock.notify_all()

    @contextlib.contextmanager
    def _planner_thread(self, control: RequestControl, record: dict, memory: int):
        """Hold one of the ``workers`` planner threads and ``memory`` bytes of the plan-memory budget
        (``max_plan_memory_bytes``, shared by the plans running at once); wait for both, first come
        first served, while the request's deadline allows. Raises UNAVAILABLE when draining,
        RESOURCE_EXHAUSTED when ``max_queued`` wait already, DEADLINE_EXCEEDED / CANCELLED when the
        request stops waiting."""
        t0 = time.perf_counter()
        with self._lock:
            if self._draining:
                raise _unavailable()
            waiter = _Waiter(memory)
            if not self._waiters and self._fits_locked(memory):
                self._grant_locked(waiter)
            else:
                if self._queued >= self.limits.max_queued:
                    raise _AbortRpcError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"request: {self._queued} requests already wait for this server's {self.workers} "
                        f"planner threads, its limit (--max-queued {self.limits.max_queued}); retry later or "
                        "on another planner",
                        "request",
                    )
                control.waiter = waiter
                self._waiters.append(waiter)
                self._queued += 1
        if not waiter.granted:
            self._wait_for_thread(waiter, control)
        control.grant = waiter
        record["queue_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        try:
            yield
        finally:
            with self._lock:
                control.grant = None
                self._release_locked(waiter)

    def reserve_more(self, control: RequestControl, memory: int) -> None:
        """A running plan needs ``memory`` more bytes than it reserved (its call plans, costed once
        its microbatches are known): counted at once (the per-request limit was checked)."""
        with self._lock:
            if control.grant is not None and memory > 0:
                control.grant.memory += memory
                self._reserved += memory

    def _fits_locked(self, memory: int) -> bool:
        return self._planning < self.workers and (
            self._reserved == 0 or self._reserved + memory <= self.limits.max_plan_memory_bytes
        )

    def _grant_locked(self, waiter: _Waiter) -> None:
        self._planning += 1
        self._reserved += waiter.memory
        waiter.granted = True
        waiter.event.set()

    def _release_locked(self, waiter: _Waiter) -> None:
        """A plan is done with its thread and memory: hand them on, first come first served."""
        self._planning -= 1
        self._reserved -= waiter.memory
        self._dispatch_locked()

    def _dispatch_locked(self) -> None:
        while self._waiters and self._fits_locked(self._waiters[0].memory):
            self._grant_locked(self._waiters.popleft())

    def _wait_for_thread(self, waiter: _Waiter, control: RequestControl) -> None:
        """Wait until a finished plan hands ``waiter`` a thread; leave the queue (and pass on what was
        handed over meanwhile) when the request stops waiting."""
        try:
            while True:
                with self._lock:  # every event.set() is under the lock too: none is lost
                    stop = _unavailable() if self._draining else control.stop_status()
                    if waiter.granted:
                        if stop is None:
                            return
                        self._release_locked(waiter)  # handed over as it gave up: pass it on
                    elif stop is not None:
                        self._waiters.remove(waiter)
                        self._dispatch_locked()  # it may have held up the queue
                    if stop is not None:
                        if stop.code != grpc.StatusCode.UNAVAILABLE:
                            stop.message = f"{stop.message} before a planner thread was free"
                        raise stop
                    waiter.event.clear()
                remaining = control.remaining()
                waiter.event.wait(1.0 if remaining is None else min(max(remaining, 0.0) + 1e-3, 1.0))
        finally:
            with self._lock:
                self._queued -= 1
                control.waiter = None

    def _serve(self, method: str, request, context, admit, plan):
        start = time.perf_counter()
        record: dict = {"event": "rpc", "method": method, "peer": context.peer()}
        held, control = 0, None  # request bytes counted in, the request's control
        with self._lock:
            self._active += 1
        try:
            if isinstance(request, _Unparsable):
                raise _AbortRpcError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"request: not a valid {request.type_name} message ({request.error})",
                    "request",
                )
            record["request_bytes"] = size = request.ByteSize()
            control = self._enter(size, context)
            held = size
            try:
                job = admit(request, control, record)
                record["admit_ms"] = round((time.perf_counter() - start) * 1e3, 3)
                control.check("planning")
                with self._planner_thread(control, record, job.cost.memory_bytes):
                    response = plan(job, control, record)
            except PlanCancelledError as e:  # the planner stopped at the request's token
                raise control.from_cancelled(e) from None
            record["response_bytes"] = response_size = response.ByteSize()
            response_limit = self.limits.response_limit(self.max_message_bytes)
            if response_size > response_limit:
                field = "include_call_plans" if getattr(request, "include_call_plans", False) else "response"
                raise _AbortRpcError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{field}: the response would be {response_size:,} bytes, over the server's limit of "
                    f"{response_limit:,} bytes"
                    + (
                        "; plan the microbatches' calls with PlanCalls"
                        if field == "include_call_plans"
                        else ""
                    ),
                    field,
                )
            control.check("sending the response")
            t0 = time.perf_counter()
            data = response.SerializeToString()  # here, so that a failure is ours to report
            del response
            record["serialize_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
            record["code"] = "OK"
            return data
        except _AbortRpcError as a:
            record.update(code=a.code.name, field=a.field, error=a.message)
            context.abort_with_status(_rich_status(a))
        except HartsError as e:
            a = _from_harts(e)
            record.update(code=a.code.name, field=a.field, error=a.message)
            context.abort_with_status(_rich_status(a))
        except (MemoryError, EncodeError):  # an estimate fell short: refuse, keep serving
            record.update(code="RESOURCE_EXHAUSTED", field="request", error="out of memory")
            context.abort_with_status(
                _rich_status(
                    _AbortRpcError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "request: the server ran out of memory planning it",
                        "request",
                    )
                )
            )
        except Exception as e:  # a bug: report INTERNAL, keep serving
            record.update(code="INTERNAL", error=f"{type(e).__name__}: {e}")
            self.logger.exception("unexpected error in %s", method)
            context.abort(grpc.StatusCode.INTERNAL, f"internal planner error: {type(e).__name__}: {e}")
        finally:
            if control is not None:
                control.finish()
            record["total_ms"] = round((time.perf_counter() - start) * 1e3, 3)
            level = logging.INFO if record.get("code") == "OK" else logging.WARNING
            self.logger.log(level, "rpc", extra={"fields": record})
            self._leave(held, control)

    # ------------------------------------------------------------------ admission
    def _check_cost(self, cost: _limits.Cost, record: dict) -> _limits.Cost:
        record["estimate"] = {
            "rows": cost.rows,
            "memory_bytes": cost.memory_bytes,
            "response_bytes": cost.response_bytes,
        }
        cost.check(self.limits, self.max_message_bytes)
        return cost

    def _admit_source(self, request, control, record):
        """Decode the trajectories; give packed tokens the checks ingestion starts with. Returns
        (source, decode seconds)."""
        t0 = time.perf_counter()
        source = codec.decode_trajectories(request.trajectories)
        record["input"] = "tree" if isinstance(source, SegmentTree) else "tokens"
        if isinstance(source, PackedTokens):
            codec.validate_packed(source)
            record.update(trajectories=source.num_trajectories, semantic_tokens=len(source.tokens))
        record["decode_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        return source, time.perf_counter() - t0

    def _estimate(self, source, control, record, args: dict, *, step: bool) -> _limits.Cost:
        """What the request will cost (:func:`harts_planner.estimate_cost`: exact for a segment tree,
        which it validates in O(V + N); bounds for packed tokens, from their offsets), checked against
        the server's limits before any other work. A step's call plans depend on its microbatches:
        here they are checked against a floor (every compact row of a tree at least once), and
        exactly once the step is planned (:meth:`_step_call_plans`)."""
        try:
            cost = estimate_cost(
                source,
                request="step" if step else "calls",
                microbatch=None if step else args["microbatch"],
                chunk_size=args["chunk_size"],
                conv_width=args["conv_width"],
                debug=args["debug"],
                options=args["options"] if step else None,
                cancel=control.token,
            )
        except HartsError as e:
            fields = codec.TREE_FIELDS if isinstance(source, SegmentTree) else codec.PACKED_FIELDS
            raise codec.renamed(e, {**fields, **codec.OPTION_FIELDS}) from None
        tokens = isinstance(source, PackedTokens)
        checked = self._check_cost(_limits.of_plan_cost(cost, tokens=tokens), record)
        if step and args["call_plans"] and not tokens:
            floor = _limits.Cost(cost.compact_tokens, 0, 0, "include_call_plans", _limits.CALLS_HINT)
            floor.check(self.limits, self.max_message_bytes)
        return checked

    def _ingest_tree(self, source, control, record):
        """A segment tree's batch (O(V + N log N), no per-row work), or None for packed tokens
        (ingested on a planner thread). Returns (batch, seconds)."""
        if not isinstance(source, SegmentTree):
            return None, 0.0
        t0 = time.perf_counter()
        batch = codec.ingest(source, wire=True, cancel=control.token)
        record.update(
            trajectories=batch.num_trajectories,
            semantic_tokens=batch.semantic_tokens,
            compact_tokens=batch.compact_tokens,
            segments=batch.num_segments,
            ingest_ms=round((time.perf_counter() - t0) * 1e3, 3),
        )
        return batch, time.perf_counter() - t0

    def _admit_step(self, request, control, record) -> _Job:
        args = codec.decode_plan_step_request(request)
        source, decode_s = self._admit_source(request, control, record)
        cost = self._estimate(source, control, record, args, step=True)
        batch, ingest_s = self._ingest_tree(source, control, record)
        lengths = batch.lengths if batch is not None else np.diff(source.offsets)
        try:
            codec.check_step(lengths, args["dp_size"], args["capacity"], args["options"])
        except HartsError as e:
            raise codec.renamed(e, codec.OPTION_FIELDS) from None
        return _Job(args, source, batch, cost, decode_s, ingest_s)

    def _admit_calls(self, request, control, record) -> _Job:
        args = codec.decode_plan_calls_request(request)
        source, decode_s = self._admit_source(request, control, record)
        cost = self._estimate(source, control, record, args, step=False)
        batch, ingest_s = self._ingest_tree(source, control, record)
        return _Job(args, source, batch, cost, decode_s, ingest_s)

    # ------------------------------------------------------------------ planning
    def _batch(self, job: _Job, control: RequestControl, record: dict):
        """The job's batch: built at admission (tree) or ingested now (tokens)."""
        if job.batch is not None:
            return job.batch, job.ingest_s
        control.check("ingestion")
        t0 = time.perf_counter()
        batch = codec.ingest(job.source, wire=True, cancel=control.token)
        record.update(compact_tokens=batch.compact_tokens, segments=batch.num_segments)
        return batch, time.perf_counter() - t0

    def _plan_step(self, job: _Job, control: RequestControl, record: dict):
        args = job.args
        batch, ingest_s = self._batch(job, control, record)
        control.check("planning")
        t0 = time.perf_counter()
        try:
            plan = plan_step(
                batch,
                args["dp_size"],
                args["capacity"],
                args["chunk_size"],
                cancel=control.token,
                **args["options"],
            )
        except HartsError as e:
            raise codec.renamed(e, codec.OPTION_FIELDS) from None
        t1 = time.perf_counter()
        record.update(microbatches=plan.num_microbatches, total_work=plan.total_work)
        response = pb.PlanStepResponse(plan=codec.encode_step_plan(plan))
        encode_s = time.perf_counter() - t1
        calls_s = 0.0
        if args["call_plans"]:
            calls_s, encode_calls_s = self._step_call_plans(plan, batch, job, control, record, response)
            encode_s += encode_calls_s
        _finish(
            response,
            record,
            batch,
            (job.decode_s, ingest_s, t1 - t0 + calls_s, encode_s),
            dp_size=args["dp_size"],
            capacity=args["capacity"],
            microbatches=plan.num_microbatches,
            total_work=plan.total_work,
            call_plans=args["call_plans"],
        )
        return response

    def _step_call_plans(self, plan, batch, job, control, record, response) -> tuple[float, float]:
        """Every microbatch's call plan into ``response``, after checking their cost now that the
        microbatches (and their compact work) are known; each plan is encoded and dropped at once.
        Returns (planning seconds, encoding seconds)."""
        args = job.args
        exact = estimate_call_plans(
            batch, plan.microbatches, args["chunk_size"], args["conv_width"], args["debug"], control.token
        )
        total = self._check_cost(_limits.of_plan_cost(exact), record)
        self.reserve_more(control, total.memory_bytes - job.cost.memory_bytes)
        plan_s = encode_s = 0.0
        for members in plan.microbatches:
            control.check("the next call plan")
            t0 = time.perf_counter()
            calls = plan_calls(
                batch,
                args["chunk_size"],
                trajectories=members,
                conv_width=args["conv_width"],
                cancel=control.token,
            )
            t1 = time.perf_counter()
            response.call_plans.append(codec.encode_call_plan(calls, debug=args["debug"]))
            del calls
            plan_s += t1 - t0
            encode_s += time.perf_counter() - t1
        return plan_s, encode_s

    def _plan_calls(self, job: _Job, control: RequestControl, record: dict):
        args = job.args
        batch, ingest_s = self._batch(job, control, record)
        control.check("planning")
        t0 = time.perf_counter()
        try:
            plan = plan_calls(
                batch,
                args["chunk_size"],
                trajectories=args["microbatch"],
                conv_width=args["conv_width"],
                cancel=control.token,
            )
        except HartsError as e:
            raise codec.renamed(e, {"trajectories": "microbatch"}) from None
        t1 = time.perf_counter()
        control.check("encoding")
        response = pb.PlanCallsResponse(plan=codec.encode_call_plan(plan, debug=args["debug"]))
        calls, replay = plan.num_calls, plan.replay_tokens
        del plan
        _finish(
            response,
            record,
            batch,
            (job.decode_s, ingest_s, t1 - t0, time.perf_counter() - t1),
            chunk_size=args["chunk_size"],
            calls=calls,
            replay_tokens=replay,
        )
        return response


def _finish(response, record: dict, batch, seconds: tuple, **fields) -> None:
    """Both RPCs' epilogue: the response's PlanStats (``seconds`` = decode, ingest, plan, encode)
    and the request's log record (its ``fields`` plus ingest, plan and encode milliseconds)."""
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
    record.update(
        fields,
        ingest_ms=round(ingest_s * 1e3, 3),
        plan_ms=round(plan_s * 1e3, 3),
        encode_ms=round(encode_s * 1e3, 3),
    )


# ---------------------------------------------------------------------------------- server
@dataclass
class DrainResult:
    """How a drain ended: ``finished`` every in-flight plan in the grace period; else ``cancelled``
    of them were cut off and ``stopped`` says whether they all stopped within CANCEL_WAIT_SECONDS."""

    finished: bool
    cancelled: int = 0
    stopped: bool = True

    def __bool__(self) -> bool:
        return self.finished

    @property
    def exit_code(self) -> int:
        """0 when nothing is left running (finished, or cancelled and stopped), else 1."""
        return 0 if self.finished or self.stopped else 1


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

    def drain(
        self, grace: float = DEFAULT_GRACE_SECONDS, *, cut: threading.Event | None = None
    ) -> DrainResult:
        """Graceful shutdown: health NOT_SERVING; queued and new requests get UNAVAILABLE at once;
        in-flight plans get ``grace`` seconds (fewer when ``cut`` is set meanwhile: a second signal),
        then are cancelled through their tokens and get CANCEL_WAIT_SECONDS to stop; then the server
        stops. Truthy when every in-flight plan finished."""
        self.health.enter_graceful_shutdown()
        self.servicer.begin_drain()
        counts = self.servicer.counts()
        LOGGER.info(
            "drain",
            extra={
                "fields": {
                    "event": "drain",
                    "inflight": counts["planning"],
                    "queued": counts["queued"],
                    "grace_s": grace,
                }
            },
        )
        deadline = time.monotonic() + grace
        finished = False
        while True:
            left = deadline - time.monotonic()
            if self.servicer.wait_idle(max(0.0, min(left, 0.1))):
                finished = True
                break
            if left <= 0 or (cut is not None and cut.is_set()):
                break
        result = DrainResult(finished)
        if not finished:
            result.cancelled = self.servicer.cancel_inflight()
            result.stopped = self.servicer.wait_idle(CANCEL_WAIT_SECONDS)
        self.stop(grace=0.5)
        LOGGER.info(
            "stopped",
            extra={
                "fields": {
                    "event": "stopped",
                    "drained": result.finished,
                    "cancelled": result.cancelled,
                    "stuck": not result.stopped,
                }
            },
        )
        return result

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


def create_server(
    address: str = f"{DEFAULT_HOST}:0",
    *,
    workers: int | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    limits: _limits.Limits = _limits.DEFAULT,
) -> PlannerServer:
    """Build and start a planner server on ``address`` (``host:port``; port 0 picks a free one).

    ``workers`` planner threads (default :func:`default_workers`); RPC threads are
    ``workers + limits.max_queued + SPARE_THREADS``, and gRPC itself refuses RPCs beyond them
    (RESOURCE_EXHAUSTED). Raises ValueError for a bad argument, ``RuntimeError`` when the address
    cannot be bound.
    """
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
    threads = workers + limits.max_queued + SPARE_THREADS
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="harts-planner"),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=threads,
    )
    servicer = PlannerServicer(workers=workers, max_message_bytes=max_message_bytes, limits=limits)
    handlers = {
        "PlanStep": grpc.unary_unary_rpc_method_handler(
            servicer.PlanStep,
            request_deserializer=_deserializer(pb.PlanStepRequest),
            response_serializer=_serialized,
        ),
        "PlanCalls": grpc.unary_unary_rpc_method_handler(
            servicer.PlanCalls,
            request_deserializer=_deserializer(pb.PlanCallsRequest),
            response_serializer=_serialized,
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
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port <= 0:
        raise RuntimeError(
            f"cannot bind {address}: the address is in use, not an address of this machine, or not valid"
        )
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


def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    workers: int | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    grace: float = DEFAULT_GRACE_SECONDS,
    log_format: str = "json",
    limits: _limits.Limits = _limits.DEFAULT,
) -> int:
    """Run a sidecar until SIGTERM or SIGINT, then drain (see :meth:`PlannerServer.drain`; a second
    signal ends the grace period at once).

    Prints ``harts-planner: serving on HOST:PORT`` to stdout once it accepts requests. Returns 0 once
    nothing is left running (every in-flight plan finished, or was cancelled and stopped), 1 when a
    cancelled plan did not stop (the caller should then end the process with ``os._exit``, as
    ``harts-planner serve`` does: a normal exit would wait for it). Raises ValueError / RuntimeError
    (cannot bind) before serving.
    """
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    # The planner's own backstop (max_plan_bytes) at the plan-memory budget: a plan whose estimate
    # was admitted but whose arrays would still outgrow the budget stops with RESOURCE_EXHAUSTED.
    set_max_plan_bytes(limits.max_plan_memory_bytes)
    cap_malloc_arenas((default_workers() if workers is None else workers) + 1)
    server = create_server(address, workers=workers, max_message_bytes=max_message_bytes, limits=limits)
    configure_logging(log_format)
    stop, cut = threading.Event(), threading.Event()

    def on_signal(signum, frame) -> None:
        (cut if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    LOGGER.info(
        "serving",
        extra={
            "fields": {
                "event": "serving",
                "address": server.address,
                "workers": server.servicer.workers,
                "max_message_bytes": server.servicer.max_message_bytes,
                "limits": {
                    "max_rows": limits.max_rows,
                    "max_plan_memory_bytes": limits.max_plan_memory_bytes,
                    "max_response_bytes": limits.response_limit(server.servicer.max_message_bytes),
                    "max_inflight_bytes": limits.max_inflight_bytes,
                    "max_queued": limits.max_queued,
                },
                "grace_s": grace,
                "pid": os.getpid(),
            }
        },
    )
    print(f"harts-planner: serving on {server.address}", flush=True)
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
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, preexec_fn=preexec_fn, env=env
        )
        self.address = self._read_address(startup_timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_address(self, timeout: float) -> str:
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        line = result[0] if result else ""
        prefix = "harts-planner: serving on "
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
    "DrainResult",
    "PlannerServer",
    "PlannerServicer",
    "RequestControl",
    "SidecarProcess",
    "create_server",
    "serve",
    "configure_logging",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_MAX_MESSAGE_BYTES",
]
