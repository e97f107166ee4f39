"""Field bombs (issue 38, item 1): requests whose parse would cost far more than their bytes.

The issue: the request walker built one Python tuple per top-level field (about 62 bytes of memory
per request byte, 0.6 s of GIL per MiB): a legal 64 MiB streamed request (a 9-token tree and
``chunk_size`` repeated) peaked at 4.1 GB, 100 MiB of zero bytes held 6.4 GB. Now the walk stops at
``wire.MAX_FIELDS`` fields per message level (refused naming the repeated field), bytes that are not
protobuf are refused at their first field, unknown fields are skipped, and the memory of any parse
is counted before it is spent.
"""

from __future__ import annotations

import os
import resource
import time

import grpc
import pytest
from google.protobuf.message import DecodeError
from sidecar_fixtures import TREE, Raw, calls_request, memory, step_request

from harts_planner.errors import InvalidArgumentError
from harts_planner.rpc import codec, wire
from harts_planner.rpc import planner_pb2 as pb
from harts_planner.rpc.server import SidecarProcess

MiB = 1 << 20
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _repeated(base: bytes, number: int, size: int) -> bytes:
    """``base`` followed by varint field ``number`` (value 64) repeated up to ``size`` bytes."""
    one = codec.varint(number << 3) + codec.varint(64)
    return base + one * ((size - len(base)) // len(one))


def test_a_repeated_field_is_refused_naming_it_before_anything_is_built():
    bomb = _repeated(calls_request(TREE), 3, 8 * MiB)  # chunk_size, 4 million times
    reserved = []
    t0 = time.perf_counter()
    with pytest.raises(InvalidArgumentError) as e:
        wire.read_request(bomb, pb.PlanCallsRequest, reserved.append)
    assert time.perf_counter() - t0 < 0.05
    assert e.value.field == "chunk_size" and f"limit of {wire.MAX_FIELDS}" in str(e.value)
    assert reserved == []


def test_a_repeated_field_inside_the_trajectories_is_refused_naming_it():
    traj = codec.header(3, 0) * 200  # tree_ids, 200 times
    bomb = codec.header(1, len(traj)) + traj
    with pytest.raises(InvalidArgumentError) as e:
        wire.read_request(bomb, pb.PlanCallsRequest)
    assert e.value.field == "trajectories.tree_ids"


def test_zero_bytes_are_not_protobuf_at_the_first_byte():
    t0 = time.perf_counter()
    with pytest.raises(DecodeError):
        wire.read_request(bytes(64 * MiB), pb.PlanStepRequest, lambda n: pytest.fail("reserved"))
    assert time.perf_counter() - t0 < 0.05


def test_unknown_fields_are_skipped_and_cost_nothing():
    data = calls_request(TREE) + codec.header(99, 4 * MiB) + bytes(4 * MiB)
    reserved = []
    head, which, arrays = wire.read_request(data, pb.PlanCallsRequest, reserved.append)
    assert which == "tree" and reserved == [] and head.ByteSize() < 100  # field 99 not kept


def test_the_usual_parse_is_counted_before_it_is_spent():
    """Bytes the fast reader does not handle (a field twice inside the trajectories: protobuf's
    merge rules) are parsed by protobuf, after ``PARSE_COPIES`` times the request was reserved."""
    msg = pb.PlanCallsRequest.FromString(calls_request(TREE))
    data = msg.SerializeToString() + codec.header(1, 2) + codec.header(3, 0)  # tree_ids again
    reserved = []
    head, which, arrays = wire.read_request(data, pb.PlanCallsRequest, reserved.append)
    assert which == "tree" and reserved == [wire.PARSE_COPIES * len(data)]

    def refuse(size):
        raise RuntimeError(f"no room for {size}")

    with pytest.raises(RuntimeError, match="no room"):
        wire.read_request(data, pb.PlanCallsRequest, refuse)


def test_options_over_their_bound_are_refused_naming_them():
    options = _repeated(b"", 1, 64 << 10)  # exact_threshold, 21,845 times
    data = step_request() + codec.header(5, len(options)) + options
    with pytest.raises(InvalidArgumentError) as e:
        wire.read_request(data, pb.PlanStepRequest)
    assert e.value.field == "options" and f"{wire.MAX_OPTION_BYTES:,}" in str(e.value)


def test_a_chunk_of_repeated_fields_is_refused():
    with pytest.raises(InvalidArgumentError):
        wire.read_chunk(codec.varint(2 << 3) + codec.varint(5) * 1000)


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.parametrize(
    "kind",
    ["legal-stream", "zeros-stream", "legal-unary", "step-options"],
)
def test_field_bombs_against_a_server(tmp_path, kind):
    """A 64 MiB streamed request of a 9-token tree and ``chunk_size`` repeated, 64 MiB of zero bytes
    streamed, an 8 MiB unary one, a step request whose options repeat a field: each refused
    INVALID_ARGUMENT naming the field, the server's peak within the request's bytes and their
    receive copies, and a tiny request answered after."""
    with (
        SidecarProcess(
            workers=2,
            preexec_fn=_limit_address_space,
            env={**os.environ, "MALLOC_ARENA_MAX": "2"},
            log_path=str(tmp_path / "serve.log"),
        ) as sidecar,
        Raw(sidecar.address) as raw,
    ):
        idle = memory(sidecar.pid)["VmHWM"]
        if kind == "legal-stream":
            method, data, field = (
                "PLAN_CALLS_STREAM",
                _repeated(calls_request(TREE), 3, 64 * MiB),
                "chunk_size",
            )
        elif kind == "zeros-stream":
            method, data, field = "PLAN_CALLS_STREAM", bytes(64 * MiB), "request"
        elif kind == "legal-unary":
            method, data, field = "PLAN_CALLS", _repeated(calls_request(TREE), 4, 8 * MiB - 64), "conv_width"
        else:
            options = _repeated(b"", 1, 1 * MiB)  # exact_threshold
            data = step_request() + codec.header(5, len(options)) + options
            method, field = "PLAN_STEP", "options"
        code, details = raw.code(method, data, timeout=60)
        assert code == INVALID, (code, details)
        assert details.startswith(f"{field}:"), details
        peak = memory(sidecar.pid)["VmHWM"] - idle
        assert peak < 3 * len(data) + 64 * MiB, peak
        assert raw.code("PLAN_CALLS", calls_request(TREE), timeout=10)[0] == grpc.StatusCode.OK
