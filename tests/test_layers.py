"""The layer contract (docs/architecture.md) and the absence of import cycles, as tests.

Every import counts, also those under ``TYPE_CHECKING`` and inside functions: a cycle or an
upward arrow hidden in a function still couples the packages it joins.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "async_rl"


def test_the_import_linter_contracts_hold():
    """pyproject.toml's ``[tool.importlinter]`` contracts: the layers, ``rollout`` and
    ``learner`` independent, ``config`` reading only ``algos.options`` of ``algos`` (and
    ``algos.options`` only ``bounds``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "COLUMNS": "200", "NO_COLOR": "1"}
    lint = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    proc = subprocess.run([sys.executable, "-c", lint, "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"an import breaks a contract of pyproject.toml [tool.importlinter]:\n{proc.stdout}{proc.stderr}"


def import_edges(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    """``module -> modules it imports`` over ``graph``, plus the package ``__init__`` each
    import runs: importing ``a.b.c`` from outside ``a.b`` executes ``a/b/__init__.py``, so
    a re-export there that leads back to the importer is a cycle too."""
    edges: dict[str, set[str]] = {m: set() for m in graph.modules}
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            edges[importer].add(imported)
            edges[importer].update(p for p in _packages_run(importer, imported) if p in graph.modules)
    return edges


def _packages_run(importer: str, imported: str) -> Iterator[str]:
    """The packages whose ``__init__`` importing ``imported`` runs, seen from ``importer``
    (not the ones ``importer`` is itself inside: those are already being imported)."""
    parts = imported.split(".")
    for i in range(1, len(parts)):
        package = ".".join(parts[:i])
        if package != importer and not importer.startswith(package + "."):
            yield package


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1 (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
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


def shortest_cycle(edges: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as ``[m0, m1, ..., m0]``."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in sorted(edges[node] & members):
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if succ not in came_from:
                came_from[succ] = node
                queue.append(succ)
    raise AssertionError(f"{component} is not strongly connected")


def describe(graph: grimp.ImportGraph, cycle: list[str]) -> str:
    """Each import of ``cycle`` with its line(s), e.g. ``a.x -> a.y: line 3 from a.y import f``."""
    lines = []
    for importer, imported in zip(cycle, cycle[1:]):
        details = graph.get_import_details(importer=importer, imported=imported)
        if details:
            where = "; ".join(f"line {d['line_number']}: {d['line_contents']}" for d in details)
        else:  # the edge is a package's __init__ run by importing one of its modules
            via = sorted(m for m in graph.find_modules_directly_imported_by(importer) if m.startswith(imported + "."))
            where = "runs its __init__ by importing " + ", ".join(
                f"{m} (line {d['line_number']}: {d['line_contents']})" for m in via
                for d in graph.get_import_details(importer=importer, imported=m)
            )
        lines.append(f"  {importer} -> {imported}: {where}")
    return "\n".join(lines)


def test_no_import_cycle_among_modules():
    """import-linter sees cycles between packages only; this finds one between any two
    modules (inside one package too), counting ``__init__`` re-exports."""
    graph = grimp.build_graph(PACKAGE, cache_dir=None)  # TYPE_CHECKING and function-level imports included
    edges = import_edges(graph)
    components = strongly_connected(edges)
    report = "\n".join(
        f"{', '.join(component)} import each other; the shortest cycle through {component[0]}:\n"
        f"{describe(graph, shortest_cycle(edges, component))}"
        for component in components
    )
    assert not components, f"{len(components)} import cycle(s) among {PACKAGE} modules:\n{report}"


def test_the_cycle_finder_names_each_cycle_and_its_shortest_path():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"g", "a"}}
    assert strongly_connected(edges) == [["a", "b", "c"], ["e", "f"]]
    assert shortest_cycle(edges, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert shortest_cycle(edges, ["e", "f"]) == ["e", "f", "e"]


def test_importing_a_module_runs_its_packages_init_unless_the_importer_is_inside():
    assert list(_packages_run("async_rl.rollout.worker", "async_rl.queue.replay")) == ["async_rl.queue"]
    assert list(_packages_run("async_rl.queue.replay", "async_rl.queue.keys")) == []
    assert list(_packages_run("async_rl.cli", "async_rl.config")) == []


def test_every_module_is_in_the_architecture_docs_package_layout():
    """docs/architecture.md's "Package layout" names every module of the package (a new module
    is placed there with its one job, beside the layer it is in)."""
    layout = (ROOT / "docs" / "architecture.md").read_text().split("## Package layout", 1)[1]
    modules = sorted(p.relative_to(ROOT / PACKAGE) for p in (ROOT / PACKAGE).rglob("*.py") if p.name != "__init__.py")
    missing = [str(m) for m in modules if f" {m.name} " not in layout]
    assert missing == [], f"add to docs/architecture.md's package layout: {missing}"
