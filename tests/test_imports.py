"""The package's import graph keeps its layers: no cycles, no arrow pointing upward.

Every ``.py`` file under ``lmcache_async`` is parsed with :mod:`ast` (nothing is
imported), and every import in it becomes an arrow: module level, inside functions,
under ``if TYPE_CHECKING:`` and ``importlib.import_module("lmcache_async...")`` with a
constant name alike. A lazy import is still an arrow: hiding one inside a function (or
behind ``TYPE_CHECKING``) does not change which layer knows which.

The layers, low to high (a module may import its own layer and the ones below)::

    ground floor   config, errors, logging, events, stats, health, tenancy/
    data model     keys/, layouts/, transfer/, memory/ (a package per concept)
    backends/
    core/          the request core (stages and the sidecar server call it)
    pipelines/
    engine/
    rpc/
    sync/
    (the package's own __init__: the public API, re-exporting the layers below)
    integrations/
    cli, bench/

Any module under ``lmcache_async/X/`` belongs to the layer of ``X``. A new top-level
module or package fails :func:`test_every_top_level_module_has_a_layer` until it is placed
in :data:`LAYER_OF`, so the table stays complete, and a module that would join a family by
its name prefix (``keys_memo.py``) has no layer: it goes into its family's package.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import textwrap
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

PACKAGE: Final = "lmcache_async"

API: Final = "(package __init__)"
"""The layer of the package's own ``__init__``: the public API."""

LAYERS: Final = (
    "ground floor",
    "data model",
    "backends",
    "request core",
    "pipelines",
    "engine",
    "rpc",
    "sync",
    API,
    "integrations",
    "cli/bench",
)
"""Layer names, low to high."""

RANK: Final = {name: rank for rank, name in enumerate(LAYERS)}

LAYER_OF: Final[Mapping[str, str]] = {
    # ground floor: what every floor uses; imports nothing of the package above it
    "config": "ground floor",
    "config_values": "ground floor",
    "errors": "ground floor",
    "logging": "ground floor",
    "events": "ground floor",
    "stats": "ground floor",
    "health": "ground floor",
    "tenancy": "ground floor",  # tenant names and tags; config's tenant_quotas
    # data model: a package per concept
    "keys": "data model",
    "layouts": "data model",
    "transfer": "data model",
    "memory": "data model",
    # the rest, bottom up
    "backends": "backends",
    # The request core's two-phase store/load: it drives the backends' storage manager, and
    # the pipelines' stages and the sidecar server call it (docs: "the request core").
    "core": "request core",
    "pipelines": "pipelines",
    "engine": "engine",
    "rpc": "rpc",
    "sync": "sync",
    "integrations": "integrations",
    "cli": "cli/bench",
    "bench": "cli/bench",
}
"""The layer of each top-level module or subpackage of the package."""


