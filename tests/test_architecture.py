"""The layout the design fixes, read from the source: ``daskwg/``'s file list is the
architecture. Base modules and the public API at the top, everything else in packages named
by role; the driver side (``daskwg.transport``) and the worker side (``daskwg.plugin``)
never import each other; the wire (``daskwg.wire``) imports nothing above ``errors`` and
``config``; the scheduler side (``daskwg.scheduler``) never imports torch; no module imports
itself back through others; each package's header names its modules. Modules are as large
as their one concept needs, with one generous backstop."""

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


#: The top of ``daskwg/``: the public API and the base modules every package stands on.
TOP_LEVEL = {
    "daskwg",
    "daskwg.cluster",
    "daskwg.collective",
    "daskwg.config",
    "daskwg.deadlines",
    "daskwg.decorator",
    "daskwg.errors",
    "daskwg.foreign",
    "daskwg.protocol",
    "daskwg.worker",
}
#: Packages named by role (the design's layout).
PACKAGES = {
    "daskwg.wire",
    "daskwg.serialization",
    "daskwg.futures",
    "daskwg.dispatch",
    "daskwg.groups",
    "daskwg.plans",
    "daskwg.sync",
    "daskwg.transport",
    "daskwg.plugin",
    "daskwg.scheduler",
    "daskwg.verl",
}
#: The most a module of the top and of the packages may have (``protocol``, the DataProto
#: module that mirrors verl's ``protocol.py``, aside); a backstop, not a target.
BACKSTOP_LINES = 800


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _side(module: str) -> str | None:
    for side in ("daskwg.transport", "daskwg.plugin"):
        if _in(module, side):
            return side
    return None


def _closure(graph: dict[str, set[str]], roots: set[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen


def _imports_torch(path: str) -> bool:
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(name.split(".")[0] in ("torch", "tensordict") for name in names):
            return True
    return False


def test_the_top_level_holds_the_public_api_and_base_modules_only():
    top = {m for m in _modules() if m.count(".") <= 1}
    packages = {m for m, p in _modules().items() if m.count(".") == 1 and p.endswith("__init__.py")}
    assert top - packages == TOP_LEVEL
    assert len(TOP_LEVEL) <= 15
    assert packages == PACKAGES


def test_every_package_header_names_its_modules():
    unnamed = []
    for module, path in _modules().items():
        if module == "daskwg" or not path.endswith("__init__.py"):
            continue
        header = ast.get_docstring(ast.parse(open(path).read())) or ""
        folder = os.path.dirname(path)
        for entry in sorted(os.listdir(folder)):
            name = entry[: -len(".py")] if entry.endswith(".py") else entry
            is_module = entry.endswith(".py") and entry != "__init__.py"
            is_package = os.path.isfile(os.path.join(folder, entry, "__init__.py"))
            if (is_module or is_package) and f"``{name}``" not in header:
                unnamed.append(f"{module}: {name}")
    assert unnamed == []


def test_the_driver_side_and_the_worker_side_never_import_each_other(graph):
    crossings = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if _side(a) and _side(b) and _side(a) != _side(b)
    ]
    assert crossings == []


def test_the_wire_imports_nothing_above_errors_and_config(graph):
    allowed = {"daskwg", "daskwg.errors", "daskwg.config"}
    above = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        if _in(a, "daskwg.wire")
        for b in targets
        if not _in(b, "daskwg.wire") and b not in allowed
    ]
    assert above == []


def test_base_modules_import_no_role_package_but_the_wire_and_dispatch(graph):
    """The base modules stand below the packages: only the wire (``protocol`` encodes
    tensors with ``wire.codec``) and ``@register`` (the ``decorator`` face, which
    ``worker`` binds) are under them."""
    allowed = {"daskwg.wire", "daskwg.dispatch", "daskwg.futures", "daskwg.serialization"}
    upward = [
        f"{a} -> {b}"
        for a in TOP_LEVEL - {"daskwg"}
        for b in graph[a]
        if b not in TOP_LEVEL and not any(_in(b, p) for p in allowed)
    ]
    assert upward == []


def test_the_scheduler_side_never_imports_torch(graph):
    modules = _modules()
    reached = _closure(graph, {m for m in modules if _in(m, "daskwg.scheduler")}) - {"daskwg"}
    with_torch = sorted(m for m in reached if _imports_torch(modules[m]))
    assert with_torch == []


def test_the_task_function_needs_neither_torch_nor_daskwg():
    tree = ast.parse(open(os.path.join(ROOT, "_daskwg_task.py")).read())
    imported = {
        (alias.name if isinstance(node, ast.Import) else node.module).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}


def test_no_module_passes_the_backstop():
    big = []
    for module, path in _modules().items():
        lines = open(path).read().count("\n")
        if module != "daskwg.protocol" and lines > BACKSTOP_LINES:
            big.append(f"{module}: {lines} lines")
    assert big == []


#: Calls whose first argument is a ``daskwg_*`` name of another namespace than the comm
#: handlers': a context variable's (debug) name, the scheduler's Prometheus metric families.
OTHER_NAMESPACES = {"ContextVar", "GaugeMetricFamily", "CounterMetricFamily", "HistogramMetricFamily"}


def _hand_typed_handler_names(path: str) -> list[str]:
    """Every ``"daskwg_..."`` string and every ``.daskwg_...`` attribute (Dask's
    ``rpc(address).<handler>(...)``) in ``path``, but the names of :data:`OTHER_NAMESPACES`."""
    tree = ast.parse(open(path).read())
    other = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in OTHER_NAMESPACES:
                other.add(id(node.args[0]))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("daskwg_") and id(node) not in other:
                found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("daskwg_"):
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_no_handler_name_is_typed_by_hand_outside_the_wire():
    """Comm handler names are ``daskwg.wire.messages.Handler``'s constants on both ends."""
    typed = [
        f"{module} {hit}"
        for module, path in sorted(_modules().items())
        if not _in(module, "daskwg.wire")
        for hit in _hand_typed_handler_names(path)
    ]
    assert typed == []


def test_the_handler_names_are_defined_once_each():
    from daskwg.wire.messages import HANDLERS, Handler

    names = {k: v for k, v in vars(Handler).items() if k.isupper()}
    assert len(set(HANDLERS)) == len(HANDLERS) == len(names)
    assert set(HANDLERS) == set(names.values())
    assert all(name.startswith("daskwg_") for name in HANDLERS)
