"""The sidecar's admission stage and planner threads (issue 17): cost refusals before any planning,
the in-flight bytes and queue bounds, validation errors answered while plans run, deadlines and client
cancellation while queued or planning (and their log lines), the drain of queued and in-flight
requests. Plans are held by a gate (``sidecar_fixtures.Gate``), so every test orders events instead of
timing them."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sidecar_fixtures import (
    GATED_CAPACITY,
    GATED_CHUNK,
    TREE,
    Raw,
    calls_request,
    chain_tree,
    fork_tree,
    future_code,
    one_segment,
    queued_request,
    step_request,
    wait_until,
)

import harts_planner as hp
from harts_planner import PackedTokens, RolloutBatch
from harts_planner.rpc import codec, limits
from harts_planner.rpc import planner_pb2 as pb
from harts_planner.rpc.server import create_server

INV, RES = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
DEADLINE, CANCELLED, UNAVAILABLE = (
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNAVAILABLE,
)
HELD = queued_request(capacity=GATED_CAPACITY)  # a valid PlanStep the gate holds (on a planner thread)


def _server(workers: int = 1, max_message_bytes: int = limits.DEFAULT_MAX_MESSAGE_BYTES, **limit_args):
    return create_server(
        "127.0.0.1:0",
        workers=workers,
        max_message_bytes=max_message_bytes,
        limits=limits.Limits(**limit_args),
    )


# ---------------------------------------------------------------------------------- cost before work
def _fork_step(call_plans: bool) -> bytes:
    # C = 1,040 compact rows; at T = 1,020 a microbatch holds two leaves, so the call plans have
    # 2 x 1,020 = 2,040 compact rows: more than C, known only once the step is planned.
    return step_request(fork_tree(1000, 4, 10), 2, 1020, call_plans=call_plans)


def _memory(source, **kw) -> int:
    """The server's memory estimate of a request (the planner's estimate, plus the response twice)."""
    return limits.of_plan_cost(hp.estimate_cost(source, **kw)).memory_bytes


BIG_TOKENS = PackedTokens(np.arange(200_000, dtype=np.int32) % 1000, [0, 200_000])
#: A plan-memory limit between the probe (PlanCalls of TREE) and the refused requests below.
PROBE_MEMORY = _memory(TREE)
CALLS_LIMIT = (PROBE_MEMORY + _memory(one_segment(5000))) // 2
TOKENS_LIMIT = (PROBE_MEMORY + _memory(BIG_TOKENS, request="step")) // 2

COST_CASES = [  # (id, limits, method, request, field, limit flag)
    (
        "PlanCalls rows, whole batch",
        {"max_rows": 1000},
        "PLAN_CALLS",
        calls_request(one_segment(5000)),
        "trajectories",
        "--max-rows",
    ),
    (
        "PlanCalls rows, one microbatch",
        {"max_rows": 1100},  # 1,030 compact rows and up to 5 x 63 replayed
        "PLAN_CALLS",
        calls_request(fork_tree(1000, 4, 10), microbatch=[2, 0, 1]),
        "microbatch",
        "--max-rows",
    ),
    (
        "PlanCalls response",
        {"max_response_bytes": 50_000},
        "PLAN_CALLS",
        calls_request(one_segment(5000)),
        "trajectories",
        "--max-response-mb",
    ),
    (
        "PlanCalls memory",
        {"max_plan_memory_bytes": CALLS_LIMIT},
        "PLAN_CALLS",
        calls_request(one_segment(5000)),
        "trajectories",
        "--max-plan-memory-mb",
    ),
    (
        "PlanStep call plans, before the step plan",
        {"max_rows": 1000},
        "PLAN_STEP",
        _fork_step(True),
        "include_call_plans",
        "--max-rows",
    ),
    (
        "PlanStep tokens memory",
        {"max_plan_memory_bytes": TOKENS_LIMIT},
        "PLAN_STEP",
        codec.plan_step_request(BIG_TOKENS, 1, 300_000, 64, {}, False, 4).SerializeToString(),
        "trajectories",
        "--max-plan-memory-mb",
    ),
]


@pytest.mark.parametrize("case,bounds,method,request_,field,flag", COST_CASES, ids=[c[0] for c in COST_CASES])
def test_cost_refusals_name_the_field_and_the_limit_before_any_planning(
    gate, records, case, bounds, method, request_, field, flag
):
    gate.open()
    with _server(**bounds) as srv, Raw(srv.address) as raw:
        code, details = raw.code(method, request_)
        assert code == RES, details
        assert details.startswith(f"{field}: this request needs about ") and flag in details, details
        assert gate.entered == 0  # refused at admission: the planner never ran
        (record,) = records.wait_for(code="RESOURCE_EXHAUSTED")
        assert record["field"] == field and "plan_ms" not in record and "queue_ms" not in record
        assert record["estimate"]["rows"] >= 0
        assert raw.code("PLAN_CALLS", calls_request())[0] == grpc.StatusCode.OK  # and it keeps serving


def test_call_plans_are_costed_again_once_the_step_is_planned(gate, records):
    """The floor (every compact row once) fits; the microbatches' rows, known after the step plan,
    do not: refused before any call plan."""
    gate.open()
    batch = RolloutBatch.from_segment_tree(fork_tree(1000, 4, 10))
    assert batch.compact_tokens == 1040
    with _server(max_rows=2000) as srv, Raw(srv.address) as raw:
        assert raw.code("PLAN_STEP", _fork_step(False))[0] == grpc.StatusCode.OK
        code, details = raw.code("PLAN_STEP", _fork_step(True))
        assert code == RES and details.startswith("include_call_plans: this request needs about 2,")
        assert "--max-rows" in details and "PlanCalls" in details
        (refused,) = records.wait_for(code="RESOURCE_EXHAUSTED")
        assert refused["microbatches"] == 2 and refused["estimate"]["rows"] >= 2040
        assert "plan_ms" not in refused  # the call plans never ran


@pytest.mark.parametrize("debug", [True, False])
def test_the_logged_estimates_are_the_plans_sizes(records, debug):
    """For a segment tree the estimate of a PlanCalls is exact in rows and an upper bound of the
    response bytes (tight on a big plan); the log line carries both."""
    tree = fork_tree(3000, 6, 700)
    batch = RolloutBatch.from_segment_tree(tree)
    with _server() as srv, Raw(srv.address) as raw:
        for n, (chunk, microbatch) in enumerate(((1, None), (16, [5, 0, 2]), (64, None)), 1):
            response = raw.call("PLAN_CALLS", calls_request(tree, microbatch, chunk, 3, debug))
            plan = hp.plan_calls(batch, chunk, microbatch, conv_width=3)
            # logged once gRPC ended the call, a moment after the client has the response
            logged = records.wait_for(n, timeout=10, code="OK")
            assert len(logged) == n
            record = logged[-1]
            assert record["response_bytes"] <= record["estimate"]["response_bytes"]
            assert record["estimate"]["rows"] == plan.compact_tokens + plan.replay_tokens
            assert len(response) == record["response_bytes"]
    big = [r for r in records.rpcs(code="OK") if r["response_bytes"] > 100_000]
    assert big and all(r["estimate"]["response_bytes"] <= 1.2 * r["response_bytes"] + 4096 for r in big)


# ---------------------------------------------------------------------------------- bounds
def _held(request: bytes, tree) -> int:
    """What a tree request holds while queued or planning: its bytes and its batch."""
    return len(request) + hp.estimate_cost(tree, request="step").ingest_bytes


def test_inflight_request_bytes_are_bounded(gate, records):
    """Requests held (their bytes and the batch admission built) and the receive reservation of the
    next message count against --max-inflight-mb: a big request waits for room by being refused, a
    small one still fits."""
    big = chain_tree(1500)  # 18 KB of arrays, a 0.7 MB batch
    held = step_request(big, capacity=GATED_CAPACITY)
    message = 256 << 10  # above the 80 KB response
    lane = limits.DEFAULT.receive_reservation(message)
    copies = 3 * 4 * 1500  # aligned copies of the arrays that are not aligned in the request bytes
    bound = _held(held, big) + copies + lane + _held(step_request(), TREE)
    assert _held(held, big) + _held(step_request(big, capacity=2000), big) > bound
    with (
        _server(workers=2, max_inflight_bytes=bound, max_message_bytes=message) as srv,
        Raw(srv.address) as raw,
    ):
        first = raw.future("PLAN_STEP", held)
        gate.wait_entered()
        assert _held(held, big) <= srv.servicer.counts()["inflight_bytes"] <= _held(held, big) + copies
        code, details = raw.code("PLAN_STEP", step_request(big, capacity=2000))
        assert code == RES and details.startswith("trajectories: ") and "--max-inflight-mb" in details
        assert raw.code("PLAN_STEP", step_request())[0] == grpc.StatusCode.OK  # small ones still fit
        gate.open()
        assert future_code(first) == grpc.StatusCode.OK
        assert raw.code("PLAN_STEP", step_request(big, capacity=2000))[0] == grpc.StatusCode.OK
        assert wait_until(lambda: srv.servicer.counts()["inflight_bytes"] == 0)


def test_queue_is_bounded(gate):
    with _server(max_queued=1) as srv, Raw(srv.address) as raw:
        first = raw.future("PLAN_STEP", HELD)
        gate.wait_entered()
        second = raw.future("PLAN_STEP", queued_request())
        assert wait_until(lambda: srv.servicer.counts()["queued"] == 1)
        code, details = raw.code("PLAN_STEP", queued_request())
        assert code == RES and "--max-queued 1" in details and details.startswith("request: ")
        gate.open()
        assert future_code(first) == future_code(second) == grpc.StatusCode.OK


def test_plans_running_at_once_share_the_memory_budget(gate, records):
    """Two plans that each fit the memory budget but not together run one after the other, even with
    a planner thread free."""
    big = calls_request(one_segment(100_000), chunk_size=GATED_CHUNK)  # not an express plan
    with _server(workers=3) as probe, Raw(probe.address) as raw:
        gate.open()
        assert raw.code("PLAN_CALLS", big)[0] == grpc.StatusCode.OK
        estimate = records.wait_for(method="PlanCalls")[0]["estimate"]["memory_bytes"]
    gate.close()
    with _server(workers=3, max_plan_memory_bytes=int(1.5 * estimate)) as srv, Raw(srv.address) as raw:
        first = raw.future("PLAN_CALLS", big)
        gate.wait_entered()
        second = raw.future("PLAN_CALLS", big)
        assert wait_until(lambda: srv.servicer.counts()["queued"] == 1)
        assert srv.servicer.counts()["planning"] == 1  # a thread is free, the memory is not
        gate.open()
        assert future_code(first) == future_code(second) == grpc.StatusCode.OK
        assert gate.entered == 2
        assert srv.servicer.counts()["reserved_bytes"] == 0


# ---------------------------------------------------------------------------------- validation
INVALID = [  # (method, request, code, field) answered at admission
    (
        "PLAN_STEP",
        pb.PlanStepRequest(trajectories=codec.encode_trajectories(TREE), capacity=10),
        INV,
        "dp_size",
    ),
    (
        "PLAN_STEP",
        codec.plan_step_request(hp.SegmentTree([-1, 2, 1], [1, 1, 1], [0]), 1, 10, 64, {}, False, 4),
        INV,
        "trajectories.tree.parent[1]",
    ),
    (
        "PLAN_STEP",
        codec.plan_step_request(PackedTokens([1, -2, 3], [0, 3]), 1, 10, 64, {}, False, 4),
        INV,
        "trajectories.packed.tokens[1]",
    ),
    (
        "PLAN_STEP",
        codec.plan_step_request(PackedTokens([1, 2, 3], [0, 1, 1, 3]), 1, 10, 64, {}, False, 4),
        INV,
        "trajectories.packed.offsets[2]",
    ),
    ("PLAN_STEP", codec.plan_step_request(TREE, 1, 5, 64, {}, False, 4), INV, "trajectories[1]"),
    (
        "PLAN_STEP",
        codec.plan_step_request(TREE, 1, 10, 64, {"max_sampled_k": 1}, False, 4),
        INV,
        "options.max_sampled_k",
    ),
    (
        "PLAN_STEP",
        codec.plan_step_request(TREE, 3, 10, 64, {}, False, 4),
        grpc.StatusCode.FAILED_PRECONDITION,
        "dp_size",
    ),
    ("PLAN_CALLS", codec.plan_calls_request(TREE, [0, 7], 4, 4), INV, "microbatch[1]"),
    ("PLAN_CALLS", codec.plan_calls_request(TREE, [1, 1], 4, 4), INV, "microbatch"),
    (
        "PLAN_CALLS",
        codec.plan_calls_request(PackedTokens([1, 2, 3], [0, 3]), [3], 4, 4),
        INV,
        "microbatch[0]",
    ),
    ("PLAN_STEP", b"\xff\xff\xff\xff\x0f", INV, "request"),
    (
        "PLAN_CALLS",
        calls_request(one_segment(50_000), chunk_size=8),
        RES,
        "trajectories",
    ),  # --max-rows 10,000
]


def test_invalid_requests_are_answered_while_plans_hold_every_thread(gate, records):
    with _server(workers=1, max_rows=10_000) as srv, Raw(srv.address) as raw:
        held = raw.future("PLAN_STEP", HELD)
        gate.wait_entered()
        queued = raw.future("PLAN_STEP", queued_request())
        assert wait_until(lambda: srv.servicer.counts()["queued"] == 1)
        for method, request_, code, field in INVALID:
            data = request_ if isinstance(request_, bytes) else request_.SerializeToString()
            got, details = raw.code(method, data, timeout=30)
            assert got == code and details.startswith(field), (field, got, details)
        assert not held.done() and not queued.done()  # still held: nothing waited for them
        gate.open()
        assert future_code(held) == future_code(queued) == grpc.StatusCode.OK
    assert (
        len(records.rpcs(code="INVALID_ARGUMENT")) == len(INVALID) - 2
    )  # one RESOURCE_EXHAUSTED, one FAILED_PRECONDITION


def test_tiny_plans_are_made_at_once_while_long_plans_hold_every_thread(gate, records):
    """The issue: tiny valid requests waited 0.6-1.4 s at p50 behind plans. A plan of a few hundred
    trajectories at most (admission.EXPRESS_PLAN_BYTES) takes no planner thread and waits for none."""
    with _server(workers=1) as srv, Raw(srv.address) as raw:
        held = raw.future("PLAN_STEP", HELD)
        gate.wait_entered()
        queued = raw.future("PLAN_STEP", queued_request())
        assert wait_until(lambda: srv.servicer.counts()["queued"] == 1)
        assert raw.code("PLAN_CALLS", calls_request())[0] == grpc.StatusCode.OK
        assert raw.code("PLAN_STEP", step_request())[0] == grpc.StatusCode.OK
        assert not held.done() and not queued.done()
        gate.open()
        assert future_code(held) == future_code(queued) == grpc.StatusCode.OK
    express = [r for r in records.rpcs(code="OK") if r.get("express")]
    assert [r["method"] for r in express] == ["PlanCalls", "PlanStep"]


# ---------------------------------------------------------------------------------- deadlines, cancellation
def test_deadline_while_queued(gate, records):
    with _server(workers=1) as srv, Raw(srv.address) as raw:
        held = raw.future("PLAN_STEP", HELD)
        gate.wait_entered()
        late = raw.future("PLAN_STEP", queued_request(capacity=50), timeout=2.0)
        assert wait_until(lambda: srv.servicer.counts()["queued"] == 1)
        assert future_code(late) == DEADLINE
        (record,) = records.wait_for(code="DEADLINE_EXCEEDED")
        assert record["method"] == "PlanStep" and "before a planner thread was free" in record["error"]
        assert wait_until(lambda: srv.servicer.counts()["queued"] == 0)  # it left the queue
        assert not held.done()
        gate.open()
        assert future_code(held) == grpc.StatusCode.OK


def test_client_cancellation_frees_the_queue_and_the_planner_thread(gate, records):
    with _server(workers=1) as srv, Raw(srv.address) as raw:
        held = raw.future("PLAN_STEP", HELD)
        gate.wait_entered()
        queued = raw.future("PLAN_STEP", queued_request(capacity=60))
        assert wait_until(lambda: srv.servicer.counts()["queued"] == 1)
        queued.cancel()
        assert records.wait_for(code="CANCELLED")
        assert wait_until(lambda: srv.servicer.counts()["queued"] == 0)
        held.cancel()  # the plan polls its token and stops; the thread is free again
        assert len(records.wait_for(2, code="CANCELLED")) == 2 and gate.cancelled == 1
        assert raw.code("PLAN_STEP", step_request())[0] == grpc.StatusCode.OK  # gate still closed
        idle = {
            "active": 0,
            "planning": 0,
            "reserved_bytes": 0,
            "queued": 0,
            "inflight_bytes": 0,
            "receiving": 0,
            "sending": 0,
        }
        assert wait_until(lambda: srv.servicer.counts() == idle), srv.servicer.counts()


def test_a_plan_finished_after_its_client_left_is_logged_cancelled(monkeypatch, records):
    from sidecar_fixtures import Gate

    gate = Gate(polls=False).install(monkeypatch)  # a planner that never checks its token
    with _server(workers=1) as srv, Raw(srv.address) as raw:
        held = raw.future("PLAN_STEP", HELD)
        gate.wait_entered()
        held.cancel()
        assert wait_until(lambda: any(c.reason == "client" for c in list(srv.servicer._controls)))
        gate.open()  # the plan finishes after the server saw the cancellation
        (record,) = records.wait_for(code="CANCELLED")
        assert record["method"] == "PlanStep" and not records.rpcs(code="OK")
        assert wait_until(lambda: srv.servicer.counts()["active"] == 0)


def test_deadline_inside_a_plan(gate, records):
    with _server(workers=1) as srv, Raw(srv.address) as raw:
        late = raw.future("PLAN_CALLS", calls_request(chunk_size=GATED_CHUNK), timeout=2.0)
        gate.wait_entered()
        assert future_code(late) == DEADLINE
        (record,) = records.wait_for(code="DEADLINE_EXCEEDED")
        assert record["method"] == "PlanCalls" and gate.cancelled == 1
        assert raw.code("PLAN_CALLS", calls_request())[0] == grpc.StatusCode.OK


# ---------------------------------------------------------------------------------- drain
def test_drain_answers_queued_requests_at_once_and_lets_plans_finish(gate, records):
    srv = _server(workers=1)
    with Raw(srv.address) as raw:
        held = raw.future("PLAN_STEP", HELD)
        gate.wait_entered()
        queued = raw.future("PLAN_STEP", queued_request())
        assert wait_until(lambda: srv.servicer.counts()["queued"] == 1)
        box = {}
        drain = threading.Thread(target=lambda: box.setdefault("result", srv.drain(60)))
        drain.start()
        assert future_code(queued) == UNAVAILABLE  # at once: the held plan still runs
        assert not held.done()
        code, details = raw.code("PLAN_STEP", step_request())
        assert code == UNAVAILABLE and "shutting down" in details
        gate.open()
        assert future_code(held) == grpc.StatusCode.OK
        drain.join(30)
    assert box["result"].finished and box["result"].exit_code == 0


def test_drain_cancels_plans_after_the_grace(gate, records):
    srv = _server(workers=1)
    with Raw(srv.address) as raw:
        held = raw.future("PLAN_STEP", HELD)
        gate.wait_entered()
        result = srv.drain(0.2)
        assert future_code(held) == UNAVAILABLE
    assert not result.finished and result.cancelled == 1 and result.stopped and result.exit_code == 0
    (record,) = records.wait_for(code="UNAVAILABLE")
    assert "shut down before the plan finished" in record["error"]
    stopped = [r for r in records.items if r.get("event") == "stopped"]
    assert stopped == [{"event": "stopped", "drained": False, "cancelled": 1, "stuck": False}]


# ---------------------------------------------------------------------------------- packed checks
@st.composite
def packed(draw):
    n = draw(st.integers(0, 6))
    lengths = draw(st.lists(st.integers(-1, 4), min_size=n, max_size=n))
    offsets = np.concatenate([[draw(st.integers(-1, 1))], np.cumsum(lengths)]).astype(np.int64)
    size = max(int(offsets[-1]), 0) + draw(st.integers(-1, 1))
    tokens = np.array(
        draw(st.lists(st.integers(-2, 5), min_size=max(size, 0), max_size=max(size, 0))), np.int32
    )
    ids = draw(st.one_of(st.none(), st.lists(st.integers(-1, 3), min_size=max(n - 1, 0), max_size=n + 1)))
    return PackedTokens(tokens, offsets, None if ids is None else np.array(ids, np.int64))


@settings(max_examples=400, deadline=None)
@given(packed())
def test_packed_checks_are_the_ingestion_checks(source):
    """``codec.validate_packed`` raises exactly what ingestion raises first (class, field, message),
    and nothing when ingestion accepts the arrays."""
    try:
        codec.ingest(source, wire=True)
        expected = None
    except hp.HartsError as e:
        expected = (type(e), e.field, str(e))
    try:
        codec.validate_packed(source)
        got = None
    except hp.HartsError as e:
        got = (type(e), e.field, str(e))
    assert got == expected


@st.composite
def step_arguments(draw):
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    tokens = [[j] + [draw(st.integers(0, 2)) for _ in range(n - 1)] for j, n in enumerate(lengths)]
    options = {}
    for name, lo in codec.OPTION_MINIMUMS.items():
        if draw(st.booleans()):
            options[name] = draw(st.integers(lo - 2, lo + 3))
    if draw(st.booleans()):
        options["search"] = draw(st.sampled_from(["auto", "exact", "heuristic", "fast"]))
    return tokens, draw(st.integers(0, 4)), draw(st.integers(0, 7)), options


@settings(max_examples=300, deadline=None)
@given(step_arguments())
def test_step_checks_are_the_planners_first_checks(args):
    """``codec.check_step`` raises exactly what ``plan_step`` raises first (class, field, message) when
    that is one of its up-front checks, and nothing when the plan succeeds."""
    tokens, dp, cap, options = args
    batch = RolloutBatch.from_token_lists(tokens)
    try:
        hp.plan_step(batch, dp, cap, **options)
        expected = None
    except hp.HartsError as e:
        expected = (type(e), e.field, str(e))
    try:
        codec.check_step(batch.lengths, dp, cap, options)
        got = None
    except hp.HartsError as e:
        got = (type(e), e.field, str(e))
    if expected is None or got is not None:
        assert got == expected
    else:  # a check that needs the plan (K_min, feasibility, the exact table): left to the planner
        field, message = expected[1], expected[2]
        assert field in ("capacity", "search") and "must be" not in message, expected
