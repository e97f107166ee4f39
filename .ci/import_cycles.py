"""Fail on any import cycle among the modules of harts_runtime, harts_planner and harts_kernels.

import-linter's contracts (pyproject.toml, ``[tool.importlinter]``) order the packages' floors; its
``acyclic_siblings`` contract would see cycles between siblings only, not a package's ``__init__``
and its own children. This check sees every module: type-only (``if TYPE_CHECKING:``) and
function-level imports count, as they do for the contracts. It uses grimp, import-linter's graph
library, and reads the source tree (run by .ci/lint with the checkout's package folders first on
PYTHONPATH; nothing is imported).

Two modules are not in the source tree: the planner's C++ extension (``harts_planner._native``) and
the protobuf module generated at build time (``harts_planner.rpc.planner_pb2``). grimp records an
import of either as an import of its package's ``__init__``; such an edge is dropped when its import
lines name only out-of-source modules or the package's own submodules (which have edges of their own).

Prints each cycle (its modules, and one loop with the import lines) and exits 1; exits 0 when none.
"""

from __future__ import annotations

import re
import sys

import grimp

PACKAGES = ("harts_runtime", "harts_planner", "harts_kernels")
OUT_OF_SOURCE = frozenset({"harts_planner._native", "harts_planner.rpc.planner_pb2"})
_FROM = re.compile(r"^\s*from\s+([\w.]+)\s+import\s+(.*)$")


def _imported_names(rest: str) -> list[str] | None:
    """The names of ``from M import <rest>`` (one line of it); None when the line does not say."""
    rest = rest.split("#", 1)[0].strip().strip("()").strip()
    if not rest or rest == "*":
        return None
    return [part.split(" as ")[0].strip() for part in rest.split(",") if part.strip()]


def _only_submodules(graph, importer: str, package: str) -> bool:
    """Whether every line of ``importer`` that grimp counts as importing ``package`` imports only
    out-of-source modules or ``package``'s submodules (so no name of its ``__init__``)."""
    details = graph.get_import_details(importer=importer, imported=package)
    if not details:
        return False
    for d in details:
        m = _FROM.match(d["line_contents"])
        if m is None:
            return False
        module, rest = m.groups()
        if module in OUT_OF_SOURCE:
            continue
        names = _imported_names(rest)
        if module != package or names is None:
            return False
        for name in names:
            sub = f"{package}.{name}"
            if sub not in OUT_OF_SOURCE and sub not in graph.modules:
                return False
    return True


def import_edges(graph) -> dict[str, set[str]]:
    """module -> the modules it imports, within :data:`PACKAGES`, out-of-source imports dropped."""
    edges: dict[str, set[str]] = {}
    for m in graph.modules:
        out = set()
        for i in graph.find_modules_directly_imported_by(m):
            if i == m:
                continue
            if m.startswith(i + ".") and _only_submodules(graph, m, i):
                continue
            out.add(i)
        edges[m] = out
    return edges


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def shortest_loop(edges: dict[str, set[str]], members: list[str]) -> list[str]:
    """A shortest loop through ``members[0]`` inside the component (breadth first)."""
    inside = set(members)
    start = members[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & inside):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def main() -> int:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    edges = import_edges(graph)
    cycles = strongly_connected(edges)
    for members in cycles:
        print(f"import cycle among {len(members)} modules: {', '.join(members)}")
        loop = shortest_loop(edges, members)
        for a, b in zip(loop, loop[1:]):
            lines = sorted({d["line_number"] for d in graph.get_import_details(importer=a, imported=b)})
            print(f"  {a} -> {b} (l.{', l.'.join(map(str, lines))})")
    if cycles:
        print(f"import cycles: {len(cycles)} (type-only and function-level imports count)")
        return 1
    print(f"import cycles: none in {', '.join(PACKAGES)} ({len(edges)} modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
