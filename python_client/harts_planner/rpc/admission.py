"""Admission and costing: what a call may hold, and whether a request may proceed.

Three parts, each used by the servicer (:mod:`harts_planner.rpc.servicer`):

* :class:`Guard`, a gRPC server interceptor that sees every call when it arrives, on gRPC's own
  thread, before any thread of a pool is taken: planner calls (PlanStep, PlanCalls and their
  ``*Stream`` forms) run on the planner pool, at most ``planner_calls`` at once; health and
  reflection calls on their own small pool, at most ``service_calls`` at once, so that no number of
  planner calls, stalled or not, delays a health check. When a class is full, the call of that
  class that has waited longest (at least :data:`EVICT_AFTER_SECONDS`) for a request it never got is
  cut off to make room: stalled streams cannot keep a live client out. Otherwise a call over its
  class's bound is refused at once (RESOURCE_EXHAUSTED) on a third, tiny pool. Service calls read
  their requests through :class:`GuardedReader` (the receive timeout, as planner calls).
* :class:`Budget`, the ledger of what calls hold: request bytes (every stream reserves what its next
  message may be before it reads it, then holds what it received and what admission built:
  ``--max-inflight-mb``), planner threads (``--workers``), the plan-memory budget shared by the plans
  running at once and the responses not yet delivered (``--max-plan-memory-mb``), and the queue
  (``--max-queued``). Over a bound, a call gets RESOURCE_EXHAUSTED naming the field and the flag;
  a plan that fits waits for a thread and room, first come first served (a small one may pass a
  big one that does not fit yet), while its deadline allows; a tiny plan (a few hundred
  trajectories: :data:`EXPRESS_PLAN_BYTES`) is made at once on its call's thread.
* :class:`Admission`, the checks and the cost of one request before it waits for a planner thread:
  its scalars, the vectorized checks ingestion starts with (packed tokens), the planner's cost
  estimate from the request alone (:func:`harts_planner.estimate_cost`; a segment tree is validated
  in O(V + N)) against :class:`~harts_planner.rpc.limits.Limits`, a segment tree's batch (O(V + N log
  N)) and the step planner's first checks.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np

from harts_planner import estimate_call_plans, estimate_cost
from harts_planner.errors import HartsError
from harts_planner.rpc import codec, control
from harts_planner.rpc import limits as _limits
from harts_planner.rpc.codec import PackedTokens, SegmentTree
from harts_planner.rpc.control import AbortRpcError, RequestControl, exhausted, unavailable

#: Planner methods (the servicer's); every other method is a service (health, reflection).
PLANNER_METHODS = tuple(
    f"/{codec.SERVICE_NAME}/{m}" for m in ("PlanStep", "PlanCalls", "PlanStepStream", "PlanCallsStream")
)
#: Health and reflection calls at once (their own threads).
SERVICE_CALLS = 16
#: Threads answering calls refused on arrival.
REFUSAL_THREADS = 4
#: A plan whose memory is at most this share of the budget may pass bigger ones waiting for room.
SMALL_SHARE = 64
#: A plan whose planner memory is at most this (a few hundred trajectories) is made at once on the
#: call's own thread, without waiting for a planner thread behind long plans.
EXPRESS_PLAN_BYTES = 2 << 20
#: A call that has waited this long for (the rest of) its request without receiving anything may be
#: cut off to make room for a new call when its class is full (a stalled stream cannot hold a slot
#: that a live client needs), by class: a health check's request is a few bytes; a planner call's
#: may be a whole message (--max-message-mb) whose progress the server cannot see.
EVICT_AFTER_SECONDS = {"service": 0.2, "planner": 0.25}


# ---------------------------------------------------------------------------------- the ledger
class Grant:
    """A call's planner thread and its ``memory`` bytes of the plan-memory budget."""

    __slots__ = ("event", "granted", "memory", "thread")

    def __init__(self, memory: int):
        self.event = threading.Event()
        self.granted = False
        self.memory = memory
        self.thread = False  # holds a planner thread