@dataclass(frozen=True)
class Edge:
    """One import: ``source`` imports ``target`` at ``path``:``line``."""

    source: str
    target: str
    path: str
    line: int
    where: str
    """``module level``, ``in function f``, ``under TYPE_CHECKING``..."""

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}  ({self.path}:{self.line}, {self.where})"


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package at ``root`` by dotted name: ``.py`` files (a package's
    ``__init__.py`` is the package's name) and compiled extensions."""
    suffixes = sorted(importlib.machinery.EXTENSION_SUFFIXES, key=len, reverse=True)
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).parts)
        name = parts[-1]
        if name.endswith(".py"):
            stem = name.removesuffix(".py")
        else:
            suffix = next((s for s in suffixes if name.endswith(s)), None)
            if suffix is None:
                continue
            stem = name.removesuffix(suffix)
        parts[-1] = stem
        if stem == "__init__":
            parts.pop()
        dotted = ".".join([package, *parts])
        existing = modules.get(dotted)
        if existing is None or existing.name != "__init__.py":  # a package beats a module
            modules[dotted] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportVisitor(ast.NodeVisitor):
    """Collects the imports of one module, each with where in the module it is."""

    def __init__(self, module: str, is_package: bool, known: set[str], package: str) -> None:
        self.module = module
        self.is_package = is_package
        self.known = known
        self.package = package
        self.context: list[str] = []
        self.found: list[tuple[str, int, str]] = []

    def _where(self) -> str:
        return ", ".join(self.context) if self.context else "module level"

    def _add(self, target: str, line: int) -> None:
        if target == self.package or target.startswith(self.package + "."):
            self.found.append((self._resolve(target), line, self._where()))

    def _resolve(self, target: str) -> str:
        """The deepest module of ``target`` that exists (``pkg.mod.name`` -> ``pkg.mod``)."""
        name = target
        while name not in self.known and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in self.known else target

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.context.append(f"in function {node.name}")
        self.generic_visit(node)
        self.context.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.context.append("under TYPE_CHECKING")
        for child in node.body:
            self.visit(child)
        self.context.pop()
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.module.split(".")
            base = parts if self.is_package else parts[:-1]
            if node.level - 1 > len(base) - 1:
                raise AssertionError(f"{self.module}:{node.lineno}: relative import beyond top")
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            self._add(sub if sub in self.known else source, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if (
            name in {"import_module", "__import__"}
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            self._add(node.args[0].value, node.lineno)
        self.generic_visit(node)


def import_edges(root: Path, package: str) -> tuple[dict[str, Path], list[Edge]]:
    """The modules of the package at ``root`` and every import arrow between them."""
    modules = module_files(root, package)
    known = set(modules)
    edges: list[Edge] = []
    for module, path in modules.items():
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        visitor = _ImportVisitor(module, path.name == "__init__.py", known, package)
        visitor.visit(tree)
        shown = str(path.relative_to(root.parent))
        for target, line, where in dict.fromkeys(visitor.found):  # `import a, b`: one arrow
            if target != module:
                edges.append(Edge(module, target, shown, line, where))
    return modules, edges


def top_name(module: str, package: str) -> str | None:
    """The top-level module or subpackage ``module`` lives in (None: the package itself)."""
    rest = module.removeprefix(package)
    return rest.lstrip(".").split(".", 1)[0] or None


def layer_of(module: str, package: str) -> str | None:
    """The layer of ``module``; None when its top-level name is in no table."""
    top = top_name(module, package)
    if top is None:
        return API
    return LAYER_OF.get(top)


def unplaced(modules: Iterable[str], package: str) -> list[str]:
    """Modules whose layer is unknown (a new top-level name not yet in the table)."""
    return sorted(m for m in modules if layer_of(m, package) is None)


def upward_edges(edges: Iterable[Edge], package: str) -> list[tuple[Edge, str, str]]:
    """Arrows from a layer to a higher one, each with both layers' names."""
    found = []
    for edge in edges:
        low, high = layer_of(edge.source, package), layer_of(edge.target, package)
        if low is not None and high is not None and RANK[high] > RANK[low]:
            found.append((edge, low, high))
    return found


def cycles(edges: Iterable[Edge]) -> list[list[Edge]]:
    """One concrete cycle (as its arrows) for every strongly connected group of modules."""
    edges = list(edges)
    graph: dict[str, dict[str, Edge]] = defaultdict(dict)
    for edge in edges:
        graph[edge.source].setdefault(edge.target, edge)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan, recursive: the graph is a few hundred nodes
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted({e.source for e in edges} | {e.target for e in edges}):
        if node not in index:
            connect(node)

    found = []
    for group in groups:
        start = min(group)
        # The shortest way round from start back to start inside the group (BFS).
        previous: dict[str, Edge] = {}
        frontier = [start]
        while frontier and start not in previous:
            following = []
            for node in frontier:
                for succ, edge in sorted(graph[node].items()):
                    if succ in group and succ not in previous:
                        previous[succ] = edge
                        following.append(succ)
            frontier = following
        path = [previous[start]]
        while path[-1].source != start:
            path.append(previous[path[-1].source])
        found.append(path[::-1])
    return sorted(found, key=lambda cycle: cycle[0].source)


def package_root() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.submodule_search_locations, f"{PACKAGE} not found"
    return Path(next(iter(spec.submodule_search_locations)))


def _cycle_report(found: list[list[Edge]]) -> str:
    lines = []
    for cycle in found:
        names = " -> ".join([cycle[0].source, *(edge.target for edge in cycle)])
        lines.append(f"cycle: {names}")
        lines.extend(f"    {edge}" for edge in cycle)
    return "\n".join(lines)


def _upward_report(found: list[tuple[Edge, str, str]]) -> str:
    return "\n".join(f"{low} imports {high}: {edge}" for edge, low, high in found)


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], list[Edge]]:
    return import_edges(package_root(), PACKAGE)


def test_the_walk_sees_the_package(graph: tuple[dict[str, Path], list[Edge]]) -> None:
    modules, edges = graph
    assert f"{PACKAGE}.errors" in modules and f"{PACKAGE}.rpc.client" in modules
    assert any(e.source == PACKAGE and e.target.startswith(f"{PACKAGE}.engine") for e in edges)


def test_every_top_level_module_has_a_layer(graph: tuple[dict[str, Path], list[Edge]]) -> None:
    modules, _ = graph
    missing = unplaced(modules, PACKAGE)
    if missing:
        pytest.fail(
            "modules with no layer: place their top-level name in LAYER_OF in "
            f"tests/test_imports.py (layers: {' < '.join(LAYERS)}): {missing}",
            pytrace=False,
        )


def test_no_import_cycles(graph: tuple[dict[str, Path], list[Edge]]) -> None:
    _, edges = graph
    found = cycles(edges)
    if found:
        pytest.fail(
            "import cycles (a lazy import inside a function or under TYPE_CHECKING counts "
            "too):\n" + _cycle_report(found),
            pytrace=False,
        )


def test_no_import_points_upward(graph: tuple[dict[str, Path], list[Edge]]) -> None:
    _, edges = graph
    found = upward_edges(edges, PACKAGE)
    if found:
        pytest.fail(
            f"imports against the layers {' < '.join(LAYERS)}:\n" + _upward_report(found),
            pytrace=False,
        )


