"""Save and load trajectory batches.

A batch is ``tokens`` (int32 [S], every trajectory back to back), ``offsets`` (int64 [N + 1],
trajectory ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``) and optional ``tree_ids`` (int64 [N]).
Every trajectory holds at least one token, ``offsets[0] == 0``, ``offsets[-1] == S`` and token ids
lie in ``[0, 2**31 - 1]``.

Formats
-------
``.hrb`` (HARTS raw batch), all integers little-endian::

    offset  size        field
    0       8           magic     b"HARTSRB\\0"
    8       4           version   uint32, 1
    12      4           flags     uint32, bit 0: tree ids present; other bits zero
    16      8           N         uint64, number of trajectories
    24      8           S         uint64, number of tokens
    32      8 (N + 1)   offsets   int64[N + 1]
    ...     4 S         tokens    int32[S]
    ...     8 N         tree_ids  int64[N], only when flag bit 0 is set
    ...     4           crc32     uint32, zlib.crc32 of every preceding byte

``.jsonl``: one object per trajectory and line, ``{"tokens": [...], "tree_id": 3}``; ``tree_id`` is
optional but then absent from every line (so an empty file loads without tree ids). Blank lines are
skipped. Meant for small, hand-inspectable batches.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np

__all__ = ["FORMATS", "BatchFormatError", "load_batch", "save_batch", "validate_batch"]

MAGIC = b"HARTSRB\0"
VERSION = 1
FLAG_TREE_IDS = 1
FORMATS = {".hrb": "hrb", ".jsonl": "jsonl"}

_HEADER = struct.Struct("<8sIIQQ")
_CRC = struct.Struct("<I")
_MAX_TOKEN = 2**31 - 1

PathLike = str | os.PathLike[str]
Batch = tuple[np.ndarray, np.ndarray, np.ndarray | None]


class BatchFormatError(ValueError):
    """A batch (in memory or on disk) breaks the format; the message names the field and problem."""


def save_batch(
    path: PathLike,
    tokens: np.ndarray,
    offsets: np.ndarray,
    tree_ids: np.ndarray | None = None,
    *,
    format: str | None = None,
) -> None:
    """Write a batch to ``path``.

    Parameters
    ----------
    path : str or os.PathLike
        Destination file; overwritten if it exists.
    tokens : array_like of int, shape [S]
        Token ids in ``[0, 2**31 - 1]``.
    offsets : array_like of int, shape [N + 1]
        Strictly increasing trajectory boundaries with ``offsets[0] == 0`` and
        ``offsets[-1] == S``.
    tree_ids : array_like of int, shape [N], optional
        Tree of each trajectory.
    format : {"hrb", "jsonl"}, optional
        File format; inferred from the extension of ``path`` when None.

    Raises
    ------
    BatchFormatError
        If the arrays do not form a valid batch; the message names the field.
    ValueError
        If the format is unknown or cannot be inferred.
    """
    kind = _resolve_format(path, format)
    tokens, offsets, tree_ids = _as_batch(tokens, offsets, tree_ids)
    validate_batch(tokens, offsets, tree_ids)
    if kind == "hrb":
        _save_hrb(Path(path), tokens, offsets, tree_ids)
    else:
        _save_jsonl(Path(path), tokens, offsets, tree_ids)


def load_batch(path: PathLike, *, format: str | None = None) -> Batch:
    """Read and validate a batch written by :func:`save_batch`.

    Parameters
    ----------
    path : str or os.PathLike
        Source file.
    format : {"hrb", "jsonl"}, optional
        File format; inferred from the extension of ``path`` when None.

    Returns
    -------
    tokens : np.ndarray, int32, shape [S]
    offsets : np.ndarray, int64, shape [N + 1]
    tree_ids : np.ndarray, int64, shape [N], or None when the file stores no tree ids

    Raises
    ------
    BatchFormatError
        If ``path`` is not a regular file (a FIFO, for one, could block the read forever), or the
        file is malformed: for ``.hrb`` a bad magic, unsupported version, unknown flags,
        wrong file size (truncated or trailing bytes), checksum mismatch or invalid batch arrays;
        for ``.jsonl`` invalid JSON (also nested too deeply, or not UTF-8) or fields, with the line
        number.
    ValueError
        If the format is unknown or cannot be inferred.
    OSError
        If the file cannot be read.
    """
    kind = _resolve_format(path, format)
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO or device could block reading forever
        raise BatchFormatError(f"{os.fspath(path)}: not a regular file (a directory, FIFO, socket or device)")
    if kind == "hrb":
        return _load_hrb(Path(path))
    return _load_jsonl(Path(path))


def validate_batch(tokens: np.ndarray, offsets: np.ndarray, tree_ids: np.ndarray | None) -> None:
    """Check the batch invariants of already-typed arrays.

    Parameters
    ----------
    tokens : np.ndarray, any integer dtype, shape [S]
    offsets : np.ndarray, int64, shape [N + 1]
    tree_ids : np.ndarray, int64, shape [N], or None

    Raises
    ------
    BatchFormatError
        Naming ``offsets``, ``tokens`` or ``tree_ids`` and the broken invariant.
    """
    if tokens.ndim != 1:
        raise BatchFormatError(f"tokens: expected a 1-D array, got shape {tokens.shape}")
    if offsets.ndim != 1 or offsets.size == 0:
        raise BatchFormatError(
            f"offsets: expected a 1-D array of N + 1 >= 1 entries, got shape {offsets.shape}"
        )
    if offsets[0] != 0:
        raise BatchFormatError(f"offsets: offsets[0] must be 0, got {offsets[0]}")
    steps = np.diff(offsets)
    if np.any(steps < 0):
        index = int(np.argmax(steps < 0)) + 1
        raise BatchFormatError(
            f"offsets: not non-decreasing at index {index} ({offsets[index - 1]} > {offsets[index]})"
        )
    if np.any(steps == 0):
        raise BatchFormatError(f"offsets: trajectory {int(np.argmax(steps == 0))} is empty")
    if offsets[-1] != tokens.size:
        raise BatchFormatError(
            f"offsets: offsets[-1] = {offsets[-1]} does not match S = {tokens.size} tokens"
        )
    if tokens.size and (tokens.min() < 0 or tokens.max() > _MAX_TOKEN):
        bad = int(np.argmax((tokens < 0) | (tokens > _MAX_TOKEN)))
        raise BatchFormatError(f"tokens: token id {tokens[bad]} at index {bad} is outside [0, {_MAX_TOKEN}]")
    if tree_ids is not None and tree_ids.shape != (offsets.size - 1,):
        raise BatchFormatError(f"tree_ids: expected shape ({offsets.size - 1},), got {tree_ids.shape}")


def _resolve_format(path: PathLike, format: str | None) -> str:
    """Return ``"hrb"`` or ``"jsonl"`` for an explicit ``format`` or the extension of ``path``."""
    if format is not None:
        if format not in FORMATS.values():
            raise ValueError(f"format: unknown format {format!r}; choose one of {sorted(FORMATS.values())}")
        return format
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(
            f"format: cannot infer a batch format from extension {suffix!r} of "
            f"{os.fspath(path)!r}; use one of {sorted(FORMATS)} or pass format="
        )
    return FORMATS[suffix]


def _as_batch(tokens: np.ndarray, offsets: np.ndarray, tree_ids: np.ndarray | None) -> Batch:
    """Turn array-likes into 1-D integer arrays, rejecting anything else.

    ``offsets`` and ``tree_ids`` become int64; ``tokens`` keeps its integer dtype (its range is
    checked by :func:`validate_batch`) so that an int32 array is written without a copy.
    """
    tokens = _integer_array(tokens, "tokens")
    offsets = _int64_array(offsets, "offsets")
    return tokens, offsets, None if tree_ids is None else _int64_array(tree_ids, "tree_ids")


def _integer_array(value: object, name: str) -> np.ndarray:
    """``value`` as a 1-D integer array (an empty sequence becomes int64)."""
    array = np.asarray(value)
    if array.size == 0:
        array = array.astype(np.int64)
    if array.dtype.kind not in "iu" or array.ndim != 1:
        raise BatchFormatError(
            f"{name}: expected a 1-D integer array, got dtype {array.dtype} and shape {array.shape}"
        )
    return array


def _int64_array(value: object, name: str) -> np.ndarray:
    """``value`` as a 1-D int64 array, rejecting unsigned values that do not fit."""
    array = _integer_array(value, name)
    if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
        raise BatchFormatError(f"{name}: value {array.max()} does not fit int64")
    return array.astype(np.int64, copy=False)


def _save_hrb(path: Path, tokens: np.ndarray, offsets: np.ndarray, tree_ids: np.ndarray | None) -> None:
    """Write the ``.hrb`` layout, computing the CRC32 while streaming the sections."""
    flags = FLAG_TREE_IDS if tree_ids is not None else 0
    sections = [
        _HEADER.pack(MAGIC, VERSION, flags, offsets.size - 1, tokens.size),
        np.ascontiguousarray(offsets, dtype="<i8"),
        np.ascontiguousarray(tokens, dtype="<i4"),
    ]
    if tree_ids is not None:
        sections.append(np.ascontiguousarray(tree_ids, dtype="<i8"))
    crc = 0
    with path.open("wb") as out:
        for section in sections:
            view = memoryview(section).cast("B")
            crc = zlib.crc32(view, crc)
            out.write(view)
        out.write(_CRC.pack(crc))


def _load_hrb(path: Path) -> Batch:
    """Read and validate an ``.hrb`` file; see :func:`load_batch`."""
    data = np.fromfile(path, dtype=np.uint8)
    if data.size < _HEADER.size + _CRC.size:
        raise BatchFormatError(
            f"header: file is truncated ({data.size} bytes, a header and "
            f"checksum need {_HEADER.size + _CRC.size})"
        )
    magic, version, flags, n, s = _HEADER.unpack_from(data.data)
    if magic != MAGIC:
        raise BatchFormatError(f"magic: expected {MAGIC!r}, got {magic!r}")
    if version != VERSION:
        raise BatchFormatError(
            f"version: unsupported format version {version} (this reader supports {VERSION})"
        )
    if flags & ~FLAG_TREE_IDS:
        raise BatchFormatError(f"flags: unknown flag bits {flags & ~FLAG_TREE_IDS:#x}")
    has_tree_ids = bool(flags & FLAG_TREE_IDS)
    expected = _HEADER.size + 8 * (n + 1) + 4 * s + (8 * n if has_tree_ids else 0) + _CRC.size
    if data.size != expected:
        problem = "truncated" if data.size < expected else "has trailing bytes"
        raise BatchFormatError(
            f"file size: {problem}: N = {n} and S = {s} need {expected} bytes, got {data.size}"
        )
    stored = _CRC.unpack_from(data.data, data.size - _CRC.size)[0]
    computed = zlib.crc32(data[: -_CRC.size].data)
    if stored != computed:
        raise BatchFormatError(f"crc32: checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")
    offsets = _section(data, _HEADER.size, "<i8", n + 1)
    tokens = _section(data, _HEADER.size + 8 * (n + 1), "<i4", s)
    tree_ids = _section(data, _HEADER.size + 8 * (n + 1) + 4 * s, "<i8", n) if has_tree_ids else None
    validate_batch(tokens, offsets, tree_ids)
    return tokens, offsets, tree_ids


def _section(data: np.ndarray, start: int, dtype: str, count: int) -> np.ndarray:
    """Native-endian view (or aligned copy) of ``count`` items of ``dtype`` at byte ``start``."""
    little = np.frombuffer(data, dtype=dtype, count=count, offset=start)
    native = little.astype(np.dtype(dtype).newbyteorder("="), copy=False)
    return native if native.flags.aligned else native.copy()


def _save_jsonl(path: Path, tokens: np.ndarray, offsets: np.ndarray, tree_ids: np.ndarray | None) -> None:
    """Write one ``{"tokens": [...], "tree_id": int}`` object per line."""
    with path.open("w", encoding="utf-8") as out:
        for i in range(offsets.size - 1):
            record: dict[str, object] = {"tokens": tokens[offsets[i] : offsets[i + 1]].tolist()}
            if tree_ids is not None:
                record["tree_id"] = int(tree_ids[i])
            out.write(json.dumps(record, separators=(",", ":")) + "\n")


def _load_jsonl(path: Path) -> Batch:
    """Read and validate a ``.jsonl`` batch; see :func:`load_batch`."""
    trajectories: list[list[int]] = []
    tree_ids: list[int] = []
    first_has_tree_id: bool | None = None
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise BatchFormatError(
                    f"line {number}: not UTF-8 text ({error.reason} at byte {error.start})"
                ) from None
            if not line.strip():
                continue
            tokens, tree_id = _parse_jsonl_line(line, number)
            if first_has_tree_id is None:
                first_has_tree_id = tree_id is not None
            elif first_has_tree_id != (tree_id is not None):
                here, first = ("missing", "given") if tree_id is None else ("given", "missing")
                raise BatchFormatError(
                    f"line {number}: tree_id: {here} here but {first} on the "
                    f"first trajectory line; give it on every line or none"
                )
            trajectories.append(tokens)
            if tree_id is not None:
                tree_ids.append(tree_id)
    lengths = [len(t) for t in trajectories]
    offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).astype(np.int64)
    flat = np.fromiter((tok for t in trajectories for tok in t), dtype=np.int32, count=int(offsets[-1]))
    return flat, offsets, (np.asarray(tree_ids, dtype=np.int64) if first_has_tree_id else None)


def _parse_jsonl_line(line: str, number: int) -> tuple[list[int], int | None]:
    """Parse one JSONL record into its token list and optional tree id.

    Raises
    ------
    BatchFormatError
        Naming the line number and the offending field.
    """
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise BatchFormatError(f"line {number}: invalid JSON: {error.msg}") from None
    except RecursionError:
        raise BatchFormatError(f"line {number}: invalid JSON: nested too deeply") from None
    if not isinstance(record, dict):
        raise BatchFormatError(f"line {number}: expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - {"tokens", "tree_id"})
    if unknown:
        raise BatchFormatError(
            f"line {number}: {unknown[0]}: unknown field (expected 'tokens' and optional 'tree_id')"
        )
    tokens = record.get("tokens")
    if not isinstance(tokens, list):
        raise BatchFormatError(
            f"line {number}: tokens: expected a list of token ids, got {type(tokens).__name__}"
        )
    if not tokens:
        raise BatchFormatError(f"line {number}: tokens: empty trajectory")
    for index, token in enumerate(tokens):
        if not _is_int(token) or not 0 <= token <= _MAX_TOKEN:
            raise BatchFormatError(
                f"line {number}: tokens: entry {index} = {token!r} is not a token id in [0, {_MAX_TOKEN}]"
            )
    if "tree_id" not in record:
        return tokens, None
    tree_id = record["tree_id"]
    if not (_is_int(tree_id) and -(2**63) <= tree_id < 2**63):
        raise BatchFormatError(f"line {number}: tree_id: expected an int64, got {tree_id!r}")
    return tokens, tree_id


def _is_int(value: object) -> bool:
    """Whether ``value`` is a JSON integer (``bool`` excluded)."""
    return isinstance(value, int) and not isinstance(value, bool)
