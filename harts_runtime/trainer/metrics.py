"""A job's outputs per step, for both commands (:class:`MetricsWriter`): a JSON-lines file (one
object per step; a resumed run drops the records past its step first: ``harts-train --metrics
FILE``, ``harts-rl``'s ``DIR/metrics.jsonl``), TensorBoard event files (``--tensorboard DIR``;
``harts-rl``: ``DIR/tb`` when tensorboard is installed), and at the end of an RL run
``DIR/reward.png`` (:func:`plot_rewards`, the reward curve) when matplotlib is importable (else a
note says it was skipped and which extra brings it: ``rl``).

``metrics.jsonl`` is never rewritten in place: records are appended (flushed and synced each step),
and when a resumed run must drop records past its step (or a line a kill cut short) the records it
keeps are written to a temporary file, synced and renamed over it, so a kill at any point leaves
every record of the steps it keeps.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from harts_runtime.trainer_state import write_atomic

__all__ = ["MetricsWriter", "finite", "plot_rewards", "read_metrics", "write_atomic"]


def finite(v):
    """``v``, or None for a non-finite float (JSON has no NaN)."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def read_metrics(path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (unreadable lines skipped)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _kept(line: str, resumed_step: int) -> bool:
    """Whether a resumed run at ``resumed_step`` keeps this line (a record of a step at most it)."""
    if not resumed_step:
        return False
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return False
    return isinstance(step, int) and not isinstance(step, bool) and 0 < step <= resumed_step


class MetricsWriter:
    """Appends step records to the JSON-lines file ``path`` (flushed and synced each step) and, with
    ``tensorboard`` (a folder), writes their numbers as ``<prefix>/<name>`` scalars there
    (``optional``: only when tensorboard is installed). ``path`` a folder: an RL run folder's
    (:meth:`of_run`). ``resumed_step``: the records past it are dropped first (by rename); 0: a new
    run, the file starts empty."""

    def __init__(
        self, path, resumed_step: int = 0, *, tensorboard=None, prefix: str = "train", optional: bool = False
    ):
        self.path = None if path is None else Path(path)
        if self.path is not None and self.path.is_dir():  # an RL run folder (:meth:`of_run`)
            tensorboard, prefix, optional = self.path / "tb", "rl", True
            self.path = self.path / "metrics.jsonl"
        self.prefix = prefix
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                current = self.path.read_text() if self.path.is_file() else None
            except (OSError, UnicodeDecodeError):
                current = None
            keep = "".join(line + "\n" for line in (current or "").splitlines() if _kept(line, resumed_step))
            if current != keep:
                write_atomic(self.path, keep)
            self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self.writer = None
        if tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(
                    str(tensorboard), purge_step=resumed_step + 1 if resumed_step else None
                )
            except ImportError:
                if not optional:
                    raise

    @classmethod
    def of_run(cls, out_dir, resumed_step: int = 0) -> MetricsWriter:
        """An RL run folder's: ``DIR/metrics.jsonl`` and, when installed, TensorBoard in ``DIR/tb``."""
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        return cls(out_dir, resumed_step)

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps({k: finite(v) for k, v in record.items()}) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        if self.writer is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self.writer.add_scalar(f"{self.prefix}/{k}", v, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self.writer is not None:
            self.writer.close()


def plot_rewards(out_dir) -> str:
    """Write ``DIR/reward.png`` from ``DIR/metrics.jsonl``; returns a line saying what was done."""
    records = read_metrics(Path(out_dir) / "metrics.jsonl")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            "reward curve: skipped (matplotlib is not installed: pip install 'harts[rl]'; metrics.jsonl has "
            "reward_mean per step)"
        )
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([r["step"] for r in records], [r["reward_mean"] for r in records])
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    fig.tight_layout()
    path = Path(out_dir) / "reward.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"reward curve: {path}"