class Budget:
    """The ledger of the server's bounds (see the module docstring); thread-safe."""

    def __init__(self, workers: int, limits: _limits.Limits, max_message_bytes: int):
        self.workers = workers
        self.limits = limits
        self.max_message_bytes = max_message_bytes
        self._lock = threading.Condition()
        self._active = 0  # calls inside a handler (any phase)
        self._planning = 0  # calls holding a planner thread
        self._reserved = 0  # plan memory of the plans running and the responses not yet delivered
        self._queued = 0  # calls waiting for a planner thread
        self._held = 0  # request bytes held (receive reservations included)
        self._receiving = 0
        self._sending = 0
        self._draining = False
        self._controls: set[RequestControl] = set()
        self._waiters: collections.deque[Grant] = collections.deque()
        self._receivers: dict[RequestControl, str] = {}  # calls waiting for a request message: class

    # ------------------------------------------------------------------ state
    @property
    def draining(self) -> bool:
        return self._draining

    def counts(self) -> dict:
        with self._lock:
            return {
                "active": self._active,
                "planning": self._planning,
                "reserved_bytes": self._reserved,
                "queued": self._queued,
                "inflight_bytes": self._held,
                "receiving": self._receiving,
                "sending": self._sending,
            }

    def wake(self, ctl: RequestControl) -> None:
        """A call was cancelled: wake it if it waits for a planner thread."""
        with self._lock:
            if ctl.waiter is not None:
                ctl.waiter.event.set()

    def begin_drain(self) -> None:
        """Refuse new calls (UNAVAILABLE) from now on; calls waiting for a planner thread get
        UNAVAILABLE at once."""
        with self._lock:
            self._draining = True
            for waiter in self._waiters:
                waiter.event.set()
            self._lock.notify_all()

    def cancel_inflight(self) -> int:
        """Cut off every call in a handler (plans through their tokens, transfers by ending the
        RPC); returns how many."""
        with self._lock:
            controls = list(self._controls)
        for c in controls:
            c.cut_off("shutdown")
        return len(controls)

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no call is in a handler; False when ``timeout`` passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: self._active == 0, timeout)

    # ------------------------------------------------------------------ calls
    def enter(self, ctl: RequestControl) -> None:
        with self._lock:
            if self._draining:
                raise unavailable()
            self._active += 1
            self._controls.add(ctl)

    def leave(self, ctl: RequestControl) -> None:
        with self._lock:
            self._active -= 1
            self._controls.discard(ctl)
            self._lock.notify_all()

    def hold(self, size: int, field: str = "request", what: str = "request bytes") -> None:
        """Count ``size`` more bytes of requests held; RESOURCE_EXHAUSTED naming ``field`` when that
        would pass ``--max-inflight-mb`` (a request alone may pass it)."""
        if size <= 0:
            return
        with self._lock:
            bound = self.limits.max_inflight_bytes
            if self._held + size > bound and self._held > 0:
                raise exhausted(
                    field,
                    f"{size:,} {what} would bring the bytes this server holds for requests to "
                    f"{self._held + size:,}, over its limit of {bound:,} (--max-inflight-mb); "
                    "retry later or on another planner",
                )
            self._held += size

    def release(self, size: int) -> None:
        if size:
            with self._lock:
                self._held -= size
                self._lock.notify_all()

    def receiving(self, ctl: RequestControl, kind: str, waiting: bool) -> None:
        """``ctl`` (a call of class ``kind``) starts or stops waiting for a request message."""
        with self._lock:
            if waiting:
                self._receivers[ctl] = kind
                self._receiving += kind == "planner"
            elif self._receivers.pop(ctl, None) is not None:
                self._receiving -= kind == "planner"

    def evict_stalled(self, kind: str, min_age: float | None = None) -> bool:
        """Cut off the call of class ``kind`` that has waited longest (at least ``min_age`` seconds)
        for its request without receiving anything; True when there was one. Its slot, thread and
        receive reservation come free as soon as its handler sees it (milliseconds)."""
        now = time.monotonic()
        min_age = EVICT_AFTER_SECONDS[kind] if min_age is None else min_age
        with self._lock:
            stalled = [c for c, k in self._receivers.items() if k == kind and now - c.progress_at >= min_age]
            victim = min(stalled, key=lambda c: c.progress_at) if stalled else None
            if victim is not None:
                del self._receivers[victim]
                self._receiving -= kind == "planner"
        if victim is None:
            return False
        victim.cut_off("evicted")
        return True

    def wait_room(self, size: int, timeout: float) -> bool:
        """Wait until ``size`` more bytes of requests fit (or nothing is held)."""
        with self._lock:
            return self._lock.wait_for(
                lambda: self._held == 0 or self._held + size <= self.limits.max_inflight_bytes, timeout
            )

    def sending(self, delta: int) -> None:
        with self._lock:
            self._sending += delta

    # ------------------------------------------------------------------ planner threads
    def acquire(self, ctl: RequestControl, memory: int, express: bool = False) -> Grant:
        """A planner thread and ``memory`` bytes of the plan-memory budget, waited for while the
        call's deadline allows. An ``express`` plan (one the planner makes in well under a
        millisecond: :data:`EXPRESS_PLAN_BYTES`) takes no planner thread and waits for nobody when
        its memory fits. Raises UNAVAILABLE when draining, RESOURCE_EXHAUSTED when ``max_queued`` wait
        already, DEADLINE_EXCEEDED / CANCELLED when the call stops waiting."""
        with self._lock:
            if self._draining:
                raise unavailable()
            grant = Grant(memory)
            if express and self._reserved + memory <= self.limits.max_plan_memory_bytes:
                self._reserved += memory
                grant.granted = True
                ctl.grant = grant
                return grant
            if (not self._waiters or self._small(memory)) and self._fits_locked(memory):
                self._grant_locked(grant)
            else:
                if self._queued >= self.limits.max_queued:
                    raise exhausted(
                        "request",
                        f"{self._queued} requests already wait for this server's {self.workers} planner "
                        f"threads, its limit (--max-queued {self.limits.max_queued}); retry later or on "
                        "another planner",
                    )
                ctl.waiter = grant
                self._waiters.append(grant)
                self._queued += 1
        if not grant.granted:
            self._wait(grant, ctl)
        ctl.grant = grant
        return grant

    def reserve_more(self, ctl: RequestControl, memory: int) -> None:
        """A running plan needs ``memory`` more bytes than it reserved (its call plans, costed once
        its microbatches are known): counted at once (the per-request limit was checked)."""
        with self._lock:
            if ctl.grant is not None and memory > 0:
                ctl.grant.memory += memory
                self._reserved += memory

    def release_thread(self, grant: Grant) -> None:
        """The plan is made: its planner thread goes to the next waiter; its memory stays reserved
        until :meth:`release_memory` (the response is delivered)."""
        with self._lock:
            if grant.thread:
                grant.thread = False
                self._planning -= 1
                self._dispatch_locked()

    def release_memory(self, grant: Grant) -> None:
        with self._lock:
            if grant.thread:
                grant.thread = False
                self._planning -= 1
            self._reserved -= grant.memory
            grant.memory = 0
            self._dispatch_locked()

    def _small(self, memory: int) -> bool:
        return memory <= self.limits.max_plan_memory_bytes // SMALL_SHARE

    def _fits_locked(self, memory: int) -> bool:
        return self._planning < self.workers and (
            self._reserved == 0 or self._reserved + memory <= self.limits.max_plan_memory_bytes
        )

    def _grant_locked(self, grant: Grant) -> None:
        self._planning += 1
        self._reserved += grant.memory
        grant.granted = grant.thread = True
        grant.event.set()

    def _dispatch_locked(self) -> None:
        """Hand free threads and room on: first come first served; a small plan that fits may pass
        the head when the head does not fit."""
        while self._waiters and self._fits_locked(self._waiters[0].memory):
            self._grant_locked(self._waiters.popleft())
        if self._waiters and self._planning < self.workers:
            for grant in list(self._waiters):
                if self._small(grant.memory) and self._fits_locked(grant.memory):
                    self._waiters.remove(grant)
                    self._grant_locked(grant)

    def _wait(self, grant: Grant, ctl: RequestControl) -> None:
        """Wait until a thread and room are handed to ``grant``; leave the queue (and pass on what
        was handed over meanwhile) when the call stops waiting."""
        try:
            while True:
                with self._lock:  # every event.set() is under the lock too: none is lost
                    stop = unavailable() if self._draining else ctl.stop_status()
                    if grant.granted:
                        if stop is None:
                            return
                        self._planning -= 1  # handed over as it gave up: pass it on
                        grant.thread = False
                        self._reserved -= grant.memory
                        grant.memory = 0
                        self._dispatch_locked()
                    elif stop is not None:
                        self._waiters.remove(grant)
                        self._dispatch_locked()  # it may have held up the queue
                    if stop is not None:
                        if stop.code != grpc.StatusCode.UNAVAILABLE:
                            stop.message = f"{stop.message} before a planner thread was free"
                        raise stop
                    grant.event.clear()
                remaining = ctl.remaining()
                grant.event.wait(1.0 if remaining is None else min(max(remaining, 0.0) + 1e-3, 1.0))
        finally:
            with self._lock:
                self._queued -= 1
                ctl.waiter = None


