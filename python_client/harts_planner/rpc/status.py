"""The planner's errors on the wire: one table, read by the server and by the client.

=========================  ====================  ===================================  ====================
Python error               gRPC status           google.rpc detail (its field entry)  entry names the field
=========================  ====================  ===================================  ====================
InvalidArgumentError       INVALID_ARGUMENT      BadRequest (field_violations)        ``field``
ResourceLimitError         RESOURCE_EXHAUSTED    QuotaFailure (violations)            ``subject``
InfeasibleError            FAILED_PRECONDITION   PreconditionFailure (violations)     ``subject``
=========================  ====================  ===================================  ====================

The server (:mod:`harts_planner.rpc.server`) turns a planner error into its status with one detail
whose entry names the request field (:func:`rich_status`); the client (:mod:`harts_planner.rpc.client`)
turns the status back into the same Python class with ``.field`` (:func:`error_class`,
:func:`field_of`). Any other :class:`~harts_planner.HartsError` travels as INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import grpc
from google.protobuf import any_pb2, message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from harts_planner.errors import HartsError, InfeasibleError, InvalidArgumentError, ResourceLimitError


@dataclass(frozen=True)
class ErrorStatus:
    """One row of :data:`TABLE`: a planner error class, its status code and its detail message.

    ``detail`` has a repeated field ``entries`` of ``entry`` messages; ``subject`` is the entry's
    field that names the request field, ``extra`` fixed values of the entry's other fields."""

    error: type[HartsError]
    code: grpc.StatusCode
    detail: type[message.Message]
    entries: str
    entry: type[message.Message]
    subject: str
    extra: dict = field(default_factory=dict)


TABLE: tuple[ErrorStatus, ...] = (
    ErrorStatus(
        InvalidArgumentError,
        grpc.StatusCode.INVALID_ARGUMENT,
        error_details_pb2.BadRequest,
        "field_violations",
        error_details_pb2.BadRequest.FieldViolation,
        "field",
    ),
    ErrorStatus(
        ResourceLimitError,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        error_details_pb2.QuotaFailure,
        "violations",
        error_details_pb2.QuotaFailure.Violation,
        "subject",
    ),
    ErrorStatus(
        InfeasibleError,
        grpc.StatusCode.FAILED_PRECONDITION,
        error_details_pb2.PreconditionFailure,
        "violations",
        error_details_pb2.PreconditionFailure.Violation,
        "subject",
        {"type": "PLAN"},
    ),
)

_BY_CODE = {row.code: row for row in TABLE}


def for_error(err: HartsError) -> ErrorStatus:
    """The row of a planner error (a HartsError of no listed class: INVALID_ARGUMENT's)."""
    for row in TABLE:
        if isinstance(err, row.error):
            return row
    return TABLE[0]


def error_class(code: grpc.StatusCode) -> type[HartsError] | None:
    """The planner error a status code stands for, or None (a transport failure)."""
    row = _BY_CODE.get(code)
    return None if row is None else row.error


def rich_status(code: grpc.StatusCode, message_text: str, field_path: str | None) -> grpc.Status:
    """The status to abort an RPC with: ``code``, ``message_text`` and, when ``field_path`` is given
    and ``code`` is in :data:`TABLE`, the row's detail with one entry naming ``field_path``."""
    details = []
    row = _BY_CODE.get(code)
    if row is not None and field_path is not None:
        entry = row.entry(**{row.subject: field_path, "description": message_text, **row.extra})
        detail = any_pb2.Any()
        detail.Pack(row.detail(**{row.entries: [entry]}))
        details.append(detail)
    return rpc_status.to_status(
        status_pb2.Status(code=getattr(code_pb2, code.name), message=message_text, details=details)
    )


def field_of(err: grpc.RpcError) -> str | None:
    """The request field named by a failed call's first detail of a :data:`TABLE` type, or None."""
    # A failed call's RpcError is also its grpc.Call (grpc's stubs keep the two apart).
    status = rpc_status.from_call(cast(grpc.Call, err))
    if status is None:
        return None
    for detail in status.details:
        for row in TABLE:
            if detail.Is(row.detail.DESCRIPTOR):
                msg = row.detail()
                detail.Unpack(msg)
                for entry in getattr(msg, row.entries):
                    return getattr(entry, row.subject)
    return None


__all__ = ["ErrorStatus", "TABLE", "error_class", "field_of", "for_error", "rich_status"]
