# Type stub of the planner's C++ extension (planner_cpp/bindings/, built as harts_planner._native) for
# type checkers: pyright (.ci/lint) reads it, Python never does. Made with pybind11-stubgen 3.0.0 from
# the built module, then corrected where the binding's docstrings are not Python: the C++ type
# harts::RolloutBatch is CompactBatch, `cancel` takes None, and the exceptions (created by the module,
# named harts_planner.*) are declared here. tests/planner/test_native_stub.py checks that it names
# exactly the module's public names and each class's attributes: update it with the bindings.
from __future__ import annotations

import collections.abc
import typing

import numpy
import numpy.typing

__all__: list[str] = [
    "CallPlan",
    "CallShape",
    "CancelToken",
    "CompactBatch",
    "CpSplit",
    "DEFAULT_MAX_PLAN_BYTES",
    "HartsError",
    "InfeasibleError",
    "InvalidArgumentError",
    "MAX_CHUNK_SIZE",
    "MAX_CONV_WIDTH",
    "MAX_CP_COST",
    "MAX_CP_SIZE",
    "MAX_SEMANTIC_TOKENS",
    "MAX_TRAJECTORIES",
    "PlanCancelledError",
    "ResourceLimitError",
    "StepPlan",
    "batch_call_shape",
    "batch_partition_shape",
    "call_plan_bytes",
    "default_step_options",
    "exact_contiguous_partitions",
    "ingest",
    "ingest_segment_tree",
    "max_plan_bytes",
    "natural_partition",
    "partition_retained_bytes",
    "plan_calls",
    "plan_cp",
    "plan_segment_forest",
    "plan_step",
    "planner_limits",
    "row_arrays_bytes",
    "rows_built",
    "set_max_plan_bytes",
    "step_plan_bytes",
    "time_plan_segment_forest",
    "token_call_shape",
    "token_ingest_bytes",
    "tree_call_shape",
    "tree_ingest_bytes",
    "tree_partition_shape",
]

class HartsError(ValueError):
    """Base class of the planner's errors; ``field`` names the input at fault (None if none)."""

    field: str | None

class InfeasibleError(HartsError): ...
class InvalidArgumentError(HartsError): ...

class ResourceLimitError(HartsError):
    # Set in Python by harts_planner.plan_cost on the errors of its estimates only (the limit's
    # name, the amount needed and the limit); tests/planner/test_native_stub.py knows them.
    limit: str
    needed: int
    maximum: int

class PlanCancelledError(HartsError):
    deadline_exceeded: bool

class CancelToken:
    """
    Cooperative cancellation of a planning call (harts/cancel.h). Pass it as `cancel=`; cancel() or an expired set_deadline() stops the call within milliseconds with PlanCancelledError. Thread-safe: cancel it from any thread while the call runs.
    """
    def __init__(self) -> None: ...
    def __repr__(self) -> str: ...
    def cancel(self) -> None:
        """
        Request cancellation (thread-safe; never undone).
        """
    def set_deadline(self, seconds) -> None:
        """
        Stop the call once ``seconds`` (a real number) have passed from now; a negative value is
                already past, ``math.inf`` clears the deadline. InvalidArgumentError naming ``seconds`` for
                anything else (a string, a bool, None, NaN).
        """
    @property
    def cancel_requested(self) -> bool:
        """
        True once cancel() was called.
        """

