"""Requests that ask for more memory than a machine has (issue 17), against a real ``harts-planner
serve`` under a 2 GiB address-space limit (``RLIMIT_AS``): each is refused with RESOURCE_EXHAUSTED
naming the field and the limit before anything is allocated, the server's peak memory stays near its
idle size, and it keeps serving correct plans. Without the cost checks these requests end in
``std::bad_alloc`` (INTERNAL) or a killed process."""

from __future__ import annotations

import os
import resource

import grpc
import pytest
from sidecar_fixtures import TREE, Raw, calls_request, copies_tree, memory, one_segment, step_request

from harts_planner import Planner, RolloutBatch, estimate_cost, synth
from harts_planner.rpc import codec, limits
from harts_planner.rpc import planner_pb2 as pb
from harts_planner.rpc.server import SidecarProcess

AS_LIMIT = 2 << 30
RES = grpc.StatusCode.RESOURCE_EXHAUSTED


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def _bounded(extra_args=(), tmp_path=None) -> SidecarProcess:
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}  # glibc reserves 64 MB of address space per arena
    return SidecarProcess(
        workers=2,
        extra_args=list(extra_args),
        preexec_fn=_limit_address_space,
        env=env,
        log_path=None if tmp_path is None else str(tmp_path / "serve.log"),
    )


@pytest.fixture(scope="module")
def swe_tree():
    syn = synth.generate("swe-like", seed=0)
    return RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids).segment_tree()


HUGE = [  # (id, method, request, field, the limit named)
    (
        "26-byte PlanCalls of 2^31 - 1 rows",
        "PLAN_CALLS",
        calls_request(one_segment(2**31 - 1)),
        "trajectories",
        "--max-rows",
    ),
    (
        "PlanCalls of 2^26 rows",
        "PLAN_CALLS_STREAM",
        calls_request(one_segment(2**26)),
        "trajectories",
        "--max-response-mb",
    ),
    (
        "PlanStep with the call plans of 2^26 rows",
        "PLAN_STEP_STREAM",
        step_request(one_segment(2**26), capacity=2**26, call_plans=True),
        "include_call_plans",
        "--max-response-mb",
    ),
    (
        "PlanStep of 2^26-row call plans, layouts alone",
        "PLAN_STEP_STREAM",
        step_request(one_segment(2**26), capacity=2**26, call_plans=True, debug=False),
        "include_call_plans",
        "--max-response-mb",
    ),
    (
        "unary PlanCalls of 2^20 rows: over one message",
        "PLAN_CALLS",
        calls_request(one_segment(2**20)),
        "trajectories",
        "--max-message-mb",
    ),
]


def test_requests_for_huge_plans_are_refused_before_any_allocation(swe_tree, tmp_path):
    assert len(HUGE[0][2]) == 26
    with _bounded(["--max-plan-memory-mb", "256"], tmp_path) as sidecar, Raw(sidecar.address) as raw:
        idle = memory(sidecar.pid)["VmHWM"]
        for case, method, request_, field, flag in HUGE:
            code, details = raw.code(method, request_, timeout=60)
            assert code == RES, (case, code, details)
            assert details.startswith(f"{field}: this request needs about ") and flag in details, (
                case,
                details,
            )
        # The whole swe-like batch's call plan (a 49 KB request, a 533 MB response, 534 MB to build).
        whole = codec.plan_calls_request(swe_tree, None, 64, 4).SerializeToString()
        assert len(whole) < 60_000
        code, details = raw.code("PLAN_CALLS_STREAM", whole, timeout=60)
        assert code == RES and details.startswith("trajectories: ") and "--max-plan-memory-mb" in details
        # Step plans of those shapes cost O(V + N): served.
        with Planner(sidecar.address, timeout=60) as p:
            assert p.plan_step(one_segment(2**31 - 1), 1, 2**31 - 1).num_microbatches == 1
            local = Planner().plan_step(TREE, 1, 10, call_plans=True)
            assert p.plan_step(TREE, 1, 10, call_plans=True) == local
            assert p.health() == "SERVING"
        peak = memory(sidecar.pid)["VmHWM"]
        assert peak - idle < 100 << 20, (idle, peak)  # nothing big was ever allocated
    assert sidecar.proc.returncode == 0


def test_a_streamed_533_mb_plan_is_served_within_a_2_gib_address_space(swe_tree):
    """The whole swe-like call plan (533 MB) through PlanCallsStream: the response is sent from the
    plan's own arrays in 1 MiB chunks, so the server needs about the plan (the estimate, 512 MiB),
    not the plan and two copies of its response (1.6 GB, which did not fit before)."""
    with _bounded() as sidecar, Raw(sidecar.address) as raw:
        idle = memory(sidecar.pid)["VmHWM"]
        whole = codec.plan_calls_request(swe_tree, None, 64, 4).SerializeToString()
        response = raw.call("PLAN_CALLS_STREAM", whole, timeout=120)
        assert len(response) > 500 << 20
        peak = memory(sidecar.pid)["VmHWM"]
        cost = estimate_cost(swe_tree)
        held = limits.request_bytes(len(whole), 0, cost)  # the request and its tree's batch
        estimate = limits.of_plan_cost(cost, stream=True).memory_bytes + held
        assert peak - idle <= estimate < 1.1 * (peak - idle), (peak - idle, estimate)
        plan = codec.decode_call_plan(pb.PlanCallsResponse.FromString(response).plan)
        del response
        assert plan == Planner().plan_calls(swe_tree, 64)
    assert sidecar.proc.returncode == 0


def test_an_estimate_that_falls_short_still_ends_in_resource_exhausted(swe_tree):
    """Under the default plan-memory limit (8 GiB) the call plan of four swe-like steps (2 GB) is
    admitted but does not fit in 2 GiB: RESOURCE_EXHAUSTED (out of memory), not INTERNAL or a dead
    server."""
    four = copies_tree(swe_tree, 4)
    with _bounded(["--max-response-mb", "4096"]) as sidecar, Raw(sidecar.address) as raw:
        whole = codec.plan_calls_request(four, None, 64, 4).SerializeToString()
        code, details = raw.code("PLAN_CALLS_STREAM", whole, timeout=120)
        assert code == RES and details.startswith("request: the server ran out of memory"), details
        with Planner(sidecar.address, timeout=60) as p:
            assert p.plan_calls(TREE, 4) == Planner().plan_calls(TREE, 4)
    assert sidecar.proc.returncode == 0
