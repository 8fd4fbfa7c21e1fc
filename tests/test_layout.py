"""The house's floors: each package imports only the packages below it, and no modules import
each other in a circle (README.md, Layout). Read from the source with `ast`, every import
counted: at the top, inside functions, and under `TYPE_CHECKING`."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What each package may import of the others (its own modules are always allowed).
FLOORS: dict[str, frozenset[str]] = {
    "accounting": frozenset(),
    "allocator": frozenset({"accounting"}),
    "exporter": frozenset({"accounting", "allocator"}),
    "kvledger": frozenset({"accounting", "allocator", "exporter"}),
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in FLOORS:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _imported(name: str, path: Path) -> Iterator[str]:
    """The modules of this tree that `name` imports (a name imported from a package is the
    submodule where one exists)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                yield t


GRAPH = {name: set(_imported(name, path)) for name, path in MODULES.items()}


def test_every_package_imports_only_the_floors_below_it() -> None:
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in GRAPH.items()
        for b in targets
        if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in FLOORS[a.split(".")[0]]
    )
    assert upward == []


def _circles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert _circles() == []


def test_the_check_sees_a_circle_and_an_arrow_up() -> None:
    """The two checks can fail: planted into a copy of the graph, both are found."""
    saved = {k: set(v) for k, v in GRAPH.items()}
    try:
        GRAPH["accounting.units"].add("accounting.ledger")
        GRAPH["accounting.ledger"].add("accounting.units")
        assert ["accounting.ledger", "accounting.units"] in _circles()
        GRAPH["exporter.metrics"].add("kvledger.cli")
        up = [b for b in GRAPH["exporter.metrics"] if b.split(".")[0] not in FLOORS["exporter"]]
        assert up == ["kvledger.cli"]
    finally:
        GRAPH.clear()
        GRAPH.update(saved)
