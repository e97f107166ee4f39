"""The handlers of ``harts.planner.v1.PlannerService``: one call from its first byte to its last.

Every method (PlanStep, PlanCalls and their ``*Stream`` forms) is served by one generator on a
thread of the planner pool (:class:`~harts_planner.rpc.interceptor.Guard` bounds how many), through
these phases, each logged in the call's record (:mod:`harts_planner.rpc.logs`):

1. *receive*: the request message (unary) or chunks (``*Stream``: the first announces the size,
   checked against ``--max-request-mb`` and held against ``--max-inflight-mb`` before the rest is
   read), each read under a receive reservation and the receive timeout, the whole request within
   its total receive deadline (``--receive-timeout`` + its bytes / ``--min-receive-rate-mb``,
   logged as ``receive_deadline_s``) (:class:`~harts_planner.rpc.request_reader.GuardedReader`);
   a drain cuts it off at once; a chunked request is assembled in one
   buffer and its arrays read in place (:mod:`harts_planner.rpc.wire`);
2. *admit* (:class:`~harts_planner.rpc.admission.Admission`): checks and cost before any planner
   thread is taken; a bad or unaffordable request is answered here (a request over
   :data:`ADMIT_INLINE_BYTES` is admitted at the planner threads' priority);
3. *queue*: a planner thread and room in the plan-memory budget
   (:meth:`~harts_planner.rpc.ledger.Budget.acquire`), while the deadline allows;
4. *plan* on one of ``workers`` planner threads, which run at a lower scheduling priority than the
   threads that answer calls (:data:`PLANNER_NICENESS`; the C++ core releases the GIL and polls the
   call's cancel token); a tiny plan (:data:`~harts_planner.rpc.admission.EXPRESS_PLAN_BYTES`) is
   made at once on the call's thread; then the request and the planner thread are given back;
5. *encode*: the response as wire parts over the plan's arrays, no copy (:mod:`~harts_planner.rpc.wire`);
6. *send*: one message (unary, at most ``--max-message-mb``) or 1 MiB chunks, each copied out of
   the GIL and sent once the client has taken the previous one; the call's stop status (deadline,
   cancellation, a drain) is checked before each chunk, and the watchdog ends a call whose client
   reads nothing for ``--send-timeout`` seconds or reads it slower than ``--min-send-rate-mb``
   after that (the total send deadline, ``--send-timeout`` + its bytes / the rate, logged as
   ``send_deadline_s``). The plan's memory stays reserved until the response
   is delivered.

The record says OK only for a response that was delivered (``delivered: true``): a call whose
handler sent its whole response (the one message of PlanStep / PlanCalls, every chunk of a
``*Stream``) is logged once gRPC ended it, not when the handler returned (gRPC's buffers take
several MiB that the client may never read), and CANCELLED when the client reset it before its
status went out (it cancelled after the last message left the handler but before it had it all);
a call that ended any other way is logged with the status it ended with.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError, EncodeError

from harts_planner.call_plan import plan_calls
from harts_planner.errors import HartsError, PlanCancelledError
from harts_planner.rpc import codec, control, logs, wire
from harts_planner.rpc import limits as _limits
from harts_planner.rpc import planner_pb2 as pb
from harts_planner.rpc.admission import Admission
from harts_planner.rpc.control import AbortRpcError, RequestControl, exhausted
from harts_planner.rpc.ledger import Budget
from harts_planner.rpc.request_reader import GuardedReader
from harts_planner.step_plan import plan_step

#: The four methods: (name, request message class, streamed, step).
METHODS = (
    ("PlanStep", pb.PlanStepRequest, False, True),
    ("PlanCalls", pb.PlanCallsRequest, False, False),
    ("PlanStepStream", pb.PlanStepRequest, True, True),
    ("PlanCallsStream", pb.PlanCallsRequest, True, False),
)


#: Requests up to this size are admitted on the call's thread; bigger ones (whose checks and index
#: take longer than a health check should wait) on the planner threads' priority.
ADMIT_INLINE_BYTES = 1 << 20
#: How much lower the planner threads' scheduling priority is (their nice value above the process's):
#: a CPU-bound plan then yields the cores to the threads that answer calls (health checks, small
#: requests, admission, sending) and still uses every core they leave idle.
PLANNER_NICENESS = 10


def lower_priority(niceness: int = PLANNER_NICENESS) -> bool:
    """Raise the calling thread's nice value by ``niceness`` (Linux: a thread is a task of its own);
    True when done."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
        return True
    except (AttributeError, OSError):
        return False