class StepPlan:
    @property
    def candidates(self) -> list: ...
    @property
    def capacity(self) -> int: ...
    @property
    def compact_tokens(self) -> int: ...
    @property
    def cp_size(self) -> int: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def k_max(self) -> int: ...
    @property
    def k_min(self) -> int: ...
    @property
    def member_offsets(self) -> numpy.typing.NDArray[numpy.int64]: ...
    @property
    def members(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def natural_k(self) -> int: ...
    @property
    def num_microbatches(self) -> int: ...
    @property
    def num_trajectories(self) -> int: ...
    @property
    def objective(self) -> tuple: ...
    @property
    def phase_seconds(self) -> dict: ...
    @property
    def planning_seconds(self) -> float: ...
    @property
    def replica(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def search_mode(self) -> str: ...
    @property
    def selected(self) -> int: ...
    @property
    def slot(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def source(self) -> str: ...
    @property
    def work(self) -> numpy.typing.NDArray[numpy.int64]: ...

class CompactBatch:
    def interval_work(
        self, lo: typing.SupportsInt | typing.SupportsIndex, hi: typing.SupportsInt | typing.SupportsIndex
    ) -> int: ...
    def lcp(
        self, i: typing.SupportsInt | typing.SupportsIndex, j: typing.SupportsInt | typing.SupportsIndex
    ) -> int: ...
    def subset_work(self, trajectories: typing.Any) -> int: ...
    @property
    def adjacent_lcp(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def compact_map(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def compact_tokens(self) -> int: ...
    @property
    def component(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def lengths(self) -> numpy.typing.NDArray[numpy.int64]: ...
    @property
    def multiplicity(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def num_segments(self) -> int: ...
    @property
    def num_trajectories(self) -> int: ...
    @property
    def order(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def rank(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def row_depth(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def row_parent(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def row_segment(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_child_offsets(self) -> numpy.typing.NDArray[numpy.int64]: ...
    @property
    def segment_children(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_end(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_end_offsets(self) -> numpy.typing.NDArray[numpy.int64]: ...
    @property
    def segment_ending(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_multiplicity(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_parent(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_root(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_roots(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_row_begin(self) -> numpy.typing.NDArray[numpy.int64]: ...
    @property
    def segment_start(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_subtree_end(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def semantic_tokens(self) -> int: ...
    @property
    def tree_ids(self) -> numpy.typing.NDArray[numpy.int64]: ...

class CallPlan:
    @property
    def chunk_size(self) -> int: ...
    @property
    def compact_tokens(self) -> int: ...
    @property
    def conv_context(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def conv_width(self) -> int: ...
    @property
    def cu_offsets(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def cu_seqlens(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def direct_child(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def gather_index(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def num_calls(self) -> int: ...
    @property
    def num_segments(self) -> int: ...
    @property
    def num_sequences(self) -> int: ...
    @property
    def num_state_slots(self) -> int: ...
    @property
    def own_conv_context(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def packed_offsets(self) -> numpy.typing.NDArray[numpy.int64]: ...
    @property
    def packed_output_row(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def physical_to_global(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def physical_to_row(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def position_ids(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def replay_tokens(self) -> int: ...
    @property
    def request_chunk(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def request_position(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def request_sequence(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def request_slot(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def round_physical_offsets(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def round_sequence_offsets(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def row_to_global(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def row_to_physical(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_child_offsets(self) -> numpy.typing.NDArray[numpy.int64]: ...
    @property
    def segment_children(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_end(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_parent(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_physical_begin(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_roots(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_row_begin(self) -> numpy.typing.NDArray[numpy.int64]: ...
    @property
    def segment_sequence(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def segment_start(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def semantic_offsets(self) -> numpy.typing.NDArray[numpy.int64]: ...
    @property
    def semantic_to_physical(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def sequence_anchor(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def sequence_chain(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def sequence_chain_offsets(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def sequence_end(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def sequence_physical_offsets(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def sequence_replay_length(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def sequence_request_offsets(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def sequence_round(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def sequence_start(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def sequence_state_slot(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def slot_position(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def slot_producer(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def slot_segment(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def t_in(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def t_pre(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def trajectories(self) -> numpy.typing.NDArray[numpy.int32]: ...

class CallShape:
    """
    Sizes of one call plan, or sums over several (harts/plan_cost.h).
    """
    def __repr__(self) -> str: ...
    @property
    def batch_links(self) -> bool: ...
    @property
    def exact(self) -> bool: ...
    @property
    def height(self) -> int: ...
    @property
    def longest_walk(self) -> int: ...
    @property
    def replay_rows(self) -> int: ...
    @property
    def roots(self) -> int: ...
    @property
    def rounds(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def segments(self) -> int: ...
    @property
    def semantic_tokens(self) -> int: ...
    @property
    def sequences(self) -> int: ...
    @property
    def state_slots(self) -> int: ...
    @property
    def trajectories(self) -> int: ...

class CpSplit:
    @property
    def attention_cost(self) -> int: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def conv_width(self) -> int: ...
    @property
    def cp_size(self) -> int: ...
    @property
    def entry_rows(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def linear_cost(self) -> int: ...
    @property
    def max_cost(self) -> int: ...
    @property
    def num_rows(self) -> int: ...
    @property
    def rank_cost(self) -> numpy.typing.NDArray[numpy.int64]: ...
    @property
    def rank_row_offsets(self) -> numpy.typing.NDArray[numpy.int64]: ...
    @property
    def receive_anchor(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def receive_conv_context(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def receive_entry_offsets(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def receive_offsets(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def receive_rank(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def receive_replay_offsets(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def receive_row(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def receive_state(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def replay_rows(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def send_offsets(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def state_consumer_offsets(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def state_consumer_rank(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def state_position(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def state_rank(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def state_row(self) -> numpy.typing.NDArray[numpy.int32]: ...
    @property
    def total_cost(self) -> int: ...

def batch_call_shape(
    batch: CompactBatch,
    trajectories: typing.Any = None,
    chunk_size: typing.SupportsInt | typing.SupportsIndex = 64,
    conv_width: typing.SupportsInt | typing.SupportsIndex = 4,
    cancel: CancelToken | None = None,
) -> CallShape:
    """
    The exact shape of plan_calls(batch, ...). O(k log k); releases the GIL.
    """

def batch_partition_shape(
    batch: CompactBatch,
    chunk_size: typing.SupportsInt | typing.SupportsIndex = 64,
    conv_width: typing.SupportsInt | typing.SupportsIndex = 4,
) -> CallShape:
    """
    Bounds on the sums of the call-plan shapes of any partition of a batch. O(V).
    """

def call_plan_bytes(
    shape: CallShape,
    chunk_size: typing.SupportsInt | typing.SupportsIndex,
    conv_width: typing.SupportsInt | typing.SupportsIndex,
) -> tuple[int, int]:
    """
    (retained, scratch): bounds on the bytes plan_calls allocates for `shape`.
    """

def default_step_options() -> dict:
    """
    A new dict: every search option of plan_step and its default (harts::PlannerOptions).
    """

def exact_contiguous_partitions(
    batch: CompactBatch,
    capacity: typing.SupportsInt | typing.SupportsIndex,
    ks: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
) -> list:
    """
    Exact contiguous DP (Eq. 9) for each k: dicts k, feasible, total_work, max_work, cuts.
    """

def ingest(
    tokens: typing.Any, offsets: typing.Any, tree_ids: typing.Any = None, cancel: CancelToken | None = None
) -> CompactBatch:
    """
    Validate and ingest a packed batch (int32 tokens, int64 offsets, optional int64 tree ids; optional CancelToken). Releases the GIL.
    """

def ingest_segment_tree(
    parent: typing.Any,
    length: typing.Any,
    trajectory_end: typing.Any,
    tree_ids: typing.Any = None,
    cancel: CancelToken | None = None,
) -> CompactBatch:
    """
    Validate and build a batch from a compacted segment tree (int32 parent, length per segment; int32 trajectory_end per trajectory; optional int64 tree ids; optional CancelToken). Releases the GIL.
    """

def max_plan_bytes() -> int:
    """
    The most bytes one call plan may allocate (the C++ backstop).
    """

def natural_partition(batch: CompactBatch, capacity: typing.SupportsInt | typing.SupportsIndex) -> list[int]:
    """
    Cuts (int32 ranks, K0 + 1 entries) of the natural partition P0.
    """

def partition_retained_bytes(
    shape: CallShape,
    plans: typing.SupportsInt | typing.SupportsIndex,
    chunk_size: typing.SupportsInt | typing.SupportsIndex,
    conv_width: typing.SupportsInt | typing.SupportsIndex,
) -> int:
    """
    Bound on the retained bytes of at most `plans` call plans whose shapes sum to `shape`.
    """

def plan_calls(
    batch: CompactBatch,
    chunk_size: typing.SupportsInt | typing.SupportsIndex,
    trajectories: typing.Any = None,
    conv_width: typing.SupportsInt | typing.SupportsIndex = 4,
    cancel: CancelToken | None = None,
) -> CallPlan:
    """
    Minimum-call plan and physical layout of a microbatch (int32 trajectory ids, or None for all; optional CancelToken). Releases the GIL.
    """

def plan_cp(
    batch: CompactBatch,
    microbatch: typing.Any,
    cp_size: typing.SupportsInt | typing.SupportsIndex,
    chunk_size: typing.SupportsInt | typing.SupportsIndex = 64,
    conv_width: typing.SupportsInt | typing.SupportsIndex = 4,
    linear_cost: typing.SupportsInt | typing.SupportsIndex = 8192,
    attention_cost: typing.SupportsInt | typing.SupportsIndex = 1,
    cancel: CancelToken | None = None,
) -> CpSplit:
    """
    Context-parallel split of one microbatch (harts/cp_split.h; microbatch: int32 trajectory ids or None for all; cancel: a CancelToken or None); releases the GIL.
    """

def plan_segment_forest(
    parent: typing.Any,
    start: typing.Any,
    end: typing.Any,
    chunk_size: typing.SupportsInt | typing.SupportsIndex,
    conv_width: typing.SupportsInt | typing.SupportsIndex = 4,
    cancel: CancelToken | None = None,
) -> CallPlan:
    """
    Minimum-call plan and layout of a bare segment forest (int32 parent, start, end per segment; optional CancelToken). Releases the GIL.
    """

def plan_step(
    batch: CompactBatch,
    dp_size: typing.SupportsInt | typing.SupportsIndex,
    capacity: typing.SupportsInt | typing.SupportsIndex,
    cancel: CancelToken | None,
    exact_threshold: typing.SupportsInt | typing.SupportsIndex = 512,
    max_sampled_k: typing.SupportsInt | typing.SupportsIndex = 32,
    refine_window: typing.SupportsInt | typing.SupportsIndex = 8,
    refine_sweeps: typing.SupportsInt | typing.SupportsIndex = 2,
    max_anchors: typing.SupportsInt | typing.SupportsIndex = 3,
    repair_window: typing.SupportsInt | typing.SupportsIndex = 8,
    repair_iterations: typing.SupportsInt | typing.SupportsIndex = 4,
    greedy: bool = True,
    refine: bool = True,
    component_greedy: bool = True,
    contiguous_optimum: bool = True,
    search: str = "auto",
    microbatch_cost: typing.SupportsInt | typing.SupportsIndex = 0,
    cp_size: typing.SupportsInt | typing.SupportsIndex = 1,
) -> StepPlan:
    """
    Plan one step (harts/step_plan.h; cancel: a CancelToken or None); releases the GIL.
    """

def planner_limits() -> dict:
    """
    A new dict: the planner's size limits (kMaxTrajectories, ..., kMaxExactCells) by their Python names.
    """

def row_arrays_bytes(
    semantic_tokens: typing.SupportsInt | typing.SupportsIndex,
    compact_rows: typing.SupportsInt | typing.SupportsIndex,
) -> int:
    """
    Bytes of the per-row arrays (compact_map, multiplicity, row_parent, row_depth, row_segment).
    """

def rows_built(batch: CompactBatch) -> bool:
    """
    True once the batch's per-row arrays exist (a batch from a segment tree builds them on first use).
    """

def set_max_plan_bytes(bytes: typing.SupportsInt | typing.SupportsIndex) -> int:
    """
    Set the most bytes one call plan may allocate (>= 1); returns the previous limit. Process-wide.
    """

def step_plan_bytes(
    trajectories: typing.SupportsInt | typing.SupportsIndex,
    canonical_segments: typing.SupportsInt | typing.SupportsIndex,
    max_sampled_k: typing.SupportsInt | typing.SupportsIndex,
    exact_threshold: typing.SupportsInt | typing.SupportsIndex,
    search: str,
) -> int:
    """
    Bound on the bytes plan_step allocates (calibrated on the current step planner).
    """

def time_plan_segment_forest(
    parent: typing.Any,
    start: typing.Any,
    end: typing.Any,
    chunk_size: typing.SupportsInt | typing.SupportsIndex,
    conv_width: typing.SupportsInt | typing.SupportsIndex = 4,
) -> dict:
    """
    Benchmark helper: seconds spent building the forest, planning (Algorithm 1) and laying out.
    """

def token_call_shape(
    num_tokens: typing.SupportsInt | typing.SupportsIndex,
    offsets: typing.Any,
    trajectories: typing.Any = None,
    chunk_size: typing.SupportsInt | typing.SupportsIndex = 64,
    conv_width: typing.SupportsInt | typing.SupportsIndex = 4,
) -> CallShape:
    """
    A bound on the shape of the call plan of a token batch's microbatch, from its offsets. O(N + k).
    """

def token_ingest_bytes(
    trajectories: typing.SupportsInt | typing.SupportsIndex,
    semantic_tokens: typing.SupportsInt | typing.SupportsIndex,
    compact_rows: typing.SupportsInt | typing.SupportsIndex,
    canonical_segments: typing.SupportsInt | typing.SupportsIndex,
) -> int:
    """
    Bound on the bytes RolloutBatch.from_arrays allocates (per-row arrays included).
    """

def tree_call_shape(
    parent: typing.Any,
    length: typing.Any,
    trajectory_end: typing.Any,
    trajectories: typing.Any = None,
    chunk_size: typing.SupportsInt | typing.SupportsIndex = 64,
    conv_width: typing.SupportsInt | typing.SupportsIndex = 4,
    cancel: CancelToken | None = None,
) -> tuple:
    """
    (CallShape, canonical segments): the exact shape of the call plan of a microbatch (int32 ids, None for all) of a segment tree, which is validated. O(V + N + k); releases the GIL.
    """

def tree_ingest_bytes(
    segments: typing.SupportsInt | typing.SupportsIndex,
    trajectories: typing.SupportsInt | typing.SupportsIndex,
    canonical_segments: typing.SupportsInt | typing.SupportsIndex,
) -> int:
    """
    Bound on the bytes RolloutBatch.from_segment_tree allocates.
    """

def tree_partition_shape(
    parent: typing.Any,
    length: typing.Any,
    trajectory_end: typing.Any,
    chunk_size: typing.SupportsInt | typing.SupportsIndex = 64,
    conv_width: typing.SupportsInt | typing.SupportsIndex = 4,
    cancel: CancelToken | None = None,
) -> CallShape:
    """
    Bounds on the sums of the call-plan shapes of any partition of a segment tree's batch. O(V + N).
    """

DEFAULT_MAX_PLAN_BYTES: int = 17179869184
MAX_CHUNK_SIZE: int = 1048576
MAX_CONV_WIDTH: int = 1024
MAX_CP_COST: int = 1048576
MAX_CP_SIZE: int = 1024
MAX_SEMANTIC_TOKENS: int = 2147483647
MAX_TRAJECTORIES: int = 16777216
