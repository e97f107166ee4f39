"""Step planning: microbatch membership, DP-replica assignment and slot schedule (paper Section 3.2).

Glossary
--------
* ``D`` (``dp_size``): data-parallel degree; a *replica* is one logical model copy.
* ``T`` (``capacity``): the most compact tokens one microbatch may hold.
* microbatch ``M``: a non-empty set of trajectories; its work ``w(M) = C(M)`` is the number of unique
  token prefixes of its members (Equation 5).
* slot ``j``: the ``j``-th local microbatch of every replica; the ``D`` microbatches of a slot run in
  lockstep, so the heaviest one is the slot's critical path.
* ``J`` (Equation 4): ``(sum_M w(M), sum_j max_d w(M_dj), max_d sum_j w(M_dj))``, compared
  lexicographically: total compact work, aggregate slot-critical work, maximum replica work.
* imbalance (Equation 23): ``I = max_d w_d / mean_d w_d - 1`` over one slot (``w_d = w(M_dj)``) or over
  the whole step (``w_d = sum_j w(M_dj)``).

Every plan returned by :func:`plan_step` guarantees exact coverage, non-empty microbatches of at most
``T`` compact tokens, ``K mod D = 0`` and exactly ``K / D`` microbatches (one per slot) per replica.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from harts_planner import _native, checks
from harts_planner.batch import RolloutBatch
from harts_planner.call_plan import DEFAULT_CHUNK_SIZE, DEFAULT_CONV_WIDTH, plan_calls
from harts_planner.cp_split import CpSplit, plan_cp
from harts_planner.errors import cancel_token, invalid
from harts_planner.fields import NativeField

# Cost estimation lives in plan_cost; its public names stay importable from here.
from harts_planner.plan_cost import (
    MAX_MESSAGE_BYTES,
    CostLimits,
    PlanCost,
    estimate_call_plans,
    estimate_cost,
)

__all__ = [
    "DEFAULT_CAPACITY",
    "MAX_MESSAGE_BYTES",
    "CostLimits",
    "PlanCost",
    "StepPlan",
    "estimate_call_plans",
    "estimate_cost",
    "imbalance",
    "plan_step",
    "plan_step_with_calls",
    "schedule_metrics",
    "verify_schedule",
    "ARRAY_FIELDS",
    "SCALAR_FIELDS",
]

_I32, _I64 = np.dtype("<i4"), np.dtype("<i8")

#: Arrays of a step plan: name on the native plan (and field of ``harts.planner.v1.StepPlan``) -> dtype.
ARRAY_FIELDS: dict[str, np.dtype] = {
    "member_offsets": _I64,
    "members": _I32,
    "work": _I64,
    "replica": _I32,
    "slot": _I32,
}
#: Scalars of the native plan compared by ``StepPlan.__eq__`` (timings excluded).
SCALAR_FIELDS: tuple[str, ...] = (
    "dp_size",
    "capacity",
    "num_trajectories",
    "num_microbatches",
    "objective",
    "source",
    "search_mode",
    "natural_k",
    "k_min",
    "k_max",
    "compact_tokens",
    "candidates",
    "selected",
)

#: Options of :func:`plan_step` and their defaults (the paper's parameters), read from the C++
#: ``harts::PlannerOptions`` (``harts/step_plan.h``) through ``_native.default_step_options()``:
#:
#: ==================  =======  =========================================================================
#: option              default  meaning
#: ==================  =======  =========================================================================
#: exact_threshold     512      N0: exact contiguous DP when N <= N0 (``search="auto"``)
#: max_sampled_k       32       Q_max: sampled K values of heuristic search (>= 2)
#: refine_window       8        H of boundary refinement
#: refine_sweeps       2        boundary-refinement sweeps
#: max_anchors         3        B_ref: refined anchors (the greedy candidate counts as one)
#: repair_window       8        H of sparse repair
#: repair_iterations   4        sparse-repair iterations
#: greedy              True     run the trie-aware greedy path
#: refine              True     boundary refinement and sparse repair
#: component_greedy    True     extension, not in the paper: per-tree greedy candidate (False = paper)
#: contiguous_optimum  True     extension, not in the paper: least-work contiguous partition over the
#:                              heuristic search's K range, refined and repaired (False = paper)
#: search              "auto"   ``"auto"`` | ``"exact"`` | ``"heuristic"``
#: microbatch_cost     0        extension, not in the paper: a fixed cost of every microbatch in compact
#:                              tokens, in [0, capacity]; candidates are compared with it added to each
#:                              microbatch's work (the plan still reports J)
#: cp_size             1        context-parallel degree C in [1, MAX_CP_SIZE]: microbatches of up to
#:                              C x capacity compact rows, each split between C ranks by
#:                              :meth:`StepPlan.cp_split` (``harts/cp_split.h``); 1 = no CP (the
#:                              plans of a planner without it, byte for byte)
#: ==================  =======  =========================================================================
#:
#: ``planner.proto`` states the same defaults in its ``StepOptions`` comments (a test checks both).
DEFAULT_CAPACITY = 65_536
"""T: compact tokens per microbatch unless told otherwise (the paper's setting on an H200); the one
default of every door (``harts-planner``, ``harts-train``, the engine, the verl backend)."""

DEFAULT_OPTIONS: dict[str, object] = _native.default_step_options()


def plan_step(
    batch: RolloutBatch,
    dp_size: int,
    capacity: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cancel=None,
    *,
    call_plans: bool = False,
    conv_width: int = DEFAULT_CONV_WIDTH,
    debug: bool = True,
    **options,
) -> StepPlan:
    """Plan one training step: microbatches, their DP replicas and their slots.

    Parameters
    ----------
    batch : RolloutBatch
        The step's trajectories.
    dp_size : int
        D >= 1, the data-parallel degree.
    capacity : int
        T >= 1, the most compact tokens (unique token prefixes) per microbatch.
    chunk_size : int, default 64
        Linear-attention chunk size B in ``[1, MAX_CHUNK_SIZE]``; only used by :meth:`StepPlan.call_plans`.
    cancel : CancelToken, optional
        Stops the planning once cancelled or past its deadline (checked before the planner starts;
        inside its loops once the step planner takes the token).
    call_plans : bool, default False
        Also plan every microbatch's calls now (:meth:`StepPlan.call_plans` is filled); otherwise
        they are planned on first use of :meth:`StepPlan.call_plans`.
    conv_width : int, default 4
        w of the call plans' convolution context.
    debug : bool, default True
        False: the call plans come without their debug part (the layouts a runtime reads), as
        ``Planner.plan_step(..., debug=False)`` returns them.
    **options
        Search parameters, defaults in :data:`DEFAULT_OPTIONS`: ``exact_threshold`` (N0 = 512),
        ``max_sampled_k`` (Q_max = 32), ``refine_window`` (H = 8), ``refine_sweeps`` (2),
        ``max_anchors`` (B_ref = 3), ``repair_window`` (H = 8), ``repair_iterations`` (4),
        ``greedy`` (True), ``refine`` (True), ``search`` (``"auto"``, ``"exact"`` or ``"heuristic"``),
        and ``component_greedy`` (True): an extension beyond the paper that adds one candidate, per-tree
        greedy partitions packed best-fit decreasing (``harts/greedy.h``); it can only lower J.
        ``contiguous_optimum`` (True): an extension that adds the least-total-work contiguous
        partition over every K of the heuristic search's range (``harts/contiguous_optimum.h``,
        exact), so a heuristic plan never does more compact work than that optimum; it can only
        lower J. ``component_greedy=False, contiguous_optimum=False`` compares exactly the paper's
        candidate set. ``microbatch_cost`` (0): an extension that selects among the candidates with
        every microbatch's work counted that many compact tokens more, for a per-microbatch fixed
        time (``benchmarks/train_eval.py``'s ``microbatches`` section fits it: the fixed seconds
        over the seconds per compact token); candidates with equal J (or J with that cost) go to
        the fewer microbatches. ``cp_size`` (1): the context-parallel degree C; microbatches hold up
        to ``C x capacity`` compact rows (``capacity`` stays T, the rows of one rank) and
        :meth:`StepPlan.cp_split` splits each between the C ranks.

    Returns
    -------
    StepPlan

    Raises
    ------
    InvalidArgumentError
        A bad argument or option (``.field`` names it), or a trajectory longer than
        ``cp_size x capacity`` (``.field == "trajectories[i]"``; the message names T and C).
    InfeasibleError
        No valid plan: fewer trajectories than replicas, more microbatches needed than there are
        trajectories, or no candidate reached a feasible grouping; the message says why.
    ResourceLimitError
        ``search="exact"`` on a batch too large for the exact table.
    PlanCancelledError
        ``cancel`` fired.

    The GIL is released while planning; the result is deterministic.
    """
    call_plans, debug = checks.boolean(call_plans, "call_plans"), checks.boolean(debug, "debug")
    conv_width = checks.conv_width(conv_width)
    plan = _plan_step(batch, dp_size, capacity, chunk_size, cancel, options)
    plan._conv_width, plan._call_debug = conv_width, debug
    if call_plans:
        plan.call_plans(cancel=cancel)
    return plan


def _plan_step(batch, dp_size, capacity, chunk_size, cancel, options: dict) -> StepPlan:
    """:func:`plan_step` without the call plans."""
    if not isinstance(batch, RolloutBatch):
        raise invalid("batch", f"must be a harts_planner.RolloutBatch, got {type(batch).__name__}")
    dp_size = checks.int64(dp_size, "dp_size")
    capacity = checks.int64(capacity, "capacity")
    chunk_size = checks.chunk_size(chunk_size)
    cancel = cancel_token(cancel)
    merged: dict[str, Any] = dict(DEFAULT_OPTIONS)  # values of each option's type (checks.step_options)
    merged.update(checks.step_options(options, DEFAULT_OPTIONS))
    start = time.perf_counter()
    native = _native.plan_step(batch._native, dp_size, capacity, cancel, **merged)
    wall = time.perf_counter() - start
    return StepPlan(native, batch, chunk_size, merged, wall)


def plan_step_with_calls(
    batch: RolloutBatch,
    dp_size: int,
    capacity: int,
    chunk_size: int,
    options: dict,
    call_plans: bool,
    conv_width: int,
    debug: bool = True,
    check=None,
    cancel=None,
    limits: CostLimits | None = None,
) -> StepPlan:
    """:func:`plan_step` and, with ``call_plans``, every microbatch's call plan right away (at
    ``conv_width``; without their debug part unless ``debug``), as the sidecar and
    :meth:`harts_planner.Planner.plan_step` return them. ``check()``, when given, is called before each
    microbatch's call plan (the sidecar's deadline check; what it raises propagates); ``cancel`` (a
    CancelToken) is passed to every planning call. With ``limits`` (:class:`CostLimits`), the exact
    cost of the call plans (:func:`estimate_call_plans`, from the step plan's microbatches) is
    checked once the step is planned and before any call plan is made: ResourceLimitError naming
    ``call_plans``. Raises as :func:`plan_step` and :func:`harts_planner.plan_calls`."""
    plan = _plan_step(batch, dp_size, capacity, chunk_size, cancel, options)
    plan._conv_width, plan._call_debug = conv_width, debug
    if call_plans:
        if limits is not None:
            estimate_call_plans(batch, plan.microbatches, plan.chunk_size, conv_width, debug, cancel).check(
                limits
            )
        plans = []
        for mb in plan.microbatches:
            if check is not None:
                check()
            plans.append(
                plan_calls(batch, plan.chunk_size, mb, conv_width=conv_width, cancel=cancel, debug=debug)
            )
        plan._call_plans = plans
    return plan


def imbalance(per_replica_work) -> float:
    """Equation (23): ``max_d w_d / mean_d w_d - 1`` (0 for all-zero work)."""
    w = np.asarray(per_replica_work, dtype=np.float64)
    mean = w.mean()
    return float(w.max() / mean - 1.0) if mean > 0 else 0.0


def schedule_metrics(work, replica, slot, dp_size: int) -> dict:
    """J (Equation 4) and the imbalance metrics (Equation 23) of any schedule.

    Parameters are per-microbatch arrays: ``work`` (compact work), ``replica`` in ``[0, D)`` and ``slot``
    in ``[0, K / D)``, with every ``(replica, slot)`` pair used once.

    Returns a dict with ``total_work``, ``slot_critical_work``, ``max_replica_work``, ``slot_imbalance``
    (list, one per slot), ``slot_imbalance_p50`` / ``_p95`` (``numpy.percentile``, linear),
    ``step_imbalance``, ``replica_work`` (list) and ``num_slots``.
    """
    work = np.asarray(work, dtype=np.int64)
    replica = np.asarray(replica, dtype=np.int64)
    slot = np.asarray(slot, dtype=np.int64)
    num_slots = int(slot.max()) + 1 if len(slot) else 0
    grid = np.zeros((num_slots, dp_size), dtype=np.int64)
    grid[slot, replica] = work
    slot_imb = [imbalance(row) for row in grid]
    replica_work = grid.sum(axis=0)
    return {
        "total_work": int(work.sum()),
        "slot_critical_work": int(grid.max(axis=1).sum()) if num_slots else 0,
        "max_replica_work": int(replica_work.max()) if dp_size else 0,
        "num_slots": num_slots,
        "slot_imbalance": slot_imb,
        "slot_imbalance_p50": float(np.percentile(slot_imb, 50)) if slot_imb else 0.0,
        "slot_imbalance_p95": float(np.percentile(slot_imb, 95)) if slot_imb else 0.0,
        "step_imbalance": imbalance(replica_work),
        "replica_work": [int(x) for x in replica_work],
    }


def verify_schedule(
    batch: RolloutBatch, microbatches: Sequence[np.ndarray], replica, slot, dp_size: int, capacity: int
) -> np.ndarray:
    """Check every guarantee of a step plan; return the per-microbatch compact work.

    Raises ``AssertionError`` naming the first violated guarantee: exact coverage, non-empty
    microbatches, capacity, ``K mod D = 0``, ``K / D`` microbatches per replica, each
    ``(replica, slot)`` pair used exactly once.
    """
    k = len(microbatches)
    n = batch.num_trajectories
    assert k > 0 and k % dp_size == 0, f"K = {k} is not a positive multiple of D = {dp_size}"
    replica = np.asarray(replica)
    slot = np.asarray(slot)
    assert len(replica) == k and len(slot) == k, "replica/slot need one entry per microbatch"
    seen = np.zeros(n, dtype=np.int64)
    work = np.zeros(k, dtype=np.int64)
    for m, members in enumerate(microbatches):
        members = np.asarray(members)
        assert len(members) > 0, f"microbatch {m} is empty"
        np.add.at(seen, members, 1)
        work[m] = batch.subset_work(members)
        assert work[m] <= capacity, f"microbatch {m} has {work[m]} compact tokens > T = {capacity}"
    assert (seen == 1).all(), f"trajectories covered != once: {np.flatnonzero(seen != 1)[:10]}"
    assert ((replica >= 0) & (replica < dp_size)).all(), "replica out of range"
    assert ((slot >= 0) & (slot < k // dp_size)).all(), "slot out of range"
    assert (np.bincount(replica, minlength=dp_size) == k // dp_size).all(), "unequal microbatches per replica"
    pairs = slot.astype(np.int64) * dp_size + replica
    assert len(np.unique(pairs)) == k, "a (replica, slot) pair is used twice"
    return work


class StepPlan:
    """The plan of one training step (returned by :func:`plan_step`).

    Microbatch ``m`` runs on replica ``replica[m]`` in slot ``slot[m]``; microbatches are ordered by
    ``(slot, replica)``. Arrays are read-only numpy views of memory owned by the C++ plan.

    Attributes
    ----------
    microbatches : list of np.ndarray (int32)
        Trajectory indices of each microbatch, in lexicographic (rank) order.
    replica, slot : np.ndarray (int32, shape [K])
    work : np.ndarray (int64, shape [K])
        Compact work ``w(M)`` of each microbatch.
    objective : tuple[int, int, int]
        J of Equation (4).
    planning_seconds : float
        Time spent in the C++ planner.

    Two plans compare equal (``==``) when their schedule, objective, candidates, provenance, chunk
    size and options are equal (:data:`ARRAY_FIELDS`, :data:`SCALAR_FIELDS`), and, when both carry
    call plans already, those too; timings (``planning_seconds``, ``phase_seconds``,
    ``wall_seconds``) are not compared. A plan received from a sidecar has no :attr:`batch`.
    """

    #: The sidecar's statistics of the call (``PlanStats`` fields), on a plan received from one only.
    server_stats: dict

    def __init__(
        self,
        native,
        batch: RolloutBatch | None,
        chunk_size: int,
        options: dict,
        wall_seconds: float,
        call_plans: list | None = None,
    ):
        self._native = native
        self._batch = batch
        self.chunk_size = chunk_size
        self.options = dict(options)
        self.wall_seconds = wall_seconds
        offsets = native.member_offsets
        members = native.members
        self.microbatches: list[np.ndarray] = [
            members[offsets[m] : offsets[m + 1]] for m in range(native.num_microbatches)
        ]
        self._metrics: dict | None = None
        self._call_plans: list | None = None if call_plans is None else list(call_plans)
        self._conv_width, self._call_debug = DEFAULT_CONV_WIDTH, True  # of call_plans() on first use

    def __eq__(self, other) -> bool:
        if not isinstance(other, StepPlan):
            return NotImplemented
        a, b = self._native, other._native
        if not (
            self.chunk_size == other.chunk_size
            and self.options == other.options
            and all(getattr(a, f) == getattr(b, f) for f in SCALAR_FIELDS)
            and all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ARRAY_FIELDS)
        ):
            return False
        if self._call_plans is not None and other._call_plans is not None:
            return self._call_plans == other._call_plans
        return True

    # Unhashable (the data model's spelling); typeshed types object.__hash__ as a method only.
    __hash__ = None  # pyright: ignore[reportAssignmentType]

    # ------------------------------------------------------------------ shape
    @property
    def batch(self) -> RolloutBatch | None:
        """The planned batch (None for a plan received from a sidecar)."""
        return self._batch

    @property
    def has_call_plans(self) -> bool:
        """True once the per-microbatch call plans are computed or were received."""
        return self._call_plans is not None

    dp_size = NativeField("D.")
    capacity = NativeField("T: compact rows of one rank (of the whole microbatch without CP).")

    @property
    def cp_size(self) -> int:
        """C, the context-parallel degree (the ``cp_size`` option; 1 without CP)."""
        return int(self.options.get("cp_size", 1))

    @property
    def microbatch_capacity(self) -> int:
        """``cp_size x capacity``: the most compact rows one microbatch holds."""
        return self.cp_size * self.capacity

    num_microbatches = NativeField("K (a multiple of D).")

    @property
    def num_slots(self) -> int:
        """K / D."""
        return self.num_microbatches // self.dp_size

    replica = NativeField("int32 [K]: DP replica of each microbatch, in ``[0, D)``.")
    slot = NativeField("int32 [K]: slot of each microbatch, in ``[0, K / D)``.")
    work = NativeField("int64 [K]: compact work ``w(M) <= C x T`` of each microbatch.")

    def microbatch_at(self, replica: int, slot: int) -> np.ndarray:
        """Trajectory indices of ``M_{replica, slot}``, ``0 <= replica < D``, ``0 <= slot < K / D``
        (InvalidArgumentError naming ``replica`` or ``slot`` otherwise; no index counts from the end)."""
        replica = checks.index(replica, "replica", self.dp_size)
        slot = checks.index(slot, "slot", self.num_slots)
        return self.microbatches[slot * self.dp_size + replica]

    # ------------------------------------------------------------------ objective and metrics
    objective = NativeField(
        "tuple[int, int, int]: J = (total work, aggregate slot-critical work, max replica work), Equation (4)."
    )

    @property
    def total_work(self) -> int:
        return self.objective[0]

    @property
    def slot_critical_work(self) -> int:
        return self.objective[1]

    @property
    def max_replica_work(self) -> int:
        return self.objective[2]

    compact_tokens = NativeField(
        "G = C(X), compact tokens of the whole batch in one trie: a lower bound on total work."
    )

    @property
    def metrics(self) -> dict:
        """:func:`schedule_metrics` of this plan (imbalance per slot, P50/P95, step total)."""
        if self._metrics is None:
            self._metrics = schedule_metrics(self.work, self.replica, self.slot, self.dp_size)
        return self._metrics

    @property
    def slot_imbalance_p50(self) -> float:
        return self.metrics["slot_imbalance_p50"]

    @property
    def slot_imbalance_p95(self) -> float:
        return self.metrics["slot_imbalance_p95"]

    @property
    def step_imbalance(self) -> float:
        return self.metrics["step_imbalance"]

    # ------------------------------------------------------------------ provenance
    planning_seconds = NativeField("float: time spent in the C++ planner (timing: not compared by ``==``).")
    phase_seconds = NativeField("dict[str, float]: C++ planner time per phase (timing).")
    source = NativeField(
        "Which candidate won: ``exact``, ``evolved``, ``greedy:<order>/<policy>``, with ``+boundary`` / "
        "``+repair`` when refined."
    )
    search_mode = NativeField('The base search that ran: ``"exact"`` or ``"heuristic"``.')
    natural_k = NativeField("K0, microbatches of the natural partition.")

    @property
    def k_range(self) -> tuple[int, int]:
        """(K_min, K_max) of Equations (7)-(8)."""
        return self._native.k_min, self._native.k_max

    candidates = NativeField(
        "list[dict]: every candidate compared: dicts with ``source``, ``k`` and ``objective``."
    )
    selected = NativeField("Index of the selected candidate in :attr:`candidates`.")

    # ------------------------------------------------------------------ call plans
    def call_plans(self, progress=None, cancel=None) -> list:
        """Per-microbatch minimum-call plans (Section 3.3), computed on first use.

        Calls ``harts_planner.plan_calls(batch, chunk_size, microbatch, conv_width, debug=debug)`` for
        every microbatch (``conv_width`` and ``debug`` as given to :func:`plan_step`; 4 and True by
        default). ``progress(done, total)``, when given, is called after each microbatch's plan;
        ``cancel`` (a CancelToken) is passed to each. A plan received from a sidecar has them only
        when requested with ``call_plans=True`` (``Planner.plan_step``); otherwise this raises
        InvalidArgumentError (field ``call_plans``).
        """
        if self._call_plans is None and self._batch is None:
            raise invalid(
                "call_plans",
                "this plan came from a sidecar without call plans; request them "
                "with Planner.plan_step(..., call_plans=True) or Planner.plan_calls",
            )
        if self._call_plans is None:
            plans = []
            for mb in self.microbatches:
                plans.append(
                    plan_calls(
                        self._batch,
                        self.chunk_size,
                        mb,
                        conv_width=self._conv_width,
                        cancel=cancel,
                        debug=self._call_debug,
                    )
                )
                if progress is not None:
                    progress(len(plans), len(self.microbatches))
            self._call_plans = plans
        return self._call_plans

    # ------------------------------------------------------------------ context parallelism
    def cp_split(self, m: int, cancel=None, **costs) -> CpSplit:
        """The split of microbatch ``m`` between the plan's ``cp_size`` ranks
        (:func:`harts_planner.cp_split.plan_cp` at the plan's chunk size and ``conv_width``;
        ``costs``: ``linear_cost``, ``attention_cost``). Needs the plan's batch (InvalidArgumentError
        naming ``batch`` for a plan received from a sidecar: call ``plan_cp`` with the batch)."""
        if self._batch is None:
            raise invalid("batch", "this plan came from a sidecar; call harts_planner.plan_cp(batch, ...)")
        m = checks.index(m, "m", self.num_microbatches)
        return plan_cp(
            self._batch,
            self.microbatches[m],
            self.cp_size,
            self.chunk_size,
            conv_width=self._conv_width,
            cancel=cancel,
            **costs,
        )

    # ------------------------------------------------------------------ export
    def to_dict(self) -> dict:
        """A JSON-serializable summary: the schedule, J, imbalance metrics, K range and candidates."""
        m = self.metrics
        return {
            "dp_size": self.dp_size,
            "capacity": self.capacity,
            "chunk_size": self.chunk_size,
            "num_trajectories": self._native.num_trajectories,
            "num_microbatches": self.num_microbatches,
            "num_slots": self.num_slots,
            "microbatches": [mb.tolist() for mb in self.microbatches],
            "replica": self.replica.tolist(),
            "slot": self.slot.tolist(),
            "work": self.work.tolist(),
            "objective": {
                "total_work": self.total_work,
                "slot_critical_work": self.slot_critical_work,
                "max_replica_work": self.max_replica_work,
            },
            "imbalance": {
                "slot": m["slot_imbalance"],
                "slot_p50": m["slot_imbalance_p50"],
                "slot_p95": m["slot_imbalance_p95"],
                "step_total": m["step_imbalance"],
            },
            "replica_work": m["replica_work"],
            "compact_tokens": self.compact_tokens,
            "natural_k": self.natural_k,
            "k_range": list(self.k_range),
            "search_mode": self.search_mode,
            "source": self.source,
            "candidates": [
                {"source": c["source"], "k": c["k"], "objective": list(c["objective"])}
                for c in self.candidates
            ],
            "selected": self.selected,
            "planning_seconds": self.planning_seconds,
            "phase_seconds": self.phase_seconds,
            "options": self.options,
        }

    def __repr__(self) -> str:
        return (
            f"StepPlan(K={self.num_microbatches}, D={self.dp_size}, slots={self.num_slots}, "
            f"J={self.objective}, source={self.source!r}, planning={self.planning_seconds * 1e3:.1f} ms)"
        )
