"""The ledger of what calls hold, and the planner threads they wait for.

:class:`Budget` counts, under one lock, what the server's calls hold against its bounds:

* request bytes (``--max-inflight-mb``): every stream reserves what its next message may be before
  it reads it (:class:`~harts_planner.rpc.request_reader.GuardedReader`), then holds what it received
  and what admission built for it (:class:`~harts_planner.rpc.admission.Admission`);
* planner threads (``--workers``) and the plan-memory budget shared by the plans running at once and
  the responses not yet delivered (``--max-plan-memory-mb``);
* the queue of calls waiting for a planner thread (``--max-queued``).

Over a bound, a call gets RESOURCE_EXHAUSTED naming the field and the flag. A plan that fits waits
for a thread and room, first come first served (a plan of at most 1/:data:`SMALL_SHARE` of the budget
may pass a big one that does not fit yet), while its deadline allows; an express plan
(:data:`~harts_planner.rpc.admission.EXPRESS_PLAN_BYTES`) takes no thread and waits for nobody when
its memory fits. The ledger also knows which calls wait for a request message, so the interceptor
(:class:`~harts_planner.rpc.interceptor.Guard`) can cut off the longest stalled one
(:meth:`Budget.evict_stalled`) to make room, and it drains: :meth:`Budget.begin_drain`,
:meth:`Budget.cancel_inflight`, :meth:`Budget.wait_idle`.
"""

from __future__ import annotations

import collections
import threading
import time

import grpc

from harts_planner.rpc import limits as _limits
from harts_planner.rpc.control import RequestControl, exhausted, unavailable

#: A plan whose memory is at most this share of the budget may pass bigger ones waiting for room.
SMALL_SHARE = 64
#: A call that has waited this long for (the rest of) its request without receiving anything may be
#: cut off to make room for a new call when its class is full (a stalled stream cannot hold a slot
#: that a live client needs), by class: a health check's request is a few bytes; a planner call's
#: may be a whole message (--max-message-mb) whose progress the server cannot see.
EVICT_AFTER_SECONDS = {"service": 0.2, "planner": 0.25}


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

    def cut_uploads(self) -> int:
        """Cut off every call still receiving its request (a drain: the server will plan none of
        them); returns how many."""
        with self._lock:
            controls = [c for c in self._controls if c.uploading]
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
        """Cut off the call of class ``kind`` that waits for its request and is most overdue: that
        has received nothing for at least ``min_age`` seconds, or whose request arrives below the
        minimum rate (``--min-receive-rate-mb``) after its first ``min_age`` seconds (a stream
        trickling empty chunks); True when there was one. Its slot, thread, receive reservation and
        the bytes its request holds come free as soon as its handler sees it (milliseconds)."""
        now = time.monotonic()
        min_age = EVICT_AFTER_SECONDS[kind] if min_age is None else min_age
        rate = self.limits.min_receive_rate

        def due(c: RequestControl) -> float:
            behind = c.rate_due(min_age, rate)
            stall = c.progress_at + min_age
            return stall if behind is None else min(stall, behind)

        with self._lock:
            stalled = [c for c, k in self._receivers.items() if k == kind and due(c) <= now]
            victim = min(stalled, key=due) if stalled else None
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
        millisecond: :data:`~harts_planner.rpc.admission.EXPRESS_PLAN_BYTES`) takes no planner thread and waits for nobody when
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


__all__ = ["Budget", "EVICT_AFTER_SECONDS", "Grant", "SMALL_SHARE"]
