"""Helpers of the sidecar tests: gated planner stand-ins, raw calls, log capture, small requests.

A *gated* plan is the real planner behind a gate: a request marked by its capacity
(:data:`GATED_CAPACITY`) or chunk size (:data:`GATED_CHUNK`) enters the planner, then waits until the
test opens the gate, polling the request's cancel token like the C++ loops do (so that a cancelled or
cut-off plan stops). Other requests plan at once. The tests order events (a request answered while a
plan is held) instead of timing them.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
import numpy as np

import harts_planner as hp
from harts_planner import SegmentTree
from harts_planner.rpc import codec
from harts_planner.rpc import planner_pb2 as pb
from harts_planner.rpc import servicer as servicer_module

GATED_CAPACITY = 7777
GATED_CHUNK = 77
#: The small valid tree every gated test plans: 3 segments, 2 trajectories, 9 compact tokens.
TREE = SegmentTree([-1, 0, 0], [3, 2, 4], [1, 2])


def cancelled_error(token) -> Exception:
    """What a planner raises when its token is cancelled (``harts_planner.PlanCancelledError``)."""
    err = hp.PlanCancelledError("cancelled: the plan was cancelled")
    err.field = "cancelled"
    return err


class Gate:
    """Holds gated plans until :meth:`open`; counts plans entered and finished. ``polls`` False makes
    the stand-in ignore its token (a planner loop that never checks it)."""

    def __init__(self, polls: bool = True):
        self.polls = polls
        self._open = threading.Event()
        self._cond = threading.Condition()
        self.entered = 0
        self.finished = 0
        self.cancelled = 0

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        """Hold plans again; the counts start over."""
        self._open.clear()
        with self._cond:
            self.entered = self.finished = self.cancelled = 0

    def wait_entered(self, n: int = 1, timeout: float = 30.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.entered >= n, timeout), f"{self.entered} plans entered"

    def hold(self, cancel) -> None:
        with self._cond:
            self.entered += 1
            self._cond.notify_all()
        while not self._open.wait(0.005):
            if self.polls and cancel is not None and cancel.cancel_requested:
                with self._cond:
                    self.cancelled += 1
                raise cancelled_error(cancel)
        with self._cond:
            self.finished += 1

    def install(self, monkeypatch) -> Gate:
        """Wrap the servicer's plan_step / plan_calls (its module globals)."""
        real_step, real_calls = servicer_module.plan_step, servicer_module.plan_calls

        def plan_step(batch, dp_size, capacity, chunk_size=64, cancel=None, **options):
            if capacity == GATED_CAPACITY:
                self.hold(cancel)
            return real_step(batch, dp_size, capacity, chunk_size, **options)

        def plan_calls(batch, chunk_size=64, microbatch=None, conv_width=4, cancel=None):
            if chunk_size == GATED_CHUNK:
                self.hold(cancel)
            return real_calls(batch, chunk_size, microbatch, conv_width=conv_width)

        monkeypatch.setattr(servicer_module, "plan_step", plan_step)
        monkeypatch.setattr(servicer_module, "plan_calls", plan_calls)
        return self


