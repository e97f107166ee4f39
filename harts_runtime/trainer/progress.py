"""What ``harts-train`` shows while it trains: the progress on stderr (:class:`Progress`: a tqdm bar
on a terminal, plain lines in a log) and one text line per step (:func:`step_line`)."""

from __future__ import annotations

import time

__all__ = ["PROG", "Progress", "hms", "step_line"]

PROG = "harts-train"


class Progress:
    """A tqdm bar on a terminal, or plain lines (logs): the first step, then every ``every``
    seconds, and the last. ``mode``: ``auto``, ``bar``, ``lines`` or ``off``; off when not
    ``enabled`` (ranks other than 0) or nothing is left to train."""

    def __init__(self, mode: str, total: int, initial: int, every: float, stream, enabled: bool):
        tty = bool(getattr(stream, "isatty", lambda: False)())
        if mode == "auto":
            mode = "bar" if tty else "lines"
        self.mode = mode if enabled and total > initial else "off"
        self.total, self.initial, self.every, self.stream = total, initial, every, stream
        self.start = time.perf_counter()
        self.last = None
        self.bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, unit="step", desc=PROG, file=stream, dynamic_ncols=True
            )

    def update(self, done: int, rec: dict) -> None:
        """Step ``done`` finished with the record ``rec``."""
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['loss']:.4g}", refresh=False)
            self.bar.update(1)
            return
        if self.mode != "lines":
            return
        now = time.perf_counter()
        if self.last is not None and done < self.total and now - self.last < self.every:
            return
        self.last = now
        elapsed = now - self.start
        rate = elapsed / max(1, done - self.initial)
        eta = rate * (self.total - done)
        pct = 100.0 * done / max(1, self.total)
        print(
            f"{PROG}: step {done}/{self.total} ({pct:.0f}%) elapsed {hms(elapsed)} eta {hms(eta)} "
            f"({rate:.2f} s/step) loss={rec['loss']:.6g}",
            file=self.stream,
            flush=True,
        )

    def write(self, line: str, out) -> None:
        """Print ``line`` to ``out`` without breaking the bar."""
        if self.bar is not None:
            self.bar.write(line, file=out)
        else:
            print(line, file=out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def hms(s: float) -> str:
    """Seconds as ``m:ss`` (``h:mm:ss`` from an hour)."""
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def step_line(rec: dict, total: int) -> str:
    """A step's record as its stdout line (``step 3/20 loss=... step_time=0.11s``)."""
    gn = rec["grad_norm"]
    parts = [
        f"step {rec['step']}/{total}",
        f"loss={rec['loss']:.6f}",
        f"policy_loss={rec['policy_loss']:.6f}",
        f"router_loss={rec['router_loss']:.4g}",
        f"grad_norm={gn:.4g}" if gn is not None else "grad_norm=nan",
        f"lr={rec['lr']:.3g}",
        f"tokens={rec['semantic_tokens']:,}",
        f"rows={rec['rows']:,}",
        f"compression={rec['compression']:.2f}x",
        f"microbatches={rec['microbatches']}",
    ]
    if "kda_calls" in rec:
        parts.append(f"calls={rec['kda_calls']}")
    parts += [
        f"replay={rec['replay_tokens']:,}",
        f"plan={rec['plan_seconds'] * 1e3:.1f}ms",
        f"fbg={rec['fbg_seconds']:.2f}s",
        f"step_time={rec['step_seconds']:.2f}s",
    ]
    if rec["skipped"]:
        parts.append(f"SKIPPED ({rec['skip_reason']})")
    return " ".join(parts)
