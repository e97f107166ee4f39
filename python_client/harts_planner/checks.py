"""Argument checks shared by the planner's Python layer (batch, step plan, call plan, Planner, codec).

Each check returns the value converted to its canonical type or raises
:class:`~harts_planner.InvalidArgumentError` whose ``field`` is the ``field`` argument and whose
message starts with it, formatted like the C++ core's (``"chunk_size: must be in [1, 1048576], got 0"``).
The checks run in O(1), the array checks in O(n) for ``n`` elements (plus one conversion copy when
the dtype differs); none of them allocate for an input that is already canonical.

======================  =============================================================================
check                   accepts
======================  =============================================================================
:func:`integer`         a Python or numpy integer (never a bool) within ``[lo, hi]`` (either side open)
:func:`int64`           the same, and it fits a signed 64-bit integer (a proto ``int64``)
:func:`index`           an integer in ``[0, size)``
:func:`boolean`         a Python or numpy bool
:func:`string`          a ``str``
:func:`chunk_size`      B in ``[1, MAX_CHUNK_SIZE]``
:func:`conv_width`      w in ``[1, MAX_CONV_WIDTH]``
:func:`int_array`       array-like of integers, one-dimensional, each value fitting ``dtype``
:func:`trajectory_ids`  a non-empty one-dimensional integer array of int32 trajectory indices
:func:`step_options`    search options of the step planner (names and value types)
======================  =============================================================================

Only type and range are checked here; what needs the data (an index out of a batch's range, a repeated
trajectory, a cycle) is checked by the C++ core, which names the element (``trajectories[j]``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from harts_planner import _native
from harts_planner.errors import invalid

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_LIMITS = _native.planner_limits()
MAX_CHUNK_SIZE: int = _LIMITS["MAX_CHUNK_SIZE"]
MAX_CONV_WIDTH: int = _LIMITS["MAX_CONV_WIDTH"]
MAX_CP_SIZE: int = _LIMITS["MAX_CP_SIZE"]


def _range_text(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"must be in [{lo}, {hi}]"
    return f"must be >= {lo}" if lo is not None else f"must be <= {hi}"


def integer(value, field: str, lo: int | None = None, hi: int | None = None) -> int:
    """``int(value)`` for a Python or numpy integer (not a bool) with ``lo <= value <= hi``
    (``None`` leaves that side open)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise invalid(field, f"must be an integer, got {value!r}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise invalid(field, f"{_range_text(lo, hi)}, got {value}")
    return value


def int64(value, field: str, lo: int | None = None) -> int:
    """:func:`integer` that also fits int64 (what a proto ``int64`` field or a C++ ``int64_t`` holds)."""
    value = integer(value, field)
    if not INT64_MIN <= value <= INT64_MAX:
        raise invalid(field, f"must fit int64, got {value}")
    return integer(value, field, lo)


def index(value, field: str, size: int) -> int:
    """An integer in the half-open range ``[0, size)``."""
    value = integer(value, field)
    if not 0 <= value < size:
        raise invalid(field, f"must be in [0, {size}), got {value}")
    return value


def boolean(value, field: str) -> bool:
    """``bool(value)`` for a Python or numpy bool (not an integer)."""
    if not isinstance(value, (bool, np.bool_)):
        raise invalid(field, f"must be a bool, got {value!r}")
    return bool(value)


def string(value, field: str) -> str:
    """``value`` when it is a ``str``."""
    if not isinstance(value, str):
        raise invalid(field, f"must be a string, got {value!r}")
    return value


def chunk_size(value, field: str = "chunk_size") -> int:
    """B, the linear-attention chunk size, in ``[1, MAX_CHUNK_SIZE]`` (2^20)."""
    return integer(value, field, 1, MAX_CHUNK_SIZE)


def conv_width(value, field: str = "conv_width") -> int:
    """w, the causal-convolution width, in ``[1, MAX_CONV_WIDTH]`` (1024)."""
    return integer(value, field, 1, MAX_CONV_WIDTH)


def int_array(values, dtype, field: str) -> np.ndarray:
    """``values`` as a C-contiguous one-dimensional array of ``dtype`` (zero copy when it already is).

    Raises when it is not one-dimensional, holds non-integers (an empty array of any dtype is
    accepted) or a value that does not fit ``dtype``.
    """
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise invalid(field, f"must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise invalid(field, f"must hold integers, got dtype {arr.dtype}")
    if arr.dtype != dtype and arr.size:
        info = np.iinfo(dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise invalid(field, f"value {bad} does not fit {np.dtype(dtype).name}")
    return np.ascontiguousarray(arr, dtype=dtype)


def trajectory_ids(values, field: str) -> np.ndarray:
    """A microbatch: int32 [k] trajectory indices, k >= 1. A value outside int32 is reported on its
    element, ``field[j]`` ("trajectory index ... is out of range"); range and repeats within the
    batch are the C++ core's checks."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise invalid(field, f"must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        raise invalid(field, "a microbatch needs at least one trajectory")
    if arr.dtype.kind not in "iu":
        raise invalid(field, f"must hold integers, got dtype {arr.dtype}")
    info = np.iinfo(np.int32)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < info.min or hi > info.max:
        j = int(np.argmax((arr < info.min) | (arr > info.max)))
        raise invalid(f"{field}[{j}]", f"trajectory index {int(arr[j])} is out of range")
    return np.ascontiguousarray(arr, dtype=np.int32)


def step_options(options: Mapping, defaults: Mapping, prefix: str = "") -> dict:
    """The given search options with canonical values: each name must be a key of ``defaults`` and
    each value of its default's type (bool, int64 or str). Value ranges and the search mode's
    spelling are checked by the C++ planner. Fields are ``prefix + name``."""
    out = {}
    for name, value in options.items():
        if name not in defaults:
            raise invalid(prefix + str(name), f"unknown option; choose from {sorted(defaults)}")
        default, field = defaults[name], prefix + name
        if isinstance(default, bool):
            out[name] = boolean(value, field)
        elif isinstance(default, int):
            out[name] = int64(value, field)
        else:
            out[name] = string(value, field)
    return out


__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "MAX_CHUNK_SIZE",
    "MAX_CONV_WIDTH",
    "MAX_CP_SIZE",
    "boolean",
    "chunk_size",
    "conv_width",
    "index",
    "int64",
    "int_array",
    "integer",
    "step_options",
    "string",
    "trajectory_ids",
]
