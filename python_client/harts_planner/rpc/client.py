"""gRPC client of the planner sidecar: deadlines on every call, status codes mapped back to the
planner's exceptions.

=====================  ============================================  ========================
gRPC status            raised                                        ``.field``
=====================  ============================================  ========================
INVALID_ARGUMENT       :class:`harts_planner.InvalidArgumentError`   request field path
RESOURCE_EXHAUSTED     :class:`harts_planner.ResourceLimitError`     request field path
FAILED_PRECONDITION    :class:`harts_planner.InfeasibleError`        request field path
DEADLINE_EXCEEDED      :class:`SidecarTimeoutError` (TimeoutError)
UNAVAILABLE            :class:`SidecarUnavailableError` (ConnectionError)
anything else          :class:`SidecarError`
=====================  ============================================  ========================

The field comes from the google.rpc.Status details the server attaches (BadRequest,
QuotaFailure, PreconditionFailure: the table of :mod:`harts_planner.rpc.status`), or, for a limit
enforced by gRPC itself (an over-size message), is ``"request"`` / ``"response"``.

Plans travel through the ``*Stream`` methods (:meth:`SidecarClient.plan_step`): the request and the
response in 1 MiB chunks (``PlanChunk``), so neither is bound by one gRPC message and neither side
holds the GIL for long while copying them. Against a server without them (UNIMPLEMENTED) the client
falls back to the unary methods for the rest of its life. TLS: ``credentials`` from
:func:`harts_planner.rpc.tls.channel_credentials`.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harts_planner.rpc import codec, status, wire
from harts_planner.rpc import planner_pb2 as pb

#: Default message-size limit of client and server: a 59M-token step is 236 MB of tokens.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30


class SidecarError(RuntimeError):
    """A sidecar call failed for a reason other than the request's content; ``code`` is the
    ``grpc.StatusCode``."""

    def __init__(self, message: str, code: grpc.StatusCode):
        super().__init__(message)
        self.code = code


class SidecarUnavailableError(SidecarError, ConnectionError):
    """The sidecar is unreachable or draining (UNAVAILABLE); retrying elsewhere is safe."""


class SidecarTimeoutError(SidecarError, TimeoutError):
    """The call's deadline passed (DEADLINE_EXCEEDED)."""


def translate(err: grpc.RpcError) -> Exception:
    """The exception a failed call raises (see the module table)."""
    code, message = err.code(), err.details() or ""
    cls = status.error_class(code)
    if cls is not None:
        field = status.field_of(err)
        if field is None:  # a limit gRPC enforced itself, before our handler ran
            field = "response" if "Sent message" in message or "response" in message.lower() else "request"
            message = f"{field}: {message}"
        exc = cls(message)
        exc.field = field
        return exc
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return SidecarTimeoutError(f"sidecar deadline exceeded: {message}", code)
    if code == grpc.StatusCode.UNAVAILABLE:
        return SidecarUnavailableError(f"sidecar unavailable: {message}", code)
    return SidecarError(f"sidecar call failed with {code.name}: {message}", code)


def _serialize(request) -> bytes:
    return request if isinstance(request, bytes) else request.SerializeToString()


def _identity(data: bytes) -> bytes:
    return data


def request_chunks(data: bytes, size: int = wire.CHUNK_BYTES):
    """A serialized request as serialized ``PlanChunk`` messages (the first with ``total_bytes``)."""
    view = memoryview(data)
    for start in range(0, max(len(view), 1), size):
        piece = view[start : start + size]
        head = (wire.varint(2 << 3) + wire.varint(len(view))) if start == 0 else b""
        yield head + (wire.header(1, len(piece)) + piece if len(piece) else b"")


