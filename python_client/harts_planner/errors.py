"""Planner errors. Every class subclasses :class:`ValueError` and carries ``field``.

=====================  ========================  =====================
Python                 C++                       gRPC status
=====================  ========================  =====================
InvalidArgumentError   harts::InvalidArgument    INVALID_ARGUMENT
ResourceLimitError     harts::ResourceExhausted  RESOURCE_EXHAUSTED
InfeasibleError        harts::FailedPrecondition FAILED_PRECONDITION
=====================  ========================  =====================

The gRPC column, with the google.rpc detail that names the field, is the table
:data:`harts_planner.rpc.status.TABLE` that the sidecar's server and client both use.
"""

from __future__ import annotations

from harts_planner._native import (  # noqa: F401  (re-exported)
    HartsError,
    InfeasibleError,
    InvalidArgumentError,
    ResourceLimitError,
)


def invalid(field: str, message: str) -> InvalidArgumentError:
    """Build an :class:`InvalidArgumentError` for ``field`` (formatted like the C++ ones)."""
    err = InvalidArgumentError(f"{field}: {message}")
    err.field = field
    return err


__all__ = ["HartsError", "InvalidArgumentError", "ResourceLimitError", "InfeasibleError", "invalid"]
