"""Wire bytes of the sidecar's large messages, made without holding the GIL.

A plan's arrays are most of its response (hundreds of MB for a big microbatch). Copying them into a
protobuf message, serializing it and handing the bytes to gRPC copied them three times, each copy
holding the GIL: one large response stalled every other call of the server (health checks for
seconds). Here a response is a list of :class:`Parts`: small protobuf-encoded pieces (scalars,
field headers) and zero-copy views of the plan's arrays, in protobuf wire format (each array is a
``bytes`` field: tag, length, the little-endian values). :meth:`Parts.fill` copies any byte range of
it into a new ``bytes`` object with ``memmove`` outside the GIL (ctypes releases it), so the
response is sent as chunks of :data:`CHUNK_BYTES` (a ``*Stream`` RPC) or filled once (a unary RPC,
at most one message) without a long hold of the GIL. The bytes equal the protobuf serialization up
to field order (tested: they parse to the same message).

In the other direction :func:`read_request` reads a request's trajectories as views of the request
bytes instead of parsing them into a message (whose bytes fields Python would copy again); its walk
is bounded (:data:`MAX_FIELDS` fields per message level: a request of one field repeated millions of
times is refused naming the field, not walked; so is the trajectories field or any of its arrays
sent twice, whose merge protobuf's parser would make), fields the message does not know are
skipped, the trajectories never reach protobuf's parser, and what the parse of the other fields
will hold is counted (``reserve``) before it is spent; and
:class:`Assembly` puts a chunked request together in one buffer, placed so that its largest array
(the tokens) is aligned.

``fill`` writes into a ``bytes`` object it has just created and that nothing else references yet
(CPython: the buffer of a new ``bytes`` of n >= 2 bytes is its own allocation).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import numpy as np

from harts_planner import call_plan as _call_plan
from harts_planner import step_plan as _step_plan
from harts_planner.errors import invalid
from harts_planner.rpc import planner_pb2 as pb
from harts_planner.rpc.codec import header, varint

#: Data bytes per chunk of a ``*Stream`` call, either way: a chunk message fits in 1 MiB.
CHUNK_BYTES = (1 << 20) - 64
_LITTLE = sys.byteorder == "little"
_CALL_PLAN_NUMBERS = {f.name: f.number for f in pb.CallPlan.DESCRIPTOR.fields}
_STEP_PLAN_NUMBERS = {f.name: f.number for f in pb.StepPlan.DESCRIPTOR.fields}


def _address(buffer) -> int:
    if isinstance(buffer, bytes):
        # typeshed's ctypes.cast leaves out bytes, which it takes (as a c_char_p: no copy).
        address = ctypes.cast(buffer, ctypes.c_void_p).value  # pyright: ignore[reportArgumentType]
        return address or 0  # a bytes object's buffer is never NULL
    return buffer.ctypes.data  # a numpy array


def _view_address(view) -> int:
    """Address of the first byte of a C-contiguous buffer (bytes, memoryview of bytes)."""
    return np.frombuffer(view, np.uint8).ctypes.data


def _new_bytes(size: int) -> bytes:
    """A new zeroed ``bytes`` object of ``size`` >= 2 bytes (calloc: no copy, pages mapped lazily)."""
    out = bytes(size)
    assert sys.getrefcount(out) == 2  # ours alone: nothing else can see it being written
    return out


class Parts:
    """A message's wire bytes as a list of pieces: ``bytes`` and 1-D uint8 numpy views (of arrays
    owned elsewhere; the views keep them alive). ``len(parts)`` is the byte count."""

    __slots__ = ("items", "ends")

    def __init__(self):
        self.items: list = []
        self.ends: list[int] = []  # cumulative end offset of each item

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def _append(self, item, size: int) -> None:
        if not size:
            return
        if isinstance(item, bytes) and self.items and isinstance(self.items[-1], bytes) and size < 4096:
            self.items[-1] += item  # coalesce small pieces
            self.ends[-1] += size
            return
        self.items.append(item)
        self.ends.append(len(self) + size)

    def add(self, data: bytes) -> Parts:
        self._append(bytes(data), len(data))
        return self

    def add_array(self, number: int, values, dtype) -> Parts:
        """A bytes field of ``values`` as little-endian ``dtype`` (omitted when empty, as protobuf
        does); zero copy when ``values`` already is a contiguous array of that type."""
        arr = np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<"))
        if arr.size:
            view = arr.reshape(-1).view(np.uint8)
            self.add(header(number, view.nbytes))
            self._append(view, view.nbytes)
        return self

    def add_message(self, number: int, inner: Parts) -> Parts:
        """A length-delimited field holding ``inner`` (its pieces are shared, not copied)."""
        self.add(header(number, len(inner)))
        for item, size in zip(inner.items, _sizes(inner.ends)):
            self._append(item, size)
        return self

    def add_field(self, number: int, message) -> Parts:
        """A (small) protobuf message as field ``number``, serialized here."""
        data = message.SerializeToString()
        return self.add(header(number, len(data)) + data)

    def fill(self, start: int = 0, size: int | None = None, prefix: bytes = b"") -> bytes:
        """``prefix`` followed by bytes ``[start, start + size)`` of the message (default: to the
        end) in a new ``bytes``, copied with ``memmove`` outside the GIL."""
        total = len(self)
        size = total - start if size is None else size
        if not 0 <= start <= start + size <= total:
            raise ValueError(f"range [{start}, {start + size}) outside a message of {total} bytes")
        if len(prefix) + size < 2:  # a new bytes of 0 or 1 bytes may be shared: copy the usual way
            return prefix + bytes(self._small(start, size))
        out = _new_bytes(len(prefix) + size)
        dst = _address(out)
        if prefix:
            ctypes.memmove(dst, _address(prefix), len(prefix))
            dst += len(prefix)
        i = int(np.searchsorted(np.asarray(self.ends), start, side="right"))
        pos, end = start, start + size
        while pos < end:
            item = self.items[i]
            item_start = self.ends[i] - _nbytes(item)
            offset, n = pos - item_start, min(self.ends[i], end) - pos
            ctypes.memmove(dst + (pos - start), _address(item) + offset, n)
            pos += n
            i += 1
        return out

    def _small(self, start: int, size: int) -> bytearray:
        out = bytearray()
        for item, end in zip(self.items, self.ends):
            item_start = end - _nbytes(item)
            lo, hi = max(start, item_start), min(start + size, end)
            if lo < hi:
                out += memoryview(item).cast("B")[lo - item_start : hi - item_start]
        return out

    def chunks(self, size: int = CHUNK_BYTES):
        """The message in pieces of ``size`` bytes (the last one shorter)."""
        total = len(self)
        for start in range(0, total, size):
            yield self.fill(start, min(size, total - start))

    def chunk_messages(self, size: int = CHUNK_BYTES):
        """The message as serialized ``PlanChunk`` messages of ``size`` data bytes each, the first
        one with ``total_bytes`` (at least one chunk, even for an empty message)."""
        total = len(self)
        for start in range(0, max(total, 1), size):
            n = min(size, total - start)
            head = header(1, n) if n else b""
            if start == 0:
                head = varint(2 << 3) + varint(total) + head
            yield self.fill(start, n, head)

    def join(self) -> bytes:
        return self.fill(0) if len(self) else b""


def _nbytes(item) -> int:
    return len(item) if isinstance(item, bytes) else item.nbytes


def _sizes(ends: list[int]) -> list[int]:
    return [b - a for a, b in zip([0, *ends[:-1]], ends)]


# ------------------------------------------------------------------------------------ responses
def call_plan(plan, debug: bool = True) -> Parts:
    """A ``CallPlan`` message (the fields of :func:`harts_planner.rpc.codec.encode_call_plan`)."""
    native = plan._native
    with_debug = debug and plan.has_debug
    scalars: dict[str, Any] = {f: int(getattr(native, f)) for f in _call_plan.SCALAR_FIELDS}
    head = pb.CallPlan(**scalars)
    if not with_debug:
        head.debug_omitted = True
    parts = Parts().add(head.SerializeToString())
    arrays = _call_plan.ARRAY_FIELDS if with_debug else _call_plan.LAYOUT_FIELDS
    for name, dtype in arrays.items():
        parts.add_array(_CALL_PLAN_NUMBERS[name], getattr(native, name), dtype)
    return parts


def step_plan(plan) -> Parts:
    """A ``StepPlan`` message (the fields of :func:`harts_planner.rpc.codec.encode_step_plan`)."""
    from harts_planner.rpc import codec

    head = codec.encode_step_plan(plan, arrays=False)
    parts = Parts().add(head.SerializeToString())
    for name, dtype in _step_plan.ARRAY_FIELDS.items():
        parts.add_array(_STEP_PLAN_NUMBERS[name], getattr(plan._native, name), dtype)
    return parts


def calls_response(plan, debug: bool) -> Parts:
    """A ``PlanCallsResponse`` without its stats: the plan (field 1); add the stats (field 2) with
    :meth:`Parts.add_field`."""
    return Parts().add_message(1, call_plan(plan, debug))


def step_response(plan, call_plans, debug: bool) -> Parts:
    """A ``PlanStepResponse`` without its stats: the step plan (1) and every call plan (2, in
    order); add the stats (field 3) with :meth:`Parts.add_field`."""
    parts = Parts().add_message(1, step_plan(plan))
    for calls in call_plans or ():
        parts.add_message(2, call_plan(calls, debug))
    return parts


# ------------------------------------------------------------------------------------ requests
#: Fields one message of a request may hold at the top level of its walk (a request has at most nine
#: distinct ones, a chunk two): protobuf lets a field repeat any number of times (the last value
#: wins), and a 64 MiB request of one repeated scalar is 32 million fields. More are refused, naming
#: the field, before anything is built for them.
MAX_FIELDS = 64
#: Bytes the server holds to parse a request's fields other than its trajectories with protobuf
#: (its copy of them, and Python's), per byte of those fields, counted before parsing.
PARSE_COPIES = 2


class _UnusualError(Exception):
    """A field runs past the end of its message, or a varint over 10 bytes: not protobuf."""


class _CorruptError(Exception):
    """The bytes are not protobuf at all (a field number 0, a wire type that does not exist)."""


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _UnusualError
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _fields(
    buf: memoryview, start: int, end: int, *, partial: bool = False, names=None, where: str = "request"
):
    """(number, wire type, start, end) of each field in ``buf[start:end]``; for a varint field, start
    is its value and end its end. With ``partial``, a length-delimited field may run past ``end``.
    At most :data:`MAX_FIELDS` fields: the next one raises InvalidArgumentError naming it (``names``:
    field number -> name; ``where`` the message's path)."""
    pos, count = start, 0
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        number, kind = key >> 3, key & 7
        if number == 0 or kind in (3, 4, 6, 7):  # no field 0; no groups in a proto3 request
            raise _CorruptError
        count += 1
        if count > MAX_FIELDS:
            name = (names or {}).get(number, f"field {number}")
            raise invalid(
                f"{where}.{name}" if where != "request" else name,
                f"the {where} holds more than {MAX_FIELDS} fields at its top level ({name} repeats), "
                f"over the server's limit of {MAX_FIELDS} (wire.MAX_FIELDS): send each field once",
            )
        if kind == 0:
            value, pos = _read_varint(buf, pos, end)
            yield number, kind, value, pos
        elif kind == 2:
            length, pos = _read_varint(buf, pos, end)
            if pos + length > end and not partial:
                raise _UnusualError
            yield number, kind, pos, pos + length
            pos += length
        elif kind == 1:
            pos += 8
            yield number, kind, pos - 8, pos
        elif kind == 5:
            pos += 4
            yield number, kind, pos - 4, pos
        else:
            raise _UnusualError
    if pos != end and not partial:
        raise _UnusualError


#: The arrays of a Trajectories message: (oneof field number or None, field number) -> name.
_SOURCES = {
    1: ("packed", {1: "tokens", 2: "offsets"}),
    2: ("tree", {1: "parent", 2: "length", 3: "trajectory_end"}),
}
_TRAJECTORY_NAMES = {f.number: f.name for f in pb.Trajectories.DESCRIPTOR.fields}


def _once(seen: dict, number: int, name: str) -> None:
    """Refuse a field seen before at this level, naming it: protobuf would merge the copies (the
    last scalar wins, messages merge), which an encoder never sends and which only a bomb needs."""
    if number in seen:
        raise invalid(
            name,
            "sent more than once in its message; the server takes each field once (as protobuf "
            "encoders send it) and does not merge copies",
        )
    seen[number] = True


def _bytes_field(kind: int, name: str) -> None:
    if kind != 2:
        raise invalid(name, f"must be a length-delimited bytes field, got wire type {kind}")


def _trajectories(buf: memoryview, start: int, end: int) -> tuple[str | None, dict]:
    """The arrays of a ``Trajectories`` message: each field at most once (a repeated one, or both
    oneof members, is refused naming it), unknown fields skipped; nothing is parsed or copied."""
    which, arrays, seen = None, {}, {}
    # Each level is walked whole first (at most MAX_FIELDS fields), so that a bomb is refused before
    # anything is built for it.
    fields = list(_fields(buf, start, end, names=_TRAJECTORY_NAMES, where="trajectories"))
    for number, kind, a, b in fields:
        if number in (1, 2) and kind == 2:
            names = _SOURCES[number][1]
            list(_fields(buf, a, b, names=names, where=f"trajectories.{_SOURCES[number][0]}"))
    for number, kind, a, b in fields:
        if number not in (1, 2, 3):
            continue  # a field this server does not know: skipped, as protobuf would keep it aside
        name = f"trajectories.{_TRAJECTORY_NAMES[number]}"
        _once(seen, number, name)
        _bytes_field(kind, name)
        if number == 3:
            arrays["tree_ids"] = buf[a:b]
            continue
        if which is not None:
            raise invalid("trajectories", "sets both packed and tree: set one of them")
        which, names = _SOURCES[number]
        inner: dict = {}
        where = f"trajectories.{which}"
        for n2, k2, c, d in _fields(buf, a, b, names=names, where=where):
            if n2 not in names:
                continue
            _once(inner, n2, f"{where}.{names[n2]}")
            _bytes_field(k2, f"{where}.{names[n2]}")
            arrays[names[n2]] = buf[c:d]
    return which, arrays


def _decode_error(cls) -> Exception:
    from google.protobuf.message import DecodeError

    return DecodeError(
        f"Error parsing message with type '{cls.DESCRIPTOR.full_name}': Wire format was corrupt"
    )


def read_request(data, cls, reserve=None):
    """A request message without its trajectories, and the trajectories as views of ``data``.

    Returns ``(message, which, arrays)``: ``message`` a ``cls`` parsed from every field but the
    trajectories (field 1); ``which`` ``"packed"``, ``"tree"`` or None (no trajectories) and
    ``arrays`` memoryviews of ``data`` by field name (``tokens``, ``offsets``, ``parent``, ...,
    ``tree_ids``). Fields ``cls`` does not know are skipped (they cost nothing), at every level.

    Nothing unbounded is built and the trajectories never reach protobuf's parser: each message
    level may hold at most :data:`MAX_FIELDS` fields, the trajectories and each of their arrays at
    most once (more raise InvalidArgumentError naming the field, before any parsing: protobuf's
    merge of repeated copies is what a bomb needs, and no encoder sends them); the memory the other
    fields' parse needs is passed to ``reserve(bytes)`` before it is spent (:data:`PARSE_COPIES`
    times their bytes, at most :data:`MAX_OPTION_BYTES` each), which may refuse it by raising.
    Raises ``google.protobuf.message.DecodeError`` for bytes that are not a ``cls`` (a field running
    past the end, a varint over 10 bytes, a field number 0, a group).
    """
    buf = memoryview(data).cast("B")
    known = {f.number: f.name for f in cls.DESCRIPTOR.fields}
    reserve = reserve or (lambda size: None)
    try:
        fields = list(_fields(buf, 0, len(buf), names=known, partial=True))
        _check_messages(cls, fields)
        rest, traj = [], None
        for number, kind, a, b in _fields(buf, 0, len(buf), names=known):
            if number == 1 and kind == 2:
                if traj is not None:
                    _once({1: True}, 1, "trajectories")
                traj = (a, b)
            elif number in known:
                rest.append((number, kind, a, b))
        head_bytes = sum(b - a for n, k, a, b in rest if k == 2)
        if head_bytes:
            reserve(PARSE_COPIES * head_bytes)
        head = _head(buf, cls, rest)
        which, arrays = (None, {}) if traj is None else _trajectories(buf, *traj)
        return head, which, arrays
    except (_CorruptError, _UnusualError):
        raise _decode_error(cls) from None


#: Largest message-typed field of a request besides its trajectories (``options``: a dozen scalars,
#: under 200 bytes): a bigger one could only be a field repeated many times inside it.
MAX_OPTION_BYTES = 4096


def _check_messages(cls, fields) -> None:
    """Refuse a message-typed field (``options``) over :data:`MAX_OPTION_BYTES`, naming it."""
    for f in cls.DESCRIPTOR.fields:
        if f.number == 1 or f.message_type is None:
            continue
        size = sum(b - a for number, kind, a, b in fields if number == f.number and kind == 2)
        if size > MAX_OPTION_BYTES:
            raise invalid(
                f.name,
                f"{size:,} bytes, over the server's limit of {MAX_OPTION_BYTES:,} for {f.message_type.name} "
                "(wire.MAX_OPTION_BYTES: a dozen scalars, each sent once)",
            )


def _head(buf: memoryview, cls, fields) -> object:
    """``cls`` parsed from the given top-level fields (re-encoded from their byte ranges)."""
    out = bytearray()
    for number, kind, a, b in fields:
        if kind == 0:
            out += varint(number << 3) + varint(a)
        elif kind == 2:
            out += header(number, b - a) + buf[a:b]
        else:
            out += varint(number << 3 | kind) + buf[a:b]
    return cls.FromString(bytes(out))


def array(view: memoryview, dtype, field: str) -> np.ndarray:
    """A native-endian array over ``view`` (zero copy when aligned and little-endian; an aligned
    copy otherwise: the C++ core reads naturally aligned values). InvalidArgumentError naming
    ``field`` when the byte count is not a whole number of values."""
    dtype = np.dtype(dtype).newbyteorder("<")
    if len(view) % dtype.itemsize:
        raise invalid(
            field,
            f"{len(view)} bytes is not a whole number of {dtype.itemsize}-byte "
            f"little-endian {'int32' if dtype.itemsize == 4 else 'int64'} values",
        )
    arr = np.frombuffer(view, dtype=dtype)
    if not _LITTLE:
        return arr.astype(dtype.newbyteorder("="))
    return arr if arr.flags.aligned else arr.copy()


# ------------------------------------------------------------------------------------ chunked requests
_CHUNK_NAMES = {f.number: f.name for f in pb.PlanChunk.DESCRIPTOR.fields}


def read_chunk(data) -> tuple[memoryview, int]:
    """The ``data`` (a view) and ``total_bytes`` (0 when unset) of a serialized ``PlanChunk``.
    Raises InvalidArgumentError on field ``request`` for bytes that are not one."""
    buf = memoryview(data).cast("B")
    view, total = buf[0:0], 0
    try:
        for number, kind, a, b in _fields(buf, 0, len(buf), names=_CHUNK_NAMES, where="request"):
            if number == 1 and kind == 2:
                view = buf[a:b]
            elif number == 2 and kind == 0:
                total = a if a < 1 << 63 else a - (1 << 64)
    except (_UnusualError, _CorruptError):
        raise invalid("request", "not a valid harts.planner.v1.PlanChunk message") from None
    return view, total


def _big_field_offset(first: bytes) -> int | None:
    """Where, in a request's first chunk, the data of its first large array begins (the tokens of a
    packed request, the parents of a tree), or None when the chunk does not tell."""
    buf = memoryview(first).cast("B")
    try:
        for number, kind, a, b in _fields(buf, 0, len(buf), partial=True):
            if number == 1 and kind == 2:
                for n2, k2, c, d in _fields(buf, a, min(b, len(buf)), partial=True):
                    if n2 in (1, 2) and k2 == 2:
                        for _, k3, e, _ in _fields(buf, c, min(d, len(buf)), partial=True):
                            return e if k3 == 2 else None
                return None
    except (_UnusualError, _CorruptError, ValueError):  # ValueError: over MAX_FIELDS (read_chunk says so)
        return None
    return None


class Assembly:
    """A chunked request put together: ``total`` bytes announced by the first chunk, written in
    order with ``memmove`` outside the GIL. The buffer starts ``pad`` bytes into a ``bytes`` object,
    chosen so that the request's first large array lands 8-byte aligned (read in place).

    Raises InvalidArgumentError on field ``request`` when the chunks hold more bytes than announced.
    """

    def __init__(self, total: int, first: bytes):
        offset = _big_field_offset(first)
        self.pad = 0 if offset is None else (-offset) % 8
        self.total = total
        self.size = 0
        self._buffer = _new_bytes(max(total + self.pad, 2))
        self._base = _address(self._buffer) + self.pad

    def add(self, chunk) -> None:
        """Append ``chunk`` (bytes or a memoryview of bytes)."""
        if self.size + len(chunk) > self.total:
            raise invalid(
                "request",
                f"the chunks hold more than the {self.total:,} bytes the first one announced (total_bytes)",
            )
        if len(chunk):
            ctypes.memmove(self._base + self.size, _view_address(chunk), len(chunk))
        self.size += len(chunk)

    def free(self) -> None:
        """Drop the buffer (a request given up half way)."""
        self._buffer = None
        self._base = 0

    def view(self) -> memoryview:
        """The request's bytes (once complete)."""
        if self.size != self.total:
            raise invalid(
                "request",
                f"the chunks hold {self.size:,} bytes, not the {self.total:,} announced (total_bytes)",
            )
        assert self._buffer is not None, "view() after free()"
        return memoryview(self._buffer)[self.pad : self.pad + self.total]


__all__ = [
    "CHUNK_BYTES",
    "MAX_FIELDS",
    "MAX_OPTION_BYTES",
    "PARSE_COPIES",
    "Assembly",
    "Parts",
    "array",
    "call_plan",
    "calls_response",
    "read_chunk",
    "read_request",
    "step_plan",
    "step_response",
]