# ---------------------------------------------------------------------------------- reading requests
class GuardedReader:
    """Reads a call's request messages: before each, the call reserves what a message may be
    (:meth:`harts_planner.rpc.limits.Limits.receive_reservation`, against ``--max-inflight-mb``
    unless ``reserve`` is False: health and reflection calls, bounded by their number instead) and
    arms the receive timeout; after it, the reservation is returned (the caller counts what it
    keeps)."""

    def __init__(
        self, iterator, ctl: RequestControl, budget: Budget, watchdog: control.Watchdog, reserve: bool = True
    ):
        self._iterator = iterator
        self._ctl = self.control = ctl
        self._budget = budget
        self._watchdog = watchdog
        self._reserve = reserve
        self._kind = "planner" if reserve else "service"

    def _hold(self, reservation: int, attempts: int = 8) -> None:
        """Reserve ``reservation`` bytes; when they do not fit, make room by cutting off the longest
        stalled receiver and try again (another call may take the room first: a few times, while
        there are stalled receivers to cut off)."""
        budget = self._budget
        for attempt in range(attempts):
            try:
                budget.hold(reservation, "request", "bytes (what one more message may hold)")
                return
            except AbortRpcError:
                if attempt == attempts - 1 or not budget.evict_stalled(self._kind):
                    raise
            budget.wait_room(reservation, 0.25)

    def __iter__(self):
        return self

    def __next__(self):
        return self.next()

    def next(self, phase: str = "receive"):
        """The next message (StopIteration at the end); RESOURCE_EXHAUSTED when the reservation
        does not fit, the call's stop status when it was cut off while waiting."""
        budget, ctl = self._budget, self._ctl
        reservation = budget.limits.receive_reservation(budget.max_message_bytes) if self._reserve else 0
        self._hold(reservation)
        ctl.phase = phase
        ctl.touch()
        budget.receiving(ctl, self._kind, True)
        self._watchdog.watch(ctl, phase, budget.limits.receive_timeout, "receive-timeout")
        try:
            message = next(self._iterator)
        except grpc.RpcError as err:  # the RPC ended while we waited (cut off, cancelled, past its deadline)
            # gRPC keeps this error in the call's state: without its traceback it cannot keep this
            # frame's callers (and the request bytes they hold) alive.
            err.with_traceback(None)
            stop = ctl.stop_status() or AbortRpcError(grpc.StatusCode.CANCELLED, "the request stream ended")
            raise stop from None
        finally:
            ctl.phase = "admit"
            budget.receiving(ctl, self._kind, False)
            budget.release(reservation)
        ctl.touch()
        return message


