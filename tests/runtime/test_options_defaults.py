"""The runtime's defaults of the planner's settings (harts_runtime.options, read by the layers and
models without importing the planner) equal the planner's own."""

from __future__ import annotations

from harts_planner.call_plan import DEFAULT_CHUNK_SIZE as PLANNER_CHUNK_SIZE
from harts_planner.step_plan import DEFAULT_CAPACITY as PLANNER_CAPACITY
from harts_runtime import options


def test_the_runtime_defaults_are_the_planners():
    assert options.DEFAULT_CHUNK_SIZE == PLANNER_CHUNK_SIZE
    assert options.DEFAULT_CAPACITY == PLANNER_CAPACITY
