"""The sidecar's structured logs: one record per RPC and one per lifecycle event.

Every record goes to the logger ``harts_planner.rpc`` (:data:`LOGGER`) with its data in the record's
``fields`` attribute; :func:`configure_logging` (run by ``serve``) prints them to stderr as JSON lines
(:class:`JsonFormatter`) or ``key=value`` text (:class:`TextFormatter`). A library logs nothing until
configured.

Records (``event``):

* ``rpc``: one per PlanStep / PlanCalls call (or its ``*Stream`` form), written when the call ended:
  method, peer, status ``code`` (and ``field`` / ``error`` when not OK), input kind, sizes, the cost
  estimate, and the milliseconds spent receiving, admitting, queued, planning, encoding and sending.
  A call whose handler sent its whole response (unary or streamed) is logged once gRPC ended the
  call, not when the handler returned (a log reader may see it a moment after the client has its
  answer): OK with ``delivered: true`` when the response and its OK status went out without the
  client resetting the call, else CANCELLED with ``delivered: false``. A response the client never
  read (cut off by ``--send-timeout`` or ``--min-send-rate-mb``, its deadline, its cancellation or
  a drain) is logged with the status it ended with and ``delivered: false``, never OK. grpcio
  reports a message it refused for size as a cancelled call, so a client's CANCELLED says
  ``client cancelled or message refused by gRPC for size`` (a request over ``--max-message-mb``, a
  response over the client's receive limit).
* ``serving``, ``drain``, ``stopped``: the server's address and limits; a drain's start; its end.
* ``warning``: a configuration to look at (a non-loopback ``--host`` without mutual TLS).
"""

from __future__ import annotations

import json
import logging
import sys

LOGGER = logging.getLogger("harts_planner.rpc")
LOGGER.addHandler(logging.NullHandler())  # a library logs nothing unless configured (serve() does)


def event(name: str, level: int = logging.INFO, logger: logging.Logger = LOGGER, **fields) -> None:
    """Log one lifecycle record ``{"event": name, **fields}``."""
    logger.log(level, name, extra={"fields": {"event": name, **fields}})


def rpc(record: dict, logger: logging.Logger = LOGGER) -> None:
    """Log one RPC's record (INFO when its code is OK, WARNING otherwise)."""
    level = logging.INFO if record.get("code") == "OK" else logging.WARNING
    logger.log(level, "rpc", extra={"fields": record})


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, message and the record's ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``time level key=value ...`` lines."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        body = " ".join(f"{k}={v}" for k, v in fields.items()) if fields else record.getMessage()
        text = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname} {body}"
        return text + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


def configure_logging(log_format: str = "json", level: int = logging.INFO, stream=None) -> None:
    """Send ``harts_planner.rpc`` records to ``stream`` (stderr) as JSON lines or text."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    LOGGER.handlers[:] = [handler]
    LOGGER.setLevel(level)
    LOGGER.propagate = False


__all__ = ["LOGGER", "JsonFormatter", "TextFormatter", "configure_logging", "event", "rpc"]
