"""``run_distributed``'s reporting: a rank's own error is raised naming the rank, a rank that dies
before its result is named with its exit code, and a rank that crashes in the process group's
teardown after writing its result (gloo did so once, SIGSEGV, on a loaded 2-core machine) costs a
warning naming the rank and the code, not the result."""

from __future__ import annotations

import os
import signal

import pytest

from harts_runtime.parallel.launch import DistributedRunError, run_distributed

pytestmark = pytest.mark.slow


def _sum_then(rank, world, how):
    import multiprocessing.util

    import torch
    import torch.distributed as dist

    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    if rank == 1 and how == "raise":
        raise ValueError("rank one's own error")
    if rank == 1 and how == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1 and how == "teardown":  # runs when the worker exits, after the result is written
        multiprocessing.util.Finalize(None, os.kill, args=(os.getpid(), signal.SIGSEGV), exitpriority=0)
    return float(x.item())


def test_a_ranks_own_error_names_the_rank():
    with pytest.raises(DistributedRunError, match=r"(?s)rank 1 failed.*ValueError: rank one's own error"):
        run_distributed(_sum_then, 2, "raise", timeout=120)


def test_a_rank_that_dies_before_its_result_is_named_with_its_code():
    with pytest.raises(DistributedRunError, match=r"(?s)rank 1 failed.*exited with code -9 and no result"):
        run_distributed(_sum_then, 2, "die", timeout=120)


def test_a_crash_in_teardown_after_the_result_keeps_the_result():
    with pytest.warns(RuntimeWarning, match=r"rank 1 exited with code -11 after writing its result"):
        assert run_distributed(_sum_then, 2, "teardown", timeout=120) == [3.0, 3.0]
