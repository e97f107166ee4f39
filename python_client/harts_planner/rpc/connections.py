"""The sidecar's connections against its file-descriptor limit, checked before it serves.

Every client connection is a file descriptor. At the usual default of 1,024 descriptors (the soft
``RLIMIT_NOFILE``), 1,100 idle connections locked every new client out, health checks included: the
kernel refused to accept more while gRPC held the ones it had. grpcio (1.85) has no option that caps
the connections a server accepts, so the cap is the descriptor limit itself: :func:`fit_file_limit`
raises the soft limit to ``max_connections`` + :data:`FD_RESERVE` (the descriptors the server needs
besides connections: its listener, log, pipes, epoll and wake-up descriptors) as far as the hard
limit allows, and says how many connections that leaves:

* enough for ``max_connections``: serve;
* fewer, but at least :data:`MIN_CONNECTIONS`: serve with a warning naming the numbers (the hard
  limit, what was asked, what is left) and how to raise it (``ulimit -Hn`` / ``LimitNOFILE=``);
* fewer than :data:`MIN_CONNECTIONS`: refuse to start (ValueError naming the numbers).

Beyond the cap the kernel refuses new connections; clients already connected keep being served
(health checks are not starved of threads by connections: :mod:`~harts_planner.rpc.interceptor`).
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
#: Fewer connections than this: the server refuses to start.
MIN_CONNECTIONS = 64


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


def fit_file_limit(max_connections: int = DEFAULT_MAX_CONNECTIONS) -> FileLimit:
    """Raise the soft ``RLIMIT_NOFILE`` toward ``max_connections`` + :data:`FD_RESERVE` (at most the
    hard limit; never lower it) and return what fits (see the module docstring). Raises ValueError
    naming the numbers when fewer than :data:`MIN_CONNECTIONS` connections fit."""
    if resource is None:
        return FileLimit(max_connections, None, None, None)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_RESERVE
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
    connections = max_connections if limit is None else min(max_connections, limit - FD_RESERVE)
    if connections < MIN_CONNECTIONS:
        raise ValueError(
            f"max_connections: the file-descriptor limit (RLIMIT_NOFILE soft {limit}, hard {_finite(hard)}) "
            f"leaves {max(connections, 0)} connections after the server's {FD_RESERVE} descriptors, fewer "
            f"than the {MIN_CONNECTIONS} it needs to serve; raise it (ulimit -n / ulimit -Hn, or "
            "LimitNOFILE= in a systemd unit)"
        )
    warning = None
    if connections < max_connections:
        warning = (
            f"the file-descriptor limit (RLIMIT_NOFILE hard {_finite(hard)}) leaves {connections} "
            f"connections after the server's {FD_RESERVE} descriptors, fewer than --max-connections "
            f"{max_connections}: clients beyond them cannot connect; raise the hard limit (ulimit -Hn, "
            "or LimitNOFILE= in a systemd unit)"
        )
    return FileLimit(connections, limit, _finite(hard), was, warning)


__all__ = ["DEFAULT_MAX_CONNECTIONS", "FD_RESERVE", "MIN_CONNECTIONS", "FileLimit", "fit_file_limit"]