def test_every_package_says_what_it_is_and_what_it_may_import() -> None:
    """Each top-level package's docstring says what it holds and, in a line starting
    ``May import:``, which layers it may import."""
    root = package_root()
    missing = []
    for init in sorted(root.glob("*/__init__.py")):
        tree = ast.parse(init.read_text(encoding="utf-8"))
        doc = ast.get_docstring(tree) or ""
        if not doc or "May import:" not in doc:
            missing.append(init.parent.name)
    assert not missing, f"packages whose docstring lacks 'May import:': {missing}"


def test_the_root_holds_only_the_ground_floor_and_packages() -> None:
    """The package's root is the ground floor (every floor uses it) and one package per
    concept: a new module at the root has to be placed in a package."""
    root = package_root()
    modules = sorted(path.stem for path in root.glob("*.py") if path.stem != "__init__")
    assert modules == sorted(
        top for top, layer in LAYER_OF.items() if layer == "ground floor" and top != "tenancy"
    ), modules
    packages = sorted(path.parent.name for path in root.glob("*/__init__.py"))
    assert set(packages) <= set(LAYER_OF), packages


# -- the checker itself ---------------------------------------------------------------------


def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")


def test_the_checker_finds_planted_cycles_arrows_and_unplaced_modules(tmp_path: Path) -> None:
    pkg = "fakepkg"
    root = tmp_path / pkg
    _write(
        root,
        {
            "__init__.py": "from .engine import Engine\n",
            "errors.py": "def late():\n    from .rpc import server\n",
            "keys.py": "from . import errors\n",
            "keys_memo.py": "import fakepkg.keys\n",
            "engine/__init__.py": "from .core import Engine\n",
            "engine/core.py": (
                "from typing import TYPE_CHECKING\n"
                "from ..keys import Key\n"
                "if TYPE_CHECKING:\n"
                "    from fakepkg.rpc import client\n"
                "class Engine: ...\n"
            ),
            "rpc/__init__.py": "",
            "rpc/client.py": "from ..engine.core import Engine\n",
            "rpc/server/__init__.py": "",
            "rpc/server/loop.py": (
                "import importlib\n"
                "def serve():\n"
                "    importlib.import_module('fakepkg.rpc.server.handlers')\n"
            ),
            "rpc/server/handlers.py": "from . import loop\nfrom ... import engine\n",
            "newthing.py": "",
        },
    )
    modules, edges = import_edges(root, pkg)
    assert unplaced(modules, pkg) == ["fakepkg.keys_memo", "fakepkg.newthing"]
    assert layer_of("fakepkg.keys", pkg) == "data model"
    assert layer_of("fakepkg.rpc.server.loop", pkg) == "rpc"
    arrows = {(e.source, e.target, e.where) for e in edges}
    assert ("fakepkg.errors", "fakepkg.rpc.server", "in function late") in arrows
    assert ("fakepkg.engine.core", "fakepkg.rpc.client", "under TYPE_CHECKING") in arrows
    assert ("fakepkg.keys", "fakepkg.errors", "module level") in arrows
    assert ("fakepkg.keys_memo", "fakepkg.keys", "module level") in arrows
    assert ("fakepkg.engine.core", "fakepkg.keys", "module level") in arrows
    assert ("fakepkg.rpc.server.handlers", "fakepkg.engine", "module level") in arrows

    upward = {(e.source, e.target, low, high) for e, low, high in upward_edges(edges, pkg)}
    assert upward == {
        ("fakepkg.errors", "fakepkg.rpc.server", "ground floor", "rpc"),
        ("fakepkg.engine.core", "fakepkg.rpc.client", "engine", "rpc"),
    }

    found = [[(e.source, e.target) for e in cycle] for cycle in cycles(edges)]
    assert found == [
        [
            ("fakepkg.engine.core", "fakepkg.rpc.client"),
            ("fakepkg.rpc.client", "fakepkg.engine.core"),
        ],
        [
            ("fakepkg.rpc.server.handlers", "fakepkg.rpc.server.loop"),
            ("fakepkg.rpc.server.loop", "fakepkg.rpc.server.handlers"),
        ],
    ]
    report = _cycle_report(cycles(edges))
    assert "under TYPE_CHECKING" in report and "rpc/server/loop.py:3" in report


def test_the_checker_passes_a_clean_package(tmp_path: Path) -> None:
    pkg = "cleanpkg"
    root = tmp_path / pkg
    _write(
        root,
        {
            "__init__.py": "from .engine import Engine\nfrom .errors import Error\n",
            "errors.py": "class Error(Exception): ...\n",
            "engine.py": "from .errors import Error\nclass Engine: ...\n",
            "cli.py": "from cleanpkg import Engine\nfrom . import engine\n",
        },
    )
    modules, edges = import_edges(root, pkg)
    assert not unplaced(modules, pkg)
    assert not upward_edges(edges, pkg)
    assert not cycles(edges)
    assert {(e.source, e.target) for e in edges} == {
        ("cleanpkg", "cleanpkg.engine"),
        ("cleanpkg", "cleanpkg.errors"),
        ("cleanpkg.engine", "cleanpkg.errors"),
        ("cleanpkg.cli", "cleanpkg"),
        ("cleanpkg.cli", "cleanpkg.engine"),
    }