def _identity(data):
    return data


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


class PlannerServicer:
    """Handlers of the planner methods (see the module docstring): :meth:`handlers` gives them for
    a generic handler; ``budget`` is the server's ledger, ``watchdog`` its timeouts."""

    def __init__(
        self,
        budget: Budget,
        watchdog: control.Watchdog,
        *,
        logger: logging.Logger = logs.LOGGER,
        chunk_bytes: int = wire.CHUNK_BYTES,
    ):
        self.budget = budget
        self.watchdog = watchdog
        self.logger = logger
        self.chunk_bytes = chunk_bytes
        self.admission = Admission(budget, chunk_bytes)
        # The planner threads (workers, granted by the budget) and as many for admitting big requests.
        self.planner_pool = futures.ThreadPoolExecutor(
            2 * budget.workers, thread_name_prefix="harts-plan", initializer=lower_priority
        )

    # ------------------------------------------------------------------ state (the budget's)
    @property
    def workers(self) -> int:
        return self.budget.workers

    @property
    def limits(self) -> _limits.Limits:
        return self.budget.limits

    @property
    def max_message_bytes(self) -> int:
        return self.budget.max_message_bytes

    @property
    def inflight(self) -> int:
        """Calls inside a handler (any phase)."""
        return self.budget.counts()["active"]

    @property
    def _controls(self):  # the calls in a handler (tests look at their reasons)
        return self.budget._controls

    def counts(self) -> dict:
        return self.budget.counts()

    def begin_drain(self) -> None:
        self.budget.begin_drain()

    def cancel_inflight(self) -> int:
        return self.budget.cancel_inflight()

    def wait_idle(self, timeout: float | None) -> bool:
        return self.budget.wait_idle(timeout)

    # ------------------------------------------------------------------ handlers
    def handlers(self, pool) -> dict:
        """``{method name: handler}``: every method as a stream-stream handler on ``pool`` (a unary
        call is one message each way on the wire, whatever the server's handler type; serving it
        as a stream lets the handler run before the request is read and know when the response
        was sent)."""
        out = {}
        for name, cls, stream, step in METHODS:

            def behavior(request_iterator, context, name=name, cls=cls, stream=stream, step=step):
                return self._call(name, cls, stream, step, request_iterator, context)

            behavior.experimental_thread_pool = pool
            out[name] = grpc.stream_stream_rpc_method_handler(
                behavior, request_deserializer=_identity, response_serializer=_identity
            )
        return out

    def _call(self, method: str, cls, stream: bool, step: bool, request_iterator, context):
        start = time.perf_counter()
        record: dict = {"event": "rpc", "method": method, "peer": context.peer()}
        budget = self.budget
        ctl = RequestControl(context, budget.wake)
        held = 0  # request bytes counted in
        grant = None
        sending = False
        entered = False
        data = request = arrays = job = parts = None  # cleared at the end: see finally
        try:
            budget.enter(ctl)
            entered = True
            reader = GuardedReader(request_iterator, ctl, budget, self.watchdog)
            ctl.uploading = True
            data, held = self._receive(reader, stream, record)
            ctl.uploading = False
            record["receive_ms"] = _ms(time.perf_counter() - start)
            parsing = [0]  # bytes a parse will hold (counted before it is spent)

            def reserve(size: int) -> None:
                budget.hold(size, "request", "bytes (parsing the request)")
                parsing[0] += size

            try:
                request, which, arrays = wire.read_request(data, cls, reserve)
            except (DecodeError, RecursionError) as e:
                raise AbortRpcError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"request: not a valid {cls.DESCRIPTOR.full_name} message ({e or type(e).__name__})",
                    "request",
                ) from None
            finally:
                held += parsing[0]
            if parsing[0]:
                record["parse_held_bytes"] = parsing[0]
            del data
            t0 = time.perf_counter()
            ctl.phase = "admit"
            admit = self.admission.step if step else self.admission.calls
            if record["request_bytes"] <= ADMIT_INLINE_BYTES:
                job = admit(request, which, arrays, ctl, record, stream)
            else:  # validating and indexing a big request takes long: as a plan, below the RPC threads
                job = self.planner_pool.submit(admit, request, which, arrays, ctl, record, stream).result()
            del arrays
            held += job.held
            record["admit_ms"] = _ms(time.perf_counter() - t0)
            ctl.check("planning")
            t0 = time.perf_counter()
            ctl.phase = "queue"
            grant = budget.acquire(ctl, job.cost.memory_bytes, job.express)
            record["queue_ms"] = _ms(time.perf_counter() - t0)
            if job.express:
                record["express"] = True
            ctl.phase = "plan"
            make = self._plan_step if step else self._plan_calls
            try:
                if job.express:  # microseconds of planning: on this thread
                    parts = make(job, ctl, record, stream)
                else:  # on a planner thread, below the RPC threads' priority
                    parts = self.planner_pool.submit(make, job, ctl, record, stream).result()
            except PlanCancelledError as e:  # the planner stopped at the call's token
                raise ctl.from_cancelled(e) from None
            budget.release_thread(grant)
            del job, request  # the request and its batch are done with: give their bytes back
            budget.release(held)
            held = 0
            record["response_bytes"] = size = len(parts)
            self._check_response(size, record.get("call_plans", False), stream)
            ctl.check("sending the response")
            ctl.phase = "send"
            budget.sending(1)
            sending = True
            ctl.begin_transfer("send")
            deadline = self.limits.transfer_deadline(size, "send")
            if deadline is not None:
                record["send_deadline_s"] = round(deadline, 3)
            limits = self.limits
            self.watchdog.watch(ctl, "send", limits.send_timeout, "send-timeout", limits.min_send_rate)
            t0 = time.perf_counter()
            if stream:
                for chunk in parts.chunk_messages(self.chunk_bytes):
                    ctl.check("sending the next chunk")
                    yield chunk
                    ctl.touch(len(chunk))
            else:
                data = parts.join()
                del parts
                record["fill_ms"] = _ms(time.perf_counter() - t0)
                ctl.check("sending the response")
                yield data
                ctl.touch(len(data))
            ctl.phase = "done"
            record["send_ms"] = _ms(time.perf_counter() - t0)
            record.update(code="OK", delivered=True)
        except AbortRpcError as a:
            self._failed(record, ctl, a.code.name, a.field, a.message)
            context.abort_with_status(a.status())
        except HartsError as e:
            a = control.from_harts(e)
            self._failed(record, ctl, a.code.name, a.field, a.message)
            context.abort_with_status(a.status())
        except (MemoryError, EncodeError):  # an estimate fell short: refuse, keep serving
            message = "request: the server ran out of memory planning it"
            self._failed(record, ctl, "RESOURCE_EXHAUSTED", "request", message)
            context.abort_with_status(
                exhausted("request", "the server ran out of memory planning it").status()
            )
        except GeneratorExit:  # gRPC dropped the call while the response was being sent
            stop = ctl.stop_status() or AbortRpcError(grpc.StatusCode.CANCELLED, "the call ended", None)
            self._failed(
                record, ctl, stop.code.name, stop.field, f"{stop.message} while sending the response"
            )
            raise
        except Exception as e:  # a bug: report INTERNAL, keep serving
            record.update(code="INTERNAL", error=f"{type(e).__name__}: {e}")
            self.logger.exception("unexpected error in %s", method)
            context.abort(grpc.StatusCode.INTERNAL, f"internal planner error: {type(e).__name__}: {e}")
        finally:
            # A traceback kept by gRPC (in the call's state) may keep this frame alive: let go of
            # the request and the plan now, not when the cycle collector finds it.
            data = request = arrays = job = parts = None  # noqa: F841
            ctl.finish()
            ctl.phase = "done"
            if sending:
                budget.sending(-1)
            if grant is not None:
                budget.release_memory(grant)
            budget.release(held)
            if "code" not in record:  # ended without a status of ours (e.g. cut off while sending)
                stop = ctl.stop_status()
                record.update(
                    code=stop.code.name if stop else "CANCELLED",
                    error=stop.message if stop else "the call ended",
                    delivered=False,
                )
            record["total_ms"] = _ms(time.perf_counter() - start)
            if record.get("code") == "OK":  # logged once gRPC ended the call: was it taken?
                ctl.on_terminated(lambda record=record, ctl=ctl: self._log_delivered(record, ctl))
            else:
                logs.rpc(record, self.logger)
            if entered:
                budget.leave(ctl)

    def _log_delivered(self, record: dict, ctl: RequestControl) -> None:
        """Log a call whose handler sent its whole response, once gRPC ended the call: OK and
        ``delivered: true`` only when the call was not cancelled before the status went out (the
        handler's last message is taken by gRPC's buffers, not yet by the client); else CANCELLED
        naming both causes grpcio cannot tell apart (:data:`control.CLIENT_GONE_RESPONSE`)."""
        if ctl.client_cancelled:
            record.update(
                code="CANCELLED",
                field=None,
                error="the client cancelled before the whole response and its status reached it "
                f"({control.CLIENT_GONE_RESPONSE})",
                delivered=False,
            )
        logs.rpc(record, self.logger)

    @staticmethod
    def _failed(record: dict, ctl: RequestControl, code: str, field: str | None, message: str) -> None:
        record.update(code=code, field=field, error=message)
        if ctl.phase in ("send", "done"):
            record["delivered"] = False

    # ------------------------------------------------------------------ receive
    def _receive(self, reader: GuardedReader, stream: bool, record: dict):
        """The request's bytes and the bytes counted in for them. A unary request is one message; a
        stream's chunks are assembled in one buffer of the size the first announced."""
        budget = self.budget
        try:
            first = reader.next()
        except StopIteration:
            self._raise_if_gone(reader)
            raise AbortRpcError(
                grpc.StatusCode.INVALID_ARGUMENT, "request: the call sent no request message", "request"
            ) from None
        if not stream:
            size = len(first)
            record["request_bytes"] = size
            budget.hold(size)
            return first, size
        data, total = wire.read_chunk(first)
        if total < len(data) or total < 0:
            raise AbortRpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request: the first chunk must set total_bytes, the request's size (>= its {len(data):,} "
                f"bytes), got {total}",
                "request",
            )
        limit = self.limits.request_limit(self.max_message_bytes, stream=True)
        record["request_bytes"] = total
        if total > limit:
            raise exhausted(
                "request",
                f"the request is {total:,} bytes, over the server's limit of {limit:,} (--max-request-mb)",
            )
        if total > self.limits.max_inflight_bytes:  # it could never be held, let alone parsed
            raise exhausted(
                "request",
                f"the request is {total:,} bytes, over the {self.limits.max_inflight_bytes:,} bytes this "
                "server holds for requests in all (--max-inflight-mb)",
            )
        deadline = self.limits.transfer_deadline(total, "receive")
        if deadline is not None:
            record["receive_deadline_s"] = round(deadline, 3)
        budget.hold(total)
        assembly = None
        try:
            assembly = wire.Assembly(total, bytes(data[:4096]))
            assembly.add(data)
            del first, data
            while True:  # to the client's half-close: the stream is closed both ways once the call ends
                try:
                    chunk, _ = wire.read_chunk(reader.next())
                except StopIteration:
                    break
                assembly.add(chunk)
            if assembly.size != total:
                self._raise_if_gone(reader)
            return assembly.view(), total
        except BaseException:
            if assembly is not None:
                assembly.free()  # at once, whatever may still reference this frame
            budget.release(total)
            raise

    @staticmethod
    def _raise_if_gone(reader: GuardedReader) -> None:
        """The request ended early: raise the call's stop status if the client went away (gRPC may
        report the end of the request before the cancellation)."""
        ctl = reader.control
        ctl.terminated.wait(0.1)
        stop = ctl.stop_status()
        if stop is not None:
            raise stop

    # ------------------------------------------------------------------ responses
    def _check_response(self, size: int, call_plans: bool, stream: bool) -> None:
        limit = self.limits.response_limit(self.max_message_bytes, stream)
        if size > limit:
            field = "include_call_plans" if call_plans else "response"
            flag = "--max-response-mb" if stream else "--max-message-mb; the *Stream RPCs send larger ones"
            raise exhausted(
                field,
                f"the response would be {size:,} bytes, over the server's limit of {limit:,} bytes ({flag})"
                + ("; plan the microbatches' calls with PlanCalls" if field == "include_call_plans" else ""),
            )

    # ------------------------------------------------------------------ planning
    def _batch(self, job, ctl: RequestControl, record: dict):
        """The job's batch: built at admission (tree) or ingested now (tokens)."""
        if job.batch is not None:
            return job.batch, job.ingest_s
        ctl.check("ingestion")
        t0 = time.perf_counter()
        batch = codec.ingest(job.source, wire=True, cancel=ctl.token)
        record.update(compact_tokens=batch.compact_tokens, segments=batch.num_segments)
        return batch, time.perf_counter() - t0

    def _plan_step(self, job, ctl: RequestControl, record: dict, stream: bool) -> wire.Parts:
        args = job.args
        batch, ingest_s = self._batch(job, ctl, record)
        ctl.check("planning")
        t0 = time.perf_counter()
        try:
            plan = plan_step(
                batch,
                args["dp_size"],
                args["capacity"],
                args["chunk_size"],
                cancel=ctl.token,
                **args["options"],
            )
        except HartsError as e:
            raise codec.renamed(e, codec.OPTION_FIELDS) from None
        plan_s = time.perf_counter() - t0
        record.update(microbatches=plan.num_microbatches, total_work=plan.total_work)
        calls = None
        if args["call_plans"]:
            record["call_plans"] = True
            self.admission.call_plans_cost(plan, batch, job, ctl, record, stream)
            calls = []
            t1 = time.perf_counter()
            for members in plan.microbatches:
                ctl.check("the next call plan")
                calls.append(
                    plan_calls(
                        batch, args["chunk_size"], members, conv_width=args["conv_width"], cancel=ctl.token
                    )
                )
            plan_s += time.perf_counter() - t1
        ctl.phase = "encode"
        t1 = time.perf_counter()
        parts = wire.step_response(plan, calls, args["debug"])
        encode_s = time.perf_counter() - t1
        record.update(dp_size=args["dp_size"], capacity=args["capacity"])
        return parts.add_field(3, self._stats(record, batch, (job.decode_s, ingest_s, plan_s, encode_s)))

    def _plan_calls(self, job, ctl: RequestControl, record: dict, stream: bool) -> wire.Parts:
        args = job.args
        batch, ingest_s = self._batch(job, ctl, record)
        ctl.check("planning")
        t0 = time.perf_counter()
        try:
            plan = plan_calls(
                batch, args["chunk_size"], args["microbatch"], conv_width=args["conv_width"], cancel=ctl.token
            )
        except HartsError as e:
            raise codec.renamed(e, {"trajectories": "microbatch"}) from None
        plan_s = time.perf_counter() - t0
        ctl.check("encoding")
        ctl.phase = "encode"
        t1 = time.perf_counter()
        parts = wire.calls_response(plan, args["debug"])
        encode_s = time.perf_counter() - t1
        record.update(chunk_size=args["chunk_size"], calls=plan.num_calls, replay_tokens=plan.replay_tokens)
        return parts.add_field(2, self._stats(record, batch, (job.decode_s, ingest_s, plan_s, encode_s)))

    @staticmethod
    def _stats(record: dict, batch, seconds: tuple) -> pb.PlanStats:
        """The response's PlanStats (``seconds``: decode, ingest, plan, encode; encoding builds the
        response's parts over the plan's arrays, the copies happen while sending: the log's
        ``fill_ms`` / ``send_ms``) and the same timings in the call's record."""
        decode_s, ingest_s, plan_s, encode_s = seconds
        record.update(ingest_ms=_ms(ingest_s), plan_ms=_ms(plan_s), encode_ms=_ms(encode_s))
        return codec.stats_message(
            batch,
            decode_seconds=decode_s,
            ingest_seconds=ingest_s,
            plan_seconds=plan_s,
            encode_seconds=encode_s,
        )


__all__ = ["METHODS", "PlannerServicer"]
