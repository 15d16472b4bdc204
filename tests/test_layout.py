"""The code's shape: dependencies point one way, the cost model is the only thing that
prices, and no module outgrows one concept.

Read from the source with ``ast`` (every import, at module level or inside a function,
``TYPE_CHECKING`` blocks apart), so these hold for code paths no other test runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("autopar", "profiler")
MAX_LINES = 500
ENTRY_POINTS = ("autopar.cli", "autopar.cli.demo")
"""The command line: the one place of ``autopar`` that loads the profiler (its
subcommands, and the demo's measurements), and only when a command runs."""


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import of ``path`` outside
    ``if TYPE_CHECKING:`` blocks; ``from a.b import c`` names ``a.b.c`` where that is a
    module, else ``a.b``."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for alias in child.names:
                    sub = f"{child.module}.{alias.name}"
                    found.append((sub if sub in MODULES else child.module, top))
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))

    visit(tree, True)
    return found


def _graph(*, lazy: bool) -> nx.DiGraph:
    g = nx.DiGraph()
    for name, path in MODULES.items():
        g.add_node(name)
        for target, top in _imports(path):
            if target in MODULES and target != name and (lazy or top):
                g.add_edge(name, target)
    return g


def test_no_import_cycles_even_through_imports_inside_functions():
    cycles = list(nx.simple_cycles(_graph(lazy=True)))
    assert not cycles, f"import cycles: {sorted(cycles, key=len)[:5]}"


def test_the_library_never_imports_the_profiler():
    """``profiler`` builds on ``autopar``; ``autopar`` reads profiles as its own typed
    data. Only the command line loads the profiler's subcommands, lazily."""
    for name, path in MODULES.items():
        if not name.startswith("autopar"):
            continue
        for target, top in _imports(path):
            if target.split(".")[0] == "profiler":
                assert name in ENTRY_POINTS and not top, f"{name} imports {target}"


def test_the_search_prices_nothing_itself():
    """The search asks the cost model for every number: it imports no primitive of the
    roofline or the collectives, and the cost model imports nothing of the search."""
    primitives = {"autopar.cost.comm", "autopar.cost.compute", "autopar.cost.host"}
    for name, path in MODULES.items():
        targets = {t for t, _ in _imports(path)}
        if name.startswith("autopar.search"):
            assert not targets & primitives, f"{name} prices with {sorted(targets & primitives)}"
        if name.startswith("autopar.cost"):
            assert not {t for t in targets if t.startswith("autopar.search")}, f"{name} imports the search"


def test_data_types_know_neither_factories_nor_renderers():
    """Plans and clusters are data: presets, profiles and text or HTML renderings are
    made elsewhere."""
    for name in ("autopar.plan", "autopar.hardware.cluster", "autopar.hardware.device"):
        targets = {t for t, _ in _imports(MODULES[name])}
        assert not {
            t for t in targets if t.startswith(("autopar.present", "autopar.profiles", "autopar.hardware.presets"))
        }


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_outgrows_one_concept(name):
    """The size habit, counted on formatted code (CI checks the formatting)."""
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by concept"
