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
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harts_planner.rpc import codec, status
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


class SidecarClient:
    """Stubs of ``harts.planner.v1.PlannerService`` over one channel (thread-safe)."""

    def __init__(self, target: str, *, max_message_bytes: int | None = None):
        limit = DEFAULT_MAX_MESSAGE_BYTES if max_message_bytes is None else int(max_message_bytes)
        self.target = target
        self._channel = grpc.insecure_channel(
            target,
            options=[("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)],
        )
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
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def plan_step(self, request: pb.PlanStepRequest | bytes, timeout: float | None) -> pb.PlanStepResponse:
        return self._call(self._plan_step, request, timeout)

    def plan_calls(self, request: pb.PlanCallsRequest | bytes, timeout: float | None) -> pb.PlanCallsResponse:
        return self._call(self._plan_calls, request, timeout)

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """The health status name (``"SERVING"``, ``"NOT_SERVING"``...) of ``service``."""
        response = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self._channel.close()

    @staticmethod
    def _call(stub, request, timeout):
        try:
            return stub(request, timeout=timeout, wait_for_ready=False)
        except grpc.RpcError as err:
            raise translate(err) from None
