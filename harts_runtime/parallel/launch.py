"""Run a function on N local processes with a gloo (or NCCL) process group: tests and small jobs.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` fresh interpreters (the ``spawn``
start method, so no forked torch state), initialises ``torch.distributed`` on a free localhost port,
calls ``fn(rank, world_size, *args)`` on each, and returns the per-rank return values (anything
``torch.save`` can store). A rank that raises, exits, or runs past ``timeout`` fails the whole call
with its traceback; survivors are terminated, so a broken collective never hangs a test.

Each rank's result comes back through a file in a private temporary folder, signed with a key
the parent hands to its children in memory (HMAC-SHA256): a file the parent did not get from its
own rank is refused before it is read, and a result of tensors and plain values is read with
``torch.load(weights_only=True)`` (others, e.g. a dataclass, only once the signature holds).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import io
import os
import pickle
import secrets
import socket
import tempfile
import time
import traceback
import warnings

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


def _sign(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def _write_result(path: str, key: bytes, record: dict) -> None:
    buf = io.BytesIO()
    torch.save(record, buf)
    data = buf.getvalue()
    with open(path + ".tmp", "wb") as f:  # renamed whole: a rank killed mid-write leaves no result
        f.write(data + _sign(key, data))
    os.replace(path + ".tmp", path)


def _read_result(path: str, key: bytes) -> dict:
    with open(path, "rb") as f:
        raw = f.read()
    data, mac = raw[:-32], raw[-32:]
    if len(raw) < 32 or not hmac.compare_digest(mac, _sign(key, data)):
        return {
            "ok": False,
            "error": f"{path}: not the result this rank wrote (its signature differs); not read",
        }
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError:  # a result holding other objects: signed by our own rank
        return torch.load(io.BytesIO(data), weights_only=False)


def _worker(rank, world_size, port, backend, out_dir, fn, args, threads, key=b""):
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
            # written before the teardown: a crash inside gloo's teardown (seen once, SIGSEGV, on a
            # loaded 2-core machine) then costs a warning, not the finished result
            _write_result(path, key, {"ok": True, "result": result})
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        if os.path.exists(path):  # the teardown failed after the result: said, the result kept
            traceback.print_exc()
        else:
            _write_result(path, key, {"ok": False, "error": traceback.format_exc()})


def run_distributed(
    fn, world_size: int, *args, backend: str = "gloo", timeout: float = 120.0, threads: int = 1
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results by rank.

    ``fn`` must be importable by name (a module-level function). Raises :class:`DistributedRunError`
    with the first failing rank's traceback, or on timeout.
    """
    ctx = mp.get_context("spawn")
    key = secrets.token_bytes(32)  # to the children through spawn's pipe, never on disk
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, backend, out_dir, fn, args, threads, key),
                daemon=True,
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
                rec = _read_result(path, key)
                if rec["ok"] and procs[r].exitcode:
                    warnings.warn(
                        f"rank {r} exited with code {procs[r].exitcode} after writing its result "
                        "(in the process group's teardown); the result is kept",
                        RuntimeWarning,
                        stacklevel=2,
                    )
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
