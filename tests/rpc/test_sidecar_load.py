"""A sidecar under load (issue 17): 16 clients for 20 s against a real ``harts-planner serve`` on
127.0.0.1 (two planner threads), each cycling through valid step plans (tree and tokens, with call
plans), valid microbatch call plans, invalid requests, oversized requests (refused by the cost
limits) and requests it cancels or gives a tiny deadline. Checks: every plan equals the in-process
plan; every status code is the expected one (never INTERNAL or UNKNOWN); the server's log agrees;
the server's peak memory stays bounded; invalid requests are answered without waiting behind the
plans (generous latency bounds); the server drains and exits 0 afterwards."""

from __future__ import annotations

import json
import threading
import time

import grpc
import numpy as np
import pytest
from sidecar_fixtures import Raw, memory

from harts_planner import PackedTokens, Planner, RolloutBatch, SegmentTree, synth
from harts_planner.rpc import codec
from harts_planner.rpc import planner_pb2 as pb
from harts_planner.rpc.server import SidecarProcess

CLIENTS, SECONDS = 16, 20.0
OK, INV, RES = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
CANCELLED, DEADLINE = grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED
KINDS = ("step", "calls", "invalid", "oversized", "cancelled", "busy")
SERVE_ARGS = ["--max-response-mb", "4", "--max-message-mb", "16"]  # the 13 MB unary "cancelled" requests


def _batch(preset: str, seed: int) -> RolloutBatch:
    syn = synth.generate(preset, seed=seed)
    return RolloutBatch.from_arrays(syn.tokens, syn.offsets, syn.tree_ids)


def _canonical(response: bytes, cls) -> bytes:
    """A response without its timings (stats, planning seconds), as deterministic bytes."""
    msg = cls.FromString(response)
    msg.ClearField("stats")
    if cls is pb.PlanStepResponse:
        msg.plan.planning_seconds = 0
        msg.plan.ClearField("phase_seconds")
    return msg.SerializeToString(deterministic=True)


def _expected_step(batch, source, dp, cap, call_plans) -> tuple[bytes, bytes]:
    plan = Planner().plan_step(batch, dp, cap, 64, call_plans=call_plans)
    response = pb.PlanStepResponse(plan=codec.encode_step_plan(plan))
    if call_plans:
        response.call_plans.extend(codec.encode_call_plan(c) for c in plan.call_plans())
    request = codec.plan_step_request(source, dp, cap, 64, {}, call_plans, 4).SerializeToString()
    return request, _canonical(response.SerializeToString(), pb.PlanStepResponse)


@pytest.fixture(scope="module")
def workload():
    small = [_batch("small", s) for s in range(3)]
    tiny = [_batch("tiny", s) for s in range(4)]
    medium = _batch("medium", 0)
    steps = []
    for i, b in enumerate(small + tiny):
        source = b.segment_tree() if i % 2 else PackedTokens(b.tokens, b.offsets, b.tree_ids)
        cap = int(b.lengths.max()) + 1000 * i
        steps.append(_expected_step(b, source, 1 + i % 2, cap, call_plans=i % 3 != 2))
    calls = []
    for i, b in enumerate(small):
        mb = Planner().plan_step(b, 2, int(b.lengths.max()) + 500).microbatches[i % 2]
        plan = Planner().plan_calls(b, 32, mb, conv_width=3)
        request = codec.plan_calls_request(b.segment_tree(), mb, 32, 3).SerializeToString()
        expected = _canonical(
            pb.PlanCallsResponse(plan=codec.encode_call_plan(plan)).SerializeToString(), pb.PlanCallsResponse
        )
        calls.append((request, expected))
    tree = SegmentTree([-1, 0, 0], [3, 2, 4], [1, 2])
    invalid = [
        ("PLAN_STEP", pb.PlanStepRequest(trajectories=codec.encode_trajectories(tree), capacity=10)),
        (
            "PLAN_STEP",
            codec.plan_step_request(SegmentTree([-1, 2, 1], [1, 1, 1], [0]), 1, 10, 64, {}, False, 4),
        ),
        ("PLAN_STEP", codec.plan_step_request(PackedTokens([1, -2, 3], [0, 3]), 1, 10, 64, {}, False, 4)),
        ("PLAN_STEP", codec.plan_step_request(tree, 1, 5, 64, {}, False, 4)),  # a trajectory over T
        ("PLAN_CALLS", codec.plan_calls_request(tree, [0, 7], 4, 4)),
        ("PLAN_CALLS", codec.plan_calls_request(tree, [1, 1], 4, 4)),
    ]
    invalid = [(m, r.SerializeToString()) for m, r in invalid] + [("PLAN_STEP", b"\xff\xff\xff\xff\x0f")]
    oversized = [  # over --max-response-mb 4: refused at admission
        ("PLAN_CALLS", codec.plan_calls_request(medium.segment_tree(), None, 64, 4).SerializeToString()),
        (
            "PLAN_STEP",
            codec.plan_step_request(medium.segment_tree(), 1, 65536, 64, {}, True, 4).SerializeToString(),
        ),
        (
            "PLAN_CALLS",
            codec.plan_calls_request(SegmentTree([-1], [2**31 - 1], [0]), None, 64, 4).SerializeToString(),
        ),
    ]
    busy = codec.plan_step_request(
        PackedTokens(medium.tokens, medium.offsets, medium.tree_ids), 2, 65536, 64, {}, False, 4
    ).SerializeToString()
    busy_expected = _expected_step(medium, medium.segment_tree(), 2, 65536, False)[1]
    return {
        "steps": steps,
        "calls": calls,
        "invalid": invalid,
        "oversized": oversized,
        "busy": (busy, busy_expected),
    }


