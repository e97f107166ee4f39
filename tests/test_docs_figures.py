"""One measured figure, one source: the GPU figures the docs quote agree with ``benchmarks/results``.

``benchmarks/figures.py`` reads every quoted figure from its results file. These tests fail when its
generated table in ``benchmarks/README.md`` or ``harts_planner/measured.py`` is stale (re-run
``python benchmarks/figures.py``), when a doc's headline sentence is not the one it renders, or when
prose anywhere in the docs quotes a TFLOP/s or GEMM-roofline figure that no results file holds.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
figures = importlib.import_module("figures")

DOCS = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    ROOT / "benchmarks" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
#: Where each headline sentence of :func:`figures.quotes` must stand verbatim.
QUOTED = {
    "headline": ["README.md", "docs/architecture.md", "docs/gpu.md"],
    "layers": ["docs/architecture.md"],
}


def _prose(path: Path) -> str:
    """The text of a doc without its generated blocks (``<!-- name:begin --> ... <!-- name:end -->``:
    each is written from its results file by its own script) and with line breaks as spaces."""
    text = re.sub(r"<!-- (\w+):begin -->.*?<!-- \1:end -->", "", path.read_text(), flags=re.S)
    return " ".join(text.split())


def _allowed_tflops() -> set[str]:
    values = []
    for f in figures.runs().values():
        values += [f["tflops_executed"], f["tflops_model"], f["tflops_trajectory"]]
    return {f"{v:.1f}" for v in values if v is not None}  # quoted as measured: one decimal


def test_generated_table_and_measured_module_are_current():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    assert figures.block() in text, "benchmarks/README.md is stale: run python benchmarks/figures.py"
    measured = (ROOT / "python_client" / "harts_planner" / "measured.py").read_text()
    assert measured == figures.measured_module(), "measured.py is stale: run python benchmarks/figures.py"


@pytest.mark.parametrize("name", sorted(QUOTED))
def test_docs_quote_the_headline_sentences(name):
    sentence = figures.quotes()[name]
    missing = [doc for doc in QUOTED[name] if sentence not in _prose(ROOT / doc)]
    assert not missing, (missing, sentence)


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_quoted_tflops_and_roofline_figure_is_a_measured_one(doc):
    text = _prose(doc)
    allowed = _allowed_tflops()
    tflops = re.findall(r"(\d[\d,]*(?:\.\d+)?) (?:executed )?TFLOP/s", text)
    assert all(t.replace(",", "") in allowed for t in tflops), (
        sorted(set(tflops) - allowed),
        sorted(allowed),
    )
    roofline = f"{figures.layer_figures()['moe_vs_roofline']:.2f}"
    assert set(re.findall(r"(\d+\.\d+)x (?:its|the) (?:GEMM |dense )?roofline", text)) <= {roofline}


def test_the_checks_catch_a_stale_figure(tmp_path):
    """The scan above is not vacuous: the stale figures the docs once quoted are caught."""
    stale = tmp_path / "stale.md"
    stale.write_text("trains at 246 TFLOP/s there; MoE 2.47x its GEMM roofline\n")
    text = _prose(stale)
    assert "246" not in _allowed_tflops() and re.findall(r"(\d+) TFLOP/s", text) == ["246"]  # 245.6, rounded
    assert f"{figures.layer_figures()['moe_vs_roofline']:.2f}" != "2.47"