# ---------------------------------------------------------------------------------- the interceptor
def _refuse(code: grpc.StatusCode, message: str, field: str):
    abort = AbortRpcError(code, message, field)

    def refuse(request_or_iterator, context):
        context.abort_with_status(abort.status())

    return refuse


class Guard(grpc.ServerInterceptor):
    """Routes each call to its pool and bounds each class of calls (see the module docstring).

    ``planner_pool`` / ``service_pool`` run the two classes; ``refusals`` the calls refused on
    arrival. Service calls (health, reflection) read their requests through :class:`GuardedReader`
    (unary requests become stream requests on the server side: the same bytes on the wire)."""

    def __init__(self, budget: Budget, watchdog: control.Watchdog, planner_pool, planner_calls: int):
        from concurrent import futures

        self.budget = budget
        self.watchdog = watchdog
        self.planner_pool = planner_pool
        self.planner_calls = planner_calls
        self.service_pool = futures.ThreadPoolExecutor(SERVICE_CALLS, thread_name_prefix="harts-service")
        self.refusals = futures.ThreadPoolExecutor(REFUSAL_THREADS, thread_name_prefix="harts-refusal")
        self._lock = threading.Lock()
        self._counts = {"planner": 0, "service": 0}

    def calls(self) -> dict:
        with self._lock:
            return dict(self._counts)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        kind = "planner" if handler_call_details.method in PLANNER_METHODS else "service"
        bound = self.planner_calls if kind == "planner" else SERVICE_CALLS
        with self._lock:
            full = self._counts[kind] >= bound
            if not full:
                self._counts[kind] += 1
        if full and not self.budget.draining and self.budget.evict_stalled(kind):
            with self._lock:  # the stalled call's thread comes free within milliseconds
                self._counts[kind] += 1
            full = False
        if full:
            return self._refusal(handler, kind, bound)
        return self._wrap(handler, kind)

    def _done(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] -= 1

    def _refusal(self, handler, kind: str, bound: int):
        if self.budget.draining:
            behavior = _refuse(grpc.StatusCode.UNAVAILABLE, unavailable().message, None)
        else:
            what = (
                "planner calls (requests received, queued, planning or sending)"
                if kind == "planner"
                else ("health and reflection calls")
            )
            behavior = _refuse(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request: this server is handling {bound} {what}, its limit; retry later or on another planner",
                "request",
            )
        behavior.experimental_thread_pool = self.refusals
        return grpc.stream_stream_rpc_method_handler(
            behavior, request_deserializer=handler.request_deserializer, response_serializer=None
        )

    def _wrap(self, handler, kind: str):
        pool = self.planner_pool if kind == "planner" else self.service_pool
        done = self._done
        guard = self

        if handler.request_streaming and handler.response_streaming:
            inner, make = handler.stream_stream, grpc.stream_stream_rpc_method_handler
        elif handler.request_streaming:
            inner, make = handler.stream_unary, grpc.stream_unary_rpc_method_handler
        elif handler.response_streaming:
            inner, make = handler.unary_stream, grpc.stream_stream_rpc_method_handler
        else:
            inner, make = handler.unary_unary, grpc.stream_unary_rpc_method_handler
        non_blocking = getattr(inner, "experimental_non_blocking", False)
        unary_request = not handler.request_streaming

        if kind == "planner":  # the servicer guards its own reads
            if handler.response_streaming:

                def behavior(request, context):
                    try:
                        yield from inner(request, context)
                    finally:
                        done(kind)

            else:

                def behavior(request, context):
                    try:
                        return inner(request, context)
                    finally:
                        done(kind)

        elif non_blocking:

            def behavior(request_iterator, context, send_response_callback):
                try:
                    request = guard._service_request(request_iterator, context, unary_request)
                    inner(request, context, send_response_callback)
                finally:
                    done(kind)

        elif handler.response_streaming:

            def behavior(request_iterator, context):
                try:
                    request = guard._service_request(request_iterator, context, unary_request)
                    yield from inner(request, context)
                finally:
                    done(kind)

        else:

            def behavior(request_iterator, context):
                try:
                    return inner(guard._service_request(request_iterator, context, unary_request), context)
                finally:
                    done(kind)

        behavior.experimental_thread_pool = pool
        if non_blocking:
            behavior.experimental_non_blocking = True
        if kind == "planner":
            return handler._replace(**{_attr(handler): behavior})
        return make(
            behavior,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _service_request(self, request_iterator, context, unary: bool):
        """A service call's request (unary: its one message) or its request stream, guarded."""
        ctl = RequestControl(context)
        reader = GuardedReader(request_iterator, ctl, self.budget, self.watchdog, reserve=False)
        if not unary:
            return reader
        try:
            return reader.next()
        except AbortRpcError as a:
            context.abort_with_status(a.status())
        except StopIteration:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request: a unary call needs one request message")

    def shutdown(self) -> None:
        self.service_pool.shutdown(wait=False, cancel_futures=True)
        self.refusals.shutdown(wait=False, cancel_futures=True)


def _attr(handler) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "stream_stream"
    if handler.request_streaming:
        return "stream_unary"
    return "unary_stream" if handler.response_streaming else "unary_unary"


# ---------------------------------------------------------------------------------- admission
@dataclass
class Job:
    """An admitted request: its arguments, trajectories, what is known of its batch and its cost."""

    args: dict
    source: object
    batch: object | None  # the batch of a segment tree (built at admission), None for tokens
    cost: _limits.Cost
    plan_cost: object = None  # the planner's PlanCost
    held: int = 0  # request bytes it holds beyond what it received (aligned copies, the tree's batch)
    express: bool = False  # small enough to plan at once (EXPRESS_PLAN_BYTES)
    decode_s: float = 0.0  # request -> arrays
    ingest_s: float = 0.0  # arrays -> batch (a tree: at admission; tokens: on a planner thread)


class Admission:
    """The checks and costs of requests (one per server: its limits and message-size bound)."""

    def __init__(self, budget: Budget, stream_chunk: int):
        self.budget = budget
        self.limits = budget.limits
        self.max_message_bytes = budget.max_message_bytes
        self.stream_chunk = stream_chunk

    def check_cost(self, cost: _limits.Cost, record: dict, stream: bool) -> _limits.Cost:
        record["estimate"] = {
            "rows": cost.rows,
            "memory_bytes": cost.memory_bytes,
            "response_bytes": cost.response_bytes,
        }
        cost.check(self.limits, self.max_message_bytes, stream)
        return cost

    def source(self, which, arrays, record) -> tuple[object, float, int]:
        """The trajectories (views of the request bytes, aligned copies where needed); packed
        tokens get the checks ingestion starts with. Returns (source, seconds, bytes copied)."""
        from harts_planner.rpc import wire

        t0 = time.perf_counter()
        copied = [0]

        def read(view, dtype, field):
            arr = wire.array(view, dtype, field)
            if arr.size and not np.may_share_memory(arr, np.frombuffer(view, np.uint8)):
                copied[0] += arr.nbytes
            return arr

        source = codec.trajectories_of(which, arrays, read)
        record["input"] = "tree" if isinstance(source, SegmentTree) else "tokens"
        if isinstance(source, PackedTokens):
            codec.validate_packed(source)
            record.update(trajectories=source.num_trajectories, semantic_tokens=len(source.tokens))
        record["decode_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        return source, time.perf_counter() - t0, copied[0]

    def estimate(self, source, ctl, record, args: dict, *, step: bool, stream: bool):
        """What the request will cost (:func:`harts_planner.estimate_cost`: exact for a segment tree,
        which it validates in O(V + N); bounds for packed tokens, from their offsets), checked against
        the server's limits before any other work. A step's call plans depend on its microbatches:
        here they are checked against a floor (every compact row of a tree at least once), and
        exactly once the step is planned (:meth:`call_plans_cost`). Returns (Cost, PlanCost)."""
        try:
            cost = estimate_cost(
                source,
                request="step" if step else "calls",
                microbatch=None if step else args["microbatch"],
                chunk_size=args["chunk_size"],
                conv_width=args["conv_width"],
                debug=args["debug"],
                options=args["options"] if step else None,
                cancel=ctl.token,
            )
        except HartsError as e:
            fields = codec.TREE_FIELDS if isinstance(source, SegmentTree) else codec.PACKED_FIELDS
            raise codec.renamed(e, {**fields, **codec.OPTION_FIELDS}) from None
        tokens = isinstance(source, PackedTokens)
        server_cost = _limits.of_plan_cost(cost, tokens=tokens, stream=stream, chunk_bytes=self.stream_chunk)
        checked = self.check_cost(server_cost, record, stream)
        if step and args["call_plans"] and not tokens:
            floor = _limits.Cost(cost.compact_tokens, 0, 0, "include_call_plans", _limits.CALLS_HINT)
            floor.check(self.limits, self.max_message_bytes, stream)
        return checked, cost

    def call_plans_cost(self, plan, batch, job: Job, ctl, record, stream: bool) -> _limits.Cost:
        """The exact cost of a step's call plans once its microbatches are known, checked; the
        memory beyond the admission estimate is reserved at once."""
        args = job.args
        exact = estimate_call_plans(
            batch, plan.microbatches, args["chunk_size"], args["conv_width"], args["debug"], ctl.token
        )
        cost = _limits.of_plan_cost(exact, stream=stream, chunk_bytes=self.stream_chunk)
        total = self.check_cost(cost, record, stream)
        self.budget.reserve_more(ctl, total.memory_bytes - job.cost.memory_bytes)
        return total

    def ingest_tree(self, source, ctl, record):
        """A segment tree's batch (O(V + N log N), no per-row work), or None for packed tokens
        (ingested on a planner thread). Returns (batch, seconds)."""
        if not isinstance(source, SegmentTree):
            return None, 0.0
        t0 = time.perf_counter()
        batch = codec.ingest(source, wire=True, cancel=ctl.token)
        record.update(
            trajectories=batch.num_trajectories,
            semantic_tokens=batch.semantic_tokens,
            compact_tokens=batch.compact_tokens,
            segments=batch.num_segments,
            ingest_ms=round((time.perf_counter() - t0) * 1e3, 3),
        )
        return batch, time.perf_counter() - t0

    def _admit(self, args, which, arrays, ctl, record, *, step: bool, stream: bool) -> Job:
        source, decode_s, copied = self.source(which, arrays, record)
        cost, plan_cost = self.estimate(source, ctl, record, args, step=step, stream=stream)
        tokens = isinstance(source, PackedTokens)
        held = _limits.request_bytes(0, copied, plan_cost, tokens=tokens)
        record["request_held_bytes"] = record.get("request_bytes", 0) + held
        self.budget.hold(held, "trajectories", "bytes (the request's batch and array copies)")
        try:
            batch, ingest_s = self.ingest_tree(source, ctl, record)
            if step:
                lengths = batch.lengths if batch is not None else np.diff(source.offsets)
                try:
                    codec.check_step(lengths, args["dp_size"], args["capacity"], args["options"])
                except HartsError as e:
                    raise codec.renamed(e, codec.OPTION_FIELDS) from None
        except BaseException:
            self.budget.release(held)
            raise
        planner = plan_cost.plan_bytes + (plan_cost.ingest_bytes if tokens else 0)
        express = planner <= EXPRESS_PLAN_BYTES and not (step and args["call_plans"])
        return Job(args, source, batch, cost, plan_cost, held, express, decode_s, ingest_s)

    def step(self, request, which, arrays, ctl, record, stream: bool) -> Job:
        args = codec.decode_plan_step_request(request)
        return self._admit(args, which, arrays, ctl, record, step=True, stream=stream)

    def calls(self, request, which, arrays, ctl, record, stream: bool) -> Job:
        args = codec.decode_plan_calls_request(request)
        return self._admit(args, which, arrays, ctl, record, step=False, stream=stream)


__all__ = [
    "Admission",
    "Budget",
    "Grant",
    "Guard",
    "GuardedReader",
    "EVICT_AFTER_SECONDS",
    "EXPRESS_PLAN_BYTES",
    "Job",
    "PLANNER_METHODS",
    "REFUSAL_THREADS",
    "SERVICE_CALLS",
]
