"""`Planner`: one planning API over two transports, in-process or a gRPC sidecar.

::

    from harts_planner import Planner, RolloutBatch

    batch = RolloutBatch.load("step.hrb")
    with Planner() as local, Planner("127.0.0.1:50051") as sidecar:
        a = local.plan_step(batch, dp_size=2, capacity=65536)
        b = sidecar.plan_step(batch, dp_size=2, capacity=65536)
        assert a == b                       # equal field by field (timings aside)
        calls = sidecar.plan_calls(batch, chunk_size=64, microbatch=a.microbatches[0])

Trajectories can be given as

* a :class:`RolloutBatch` (in-process: planned as is; sidecar: sent as its compacted
  :meth:`~RolloutBatch.segment_tree`, which plans identically),
* a :class:`SegmentTree` (a compacted tree built client-side: a few bytes per segment), or
* :class:`PackedTokens` / a ``(tokens, offsets[, tree_ids])`` tuple (the raw step: 4 bytes per token).

Both transports run the same code on the same arrays (the sidecar runs the in-process path,
:func:`harts_planner.step_plan.plan_step_with_calls` and :func:`harts_planner.plan_calls`, behind
``harts_planner.rpc.server``), so the returned :class:`StepPlan` / :class:`CallPlan` objects compare
equal. With ``debug=False`` both return call plans without their debug part (only the layout a
runtime reads; a sidecar then sends less). Errors are the same classes: :class:`InvalidArgumentError`,
:class:`ResourceLimitError`, :class:`InfeasibleError` (``.field`` names the argument; for the
sidecar, the request field path such as ``trajectories.tree.parent[3]``), plus
:class:`harts_planner.rpc.client.SidecarError` for transport failures (unavailable, deadline).
"""

from __future__ import annotations

import math
import time

from harts_planner import checks
from harts_planner.batch import PackedTokens, RolloutBatch, SegmentTree, ingest
from harts_planner.call_plan import DEFAULT_CHUNK_SIZE, DEFAULT_CONV_WIDTH, CallPlan, plan_calls
from harts_planner.errors import invalid
from harts_planner.step_plan import StepPlan, plan_step_with_calls

#: Default deadline of a sidecar call, seconds.
DEFAULT_TIMEOUT = 600.0


def as_source(trajectories) -> RolloutBatch | PackedTokens | SegmentTree:
    """Normalize the accepted trajectory forms (see the module docstring)."""
    if isinstance(trajectories, (RolloutBatch, PackedTokens, SegmentTree)):
        return trajectories
    if isinstance(trajectories, tuple) and len(trajectories) in (2, 3):
        return PackedTokens(*trajectories)
    raise invalid(
        "trajectories",
        "must be a RolloutBatch, SegmentTree, PackedTokens or a (tokens, offsets"
        f"[, tree_ids]) tuple, got {type(trajectories).__name__}",
    )


