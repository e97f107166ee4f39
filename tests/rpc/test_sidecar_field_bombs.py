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
import numpy as np
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


def _field(number: int, data: bytes) -> bytes:
    return codec.header(number, len(data)) + data


def _packed_request(tokens: bytes, offsets: bytes, *more_tokens: bytes) -> bytes:
    """A PlanCallsRequest of packed tokens; ``more_tokens``: the tokens field sent again."""
    packed = _field(1, tokens) + b"".join(_field(1, t) for t in more_tokens) + _field(2, offsets)
    traj = codec.header(1, len(packed)) + packed
    return codec.header(1, len(traj)) + traj + codec.varint(3 << 3) + codec.varint(64)  # chunk_size


TOKENS = np.arange(9, dtype="<i4").tobytes()
OFFSETS = np.array([0, 4, 9], dtype="<i8").tobytes()


def _with_tree_ids_twice() -> bytes:
    msg = pb.PlanCallsRequest.FromString(calls_request(TREE))
    ids = np.array([0, 1], dtype="<i8").tobytes()
    traj = (
        msg.trajectories.SerializeToString()
        + codec.header(3, len(ids))
        + ids
        + codec.header(3, len(ids))
        + ids
    )
    return codec.header(1, len(traj)) + traj


def _both_sources() -> bytes:
    msg = pb.PlanCallsRequest.FromString(calls_request(TREE))
    packed = codec.header(1, len(TOKENS)) + TOKENS + codec.header(2, len(OFFSETS)) + OFFSETS
    traj = msg.trajectories.SerializeToString() + codec.header(1, len(packed)) + packed
    return codec.header(1, len(traj)) + traj


@pytest.mark.parametrize(
    "make, field",
    [
        # an array of the packed tokens twice (protobuf: the last wins)
        (
            lambda: _packed_request(TOKENS, OFFSETS, TOKENS),
            "trajectories.packed.tokens",
        ),
        # tree_ids twice inside the trajectories
        (
            _with_tree_ids_twice,
            "trajectories.tree_ids",
        ),
        # the whole trajectories field twice (protobuf: merged)
        (lambda: _packed_request(TOKENS, OFFSETS) + calls_request(TREE), "trajectories"),
        # both oneof members
        (_both_sources, "trajectories"),
    ],
)
def test_a_field_sent_twice_is_refused_naming_it_before_any_parse(make, field):
    data = make()
    assert pb.PlanCallsRequest.FromString(data)  # valid protobuf: a parser would merge the copies
    reserved = []
    with pytest.raises(InvalidArgumentError) as e:
        wire.read_request(data, pb.PlanCallsRequest, reserved.append)
    assert e.value.field == field, e.value
    assert reserved == []


def test_a_large_repeated_field_is_refused_at_wire_speed():
    """The issue's bypass, scaled: one 256 KiB token array sent 63 times (within MAX_FIELDS) went
    to protobuf's parser; now refused in the walk, nothing reserved."""
    one = bytes(256 << 10)
    data = _packed_request(one, OFFSETS, *[one] * (wire.MAX_FIELDS - 2))
    t0 = time.perf_counter()
    with pytest.raises(InvalidArgumentError) as e:
        wire.read_request(data, pb.PlanCallsRequest, lambda n: pytest.fail("reserved"))
    assert time.perf_counter() - t0 < 0.05
    assert e.value.field == "trajectories.packed.tokens"


def test_unknown_fields_inside_the_trajectories_are_skipped_like_protobuf():
    """Fields the server does not know, at every level of the trajectories, are skipped: the
    arrays read equal protobuf's parse of the same bytes, and nothing is copied."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        extra = [codec.varint(n << 3) + codec.varint(int(rng.integers(0, 1 << 20))) for n in (7, 9, 15)]
        extra.append(codec.header(12, 5) + b"abcde")

        def pick(extra=extra) -> bytes:
            return b"".join(extra[i] for i in rng.permutation(len(extra))[: rng.integers(0, 4)])

        packed = (
            pick() + codec.header(1, len(TOKENS)) + TOKENS + pick() + codec.header(2, len(OFFSETS)) + OFFSETS
        )
        traj = pick() + codec.header(1, len(packed)) + packed + pick()
        data = codec.header(1, len(traj)) + traj + pick()
        ref = pb.PlanCallsRequest.FromString(data)
        head, which, arrays = wire.read_request(data, pb.PlanCallsRequest, lambda n: None)
        assert which == "packed" == ref.trajectories.WhichOneof("source")
        assert bytes(arrays["tokens"]) == ref.trajectories.packed.tokens
        assert bytes(arrays["offsets"]) == ref.trajectories.packed.offsets


def test_a_message_cut_inside_a_field_is_not_protobuf():
    data = calls_request(TREE)
    with pytest.raises(DecodeError):
        wire.read_request(data[:-3] + codec.header(1, 100), pb.PlanCallsRequest)


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
    ["legal-stream", "zeros-stream", "legal-unary", "step-options", "repeated-array-stream"],
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
        elif kind == "repeated-array-stream":  # issue 47: under MAX_FIELDS, once sent to protobuf's parser
            one = bytes(1 * MiB)
            method, data = "PLAN_CALLS_STREAM", _packed_request(one, OFFSETS, *[one] * 62)
            field = "trajectories.packed.tokens"
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
