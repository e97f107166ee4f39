"""The gRPC server interceptor that routes each call to its pool and bounds each class of calls.

:class:`Guard` sees every call when it arrives, on gRPC's own thread, before any thread of a pool is
taken: planner calls (PlanStep, PlanCalls and their ``*Stream`` forms: :data:`PLANNER_METHODS`) run
on the planner pool, at most ``planner_calls`` at once; health and reflection calls on their own
small pool, at most :data:`SERVICE_CALLS` at once, so that no number of planner calls, stalled or
not, delays a health check. When a class is full, the call of that class that has waited longest (at
least :data:`~harts_planner.rpc.ledger.EVICT_AFTER_SECONDS`) for a request it never got is cut off to
make room (:meth:`~harts_planner.rpc.ledger.Budget.evict_stalled`): stalled streams cannot keep a
live client out. Otherwise a call over its class's bound is refused at once (RESOURCE_EXHAUSTED;
UNAVAILABLE while draining) on a third, tiny pool (:data:`REFUSAL_THREADS`). Service calls read their
requests through :class:`~harts_planner.rpc.request_reader.GuardedReader` (the receive timeout, as
planner calls); planner calls are handed to the servicer, which guards its own reads.
"""

from __future__ import annotations

import threading

import grpc

from harts_planner.rpc import codec, control
from harts_planner.rpc.control import AbortRpcError, RequestControl, unavailable
from harts_planner.rpc.ledger import Budget
from harts_planner.rpc.request_reader import GuardedReader

#: Planner methods (the servicer's); every other method is a service (health, reflection).
PLANNER_METHODS = tuple(
    f"/{codec.SERVICE_NAME}/{m}" for m in ("PlanStep", "PlanCalls", "PlanStepStream", "PlanCallsStream")
)
#: Health and reflection calls at once (their own threads).
SERVICE_CALLS = 16
#: Threads answering calls refused on arrival.
REFUSAL_THREADS = 4


def _refuse(code: grpc.StatusCode, message: str, field: str | None):
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

        def finish(behavior):
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

        if kind == "planner":  # the servicer guards its own reads
            if handler.response_streaming:

                def planner_stream(request, context):
                    try:
                        yield from inner(request, context)
                    finally:
                        done(kind)

                return finish(planner_stream)

            def planner_unary(request, context):
                try:
                    return inner(request, context)
                finally:
                    done(kind)

            return finish(planner_unary)

        if non_blocking:

            def service_non_blocking(request_iterator, context, send_response_callback):
                try:
                    request = guard._service_request(request_iterator, context, unary_request)
                    inner(request, context, send_response_callback)
                finally:
                    done(kind)

            return finish(service_non_blocking)

        if handler.response_streaming:

            def service_stream(request_iterator, context):
                try:
                    request = guard._service_request(request_iterator, context, unary_request)
                    yield from inner(request, context)
                finally:
                    done(kind)

            return finish(service_stream)

        def service_unary(request_iterator, context):
            try:
                return inner(guard._service_request(request_iterator, context, unary_request), context)
            finally:
                done(kind)

        return finish(service_unary)

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


__all__ = ["Guard", "PLANNER_METHODS", "REFUSAL_THREADS", "SERVICE_CALLS"]
