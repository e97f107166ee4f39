"""Checkpoints nothing can lose under 2 gloo processes (issue 38): the staged save is collective
(every rank checksums a share, rank 0 renames after a barrier), a full disk on one rank is the
same one-line ``InvalidInputError`` naming that rank's file on every rank and leaves the previous
checkpoint in place, and a bit flipped in rank 1's shard is caught on every rank by the manifest's
SHA-256 before anything is loaded. The one-process cases: ``tests/runtime/engine/test_checkpoint_safety.py``."""

from __future__ import annotations

import os

import pytest

from harts_runtime.parallel.launch import run_distributed

pytest.importorskip("harts_planner")


def _worker(rank, world, path):
    import resource
    import signal

    import torch

    from harts_runtime import InvalidInputError, model_config
    from harts_runtime.engine import EngineConfig, HartsEngine
    from harts_runtime.parallel import ParallelDims

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dims = ParallelDims(dp_shard=world, world_size=world)
    engine = HartsEngine.build(model_config("debug", dtype="float32"), EngineConfig(capacity=30), dims)
    engine.save(path)

    def full(v):  # a DTensor parameter's whole tensor; buffers are plain
        return v.full_tensor() if hasattr(v, "full_tensor") else v

    want = {k: full(v).clone() for k, v in engine.model.state_dict().items()}
    out = {"names": sorted(os.listdir(path))}
    if rank == 1:  # writes past 50 kB fail on rank 1 only
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, resource.RLIM_INFINITY))
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(1.0)
    try:
        engine.save(path)
        out["full"] = "saved"
    except InvalidInputError as e:
        out["full"] = str(e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    out["leftovers"] = sorted(n for n in os.listdir(os.path.dirname(path)) if n.startswith("."))
    engine.load(path)
    out["old_kept"] = all(torch.equal(full(v), want[k]) for k, v in engine.model.state_dict().items())
    torch.distributed.barrier()
    if rank == 0:
        shard = os.path.join(path, "__1_0.distcp")
        data = bytearray(open(shard, "rb").read())
        data[len(data) // 2] ^= 0x01
        open(shard, "wb").write(bytes(data))
    torch.distributed.barrier()
    try:
        engine.load(path)
        out["flip"] = "loaded"
    except InvalidInputError as e:
        out["flip"] = f"{e.field}: {e}"
    return out


@pytest.mark.slow
def test_a_full_disk_on_one_rank_and_a_flipped_bit_are_one_line_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    a, b = run_distributed(_worker, 2, path, timeout=300)
    assert {"__0_0.distcp", "__1_0.distcp", "rng-0.pt", "rng-1.pt", "manifest.json"} <= set(a["names"])
    assert a["full"] == b["full"], (a["full"], b["full"])
    assert a["full"].startswith("__1_0.distcp: the file-size limit was reached"), a["full"]
    assert a["leftovers"] == [] and a["old_kept"] and b["old_kept"]
    assert a["flip"] == b["flip"] and a["flip"].startswith("__1_0.distcp: "), a["flip"]
    assert "SHA-256" in a["flip"]
