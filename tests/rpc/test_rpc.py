"""The gRPC sidecar: round trips equal the in-process plans, health, reflection, every bad-request
class with its status code and field, size limits, deadlines, concurrent clients, malformed bytes,
(the SIGTERM drain of a real `harts-planner serve` process: test_sidecar_shutdown.py)."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sidecar_fixtures import Raw, calls_request, step_request

import harts_planner as hp
from harts_planner import PackedTokens, Planner, RolloutBatch, SegmentTree, synth
from harts_planner.rpc import codec, limits
from harts_planner.rpc import planner_pb2 as pb
from harts_planner.rpc.client import SidecarTimeoutError, SidecarUnavailableError
from harts_planner.rpc.server import create_server


@pytest.fixture(scope="module")
def server():
    srv = create_server("127.0.0.1:0", workers=4)
    yield srv
    srv.stop(grace=None)


@pytest.fixture(scope="module")
def remote(server):
    with Planner(server.address, timeout=60) as p:
        yield p


@pytest.fixture(scope="module")
def small_batch():
    syn = synth.generate("small", seed=2)
    return RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids)


def _raw_channel(server):
    channel = grpc.insecure_channel(server.address)
    return channel, channel.unary_unary(
        codec.PLAN_STEP, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )


# ---------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("kind", ["tree", "tokens", "batch"])
def test_round_trip_equals_in_process(server, remote, small_batch, kind):
    b = small_batch
    source = {"tree": b.segment_tree(), "tokens": PackedTokens(b.tokens, b.offsets, b.tree_ids), "batch": b}[
        kind
    ]
    cap = int(b.lengths.max()) + 500
    local = Planner().plan_step(b, 2, cap, 32, call_plans=True, conv_width=3)
    got = remote.plan_step(source, 2, cap, 32, call_plans=True, conv_width=3)
    assert got.batch is None and got.server_stats["trajectories"] == b.num_trajectories
    assert got == local and got.call_plans() == local.call_plans()
    assert got.to_dict().keys() == local.to_dict().keys()
    for key in ("microbatches", "replica", "slot", "work", "objective", "candidates", "options", "k_range"):
        assert got.to_dict()[key] == local.to_dict()[key], key
    # Without call plans the remote plan says how to get them.
    bare = remote.plan_step(source, 2, cap, 32, max_sampled_k=4, search="heuristic")
    assert bare == Planner().plan_step(b, 2, cap, 32, max_sampled_k=4, search="heuristic")
    with pytest.raises(hp.InvalidArgumentError, match="call_plans"):
        bare.call_plans()
    # One microbatch's calls.
    mb = local.microbatches[1][::-1]
    assert remote.plan_calls(source, 16, mb, conv_width=2) == hp.plan_calls(b, 16, mb, conv_width=2)
    assert remote.plan_calls(source, 16) == hp.plan_calls(b, 16)


def _assert_layout_only(plan, full):
    """``plan`` is ``full`` without its debug part: the same layout, and every way to the debug part
    raises InvalidArgumentError on field "debug"."""
    assert not plan.has_debug and full.has_debug
    assert plan.layout == full.layout and plan == full.without_debug() and plan != full
    for name in hp.call_plan.LAYOUT_FIELDS:
        assert np.array_equal(getattr(plan, name), getattr(full, name)), name
    for read in (lambda: plan.debug, lambda: plan.t_pre, lambda: plan.chain(0), plan.to_dict):
        with pytest.raises(hp.InvalidArgumentError, match="debug=True") as e:
            read()
        assert e.value.field == "debug"


@pytest.mark.parametrize("kind", ["tree", "tokens"])
def test_omit_debug_returns_the_layout_alone(server, remote, small_batch, kind):
    b = small_batch
    source = {"tree": b.segment_tree(), "tokens": PackedTokens(b.tokens, b.offsets, b.tree_ids)}[kind]
    mb = Planner().plan_step(b, 2, int(b.lengths.max()) + 500).microbatches[1]
    full = hp.plan_calls(b, 16, mb, conv_width=3)
    got = remote.plan_calls(source, 16, mb, conv_width=3, debug=False)
    _assert_layout_only(got, full)
    assert got == Planner().plan_calls(b, 16, mb, conv_width=3, debug=False)  # both transports agree
    # In a step: every call plan without its debug part, equal to the in-process ones.
    cap = int(b.lengths.max()) + 500
    step = remote.plan_step(source, 2, cap, 32, call_plans=True, conv_width=3, debug=False)
    local = Planner().plan_step(b, 2, cap, 32, call_plans=True, conv_width=3)
    assert step == Planner().plan_step(b, 2, cap, 32, call_plans=True, conv_width=3, debug=False)
    assert len(step.call_plans()) == len(local.call_plans())
    for got_plan, full_plan in zip(step.call_plans(), local.call_plans()):
        _assert_layout_only(got_plan, full_plan)


def test_omit_debug_on_the_wire(server, small_batch):
    """The response of an omit_debug request: debug_omitted set, every debug array empty, the layout
    arrays byte for byte those of the full response, and fewer bytes in all."""
    tree = small_batch.segment_tree()
    full_req = codec.plan_calls_request(tree, None, 8, 4)
    lean_req = codec.plan_calls_request(tree, None, 8, 4, debug=False)
    assert lean_req.omit_debug and not full_req.omit_debug
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(
            codec.PLAN_CALLS, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        full, lean = (
            pb.PlanCallsResponse.FromString(call(r.SerializeToString(), timeout=30)).plan
            for r in (full_req, lean_req)
        )
    assert lean.debug_omitted and not full.debug_omitted
    for name in hp.call_plan.DEBUG_FIELDS:
        assert getattr(lean, name) == b"", name
    for name in (*hp.call_plan.SCALAR_FIELDS, *hp.call_plan.LAYOUT_FIELDS):
        assert getattr(lean, name) == getattr(full, name), name
    assert lean.ByteSize() < full.ByteSize()
    assert codec.decode_call_plan(lean) == codec.decode_call_plan(full).without_debug()
    # the codec: a plan without debug encodes as such, whatever is asked
    plan = hp.plan_calls(small_batch, 8)
    assert codec.encode_call_plan(plan, debug=False) == lean
    assert codec.encode_call_plan(plan.without_debug()) == lean
    assert codec.encode_call_plan(plan) == full


def test_debug_flag_is_a_bool(remote, small_batch):
    for planner in (remote, Planner()):
        with pytest.raises(hp.InvalidArgumentError) as e:
            planner.plan_calls(small_batch, 16, debug="no")
        assert e.value.field == "debug"
        with pytest.raises(hp.InvalidArgumentError) as e:
            planner.plan_step(small_batch, 1, 40000, call_plans=1)
        assert e.value.field == "call_plans"


def test_plans_are_deterministic_bytes(server, small_batch):
    request = codec.plan_step_request(small_batch.segment_tree(), 2, 40000, 64, {}, True, 4)
    channel, call = _raw_channel(server)
    with channel:
        a, b = (
            pb.PlanStepResponse.FromString(call(request.SerializeToString(), timeout=30)) for _ in range(2)
        )
    for r in (a, b):
        r.ClearField("stats")
        r.plan.planning_seconds = 0
        r.plan.ClearField("phase_seconds")
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


# ---------------------------------------------------------------------------------- health, reflection
def test_health(server, remote):
    assert remote.health() == "SERVING"
    from harts_planner.rpc.client import SidecarClient

    client = SidecarClient(server.address)
    assert client.health(codec.SERVICE_NAME) == "SERVING"
    with pytest.raises(hp.rpc.client.SidecarError) as e:  # unknown service: NOT_FOUND
        client.health("no.such.Service")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    client.close()


def test_reflection_lists_the_service(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = db.get_services()
        assert "harts.planner.v1.PlannerService" in services and "grpc.health.v1.Health" in services
        proto = db.FindFileContainingSymbol("harts.planner.v1.PlannerService")
        assert proto.name == "harts/planner/v1/planner.proto"
        assert [m.name for m in proto.service[0].method] == [
            "PlanStep",
            "PlanCalls",
            "PlanStepStream",
            "PlanCallsStream",
        ]


# ---------------------------------------------------------------------------------- bad requests
def _tree(parent, length, ends, ids=None):
    return pb.Trajectories(
        tree=pb.SegmentTree(
            parent=np.array(parent, "<i4").tobytes(),
            length=np.array(length, "<i4").tobytes(),
            trajectory_end=np.array(ends, "<i4").tobytes(),
        ),
        tree_ids=b"" if ids is None else np.array(ids, "<i8").tobytes(),
    )


def _packed(tokens, offsets):
    return pb.Trajectories(
        packed=pb.PackedTokens(
            tokens=np.array(tokens, "<i4").tobytes(), offsets=np.array(offsets, "<i8").tobytes()
        )
    )


GOOD = _tree([-1, 0, 0], [3, 2, 4], [1, 2])
INV, RES, PRE = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
)

BAD_STEP = [  # (case id, request, code, field, message fragment)
    ("no trajectories", pb.PlanStepRequest(dp_size=1, capacity=10), INV, "trajectories", "required"),
    (
        "misaligned tokens",
        pb.PlanStepRequest(
            trajectories=pb.Trajectories(
                packed=pb.PackedTokens(tokens=b"\x01\x00\x00", offsets=np.array([0, 1], "<i8").tobytes())
            ),
            dp_size=1,
            capacity=10,
        ),
        INV,
        "trajectories.packed.tokens",
        "3 bytes is not a whole number",
    ),
    (
        "empty trajectory",
        pb.PlanStepRequest(trajectories=_packed([1, 2, 3], [0, 1, 1, 3]), dp_size=1, capacity=10),
        INV,
        "trajectories.packed.offsets[2]",
        "trajectory 1 is empty",
    ),
    (
        "offsets not ending at S",
        pb.PlanStepRequest(trajectories=_packed([1, 2, 3], [0, 1, 2]), dp_size=1, capacity=10),
        INV,
        "trajectories.packed.offsets[2]",
        "len(tokens)",
    ),
    (
        "offsets not from 0",
        pb.PlanStepRequest(trajectories=_packed([1, 2, 3], [1, 3]), dp_size=1, capacity=10),
        INV,
        "trajectories.packed.offsets[0]",
        "must be 0",
    ),
    (
        "negative token",
        pb.PlanStepRequest(trajectories=_packed([1, -2, 3], [0, 3]), dp_size=1, capacity=10),
        INV,
        "trajectories.packed.tokens[1]",
        ">= 0",
    ),
    (
        "tree cycle",
        pb.PlanStepRequest(trajectories=_tree([-1, 2, 1], [1, 1, 1], [0]), dp_size=1, capacity=10),
        INV,
        "trajectories.tree.parent[1]",
        "cycle",
    ),
    (
        "dangling parent",
        pb.PlanStepRequest(trajectories=_tree([-1, 9], [1, 1], [1]), dp_size=1, capacity=10),
        INV,
        "trajectories.tree.parent[1]",
        "got 9",
    ),
    (
        "empty segment",
        pb.PlanStepRequest(trajectories=_tree([-1, 0], [1, 0], [1]), dp_size=1, capacity=10),
        INV,
        "trajectories.tree.length[1]",
        "at least one token",
    ),
    (
        "end out of range",
        pb.PlanStepRequest(trajectories=_tree([-1, 0], [1, 1], [5]), dp_size=1, capacity=10),
        INV,
        "trajectories.tree.trajectory_end[0]",
        "got 5",
    ),
    (
        "leaf without end",
        pb.PlanStepRequest(trajectories=_tree([-1, 0, 0], [1, 1, 1], [1]), dp_size=1, capacity=10),
        INV,
        "trajectories.tree.trajectory_end",
        "leaf segment 2",
    ),
    (
        "sizes differ",
        pb.PlanStepRequest(trajectories=_tree([-1, 0], [1], [1]), dp_size=1, capacity=10),
        INV,
        "trajectories.tree.length",
        "one entry per segment",
    ),
    (
        "negative tree id",
        pb.PlanStepRequest(trajectories=_tree([-1], [2], [0], ids=[-1]), dp_size=1, capacity=10),
        INV,
        "trajectories.tree_ids[0]",
        ">= 0",
    ),
    ("dp_size unset", pb.PlanStepRequest(trajectories=GOOD, capacity=10), INV, "dp_size", "required"),
    (
        "capacity negative",
        pb.PlanStepRequest(trajectories=GOOD, dp_size=1, capacity=-4),
        INV,
        "capacity",
        "got -4",
    ),
    (
        "chunk too large",
        pb.PlanStepRequest(trajectories=GOOD, dp_size=1, capacity=10, chunk_size=2**21),
        INV,
        "chunk_size",
        "[1, 1048576]",
    ),
    (
        "conv width",
        pb.PlanStepRequest(trajectories=GOOD, dp_size=1, capacity=10, conv_width=-1),
        INV,
        "conv_width",
        "",
    ),
    (
        "option out of range",
        pb.PlanStepRequest(
            trajectories=GOOD, dp_size=1, capacity=10, options=pb.StepOptions(max_sampled_k=1)
        ),
        INV,
        "options.max_sampled_k",
        ">= 2",
    ),
    (
        "unknown search mode",
        pb.PlanStepRequest(trajectories=GOOD, dp_size=1, capacity=10, options=pb.StepOptions(search=7)),
        INV,
        "options.search",
        "7",
    ),
    (
        "trajectory over capacity",
        pb.PlanStepRequest(trajectories=GOOD, dp_size=1, capacity=5),
        INV,
        "trajectories[1]",
        "capacity T = 5",
    ),
    (
        "too many replicas",
        pb.PlanStepRequest(trajectories=GOOD, dp_size=3, capacity=10),
        PRE,
        "dp_size",
        "N >= D",
    ),
    (
        "too many tokens",
        pb.PlanStepRequest(trajectories=_tree([-1, 0], [2**30, 2**30 - 2], [1, 1]), dp_size=1, capacity=10),
        RES,
        "trajectories.tree.trajectory_end[1]",
        "limit",
    ),
]


@pytest.mark.parametrize("case,request_,code,field,fragment", BAD_STEP, ids=[c[0] for c in BAD_STEP])
def test_bad_plan_step_requests(server, remote, case, request_, code, field, fragment):
    channel, call = _raw_channel(server)
    with channel, pytest.raises(grpc.RpcError) as e:
        call(request_.SerializeToString(), timeout=30)
    assert e.value.code() == code, e.value.details()
    assert e.value.details().startswith(field + ":") and fragment in e.value.details()
    from harts_planner.rpc.client import translate

    err = translate(e.value)  # the client maps status + detail back to the planner error and field
    assert err.field == field and isinstance(
        err, {INV: hp.InvalidArgumentError, RES: hp.ResourceLimitError, PRE: hp.InfeasibleError}[code]
    )
    assert remote.health() == "SERVING"  # the server keeps serving


def test_bad_plan_calls_requests(remote):
    tree = SegmentTree([-1, 0, 0], [3, 2, 4], [1, 2])
    with pytest.raises(
        hp.InvalidArgumentError, match=r"microbatch\[1\]: trajectory index 7 is out of range"
    ) as e:
        remote.plan_calls(tree, 4, [0, 7])
    assert e.value.field == "microbatch[1]"
    with pytest.raises(hp.InvalidArgumentError, match="appears more than once"):
        remote.plan_calls(tree, 4, [1, 1])
    with pytest.raises(hp.InvalidArgumentError, match="chunk_size: must be in"):
        remote.plan_calls(tree, 0)


def test_unparsable_bytes_are_invalid_argument(server):
    channel, call = _raw_channel(server)
    with channel, pytest.raises(grpc.RpcError) as e:
        call(b"\xff\xff\xff\xff\x0f", timeout=30)
    assert e.value.code() == INV and e.value.details().startswith(
        "request: not a valid harts.planner.v1.PlanStepRequest"
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64))
def test_fuzz_raw_request_bytes(server, data):
    """Arbitrary bytes on the wire get OK or a planner status code, never INTERNAL or UNKNOWN."""
    channel, call = _raw_channel(server)
    with channel:
        try:
            call(data, timeout=30)
        except grpc.RpcError as e:
            assert e.code() in (INV, RES, PRE), (e.code(), e.details())
            assert ":" in e.details()


# ---------------------------------------------------------------------------------- limits, deadlines
def test_over_limit_request_is_refused_and_server_keeps_serving():
    bounds = limits.Limits(max_request_bytes=200_000, max_response_bytes=64 << 10)
    with (
        create_server("127.0.0.1:0", workers=2, max_message_bytes=1 << 20, limits=bounds) as srv,
        Planner(srv.address, timeout=30) as p,
        Raw(srv.address) as raw,
    ):
        tokens = np.arange(100_000, dtype=np.int32)  # 400 KB of tokens > --max-request-mb
        with pytest.raises(hp.ResourceLimitError, match="request: the request is [0-9,]+ bytes") as e:
            p.plan_step((tokens, np.array([0, 100_000])), 1, 150_000)
        assert e.value.field == "request" and "--max-request-mb" in str(e.value)
        # A unary request over the message-size limit: refused by gRPC before it is parsed.
        big = np.arange(300_000, dtype=np.int32)
        code, _ = raw.code("PLAN_STEP", step_request(PackedTokens(big, [0, 300_000]), capacity=400_000))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The same step as a compacted tree is a few bytes; its call plans are not.
        tree = SegmentTree([-1], [40_000], [0])
        assert p.plan_step(tree, 1, 50_000).num_microbatches == 1
        with pytest.raises(
            hp.ResourceLimitError,
            match="include_call_plans: this request needs about [0-9,]+ response bytes, over the server.s limit of 65,536",
        ) as e:
            p.plan_step(tree, 1, 50_000, call_plans=True)
        assert e.value.field == "include_call_plans" and "--max-response-mb" in str(e.value)
        assert p.health() == "SERVING"


def test_the_client_falls_back_to_unary_methods_on_a_server_without_streams(small_batch):
    """A server of before the *Stream methods answers them UNIMPLEMENTED: the client plans through
    PlanStep / PlanCalls from then on, with the same plans."""
    from concurrent import futures

    from harts_planner.rpc import control
    from harts_planner.rpc.ledger import Budget
    from harts_planner.rpc.servicer import PlannerServicer

    pool = futures.ThreadPoolExecutor(8)
    servicer = PlannerServicer(
        Budget(2, limits.DEFAULT, limits.DEFAULT_MAX_MESSAGE_BYTES), control.Watchdog()
    )
    handlers = {k: v for k, v in servicer.handlers(pool).items() if not k.endswith("Stream")}
    old = grpc.server(pool)
    old.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(codec.SERVICE_NAME, handlers),))
    port = old.add_insecure_port("127.0.0.1:0")
    old.start()
    try:
        with Planner(f"127.0.0.1:{port}", timeout=30) as p:
            assert p._client.stream
            assert p.plan_step(small_batch, 1, 40000) == Planner().plan_step(small_batch, 1, 40000)
            assert not p._client.stream  # fell back
            assert p.plan_calls(small_batch, 16, [0, 1]) == Planner().plan_calls(small_batch, 16, [0, 1])
    finally:
        old.stop(None)
        servicer.watchdog.stop()
        servicer.planner_pool.shutdown()


def test_unary_responses_are_one_message_streams_carry_any_size():
    """A response larger than one message (--max-message-mb) is refused on the unary method before
    planning, naming the flag and the streamed method, and served whole by the *Stream method."""
    tree = SegmentTree([-1, 0, 0], [150_000, 2, 3], [1, 2])
    with create_server("127.0.0.1:0", workers=2, max_message_bytes=1 << 20) as srv, Raw(srv.address) as raw:
        code, details = raw.code("PLAN_CALLS", calls_request(tree))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert details.startswith("trajectories: this request needs about ") and "*Stream" in details
        with Planner(srv.address, timeout=60) as p:
            remote = p.plan_calls(tree, 64)
        local = Planner().plan_calls(tree, 64)
        assert remote == local and remote.compact_tokens == 150_005
        assert remote.server_stats["plan_seconds"] > 0


def test_deadline_is_honoured(remote, small_batch):
    # A request that cannot finish in 1 ms (a few million tokens to send, parse and ingest): a
    # tiny request on loopback can beat a sub-millisecond deadline, which made this test flaky.
    from harts_planner.bench import payload

    syn = synth.generate("medium", seed=0)
    big = RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids)
    with pytest.raises(SidecarTimeoutError):
        remote.plan_step(payload(big, "tokens"), 1, 2 * int(big.lengths.max()), timeout=1e-3)
    assert remote.plan_step(small_batch, 1, 40000).num_microbatches >= 1  # and it keeps serving


def test_unreachable_sidecar():
    with Planner("127.0.0.1:9", timeout=2) as p, pytest.raises(SidecarUnavailableError):
        p.plan_step(SegmentTree([-1], [2], [0]), 1, 4)


# ---------------------------------------------------------------------------------- concurrency
def test_sixteen_concurrent_clients_get_correct_plans(server):
    batches = []
    for seed in range(16):
        syn = synth.generate("tiny" if seed % 2 else "small", seed=seed)
        batches.append(RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids))
    expected = [
        Planner().plan_step(b, 1 + i % 2, int(b.lengths.max()) + 7 * i, call_plans=True)
        for i, b in enumerate(batches)
    ]
    results: list = [None] * 16
    barrier = threading.Barrier(16)

    def client(i: int) -> None:
        with Planner(server.address, timeout=60) as p:
            barrier.wait()
            b = batches[i]
            source = b.segment_tree() if i % 3 else PackedTokens(b.tokens, b.offsets, b.tree_ids)
            results[i] = [
                p.plan_step(source, 1 + i % 2, int(b.lengths.max()) + 7 * i, call_plans=True)
                for _ in range(3)
            ]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i in range(16):
        assert results[i] is not None and all(r == expected[i] for r in results[i]), i


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"target": ""}, "target"),
        ({"target": 5}, "target"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1.0}, "timeout"),
        ({"timeout": float("inf")}, "timeout"),
        ({"timeout": True}, "timeout"),
        ({"target": "127.0.0.1:9", "max_message_bytes": 2**31}, "max_message_bytes"),
        ({"target": "127.0.0.1:9", "max_message_bytes": 0}, "max_message_bytes"),
    ],
)
def test_planner_arguments_are_checked_where_given(kwargs, field):
    with pytest.raises(hp.InvalidArgumentError) as e:
        Planner(**kwargs)
    assert e.value.field == field
    with Planner("127.0.0.1:9") as p, pytest.raises(hp.InvalidArgumentError) as e:
        p.plan_step(SegmentTree([-1], [2], [0]), 1, 4, timeout=-2)
    assert e.value.field == "timeout"
