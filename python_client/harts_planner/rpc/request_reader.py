"""Reading a call's request messages under the ledger's bounds and the receive timeout.

:class:`GuardedReader` wraps a call's request iterator: before each message the call reserves what
the message may hold against ``--max-inflight-mb`` (:class:`~harts_planner.rpc.ledger.Budget`; when
it does not fit, the longest stalled receiver of the same class is cut off to make room) and arms the
receive timeout (:class:`~harts_planner.rpc.control.Watchdog`, ``--receive-timeout``) with the minimum
rate (``--min-receive-rate-mb``: the request as a whole must arrive within ``--receive-timeout`` +
its bytes / the rate, however steadily its chunks trickle); after it, the reservation is returned. Planner calls read through it in the servicer
(:mod:`harts_planner.rpc.servicer`); health and reflection calls through the interceptor
(:class:`~harts_planner.rpc.interceptor.Guard`), without a reservation (their number bounds them).
"""

from __future__ import annotations

import grpc

from harts_planner.rpc import control
from harts_planner.rpc.control import AbortRpcError, RequestControl
from harts_planner.rpc.ledger import Budget


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
        ctl.check("the next request message")  # cut off between two messages (a drain)
        limits = budget.limits
        reservation = limits.receive_reservation(budget.max_message_bytes) if self._reserve else 0
        self._hold(reservation)
        ctl.phase = phase
        ctl.touch()
        budget.receiving(ctl, self._kind, True)
        rate = limits.min_receive_rate if self._reserve else None
        self._watchdog.watch(ctl, phase, limits.receive_timeout, "receive-timeout", rate)
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
        ctl.touch(len(message) if isinstance(message, (bytes, bytearray, memoryview)) else 0)
        return message


__all__ = ["GuardedReader"]