class Planner:
    """Plans steps and microbatch calls in-process (``Planner()``) or on a sidecar
    (``Planner("host:port")``); both return equal :class:`StepPlan` / :class:`CallPlan` objects.

    Parameters
    ----------
    target : str, optional
        ``"host:port"`` of a ``harts-planner serve`` sidecar; None plans in this process (the C++
        core releases the GIL, so threads may share one Planner).
    timeout : float, default 600
        Deadline of each sidecar call in seconds, > 0, or None for none (per call override:
        ``timeout=``). The sidecar stops planning when it passes.
    max_message_bytes : int, default 1 GiB
        Largest gRPC message this client sends or accepts, in [1, 2^31 - 1] (the server has its own
        limit). Requests and responses travel in 1 MiB chunks (the ``*Stream`` methods), so this
        bounds them only against a server without those (unary fallback).
    tls_ca, tls_cert, tls_key : str, optional
        TLS to the sidecar (PEM files): ``tls_ca`` the CA certificates that sign the server's
        certificate (alone: TLS with the system's roots when None and a client certificate is
        given); ``tls_cert`` and ``tls_key`` this client's certificate and key, for a server that
        requires them (``serve --tls-client-ca``). None of them: a plaintext channel.

    Raises InvalidArgumentError naming ``target``, ``timeout``, ``max_message_bytes`` or the TLS
    file that cannot be used.

    A Planner is thread-safe and a context manager (closing the sidecar channel).
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_message_bytes: int | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ):
        if target is not None:
            checks.string(target, "target")
            if not target.strip():
                raise invalid("target", "must be host:port (or a gRPC target), got an empty string")
        self.target = target
        self.timeout = _check_timeout(timeout, "timeout")
        if max_message_bytes is not None:
            max_message_bytes = checks.integer(max_message_bytes, "max_message_bytes", 1, 2**31 - 1)
        self._client = None
        if target is not None:
            from harts_planner.rpc.client import SidecarClient

            credentials = None
            if tls_ca is not None or tls_cert is not None or tls_key is not None:
                from harts_planner.rpc.tls import channel_credentials

                credentials = channel_credentials(tls_ca, tls_cert, tls_key)
            self._client = SidecarClient(target, max_message_bytes=max_message_bytes, credentials=credentials)

    @property
    def is_remote(self) -> bool:
        """True for a sidecar planner."""
        return self._client is not None

    def close(self) -> None:
        """Close the sidecar channel (no-op in-process)."""
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> Planner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Planner({self.target!r})" if self.target else "Planner()"

    # ------------------------------------------------------------------ planning
    def plan_step(
        self,
        trajectories,
        dp_size: int,
        capacity: int,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        call_plans: bool = False,
        conv_width: int = DEFAULT_CONV_WIDTH,
        debug: bool = True,
        timeout: float | None = None,
        cp_size: int = 1,
        **options,
    ) -> StepPlan:
        """Plan one training step (see :func:`harts_planner.plan_step` for the arguments and options).

        Parameters
        ----------
        trajectories : RolloutBatch | SegmentTree | PackedTokens | tuple
            The step's trajectories.
        dp_size, capacity : int
            D >= 1 and T >= 1 (compact tokens per microbatch).
        chunk_size : int, default 64
            B in ``[1, MAX_CHUNK_SIZE]`` for the call plans.
        call_plans : bool, default False
            Also plan every microbatch's calls (:meth:`StepPlan.call_plans` is then filled; for a sidecar
            they travel in the response, which a large step can push over the message-size limit).
        conv_width : int, default 4
            w for the call plans' convolution context.
        debug : bool, default True
            With ``call_plans``: keep each call plan's debug part (:attr:`CallPlan.debug`); False returns
            the layouts alone (a sidecar leaves the debug arrays out of the response: ``omit_debug``).
        timeout : float, optional
            Sidecar deadline for this call (default: the Planner's).
        cp_size : int, default 1
            C, the context-parallel degree: microbatches of up to ``C x capacity`` compact rows
            (the ``cp_size`` option; a sidecar receives it as ``StepOptions.cp_size``). Split each
            between the C ranks with :meth:`StepPlan.cp_split` (in-process) or
            :func:`harts_planner.plan_cp`.
        **options
            Search options (``harts_planner.step_plan.DEFAULT_OPTIONS``).

        Returns
        -------
        StepPlan

        Raises
        ------
        InvalidArgumentError, ResourceLimitError, InfeasibleError
            As :func:`harts_planner.plan_step` and the batch constructors; ``.field`` names the input.
        harts_planner.rpc.client.SidecarError
            Sidecar unreachable, draining, or past the deadline.
        """
        source = as_source(trajectories)
        chunk_size, conv_width = checks.chunk_size(chunk_size), checks.conv_width(conv_width)
        call_plans, debug = checks.boolean(call_plans, "call_plans"), checks.boolean(debug, "debug")
        if isinstance(cp_size, bool) or cp_size != 1:  # 1 is the default: the request stays as without CP
            options = {**options, "cp_size": cp_size}
        if self._client is None:
            start = time.perf_counter()
            batch = source if isinstance(source, RolloutBatch) else ingest(source)
            plan = plan_step_with_calls(
                batch, dp_size, capacity, chunk_size, options, call_plans, conv_width, debug
            )
            plan.wall_seconds = time.perf_counter() - start
            return plan
        from harts_planner.rpc import codec

        wire = source.segment_tree() if isinstance(source, RolloutBatch) else source
        request = codec.serialize_plan_step_request(
            wire, dp_size, capacity, chunk_size, options, call_plans, conv_width, debug
        )
        start = time.perf_counter()
        response = self._client.plan_step(request, timeout=self._timeout(timeout))
        wall = time.perf_counter() - start
        calls = [codec.decode_call_plan(c) for c in response.call_plans] if call_plans else None
        plan = codec.decode_step_plan(response.plan, calls, wall)
        plan.server_stats = codec.stats_dict(response.stats)
        return plan

    def plan_calls(
        self,
        trajectories,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        microbatch=None,
        conv_width: int = DEFAULT_CONV_WIDTH,
        *,
        debug: bool = True,
        timeout: float | None = None,
    ) -> CallPlan:
        """Minimum-call plan and physical layout of one microbatch (see :func:`harts_planner.plan_calls`).

        ``microbatch`` holds distinct trajectory indices (None: every trajectory). ``debug=False``
        returns the plan without its debug part (:meth:`CallPlan.without_debug`; a sidecar sends only
        the layout: ``omit_debug``). Raises as :meth:`plan_step`; a bad index is reported on field
        ``microbatch[j]`` by both transports.
        """
        source = as_source(trajectories)
        chunk_size, conv_width = checks.chunk_size(chunk_size), checks.conv_width(conv_width)
        debug = checks.boolean(debug, "debug")
        if self._client is None:
            batch = source if isinstance(source, RolloutBatch) else ingest(source)
            return plan_calls(batch, chunk_size, microbatch, conv_width=conv_width, debug=debug)
        from harts_planner.rpc import codec

        wire = source.segment_tree() if isinstance(source, RolloutBatch) else source
        request = codec.serialize_plan_calls_request(wire, microbatch, chunk_size, conv_width, debug)
        response = self._client.plan_calls(request, timeout=self._timeout(timeout))
        plan = codec.decode_call_plan(response.plan)
        plan.server_stats = codec.stats_dict(response.stats)
        return plan

    def health(self, timeout: float = 5.0) -> str:
        """``"SERVING"`` in-process; the sidecar's health status name otherwise."""
        return "SERVING" if self._client is None else self._client.health(timeout=timeout)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else _check_timeout(timeout, "timeout")


def _check_timeout(value, field: str) -> float | None:
    """None (no deadline) or a finite number of seconds > 0."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise invalid(field, f"must be a finite number of seconds > 0 or None, got {value!r}")
    return float(value)


__all__ = ["Planner", "DEFAULT_TIMEOUT", "as_source"]
