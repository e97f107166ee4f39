"""A minimal HTTP/2 client for attacking the sidecar the way a hostile or broken client would: streams
that never send their request, requests that stop half way, responses that are never read.

gRPC's own client always finishes what it starts, so these tests speak HTTP/2 themselves (RFC 9113;
headers as HPACK literals without indexing, RFC 7541 6.2.2): :class:`H2Connection` opens a TCP
connection, exchanges SETTINGS, and then lets a test open streams (:meth:`~H2Connection.open`), send
gRPC messages or parts of them (:meth:`~H2Connection.send_message`), and choose whether to read
what the server sends (``read=False``: no flow-control credit is ever returned, so the server can send
a stream at most the initial window, ``window`` bytes; ``read_rate``: no faster than that). A reader
thread answers SETTINGS and PING
(so the server sees a live peer) and counts, per stream, the DATA bytes received and whether the
stream ended (END_STREAM or RST_STREAM). Server headers are not decoded: the tests learn a call's
status from the server's log or from a real gRPC client.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x2, 0x4, 0x5
MAX_WINDOW = 2**31 - 1
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer with an N-bit prefix (RFC 7541 5.1)."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([first | value])
    out, value = bytearray([first | top]), value - top
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def hpack_literals(headers: list[tuple[str, str]]) -> bytes:
    """Header fields as literals without indexing, new names, no Huffman coding."""
    out = bytearray()
    for name, value in headers:
        out += b"\x00" + _int(len(name), 7) + name.encode() + _int(len(value), 7) + value.encode()
    return bytes(out)


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def grpc_prefix(length: int) -> bytes:
    """The 5-byte gRPC message prefix: uncompressed, ``length`` bytes follow."""
    return b"\x00" + struct.pack(">I", length)


class Stream:
    __slots__ = ("id", "received", "ended", "reset", "send_window")

    def __init__(self, stream_id: int, send_window: int):
        self.id = stream_id
        self.received = 0
        self.ended = False
        self.reset = False
        self.send_window = send_window


class H2Connection:
    """One HTTP/2 connection to ``host:port`` (cleartext, as the sidecar's default).

    ``read``: return flow-control credit for what the server sends (False: a client that never reads;
    the server can send each stream at most ``window`` bytes and the connection 65,535 + ``window``).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        read: bool = True,
        window: int = 65535,
        timeout: float = 10.0,
        read_rate: float | None = None,
    ):
        self.read = read
        self.read_rate = read_rate  # bytes per second credited back at most (a slow reader)
        self._credited = 0
        self._started = time.monotonic()
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self.streams: dict[int, Stream] = {}
        self._next_id = 1
        self.peer_window = 65535  # the server's SETTINGS_INITIAL_WINDOW_SIZE
        self.conn_window = 65535  # what we may still send on the connection
        self.max_frame = 16384
        self.closed = False
        self.goaway = False
        self.window_updates = 0  # WINDOW_UPDATE credit the server granted (streams and connection)
        settings = struct.pack(">HI", SETTINGS_ENABLE_PUSH, 0) + struct.pack(
            ">HI", SETTINGS_INITIAL_WINDOW_SIZE, window
        )
        self._send(PREFACE + frame(SETTINGS, 0, 0, settings))
        if read:
            self._send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - 65535)))
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()

    # ---------------------------------------------------------------- sending
    def _send(self, data: bytes) -> None:
        with self._send_lock:
            self.sock.sendall(data)

    def open(self, path: str, *, authority: str = "127.0.0.1", end_stream: bool = False) -> int:
        """Open a gRPC stream to ``path`` (headers only); returns its id."""
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        with self._cond:
            sid = self._next_id
            self._next_id += 2
            self.streams[sid] = Stream(sid, self.peer_window)
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        self._send(frame(HEADERS, flags, sid, hpack_literals(headers)))
        return sid

    def send_data(
        self, sid: int, data: bytes | memoryview, *, end_stream: bool = False, timeout: float = 60.0
    ) -> int:
        """Send ``data`` on stream ``sid`` within the flow-control windows the server grants; returns
        the bytes sent (fewer when ``timeout`` passed waiting for credit, or the stream ended)."""
        view, sent = memoryview(data).cast("B"), 0
        deadline = time.monotonic() + timeout
        while sent < len(view):
            with self._cond:
                s = self.streams[sid]
                while not (self.closed or s.reset or s.ended) and min(s.send_window, self.conn_window) <= 0:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return sent
                    self._cond.wait(min(left, 0.1))
                if self.closed or s.reset or s.ended:
                    return sent
                n = min(len(view) - sent, s.send_window, self.conn_window, self.max_frame)
                s.send_window -= n
                self.conn_window -= n
            last = end_stream and sent + n == len(view)
            self._send(frame(DATA, END_STREAM if last else 0, sid, bytes(view[sent : sent + n])))
            sent += n
        if end_stream and not len(view):
            self._send(frame(DATA, END_STREAM, sid))
        return sent

    def send_message(
        self,
        sid: int,
        message: bytes,
        *,
        claimed: int | None = None,
        end_stream: bool = True,
        timeout: float = 60.0,
    ) -> int:
        """One gRPC message (its prefix claiming ``claimed`` bytes, default ``len(message)``); returns
        the bytes sent."""
        length = len(message) if claimed is None else claimed
        return self.send_data(sid, grpc_prefix(length) + message, end_stream=end_stream, timeout=timeout)

    def reset(self, sid: int, code: int = 8) -> None:
        """RST_STREAM (CANCEL by default)."""
        self._send(frame(RST_STREAM, 0, sid, struct.pack(">I", code)))

    # ---------------------------------------------------------------- reading
    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return bytes(buf)

    def _read_loop(self) -> None:
        try:
            while True:
                head = self._recv_exact(9)
                length = int.from_bytes(head[:3], "big")
                kind, flags = head[3], head[4]
                sid = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                payload = self._recv_exact(length) if length else b""
                self._on_frame(kind, flags, sid, payload)
        except (OSError, ConnectionError):
            pass
        finally:
            with self._cond:
                self.closed = True
                self._cond.notify_all()

    def _on_frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind == SETTINGS and not flags & ACK:
            with self._cond:
                for i in range(0, len(payload), 6):
                    key, value = struct.unpack(">HI", payload[i : i + 6])
                    if key == SETTINGS_INITIAL_WINDOW_SIZE:
                        delta = value - self.peer_window
                        self.peer_window = value
                        for s in self.streams.values():
                            s.send_window += delta
                    elif key == SETTINGS_MAX_FRAME_SIZE:
                        self.max_frame = value
                self._cond.notify_all()
            self._send(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            self._send(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            inc = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            with self._cond:
                self.window_updates += inc
                if sid == 0:
                    self.conn_window += inc
                elif sid in self.streams:
                    self.streams[sid].send_window += inc
                self._cond.notify_all()
        elif kind == DATA:
            with self._cond:
                s = self.streams.get(sid)
                if s is not None:
                    s.received += len(payload)
                    s.ended = s.ended or bool(flags & END_STREAM)
                self._cond.notify_all()
            if self.read and payload:
                if self.read_rate:  # take it no faster than read_rate
                    self._credited += len(payload)
                    ahead = self._credited / self.read_rate - (time.monotonic() - self._started)
                    if ahead > 0:
                        time.sleep(ahead)
                credit = struct.pack(">I", len(payload))
                self._send(frame(WINDOW_UPDATE, 0, sid, credit) + frame(WINDOW_UPDATE, 0, 0, credit))
        elif kind == HEADERS:
            with self._cond:
                s = self.streams.get(sid)
                if s is not None and flags & END_STREAM:
                    s.ended = True
                self._cond.notify_all()
        elif kind == RST_STREAM:
            with self._cond:
                s = self.streams.get(sid)
                if s is not None:
                    s.reset = True
                self._cond.notify_all()
        elif kind == GOAWAY:
            with self._cond:
                self.goaway = True
                self._cond.notify_all()

    def wait(self, predicate, timeout: float) -> bool:
        """Wait until ``predicate(self)`` (checked under the connection's lock) or ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    def finished(self, sid: int) -> bool:
        with self._cond:
            s = self.streams[sid]
            return s.ended or s.reset or self.closed

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._reader.join(5)

    def __enter__(self) -> H2Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
