"""Planner errors and cancellation. Every error class subclasses :class:`ValueError` and carries ``field``.

=====================  ========================  =====================================
Python                 C++                       gRPC status
=====================  ========================  =====================================
InvalidArgumentError   harts::InvalidArgument    INVALID_ARGUMENT
ResourceLimitError     harts::ResourceExhausted  RESOURCE_EXHAUSTED
InfeasibleError        harts::FailedPrecondition FAILED_PRECONDITION
PlanCancelledError     harts::Cancelled          CANCELLED (``field == "cancelled"``) or
                                                 DEADLINE_EXCEEDED (``field == "deadline"``)
=====================  ========================  =====================================

The gRPC column, with the google.rpc detail that names the field, is the table
:data:`harts_planner.rpc.status.TABLE` that the sidecar's server and client both use.

Cancellation (``harts/cancel.h``): a :class:`CancelToken` passed as ``cancel=`` to
:func:`~harts_planner.plan_calls`, :func:`~harts_planner.plan_step` or the
:class:`~harts_planner.RolloutBatch` constructors stops the call within milliseconds once another
thread calls :meth:`CancelToken.cancel` or its :meth:`CancelToken.set_deadline` passes; the call
then raises :class:`PlanCancelledError` (``deadline_exceeded`` tells which) and returns nothing. The
planning calls release the GIL, so other Python threads run meanwhile.
"""

from __future__ import annotations

import numbers

from harts_planner._native import (  # noqa: F401  (re-exported)
    CancelToken,
    HartsError,
    InfeasibleError,
    InvalidArgumentError,
    PlanCancelledError,
    ResourceLimitError,
)


def invalid(field: str, message: str) -> InvalidArgumentError:
    """Build an :class:`InvalidArgumentError` for ``field`` (formatted like the C++ ones)."""
    err = InvalidArgumentError(f"{field}: {message}")
    err.field = field
    return err


def _checked_set_deadline(native_set_deadline):
    def set_deadline(self, seconds) -> None:
        """Stop the call once ``seconds`` (a real number) have passed from now; a negative value is
        already past, ``math.inf`` clears the deadline. InvalidArgumentError naming ``seconds`` for
        anything else (a string, a bool, None, NaN)."""
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
            raise invalid("seconds", f"must be a number of seconds, got {type(seconds).__name__} {seconds!r}")
        native_set_deadline(self, float(seconds))

    set_deadline.native = native_set_deadline
    return set_deadline


# The binding converts the argument itself and raises TypeError for a string; wrap it once so that
# every token (however made) names the field instead.
if not hasattr(CancelToken.set_deadline, "native"):
    CancelToken.set_deadline = _checked_set_deadline(CancelToken.set_deadline)


def resource_limit(field: str, message: str) -> ResourceLimitError:
    """Build a :class:`ResourceLimitError` for ``field`` (formatted like the C++ ones)."""
    err = ResourceLimitError(f"{field}: {message}")
    err.field = field
    return err


def renamed(err: HartsError, mapping: dict[str, str]) -> HartsError:
    """The same error with its field's leading name replaced through ``mapping``
    (``trajectories[3]`` -> ``microbatch[3]``); ``err`` itself when its field is not in ``mapping``."""
    field = getattr(err, "field", None) or ""
    head, bracket, rest = field.partition("[")
    if head not in mapping:
        return err
    new_field = mapping[head] + bracket + rest
    message = str(err)
    if message.startswith(field):
        message = new_field + message[len(field) :]
    out = type(err)(message)
    out.field = new_field
    return out


def cancel_token(cancel, field: str = "cancel") -> CancelToken | None:
    """``cancel`` when it is None or a :class:`CancelToken`; InvalidArgumentError naming ``field``
    otherwise."""
    if cancel is not None and not isinstance(cancel, CancelToken):
        raise invalid(field, f"must be a harts_planner.CancelToken or None, got {type(cancel).__name__}")
    return cancel


__all__ = [
    "CancelToken",
    "HartsError",
    "InvalidArgumentError",
    "ResourceLimitError",
    "InfeasibleError",
    "PlanCancelledError",
    "cancel_token",
    "invalid",
    "renamed",
    "resource_limit",
]
