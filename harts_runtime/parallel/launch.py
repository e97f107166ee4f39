"""Run a function on N local processes with a gloo (or NCCL) process group: tests and small jobs.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` fresh interpreters (the ``spawn``
start method, so no forked torch state), initialises ``torch.distributed`` on a free localhost port,
calls ``fn(rank, world_size, *args)`` on each, and returns the per-rank return values (anything
``torch.save`` can store). A rank that raises, exits, or runs past ``timeout`` fails the whole call
with its traceback; survivors are terminated, so a broken collective never hangs a test.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistributedRunError", "free_port", "run_distributed"]


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


class DistributedRunError(RuntimeError):
    """A rank of :func:`run_distributed` failed or timed out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, backend, out_dir, fn, args, threads):
    torch.set_num_threads(threads)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, path)


def run_distributed(
    fn, world_size: int, *args, backend: str = "gloo", timeout: float = 120.0, threads: int = 1
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results by rank.

    ``fn`` must be importable by name (a module-level function). Raises :class:`DistributedRunError`
    with the first failing rank's traceback, or on timeout.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, port, backend, out_dir, fn, args, threads), daemon=True
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            if any(p.is_alive() for p in procs):
                raise DistributedRunError(
                    f"timeout after {timeout:.0f} s; ranks still running: "
                    f"{[r for r, p in enumerate(procs) if p.is_alive()]}"
                )
            results, failures = [], []
            for r in range(world_size):
                path = os.path.join(out_dir, f"rank{r}.pt")
                if not os.path.exists(path):
                    failures.append((r, f"exited with code {procs[r].exitcode} and no result"))
                    continue
                rec = torch.load(path, weights_only=False)
                if rec["ok"]:
                    results.append(rec["result"])
                else:
                    failures.append((r, rec["error"]))
            if failures:
                # a rank's own error first: its peers then fail with "Connection closed by peer"
                failures.sort(key=lambda f: any(s in f[1] for s in _PEER_LOST))
                r, error = failures[0]
                others = ", ".join(str(f[0]) for f in failures[1:])
                raise DistributedRunError(
                    f"rank {r} failed" + (f" (ranks {others} failed too)" if others else "") + f":\n{error}"
                )
            return results
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
