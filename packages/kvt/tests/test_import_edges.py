"""kvt's modules import one another without a circle, late (in-function) imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import kvt

PACKAGE = Path(kvt.__file__).parent


def import_edges() -> dict[str, set[str]]:
    """module -> the kvt modules it imports anywhere in its source (``kvt.x`` names)."""
    edges: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.glob("*.py")):
        name = "kvt" if path.stem == "__init__" else f"kvt.{path.stem}"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
        edges[name] = {m for m in found if m.startswith("kvt.") and m != name}
    return edges


def cycle_through(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle (as a path of module names), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_circle_among_kvt_modules() -> None:
    edges = import_edges()
    assert {"kvt.paths", "kvt.tcp"} <= edges.keys()
    assert cycle_through(edges) is None, " -> ".join(cycle_through(edges) or [])


def test_payload_paths_depend_on_the_interface_not_the_other_way() -> None:
    edges = import_edges()
    assert not edges["kvt.paths"] & {"kvt.rdma", "kvt.samehost", "kvt.tcp"}
    assert "kvt.paths" in edges["kvt.rdma"]
    assert "kvt.paths" in edges["kvt.samehost"]


def test_the_circle_finder_finds_a_circle() -> None:
    assert cycle_through({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_through({"a": {"b"}, "b": set()}) is None