class Records(logging.Handler):
    """Collects the ``fields`` of the server's log records (``harts_planner.rpc``)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.items: list[dict] = []
        self._cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", None)
        if fields:
            with self._cond:
                self.items.append(dict(fields))
                self._cond.notify_all()

    def rpcs(self, **match) -> list[dict]:
        with self._cond:
            return [
                r
                for r in self.items
                if r.get("event") == "rpc" and all(r.get(k) == v for k, v in match.items())
            ]

    def wait_for(self, n: int = 1, timeout: float = 30.0, **match) -> list[dict]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [
                    r
                    for r in self.items
                    if r.get("event") == "rpc" and all(r.get(k) == v for k, v in match.items())
                ]
                if len(found) >= n or time.monotonic() >= deadline:
                    return found
                self._cond.wait(max(0.0, min(0.1, deadline - time.monotonic())))


def wait_until(predicate, timeout: float = 30.0, step: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)
    return True


def step_request(tree=TREE, dp_size: int = 1, capacity: int = 100, **kw) -> bytes:
    return codec.plan_step_request(
        tree,
        dp_size,
        capacity,
        kw.pop("chunk_size", 64),
        kw.pop("options", {}),
        kw.pop("call_plans", False),
        kw.pop("conv_width", 4),
        **kw,
    ).SerializeToString()


def calls_request(
    tree=TREE, microbatch=None, chunk_size: int = 64, conv_width: int = 4, debug: bool = True
) -> bytes:
    return codec.plan_calls_request(tree, microbatch, chunk_size, conv_width, debug).SerializeToString()


class Raw:
    """Raw-bytes stubs of the RPCs over one channel: ``call(method, bytes, timeout)`` returns the
    response bytes or raises grpc.RpcError (``method`` ``"PLAN_STEP"`` / ``"PLAN_CALLS"``: unary;
    ``"PLAN_STEP_STREAM"`` / ``"PLAN_CALLS_STREAM"``: the request and the response in chunks, the
    bytes the same); ``future(...)`` for cancellation (unary)."""

    def __init__(self, address: str, credentials=None):
        options = [
            ("grpc.max_receive_message_length", 2**31 - 1),
            ("grpc.max_send_message_length", 2**31 - 1),
        ]
        self.channel = (
            grpc.insecure_channel(address, options=options)
            if credentials is None
            else grpc.secure_channel(address, credentials, options=options)
        )
        self._stubs = {
            m: self.channel.unary_unary(
                getattr(codec, m), request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            for m in ("PLAN_STEP", "PLAN_CALLS")
        }
        for m in ("PLAN_STEP_STREAM", "PLAN_CALLS_STREAM"):
            self._stubs[m] = self.channel.stream_stream(
                getattr(codec, m), request_serializer=lambda b: b, response_deserializer=lambda b: b
            )

    def call(self, method: str, data: bytes, timeout: float = 30.0) -> bytes:
        if method.endswith("_STREAM"):
            from harts_planner.rpc.client import join_chunks, request_chunks

            return bytes(join_chunks(self._stubs[method](request_chunks(data), timeout=timeout)))
        return self._stubs[method](data, timeout=timeout)

    def future(self, method: str, data: bytes, timeout: float = 60.0):
        return self._stubs[method].future(data, timeout=timeout)

    def code(self, method: str, data: bytes, timeout: float = 30.0) -> tuple[grpc.StatusCode, str]:
        try:
            self.call(method, data, timeout)
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def future_code(future, timeout: float = 60.0) -> grpc.StatusCode:
    try:
        future.result(timeout=timeout)
    except grpc.FutureCancelledError:
        return grpc.StatusCode.CANCELLED
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def queued_request(capacity: int = 100) -> bytes:
    """A valid PlanStep big enough to wait for a planner thread: 200 trajectories, about 3 MB of
    planner memory (smaller plans are made at once, without one: admission.EXPRESS_PLAN_BYTES)."""
    return step_request(fork_tree(10, 200, 5), capacity=capacity)


def one_segment(tokens: int) -> SegmentTree:
    """One trajectory of ``tokens`` tokens (the smallest request that asks for a big plan)."""
    return SegmentTree([-1], [tokens], [0])


def fork_tree(prefix: int, leaves: int, leaf: int) -> SegmentTree:
    """A shared prefix of ``prefix`` tokens and ``leaves`` children of ``leaf`` tokens each."""
    parent = np.array([-1] + [0] * leaves, dtype=np.int32)
    length = np.array([prefix] + [leaf] * leaves, dtype=np.int32)
    return SegmentTree(parent, length, np.arange(1, leaves + 1, dtype=np.int32))


def copies_tree(tree: SegmentTree, copies: int, scale: int = 1) -> SegmentTree:
    """``copies`` disjoint copies of ``tree`` (a batch of ``copies`` times the trajectories), segment
    lengths divided by ``scale`` (at least 1)."""
    v = tree.num_segments
    parent = np.concatenate([np.where(tree.parent < 0, -1, tree.parent + i * v) for i in range(copies)])
    ends = np.concatenate([tree.trajectory_end + i * v for i in range(copies)])
    length = np.tile(np.maximum(tree.length // scale, 1), copies)
    return SegmentTree(parent.astype(np.int32), length.astype(np.int32), ends.astype(np.int32))


def chain_tree(segments: int, length: int = 1) -> SegmentTree:
    """A path of ``segments`` segments, every one ending a trajectory (12 bytes per segment)."""
    parent = np.arange(-1, segments - 1, dtype=np.int32)
    return SegmentTree(parent, np.full(segments, length, np.int32), np.arange(segments, dtype=np.int32))


__all__ = [
    "GATED_CAPACITY",
    "GATED_CHUNK",
    "TREE",
    "Gate",
    "Raw",
    "Records",
    "calls_request",
    "cancelled_error",
    "chain_tree",
    "copies_tree",
    "fork_tree",
    "future_code",
    "one_segment",
    "queued_request",
    "step_request",
    "wait_until",
    "pb",
]


def memory(pid: int) -> dict:
    """VmRSS and VmHWM of a process, bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) << 10
    return out
