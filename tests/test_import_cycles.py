"""The core has no import circle (issue 17): a module that imports another which imports it
back works only by the accident of import order, and breaks when someone moves a line.

The graph is built from the source (every ``import`` statement, function-level ones too), so a
lazy import that merely hides a circle from Python's import machinery is still a circle here.
A submodule's import of its own parent package is not an edge (the parent always loads first).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

CORE = ROOT / "spikeops"
# The Prefect layers, installed as spikeops.flows and so on (symbolic links under spikeops/,
# which rglob does not follow): their circles count too.
LAYERS = ("flows", "tasks", "deployments", "demo")


def _modules() -> dict[str, Path]:
    modules = {}
    roots = [(CORE, ("spikeops",))] + [(ROOT / layer, ("spikeops", layer)) for layer in LAYERS]
    for root, prefix in roots:
        for path in root.rglob("*.py"):
            parts = prefix + path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # ``from pkg import sub`` imports the submodule when there is one.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is None or resolved == name or name.startswith(resolved + "."):
                    continue
                graph[name].add(resolved)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_level_imports() -> None:
    graph = import_graph()
    # the node reader takes the counter names from counters.py (once a lazy import of communication).
    assert "spikeops.diagnosis.counters" in graph["spikeops.diagnosis.evidence.nodes"]
    assert "spikeops.diagnosis.communication" not in graph["spikeops.diagnosis.evidence.nodes"]


def test_the_core_has_no_import_circle() -> None:
    assert cycles(import_graph()) == []


def test_the_graph_covers_the_prefect_layers() -> None:
    graph = import_graph()
    assert "spikeops.tasks.start" in graph["spikeops.deployments.serve"]
    assert any(name.startswith("spikeops.flows.") for name in graph["spikeops.deployments.pools"])
