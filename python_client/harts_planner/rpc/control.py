"""Control of the sidecar's calls: how one call stops, the watchdog that stops stalled ones, and the
drain that stops them all.

* :class:`RequestControl`: one call's deadline (the RPC's), why it stopped (``reason``), the
  :class:`harts_planner.CancelToken` the planner polls inside its loops, and the status the call
  ends with (:meth:`RequestControl.stop_status`). It is cancelled when the client cancels or its
  deadline passes (gRPC's termination callback), when the :class:`Watchdog` cuts it off, and by a
  drain after its grace.
* :class:`Watchdog`: one thread that cancels a call whose request message has not arrived within
  ``--receive-timeout`` seconds, or whose response made no progress (the client read nothing) for
  ``--send-timeout`` seconds; and, whatever the progress, a call whose request or response moves
  slower than the server's minimum rate (``--min-receive-rate-mb`` / ``--min-send-rate-mb``) once
  its timeout has passed: a transfer of ``n`` bytes has ``timeout + n / rate`` seconds in all (the
  total receive and send deadlines; a stream trickling empty chunks is cut off after the timeout,
  not never). Cancelling ends the RPC in gRPC with the status the log records, which frees
  whatever gRPC holds for it (its receive buffer, the unsent response) and wakes the call's thread.
* :func:`drain`: graceful shutdown (SIGTERM): health NOT_SERVING; queued and new calls get
  UNAVAILABLE at once; calls still receiving their request are cut off at once (an upload the
  server would never plan); calls in flight (planning or sending their response) get ``grace`` seconds;
  then every call left is cancelled (plans through their tokens, responses by ending the RPC) and
  logged UNAVAILABLE with ``delivered: false``; then the server stops. A response logged OK was
  delivered.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import grpc

from harts_planner.errors import CancelToken, HartsError, PlanCancelledError
from harts_planner.rpc import logs, status

#: After the grace period: how long cancelled calls get to stop before the server gives up on them.
CANCEL_WAIT_SECONDS = 5.0


class AbortRpcError(Exception):
    """Ends an RPC with a status (raised inside a handler, turned into ``context.abort``)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None):
        super().__init__(message)
        self.code, self.message, self.field = code, message, field

    def status(self) -> grpc.Status:
        """The status with a google.rpc detail naming :attr:`field` (:func:`status.rich_status`)."""
        return status.rich_status(self.code, self.message, self.field)


def from_harts(err: HartsError) -> AbortRpcError:
    """The status of a planner error (the table of :mod:`harts_planner.rpc.status`)."""
    return AbortRpcError(status.for_error(err).code, str(err), getattr(err, "field", None) or "request")


