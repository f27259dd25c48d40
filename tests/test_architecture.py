"""The layout the design fixes, read from the source: the driver side (``daskwg.transport``)
and the worker side (``daskwg.plugin``) never import each other, no module imports itself
back through others, and modules and classes stay small enough to hold one concept."""

from __future__ import annotations

import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "daskwg")

pytestmark = pytest.mark.timeout(60)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found[_module_name(path)] = path
    return found


def _imports(module: str, path: str, known: set[str]) -> set[str]:
    """Every daskwg module ``module`` imports, at the top or inside a function."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # "from .x import y" is module x, or module x.y when y is a submodule.
            names = [
                f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in known else prefix
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, set(modules)) for m, p in modules.items()}


def _side(module: str) -> str | None:
    for side in ("daskwg.transport", "daskwg.plugin"):
        if module == side or module.startswith(side + "."):
            return side
    return None


def test_the_driver_side_and_the_worker_side_never_import_each_other(graph):
    crossings = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if _side(a) and _side(b) and _side(a) != _side(b)
    ]
    assert crossings == []


def test_the_wire_imports_neither_side(graph):
    assert {b for b in graph["daskwg.wire.messages"] if _side(b)} == set()


def test_no_module_imports_itself_back(graph):
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in done:
                visit(target, path + [target])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert cycles == []


def test_the_task_function_needs_neither_torch_nor_daskwg():
    tree = ast.parse(open(os.path.join(ROOT, "_daskwg_task.py")).read())
    imported = {
        (alias.name if isinstance(node, ast.Import) else node.module).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}


def test_modules_and_classes_hold_one_concept_each():
    """About 500 lines a module (protocol.py, the DataProto module, aside) and about 400
    a class (DataProto aside), with a tenth for "about"."""
    big_modules, big_classes = [], []
    for module, path in _modules().items():
        source = open(path).read()
        if module != "daskwg.protocol" and source.count("\n") > 550:
            big_modules.append(f"{module}: {source.count(chr(10))} lines")
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef) and node.name != "DataProto":
                lines = node.end_lineno - node.lineno + 1
                if lines > 440:
                    big_classes.append(f"{module}.{node.name}: {lines} lines")
    assert big_modules == [] and big_classes == []