def join_chunks(chunks) -> memoryview:
    """The message a stream of serialized ``PlanChunk`` messages carries, assembled in a buffer of
    the first chunk's ``total_bytes`` (copied outside the GIL). Raises SidecarError (DATA_LOSS)
    when the chunks do not add up."""
    assembly = None
    try:
        for raw in chunks:
            data, total = wire.read_chunk(raw)
            if assembly is None:
                assembly = wire.Assembly(max(total, len(data)), b"")
            assembly.add(data)
        if assembly is None:
            raise SidecarError("the response stream carried no chunk", grpc.StatusCode.DATA_LOSS)
        return assembly.view()
    except ValueError as e:  # InvalidArgumentError of read_chunk / Assembly: the chunks do not add up
        raise SidecarError(f"the response's chunks do not add up: {e}", grpc.StatusCode.DATA_LOSS) from None


class SidecarClient:
    """Stubs of ``harts.planner.v1.PlannerService`` over one channel (thread-safe).

    ``credentials``: TLS channel credentials (:func:`harts_planner.rpc.tls.channel_credentials`);
    None for a plaintext channel. ``stream``: plan through the ``*Stream`` methods (default; False
    uses the unary ones, which a response or request larger than the server's message limit
    cannot use)."""

    def __init__(
        self,
        target: str,
        *,
        max_message_bytes: int | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        stream: bool = True,
    ):
        limit = DEFAULT_MAX_MESSAGE_BYTES if max_message_bytes is None else int(max_message_bytes)
        self.target = target
        self.stream = stream
        options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=options)
        # Requests are messages or bytes already serialized (codec.serialize_*_request).
        self._plan_step = self._channel.unary_unary(
            codec.PLAN_STEP,
            request_serializer=_serialize,
            response_deserializer=pb.PlanStepResponse.FromString,
        )
        self._plan_calls = self._channel.unary_unary(
            codec.PLAN_CALLS,
            request_serializer=_serialize,
            response_deserializer=pb.PlanCallsResponse.FromString,
        )
        self._plan_step_stream = self._channel.stream_stream(
            codec.PLAN_STEP_STREAM, request_serializer=_identity, response_deserializer=_identity
        )
        self._plan_calls_stream = self._channel.stream_stream(
            codec.PLAN_CALLS_STREAM, request_serializer=_identity, response_deserializer=_identity
        )
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def plan_step(self, request: pb.PlanStepRequest | bytes, timeout: float | None) -> pb.PlanStepResponse:
        if self.stream:
            data = self._streamed(self._plan_step_stream, request, timeout)
            if data is not None:
                # protobuf's stub says bytes; FromString takes any bytes-like object (no copy).
                return pb.PlanStepResponse.FromString(data)  # pyright: ignore[reportArgumentType]
        return self._call(self._plan_step, request, timeout)

    def plan_calls(self, request: pb.PlanCallsRequest | bytes, timeout: float | None) -> pb.PlanCallsResponse:
        if self.stream:
            data = self._streamed(self._plan_calls_stream, request, timeout)
            if data is not None:
                # protobuf's stub says bytes; FromString takes any bytes-like object (no copy).
                return pb.PlanCallsResponse.FromString(data)  # pyright: ignore[reportArgumentType]
        return self._call(self._plan_calls, request, timeout)

    def _streamed(self, stub, request, timeout) -> memoryview | None:
        """The response bytes of a ``*Stream`` call, or None when the server has no such method."""
        data = _serialize(request)
        try:
            return join_chunks(stub(request_chunks(data), timeout=timeout, wait_for_ready=False))
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.stream = False
                return None
            raise translate(err) from None

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """The health status name (``"SERVING"``, ``"NOT_SERVING"``...) of ``service``."""
        # grpc_health's stub declares HealthStub without the methods its __init__ adds.
        check = self._health.Check  # pyright: ignore[reportAttributeAccessIssue]
        response = self._call(check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self._channel.close()

    @staticmethod
    def _call(stub, request, timeout):
        try:
            return stub(request, timeout=timeout, wait_for_ready=False)
        except grpc.RpcError as err:
            raise translate(err) from None
