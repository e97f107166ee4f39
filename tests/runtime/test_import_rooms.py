"""The runtime's rooms import down the pipeline only (docs/architecture.md, "Packages and what each
may import"): layout/, modules/ and loss/ import no other room; ops/ imports layout/ and modules/
(the fla-or-reference switch); layers/ import layout/, modules/, ops/ and the kernels; models/
import layers/ and loss/. Shared by all:
``harts_runtime.errors`` and ``harts_runtime.options`` (the options' declared defaults, such as
``DEFAULT_CHUNK_SIZE``; torch-free, below every room) (and ``testing`` nowhere in production code)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "harts_runtime"
SHARED = {"errors", "options"}
ALLOWED = {
    "layout": set(),
    "modules": set(),
    "loss": set(),
    "ops": {"layout", "modules"},
    "layers": {"layout", "modules", "ops"},
    "models": {"layers", "loss", "layout", "modules", "ops"},
}


def _imports(path: Path):
    """Module names imported by ``path``, except under ``if TYPE_CHECKING:`` (annotations only)."""
    tree = ast.parse(path.read_text())
    for node in list(ast.walk(tree)):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_room_imports_point_down_the_pipeline(room):
    bad = []
    for f in sorted((ROOT / room).rglob("*.py")):
        for mod in _imports(f):
            parts = mod.split(".")
            if parts[0] != "harts_runtime" or len(parts) < 2:
                continue
            target = parts[1]
            if target in (room, *SHARED) or target in ALLOWED[room]:
                continue
            bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, bad
