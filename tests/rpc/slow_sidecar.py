"""``python slow_sidecar.py serve ...``: ``harts-planner serve`` whose PlanStep requests of capacity
:data:`SLOW_CAPACITY` take ``HARTS_TEST_SLOW_SECONDS`` (default 15) before the real plan, polling the
request's cancel token every 5 ms as the planner's loops do (``HARTS_TEST_SLOW_POLLS=0``: never).
On entering such a plan it prints ``slow plan started`` to stderr (the log). A test stand-in for a
long plan that does not depend on how fast the planner is."""

from __future__ import annotations

import os
import sys
import time

from harts_planner.rpc import control, servicer

SLOW_CAPACITY = 8888
SECONDS = float(os.environ.get("HARTS_TEST_SLOW_SECONDS", "15"))
POLLS = os.environ.get("HARTS_TEST_SLOW_POLLS", "1") != "0"
control.CANCEL_WAIT_SECONDS = float(os.environ.get("HARTS_TEST_CANCEL_WAIT", control.CANCEL_WAIT_SECONDS))
_real = servicer.plan_step


def plan_step(batch, dp_size, capacity, chunk_size=64, cancel=None, **options):
    if capacity == SLOW_CAPACITY:
        print("slow plan started", file=sys.stderr, flush=True)
        end = time.monotonic() + SECONDS
        while time.monotonic() < end:
            if POLLS and cancel is not None and cancel.cancel_requested:
                sys.path.insert(0, os.path.dirname(__file__))
                from sidecar_fixtures import cancelled_error

                raise cancelled_error(cancel)
            time.sleep(0.005)
        capacity = 100
    return _real(batch, dp_size, capacity, chunk_size, **options)


servicer.plan_step = plan_step

if __name__ == "__main__":
    from harts_planner.cli import main

    sys.exit(main(sys.argv[1:]))
