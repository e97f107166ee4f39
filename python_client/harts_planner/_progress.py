"""A dependency-free progress bar for long phases, written to stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Progress of a phase with a known amount of work.

    Call the instance as ``progress(done, total)`` (the signature generators accept) and
    ``close()`` at the end. Redraws at most ten times a second; silent when ``enabled``
    is false, and draws a single final line when the stream is not a terminal.
    """

    def __init__(self, label: str, *, enabled: bool = True, stream: TextIO | None = None):
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._done = 0
        self._total = 0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, done: int, total: int) -> None:
        self._done, self._total = done, total
        now = time.perf_counter()
        if self.enabled and self._tty and (now - self._last_draw > 0.1 or done >= total):
            self._last_draw = now
            self._draw(end="\r")

    def _draw(self, end: str) -> None:
        frac = self._done / self._total if self._total else 1.0
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        elapsed = time.perf_counter() - self.start
        self.stream.write(f"{self.label:<12} [{bar}] {self._done}/{self._total} {elapsed:6.2f}s{end}")
        self.stream.flush()

    def close(self) -> float:
        """Finish the bar; returns the elapsed seconds."""
        if self.enabled:
            self._draw(end="\n")
        return time.perf_counter() - self.start