def unavailable() -> AbortRpcError:
    return AbortRpcError(grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another planner")


def exhausted(field: str, message: str) -> AbortRpcError:
    return AbortRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{field}: {message}", field)


#: What a call ended CANCELLED by its client's side may have been: grpcio reports a message gRPC
#: refused for its size (a request over the server's ``--max-message-mb``, a response over the
#: client's receive limit) exactly as a client's cancellation (a cancelled call, no status or cause),
#: so the log names both.
CLIENT_GONE = "client cancelled or message refused by gRPC for size: over --max-message-mb"
#: The same for a response the handler sent whole (the size is the client's receive limit's).
CLIENT_GONE_RESPONSE = "client cancelled or message refused by gRPC for size: over the client's receive limit"

#: Why a call was stopped -> (status code, message, field). "client" and "deadline" come from gRPC.
_REASONS = {
    "deadline": (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", "deadline"),
    "shutdown": (grpc.StatusCode.UNAVAILABLE, "the server shut down", None),
    "receive-timeout": (
        grpc.StatusCode.CANCELLED,
        "request: the request did not arrive within the server's --receive-timeout",
        "request",
    ),
    "send-timeout": (
        grpc.StatusCode.CANCELLED,
        "response: the client read none of the response for the server's --send-timeout",
        "response",
    ),
    "evicted": (
        grpc.StatusCode.CANCELLED,
        "request: the request had not arrived and the server needed the call's slot for another",
        "request",
    ),
    "receive-rate": (grpc.StatusCode.CANCELLED, "request: the request arrived too slowly", "request"),
    "send-rate": (grpc.StatusCode.CANCELLED, "response: the client read the response too slowly", "response"),
    "client": (grpc.StatusCode.CANCELLED, f"the client cancelled the request ({CLIENT_GONE})", None),
}
#: The flags of the two minimum rates, by phase.
_RATE_FLAGS = {
    "receive": ("--receive-timeout", "--min-receive-rate-mb"),
    "send": ("--send-timeout", "--min-send-rate-mb"),
}


def _end_rpc(context, stop: AbortRpcError | None) -> None:
    """End an RPC from any thread, the client seeing ``stop``'s code and message: gRPC core's
    cancel-with-status on the server call (what grpcio's own client-side cancel calls; the sync
    server's context exposes only a plain cancel, which the client sees as CANCELLED). A context
    without the call object (another gRPC build) is cancelled plainly."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    if stop is not None and call is not None:
        from grpc._cython import cygrpc

        try:
            call.cancel(cygrpc.StatusCode(stop.code.value[0]), stop.message)
            return
        except (TypeError, ValueError, AttributeError):
            pass
    context.cancel()


class RequestControl:
    """Cancellation of one call: a deadline (the RPC's), the reason it stopped, and the
    :class:`harts_planner.CancelToken` the planner polls inside its loops.

    The token is cancelled when the RPC terminates early (the client cancelled, or its deadline
    passed: gRPC calls back), when the watchdog cuts the call off and when the server does (a
    drain's grace ran out). ``wake`` is called on every cancellation (the budget wakes a waiting
    call). ``on_terminated`` callbacks run when gRPC ends the RPC (early or not) after the handler
    stopped running (the servicer logs a call whose response was never delivered there).
    """

    def __init__(self, context, wake=None):
        self.context = context
        self._wake = wake
        self._lock = threading.Lock()
        # "client", "deadline", "shutdown", "receive-timeout", "send-timeout", "evicted"
        self.reason: str | None = None
        # The budget's ledger.Grant (typed Any: ledger imports this module) while it waits for a
        # planner thread, and while it holds one.
        self.waiter: Any = None
        self.grant: Any = None
        self.phase = "receive"  # receive, admit, queue, plan, encode, send, done
        self.progress_at = time.monotonic()  # the last sign of life of the transfer (receive, send)
        # The transfer under way (its phase, when it began, bytes moved): the minimum-rate rule.
        self.transfer = "receive"
        self.transfer_started = self.progress_at
        self.moved = 0
        self.uploading = False  # reading its request (a drain cuts it off at once)
        self.terminated = threading.Event()  # gRPC ended the RPC
        self.client_cancelled = False  # it ended cancelled (RST_STREAM), whatever the handler had sent
        self._done = False
        self._on_terminated: list = []
        remaining = context.time_remaining() if context is not None else None
        if remaining is not None and remaining > 1e9:  # no deadline (gRPC says "infinite")
            remaining = None
        self.deadline = None if remaining is None else time.monotonic() + max(remaining, 0.0)
        self.token = CancelToken()
        if remaining is not None:
            self.token.set_deadline(max(remaining, 0.0))
        if context is not None and not context.add_callback(self._terminated):
            self._terminated()  # the RPC has already ended

    def _terminated(self) -> None:
        """gRPC's callback: the RPC ended (completed, cancelled by the client, or past its deadline;
        gRPC's clock may run a little ahead of ours, hence the margin)."""
        # grpcio's own record of how the call closed (no public accessor): "cancelled" when the
        # client reset the stream before the status went out, even after the handler's last message.
        state = getattr(self.context, "_state", None)
        self.client_cancelled = getattr(state, "client", None) == "cancelled"
        if not self._done:
            remaining = self.remaining()
            self.cancel("deadline" if remaining is not None and remaining < 0.05 else "client")
        self.terminated.set()
        with self._lock:
            callbacks, self._on_terminated = self._on_terminated, []
        for callback in callbacks:
            callback()

    def on_terminated(self, callback) -> None:
        """Run ``callback()`` when gRPC ends the RPC (at once if it has)."""
        with self._lock:
            if not self.terminated.is_set():
                self._on_terminated.append(callback)
                return
        callback()

    def cancel(self, reason: str) -> None:
        """Stop this call's plan (the planner stops at its next poll); thread-safe. The first
        reason sticks."""
        with self._lock:
            if self.reason is None:
                self.reason = reason
        self.token.cancel()
        if self._wake is not None:
            self._wake(self)

    def cut_off(self, reason: str) -> None:
        """Stop the call (the watchdog, a drain). A call blocked in gRPC, receiving its request or
        sending its response, has its RPC ended now with the status of ``reason`` (the one the log
        names: UNAVAILABLE for a drain, which clients may retry on another planner; gRPC frees what
        it holds for the call); any other stops at its next check or poll and answers with it."""
        self.cancel(reason)
        if self.context is not None and self.phase in ("receive", "send"):
            _end_rpc(self.context, self.stop_status())

    def touch(self, moved: int = 0) -> None:
        """The transfer made progress (a request chunk arrived, a response chunk was taken):
        ``moved`` more bytes."""
        self.progress_at = time.monotonic()
        self.moved += moved

    def begin_transfer(self, phase: str) -> None:
        """The request starts arriving or the response starts going out: the minimum-rate clock
        (:meth:`behind`) starts now, at 0 bytes."""
        self.transfer, self.transfer_started, self.moved = phase, time.monotonic(), 0
        self.progress_at = self.transfer_started

    def rate_due(self, seconds: float | None, rate: float | None) -> float | None:
        """When the transfer falls below ``rate`` bytes/s after its first ``seconds``: its start +
        ``seconds`` + bytes moved / ``rate`` (monotonic); None without a rate."""
        if rate is None or seconds is None:
            return None
        return self.transfer_started + seconds + self.moved / rate

    def finish(self) -> None:
        """The handler is done: later callbacks are not cancellations."""
        self._done = True

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def stop_status(self) -> AbortRpcError | None:
        """Why this call must stop now (DEADLINE_EXCEEDED, CANCELLED, UNAVAILABLE), or None."""
        reason = self.reason
        if reason is None and self.expired():
            reason = "deadline"
        if reason is None and self.context is not None and not self.context.is_active():
            reason = "client"
        if reason is None:
            return None
        code, message, field = _REASONS.get(reason, _REASONS["client"])
        if message == _REASONS["client"][1] and self.phase in ("send", "done"):  # a response's size
            message = f"the client cancelled the request ({CLIENT_GONE_RESPONSE})"
        if reason == "shutdown":
            what = "its response was delivered" if self.phase == "send" else "the plan finished"
            if self.uploading:
                what = "the request arrived"
            message = f"the server shut down before {what}; retry on another planner"
        elif reason in ("receive-rate", "send-rate"):
            phase = reason.partition("-")[0]
            timeout, flag = _RATE_FLAGS[phase]
            what = "of the request arrived" if phase == "receive" else "of the response were read"
            message = (
                f"{field}: {self.moved:,} bytes {what} in "
                f"{time.monotonic() - self.transfer_started:.1f} s, below the server's minimum rate "
                f"({flag}, after {timeout})"
            )
        return AbortRpcError(code, message, field)

    def check(self, phase: str) -> None:
        """Raise the stop status (its message says which phase was next), if any."""
        stop = self.stop_status()
        if stop is not None:
            stop.message = f"{stop.message} before {phase}"
            raise stop

    def from_cancelled(self, err: PlanCancelledError) -> AbortRpcError:
        """The status of a plan the planner stopped (``PlanCancelledError``)."""
        stop = self.stop_status()
        if stop is None:  # the token's own clock ran out first
            code, message, field = _REASONS["deadline"]
            stop = AbortRpcError(code, message, field)
        stop.message = f"{stop.message} ({err})"
        return stop


class Watchdog:
    """One thread that cuts off calls whose transfer stalls.

    :meth:`watch` arms a timer on a call: it fires when ``control.progress_at`` is more than
    ``seconds`` old (:meth:`RequestControl.touch` pushes it back), or, with a ``rate`` (bytes/s),
    when the transfer has fallen behind it (:meth:`RequestControl.rate_due`), and the call is still
    in ``phase`` (the phase it was armed in); firing cuts the call off with ``reason`` (stalled) or
    ``PHASE-rate`` (too slow). Timers of calls that moved on are dropped when they come due.
    O(log n) per timer.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._heap: list = []
        self._seq = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="harts-planner-watchdog", daemon=True)
        self._thread.start()

    def watch(
        self,
        control: RequestControl,
        phase: str,
        seconds: float | None,
        reason: str,
        rate: float | None = None,
    ) -> None:
        """Arm a timer (a weak reference: a finished call is not kept alive, nor its gRPC stream)."""
        if seconds is None:
            return
        with self._cond:
            due, _ = _due(control, seconds, rate, reason)
            entry = (due, next(self._seq), weakref.ref(control), phase, seconds, rate, reason)
            heapq.heappush(self._heap, entry)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            fire = []
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = None if not self._heap else max(self._heap[0][0] - time.monotonic(), 0.0)
                    self._cond.wait(wait)
                if self._stopped:
                    return
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    _, _, ref, phase, seconds, rate, reason = heapq.heappop(self._heap)
                    control = ref()
                    if control is None or control.phase != phase or control.terminated.is_set():
                        continue  # gone or moved on
                    due, why = _due(control, seconds, rate, reason)
                    if due > now:  # progress since it was armed: check again then
                        entry = (due, next(self._seq), ref, phase, seconds, rate, reason)
                        heapq.heappush(self._heap, entry)
                    else:
                        fire.append((control, why))
                    del control
            for control, reason in fire:
                control.cut_off(reason)


def _due(control: RequestControl, seconds: float, rate: float | None, reason: str) -> tuple[float, str]:
    """When a watched call is due and why: stalled (``reason``) or behind the minimum rate."""
    stall = control.progress_at + seconds
    behind = control.rate_due(seconds, rate)
    if behind is not None and behind < stall - 0.01:  # else it is a stall: nothing came at all
        return behind, f"{control.transfer}-rate"
    return stall, reason


@dataclass
class DrainResult:
    """How a drain ended: ``finished`` every call in flight (planning or sending) within the grace;
    else ``cancelled`` of them were cut off and ``stopped`` says whether they all stopped within
    CANCEL_WAIT_SECONDS."""

    finished: bool
    cancelled: int = 0
    stopped: bool = True

    def __bool__(self) -> bool:
        return self.finished

    @property
    def exit_code(self) -> int:
        """0 when nothing is left running (finished, or cancelled and stopped), else 1."""
        return 0 if self.finished or self.stopped else 1


def drain(server, grace: float, *, cut: threading.Event | None = None) -> DrainResult:
    """Graceful shutdown of a :class:`~harts_planner.rpc.server.PlannerServer`: health NOT_SERVING;
    queued and new calls get UNAVAILABLE at once; calls in flight (planning, or sending a response)
    get ``grace`` seconds (fewer when ``cut`` is set meanwhile: a second signal), then are cut off
    (plans through their tokens, responses by ending the RPC: each logged UNAVAILABLE, not
    delivered) and get :data:`CANCEL_WAIT_SECONDS` to stop; then the server stops."""
    servicer = server.servicer
    server.health.enter_graceful_shutdown()
    servicer.begin_drain()
    uploads = servicer.budget.cut_uploads()
    counts = servicer.counts()
    logs.event(
        "drain",
        inflight=counts["planning"],
        queued=counts["queued"],
        sending=counts["sending"],
        uploads_cut=uploads,
        grace_s=grace,
    )
    deadline = time.monotonic() + grace
    finished = False
    while True:
        left = deadline - time.monotonic()
        if servicer.wait_idle(max(0.0, min(left, 0.1))):
            finished = True
            break
        if left <= 0 or (cut is not None and cut.is_set()):
            break
    result = DrainResult(finished)
    if not finished:
        result.cancelled = servicer.cancel_inflight()
        result.stopped = servicer.wait_idle(CANCEL_WAIT_SECONDS)
    server.stop(grace=0.5)
    logs.event(
        "stopped",
        drained=result.finished,
        cancelled=result.cancelled,
        stuck=not result.stopped,
    )
    return result


__all__ = [
    "AbortRpcError",
    "CANCEL_WAIT_SECONDS",
    "CLIENT_GONE",
    "CLIENT_GONE_RESPONSE",
    "DrainResult",
    "RequestControl",
    "Watchdog",
    "drain",
    "exhausted",
    "from_harts",
    "unavailable",
]
