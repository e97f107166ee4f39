"""Context parallelism through the sidecar (issue 35): ``StepOptions.cp_size`` plans exactly as in
process, the admission check refuses a trajectory longer than C x T before planning, and a CP plan's
microbatches split the same from the client's batch."""

from __future__ import annotations

import pytest

import harts_planner as hp
from harts_planner import Planner, RolloutBatch
from harts_planner.rpc.server import create_server


@pytest.fixture(scope="module")
def remote():
    srv = create_server("127.0.0.1:0", workers=2)
    with Planner(srv.address, timeout=60) as p:
        yield p
    srv.stop(grace=None)


def test_cp_step_plans_equal_in_process(remote):
    batch = RolloutBatch.from_token_lists(
        [list(range(1, 90)), list(range(1, 40)) + [500, 501], [7, 8, 9], list(range(1, 60))]
    )
    local = Planner().plan_step(batch, 1, 32, 16, cp_size=3)
    got = remote.plan_step(batch, 1, 32, 16, cp_size=3)
    assert got == local and got.cp_size == 3 and got.capacity == 32 and (got.work <= 96).all()
    assert remote.plan_step(batch, 1, 96, 16) != got  # capacity T, not C x T, travels as capacity
    for m, members in enumerate(got.microbatches):
        assert hp.plan_cp(batch, members, 3, 16) == local.cp_split(m)
    with pytest.raises(hp.InvalidArgumentError) as e:
        remote.plan_step(batch, 1, 32, 16, cp_size=2)
    assert e.value.field == "trajectories[0]" and "C x T = 2 x 32 = 64" in str(e.value)
    with pytest.raises(hp.InvalidArgumentError) as e:
        remote.plan_step(batch, 1, 32, 16, cp_size=0)
    assert e.value.field == "options.cp_size" and "must be in [1, 1024], got 0" in str(e.value)
