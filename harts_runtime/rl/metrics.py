"""An RL run's outputs per step (:class:`MetricsWriter`): ``DIR/metrics.jsonl`` (one JSON object per
step; a resumed run drops the records past its step first), TensorBoard event files in ``DIR/tb``
when tensorboard is installed, and at the end ``DIR/reward.png`` (the reward curve) when matplotlib
is importable (else a note says it was skipped; matplotlib is not a dependency).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["MetricsWriter", "plot_rewards", "read_metrics"]


def _finite(v):
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


class MetricsWriter:
    """Appends step records to ``DIR/metrics.jsonl`` (and TensorBoard when installed)."""

    def __init__(self, out_dir, resumed_step: int = 0):
        self.dir = Path(out_dir)
        self.path = self.dir / "metrics.jsonl"
        keep = (
            [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= resumed_step]
            if resumed_step
            else []
        )
        self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(
                str(self.dir / "tb"), purge_step=resumed_step + 1 if resumed_step else None
            )
        except ImportError:
            pass

    def write(self, record: dict) -> None:
        self._file.write(json.dumps({k: _finite(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        if self.writer is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self.writer.add_scalar(f"rl/{k}", v, record["step"])

    def close(self) -> None:
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
        return "reward curve: skipped (matplotlib is not installed; metrics.jsonl has reward_mean per step)"
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([r["step"] for r in records], [r["reward_mean"] for r in records])
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    fig.tight_layout()
    path = Path(out_dir) / "reward.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"reward curve: {path}"
