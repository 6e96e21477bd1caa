"""The packages' import graph, built from the source: no circles, no upward imports.

Layers: ``shm_broadcast`` (bottom) <- ``device_comms`` <- ``coordinator``. An
edge is any import a module can execute: at module level or inside a function
(a lazy import still ties the two modules), but not one under
``if TYPE_CHECKING:``, which never runs. ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg``. A package's ``__init__``
re-exporting its own children is not an edge back from them.

The worked example (``coordinator/engine``) uses only the public API: the
three packages' top-level names and the public modules listed below.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = {"shm_broadcast": 0, "device_comms": 1, "coordinator": 2}

#: What the worked example may import besides itself and the packages' top level.
PUBLIC_MODULES = frozenset({
    "coordinator.testing", "coordinator.custom_ops", "coordinator.moe", "coordinator.errors",
    "coordinator.parallel_state", "coordinator.communication_op",
})


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    return {module_name(p, root): p for pkg in LAYERS for p in sorted((root / pkg).rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``path``) may import at run time."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    if path.name == "__init__.py":  # re-exporting its children is not a tie back
        found = {t for t in found if not t.startswith(name + ".")}
    return found


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    modules = all_modules(root)
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
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


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, t) for m, targets in graph.items() for t in targets
                  if LAYERS[t.split(".")[0]] > LAYERS[m.split(".")[0]])


GRAPH = import_graph()


def test_the_graph_covers_every_package() -> None:
    for pkg in LAYERS:
        assert pkg in GRAPH and any(m.startswith(pkg + ".") for m in GRAPH), pkg


def test_no_import_circles() -> None:
    found = circles(GRAPH)
    assert not found, "import circles (module-level or lazy imports):\n" + "\n".join(
        f"circle of {len(c)}: {', '.join(c)}" for c in found)


def test_no_upward_imports() -> None:
    assert upward_imports(GRAPH) == []


def test_the_worked_example_uses_only_the_public_api() -> None:
    bad = sorted(
        (m, t) for m, targets in GRAPH.items() if m.startswith("coordinator.engine")
        for t in targets
        if not t.startswith("coordinator.engine") and t not in LAYERS and t not in PUBLIC_MODULES)
    assert bad == []


# ----------------------------------------------------------------- the checker itself
def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for pkg in LAYERS:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize("files, expected", [
    pytest.param({"device_comms/a.py": "import device_comms.b\n",
                  "device_comms/b.py": "def f():\n    from device_comms import a\n"},
                 [["device_comms.a", "device_comms.b"]], id="lazy-import-closes-a-circle"),
    pytest.param({"device_comms/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from device_comms.b import B\n",
                  "device_comms/b.py": "from device_comms import a\n"},
                 [], id="type-checking-import-is-no-edge"),
    pytest.param({"coordinator/x/__init__.py": "from coordinator.x.y import Y\n",
                  "coordinator/x/y.py": "from coordinator.x import z\n",
                  "coordinator/x/z.py": "import coordinator.x.y\n"},
                 [["coordinator.x.y", "coordinator.x.z"]], id="from-package-import-module"),
    pytest.param({"coordinator/x/__init__.py": "from .y import Y\n",
                  "coordinator/x/y.py": "from . import z\n",
                  "coordinator/x/z.py": "from .y import Y\n"},
                 [["coordinator.x.y", "coordinator.x.z"]], id="relative-imports"),
])
def test_circles_are_found(tmp_path: pathlib.Path, files: dict[str, str],
                           expected: list[list[str]]) -> None:
    assert circles(import_graph(_tree(tmp_path, files))) == expected


def test_an_upward_import_is_found(tmp_path: pathlib.Path) -> None:
    root = _tree(tmp_path, {"shm_broadcast/a.py": "def f():\n    import coordinator\n",
                            "device_comms/b.py": "from shm_broadcast import a\n"})
    assert upward_imports(import_graph(root)) == [("shm_broadcast.a", "coordinator")]
