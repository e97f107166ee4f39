"""harts_planner/_native.pyi (the type checker's view of the C++ extension) names exactly what the
built module has: its public names, each class's public attributes and each exception's base."""

from __future__ import annotations

import ast
from pathlib import Path

import harts_planner
from harts_planner import _native

STUB = Path(harts_planner.__file__).with_name("_native.pyi")
# Attributes the stub declares that Python code sets on instances (not on the module's classes).
PYTHON_SET = {"ResourceLimitError": {"limit", "needed", "maximum"}}


def _public(names) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def _stub_tree() -> ast.Module:
    return ast.parse(STUB.read_text())


def _stub_classes() -> dict[str, ast.ClassDef]:
    return {node.name: node for node in _stub_tree().body if isinstance(node, ast.ClassDef)}


def _stub_module_names() -> set[str]:
    names: set[str] = set()
    for node in _stub_tree().body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return _public(names)


def test_stub_names_the_modules_public_names():
    assert _stub_module_names() == _public(dir(_native))
    all_node = next(
        n
        for n in _stub_tree().body
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "__all__"
    )
    assert set(ast.literal_eval(all_node.value)) == _public(dir(_native))


def _stub_attrs(classes: dict[str, ast.ClassDef], name: str) -> set[str]:
    """The public attributes the stub gives class ``name``, with those of its bases in the stub."""
    node = classes[name]
    attrs = {m.name for m in node.body if isinstance(m, ast.FunctionDef)}
    attrs |= {
        m.target.id for m in node.body if isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name)
    }
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            attrs |= _stub_attrs(classes, base.id)
    return _public(attrs)


def test_stub_classes_name_each_attribute_and_base():
    classes = _stub_classes()
    assert classes
    for name, node in classes.items():
        cls = getattr(_native, name)
        if issubclass(cls, BaseException):
            # An exception declares what it adds to ValueError, and the same base.
            expected = _public(dir(cls)) - _public(dir(ValueError)) | PYTHON_SET.get(name, set())
            assert _stub_attrs(classes, name) == expected, name
            bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
            assert bases == [cls.__bases__[0].__name__], name
        else:
            assert _stub_attrs(classes, name) == _public(dir(cls)), name
