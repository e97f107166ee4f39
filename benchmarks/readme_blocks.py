"""The generated blocks of ``benchmarks/README.md``: a benchmark replaces the text between its
``<!-- name:begin -->`` / ``<!-- name:end -->`` markers, or appends a section with them."""

from __future__ import annotations

from pathlib import Path


def update_readme(path: Path, block: str, begin: str, end: str, heading: str) -> None:
    """Put ``block`` (which starts with ``begin`` and ends with ``end``) into ``path`` in place of
    the old block, or append it under ``## heading`` when there is none yet."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip() + f"\n\n## {heading}\n\n" + block + "\n"
    path.write_text(text)
