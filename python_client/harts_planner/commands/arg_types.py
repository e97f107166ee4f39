"""The argparse types of `harts-planner`'s options.

Every option value is checked where it is given (argparse ``type=``): a bad one ends the command
before any work with one line, ``harts-planner <command>: error: argument --dp: must be >= 1, got 0``.
"""

from __future__ import annotations

import argparse
import os

INT64_MAX = 2**63 - 1


def _range_text(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"must be in [{lo}, {hi}]"
    return f"must be >= {lo}" if lo is not None else f"must be <= {hi}"


def int_arg(lo: int | None = None, hi: int | None = INT64_MAX):
    """An argparse type: a decimal integer in ``[lo, hi]`` (int64 unless ``hi`` says otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{_range_text(lo, hi)}, got {value}")
        return value

    return parse


def float_arg(lo: float = 0.0, hi: float = 1e9):
    """An argparse type: a finite number in ``[lo, hi]``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not lo <= value <= hi:  # also NaN
            raise argparse.ArgumentTypeError(f"must be in [{lo:g}, {hi:g}], got {text}")
        return value

    return parse


def _batch_formats() -> tuple[str, ...]:
    from harts_planner.batch_io import FORMATS

    return tuple(FORMATS)


def _suffix_of(text: str) -> str:
    return os.path.splitext(text)[1].lower()


def input_batch(text: str) -> str:
    """An argparse type: an existing, readable batch file (``.hrb`` or ``.jsonl``)."""
    if _suffix_of(text) not in _batch_formats():
        raise argparse.ArgumentTypeError(
            f"{text!r}: not a batch file; the name must end in {' or '.join(_batch_formats())}"
        )
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text!r}: no such file")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r}: is a directory, not a batch file")
    if not os.path.isfile(text):  # a FIFO, socket or device: reading it could wait forever
        raise argparse.ArgumentTypeError(
            f"{text!r}: not a regular file (a FIFO, socket or device); save the batch to a file"
        )
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: not readable")
    return text


def input_file(text: str) -> str:
    """An argparse type: an existing, readable regular file (a certificate or key)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: no such file" if not os.path.exists(text) else f"{text!r}: not a regular file"
        )
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: not readable")
    return text


def output_file(suffixes: tuple[str, ...] | None = None):
    """An argparse type: a file path to write (its directory exists, it is not a directory, and its
    name ends in one of ``suffixes`` when given)."""

    def parse(text: str) -> str:
        choices = _batch_formats() if suffixes is None else suffixes
        if choices and _suffix_of(text) not in choices:
            raise argparse.ArgumentTypeError(f"{text!r}: the name must end in {' or '.join(choices)}")
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"{text!r}: is a directory")
        parent = os.path.dirname(os.path.abspath(text))
        if not os.path.isdir(parent):
            raise argparse.ArgumentTypeError(f"{text!r}: directory {parent!r} does not exist")
        return text

    return parse


def json_destination(text: str) -> str:
    """``-`` (stdout) or a file path to write."""
    return text if text == "-" else output_file(())(text)


def target_arg(text: str) -> str:
    """An argparse type: a sidecar address ``host:port`` (``[v6]:port``), or a gRPC target with a
    scheme (``unix:PATH``, ``dns:///host:port``)."""
    if text.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or host in ("[", "[]"):
        raise argparse.ArgumentTypeError(f"must be HOST:PORT, got {text!r}")
    try:
        number = int(port, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port of {text!r} must be an integer, got {port!r}") from None
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port of {text!r} must be in [1, 65535], got {number}")
    return text


def host_arg(text: str) -> str:
    """An argparse type: a host name or address to bind (no port, no spaces)."""
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if not bare or any(c.isspace() for c in bare) or ("/" in bare):
        raise argparse.ArgumentTypeError(f"must be a host name or address, got {text!r}")
    return bare


__all__ = [
    "INT64_MAX",
    "float_arg",
    "host_arg",
    "input_batch",
    "input_file",
    "int_arg",
    "json_destination",
    "output_file",
    "target_arg",
]
