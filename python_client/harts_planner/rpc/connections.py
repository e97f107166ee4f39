"""The sidecar's connection cap, and its file-descriptor limit fitted to it before it serves.

``--max-connections N`` caps the connections of the planner port: gRPC core's per-listener
connection quota (channel argument ``grpc.max_allowed_incoming_connections``, set by
:func:`harts_planner.rpc.server.server_options`) accepts a connection past the cap and closes it at
once, so the client gets UNAVAILABLE at once instead of a hang, and the server never runs out of
descriptors. Connections that make no call for ``MAX_CONNECTION_IDLE_MS`` are closed, and so are
those that do not finish the HTTP/2 handshake within ``HANDSHAKE_TIMEOUT_MS``
(:mod:`harts_planner.rpc.server`), freeing their places.

Health checks keep a reserve of their own with ``--health-port``: a second listener serving only
``grpc.health.v1``, with its own cap of :data:`HEALTH_CONNECTIONS` connections, so that no number of
planner-port connections locks a health check out (bind it where only probes reach it to keep
other clients off it as well).

Every connection is a file descriptor. At the usual default of 1,024 descriptors (the soft
``RLIMIT_NOFILE``), 1,100 idle connections would lock every new client out, health checks
included: the kernel refuses to accept more while gRPC holds the ones it has. :func:`fit_file_limit`
raises the soft limit to the connections + :data:`FD_RESERVE` (the descriptors the server needs
besides connections: its listeners, log, pipes, epoll and wake-up descriptors) as far as the hard
limit allows, and says how many connections that leaves (the cap gRPC enforces is that number):

* enough for ``max_connections``: serve;
* fewer, but at least :data:`MIN_CONNECTIONS` (or all that were asked, when fewer were): serve
  with a warning naming the numbers (the hard limit, what was asked, what is left) and how to raise
  it (``ulimit -Hn`` / ``LimitNOFILE=``);
* fewer: refuse to start (ValueError naming the numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    import resource
except ImportError:  # not a POSIX system: no descriptor limit to fit
    resource = None

#: Default most connections the server is ready for (``harts-planner serve --max-connections``).
DEFAULT_MAX_CONNECTIONS = 4096
#: Descriptors the server needs besides its connections.
FD_RESERVE = 128
#: Fewer connections than this (unless fewer were asked): the server refuses to start.
MIN_CONNECTIONS = 64
#: Connections of the health port (``--health-port``), besides ``--max-connections``.
HEALTH_CONNECTIONS = 32


@dataclass(frozen=True)
class FileLimit:
    """What :func:`fit_file_limit` found and did: ``connections`` the server can hold, the soft and
    hard ``RLIMIT_NOFILE`` (None: unlimited / unknown), the soft limit before (``was``), and a
    ``warning`` when fewer connections than asked fit."""

    connections: int
    soft: int | None
    hard: int | None
    was: int | None
    warning: str | None = None


def _finite(value: int) -> int | None:
    return None if resource is None or value == resource.RLIM_INFINITY else int(value)


def fit_file_limit(max_connections: int = DEFAULT_MAX_CONNECTIONS, health: bool = False) -> FileLimit:
    """Raise the soft ``RLIMIT_NOFILE`` toward ``max_connections`` + :data:`FD_RESERVE` (+
    :data:`HEALTH_CONNECTIONS` with ``health``: a health port) at most to the hard limit (never
    lower it) and return the planner-port connections that fit (see the module docstring). Raises
    ValueError naming the numbers when fewer than :data:`MIN_CONNECTIONS` (or than were asked, if
    fewer) fit."""
    reserve = FD_RESERVE + (HEALTH_CONNECTIONS if health else 0)
    if resource is None:
        return FileLimit(max_connections, None, None, None)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + reserve
    was = _finite(soft)
    if was is not None and was < want:
        target = want if _finite(hard) is None else min(want, hard)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
    limit = _finite(soft)
    connections = max_connections if limit is None else min(max_connections, limit - reserve)
    if connections < min(MIN_CONNECTIONS, max_connections):
        raise ValueError(
            f"max_connections: the file-descriptor limit (RLIMIT_NOFILE soft {limit}, hard {_finite(hard)}) "
            f"leaves {max(connections, 0)} connections after the server's {reserve} descriptors, fewer "
            f"than the {MIN_CONNECTIONS} it needs to serve; raise it (ulimit -n / ulimit -Hn, or "
            "LimitNOFILE= in a systemd unit)"
        )
    warning = None
    if connections < max_connections:
        warning = (
            f"the file-descriptor limit (RLIMIT_NOFILE hard {_finite(hard)}) leaves {connections} "
            f"connections after the server's {reserve} descriptors, fewer than --max-connections "
            f"{max_connections}: clients beyond them cannot connect; raise the hard limit (ulimit -Hn, "
            "or LimitNOFILE= in a systemd unit)"
        )
    return FileLimit(connections, limit, _finite(hard), was, warning)


__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "FD_RESERVE",
    "HEALTH_CONNECTIONS",
    "MIN_CONNECTIONS",
    "FileLimit",
    "fit_file_limit",
]
