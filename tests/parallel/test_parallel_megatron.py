"""Optional: process groups from megatron-core's ``parallel_state`` (skipped without megatron-core).

megatron-core is the optional extra ``megatron``; CI does not install it. Checked by hand on CPU with
megatron-core 0.16.1 (the newest release installable on Python 3.11) and gloo.
"""

import pytest
import torch

from harts_runtime.parallel.launch import run_distributed

pytest.importorskip("megatron.core")


def _mcore_worker(rank, world, dims_kw):
    import torch.distributed as dist

    from harts_runtime.parallel import ParallelDims, megatron_groups

    dims = ParallelDims(world_size=world, **dims_kw)
    groups = megatron_groups(dims)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=groups.dp)
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    return {"ranks": groups.ranks, "dp_sum": float(t)}


@pytest.mark.slow  # 2 processes each
@pytest.mark.parametrize("dims_kw", [dict(dp=2), dict(tp=2), dict(dp=2, ep=2)], ids=["dp2", "tp2", "dp2-ep2"])
def test_megatron_parallel_state_groups_match_parallel_dims(dims_kw):
    out = run_distributed(_mcore_worker, 2, dims_kw, timeout=120)
    for rank, r in enumerate(out):
        want_ranks = {"dp": [0, 1], "tp": [rank], "ep": [0, 1], "edp": [rank]} if "ep" in dims_kw else None
        if want_ranks:
            assert r["ranks"] == want_ranks
        assert r["dp_sum"] == (3.0 if dims_kw.get("dp", 1) == 2 else float(rank + 1))
