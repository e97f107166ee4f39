"""The install that ``harts-rl`` needs is named: the ``rl`` extra brings the runtime, transformers
(the rollout engine), matplotlib (``DIR/reward.png``) and tensorboard; the README's harts-rl section
installs it; a run without matplotlib says which extra brings the curve."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).parents[2]


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _names(reqs, extras, seen=()) -> set[str]:
    """The distributions ``reqs`` bring, the project's own extras (``harts[a,b]``) expanded."""
    out = set()
    for r in reqs:
        m = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]+)\])?", r)
        name, sub = m.group(1).lower(), m.group(2)
        if name == "harts":
            for e in (sub or "").split(","):
                if e and e not in seen:
                    out |= _names(extras[e], extras, (*seen, e))
        else:
            out.add(name)
    return out


def test_the_rl_extra_brings_what_harts_rl_uses():
    extras = _extras()
    brings = _names(extras["rl"], extras)
    assert {"torch", "fla-core", "transformers", "safetensors", "matplotlib", "tensorboard"} <= brings


def test_the_readme_names_the_extra_in_the_harts_rl_section():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Agentic RL in ten minutes") :]
    section = section[: section.index("\n## ", 5)]
    assert 'pip install ".[rl]"' in section and "matplotlib" in section and "reward.png" in section


def test_a_run_without_matplotlib_says_which_extra_brings_the_curve(tmp_path, monkeypatch):
    from harts_runtime.trainer.metrics import plot_rewards

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    line = plot_rewards(tmp_path)
    assert line.startswith("reward curve: skipped") and "harts[rl]" in line
    assert not (tmp_path / "reward.png").exists()