def run_load(sidecar: SidecarProcess, workload: dict, clients: int = CLIENTS, seconds: float = SECONDS):
    """``clients`` threads cycling through :data:`KINDS` for ``seconds``; returns the rows
    (kind, status code, seconds, plan correct) and the server's peak memory (bytes)."""
    results: list[tuple[str, grpc.StatusCode, float, bool]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    stop_at = time.monotonic() + seconds

    def client(i: int) -> None:
        rng = np.random.default_rng(i)
        with Raw(sidecar.address) as raw:
            n = 0
            while time.monotonic() < stop_at:
                kind = KINDS[(i + n) % len(KINDS)]
                n += 1
                correct = True
                t0 = time.perf_counter()
                if kind == "step":
                    request, expected = workload["steps"][int(rng.integers(len(workload["steps"])))]
                    code, response = _call(raw, "PLAN_STEP", request)
                    correct = code != OK or _canonical(response, pb.PlanStepResponse) == expected
                elif kind == "calls":
                    request, expected = workload["calls"][int(rng.integers(len(workload["calls"])))]
                    code, response = _call(raw, "PLAN_CALLS", request)
                    correct = code != OK or _canonical(response, pb.PlanCallsResponse) == expected
                elif kind == "busy":  # in chunks, through the streamed method
                    request, expected = workload["busy"]
                    code, response = _call(raw, "PLAN_STEP_STREAM", request)
                    correct = code != OK or _canonical(response, pb.PlanStepResponse) == expected
                elif kind == "cancelled":
                    request, _ = workload["busy"]
                    if n % 2:
                        future = raw.future("PLAN_STEP", request, timeout=60)
                        time.sleep(float(rng.uniform(0, 0.05)))
                        future.cancel()
                        code = _future_code(future)
                    else:
                        code, _ = _call(raw, "PLAN_STEP", request, timeout=float(rng.uniform(0.001, 0.05)))
                else:
                    method, request = workload[kind][int(rng.integers(len(workload[kind])))]
                    code, _ = _call(raw, method, request)
                with lock:
                    results.append((kind, code, time.perf_counter() - t0, correct))

    def run(i: int) -> None:
        try:
            client(i)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    assert not errors, errors[0]
    return results, memory(sidecar.pid)["VmHWM"]


def test_sixteen_clients_mixed_requests_for_twenty_seconds(workload, tmp_path):
    log = tmp_path / "serve.log"
    sidecar = SidecarProcess(workers=2, log_path=str(log), extra_args=SERVE_ARGS)
    try:
        results, peak = run_load(sidecar, workload)
        with Planner(sidecar.address, timeout=30) as p:
            assert p.health() == "SERVING"
    finally:
        code = sidecar.terminate(60)
    assert code == 0

    by_kind = {k: [r for r in results if r[0] == k] for k in KINDS}
    expected_codes = {
        "step": {OK},
        "calls": {OK},
        "busy": {OK},
        "invalid": {INV},
        "oversized": {RES},
        "cancelled": {OK, CANCELLED, DEADLINE},
    }
    for kind, rows in by_kind.items():
        assert rows, kind
        codes = {r[1] for r in rows}
        assert codes <= expected_codes[kind], (kind, codes)
        assert all(r[3] for r in rows), kind  # every plan equal to the in-process one
    assert peak < 1 << 30, peak  # bounded: no request built more than its estimate allows

    # Invalid requests are answered at admission, not behind the plans: generous bounds.
    latency = np.array([r[2] for r in by_kind["invalid"]])
    assert np.percentile(latency, 50) < 0.25 and np.percentile(latency, 99) < 2.0, np.percentile(
        latency, [50, 99]
    )

    # The server's log says what the clients saw.
    rpcs = [json.loads(line) for line in log.read_text().splitlines() if '"event": "rpc"' in line]
    logged = {
        c: sum(r["code"] == c for r in rpcs)
        for c in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "INTERNAL", "UNKNOWN")
    }
    assert logged["INTERNAL"] == logged["UNKNOWN"] == 0
    assert logged["INVALID_ARGUMENT"] == len(by_kind["invalid"])
    assert logged["RESOURCE_EXHAUSTED"] == len(by_kind["oversized"])
    client_cancelled = sum(r[1] in (CANCELLED, DEADLINE) for r in by_kind["cancelled"])
    server_cancelled = sum(r["code"] in ("CANCELLED", "DEADLINE_EXCEEDED") for r in rpcs)
    assert server_cancelled <= client_cancelled  # one that never reached a handler is not logged
    assert not any(r["code"] == "OK" and r.get("method") == "PlanStep" and r.get("error") for r in rpcs)


def _call(raw: Raw, method: str, request: bytes, timeout: float = 120.0):
    try:
        return OK, raw.call(method, request, timeout)
    except grpc.RpcError as e:
        return e.code(), None


def _future_code(future) -> grpc.StatusCode:
    try:
        future.result(timeout=120)
    except grpc.FutureCancelledError:
        return CANCELLED
    except grpc.RpcError as e:
        return e.code()
    return OK
