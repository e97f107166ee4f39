"""Deadlines and cancellation inside real C++ plans (issue 17): the planner polls the request's
``harts_planner._native.CancelToken`` in its loops, so a plan whose client gave up stops and frees its
planner thread, and the log says DEADLINE_EXCEEDED / CANCELLED. The slow request is many copies of
the ``swe-like`` tree (a step that plans for seconds); bounds are generous (seconds, against a plan
of many seconds)."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from sidecar_fixtures import Raw, future_code, step_request, wait_until

from harts_planner import RolloutBatch, SegmentTree, synth
from harts_planner.rpc import codec
from harts_planner.rpc.server import create_server

#: The slow request: 600 copies of the swe-like tree, segment lengths / 16 (to stay under 2^31 tokens),
#: T = 65,536 / 16: 1,266,600 trajectories, a 19 MB request whose step plans for 10-16 s on one core
#: (so several seconds of plan remain when the 5 s deadline expires).
COPIES, SCALE = 600, 16


def copies_tree(tree: SegmentTree, copies: int, scale: int = 1) -> SegmentTree:
    """``copies`` disjoint copies of ``tree``, segment lengths divided by ``scale`` (at least 1)."""
    v = tree.num_segments
    parent = np.concatenate([np.where(tree.parent < 0, -1, tree.parent + i * v) for i in range(copies)])
    ends = np.concatenate([tree.trajectory_end + i * v for i in range(copies)])
    length = np.tile(np.maximum(tree.length // scale, 1), copies)
    return SegmentTree(parent.astype(np.int32), length.astype(np.int32), ends.astype(np.int32))


@pytest.fixture(scope="module")
def slow_request():
    syn = synth.generate("swe-like", seed=0)
    tree = RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids).segment_tree()
    big = copies_tree(tree, COPIES, SCALE)
    return codec.serialize_plan_step_request(big, 1, 65536 // SCALE, 64, {}, False, 4)


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_an_abandoned_plan_frees_its_thread(slow_request, records, how):
    # a 19 MB unary request: over the default 8 MiB message limit
    with create_server("127.0.0.1:0", workers=1, max_message_bytes=64 << 20) as srv, Raw(srv.address) as raw:
        # deadline: 5 s from the call, so the upload and its admission (up to ~2 s on a loaded 2-core
        # machine, more beside CI's background stages; a 1 s deadline could expire before planning
        # began) leave the plan started and seconds from done when it expires
        slow = raw.future("PLAN_STEP", slow_request, timeout=600 if how == "cancel" else 5.0)
        assert wait_until(lambda: srv.servicer.counts()["planning"] == 1)
        time.sleep(0.5)  # well inside the plan
        if how == "cancel":
            slow.cancel()
        assert future_code(slow) == (
            grpc.StatusCode.CANCELLED if how == "cancel" else grpc.StatusCode.DEADLINE_EXCEEDED
        )
        gave_up = time.monotonic()
        assert raw.code("PLAN_STEP", step_request())[0] == grpc.StatusCode.OK
        freed = time.monotonic() - gave_up
        (record,) = records.wait_for(code="CANCELLED" if how == "cancel" else "DEADLINE_EXCEEDED")
    assert record["method"] == "PlanStep" and record["trajectories"] > 100_000
    assert freed < 3.0, freed  # the thread was free again at once, not after the whole plan
