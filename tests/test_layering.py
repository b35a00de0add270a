"""The package's layering, read from every import of every module (function-level ones too).

- Imports go down the layers: ``zeroc`` (``compiler/``) -> ``zeroc.passes`` ->
  ``zeroc.codegen`` -> ``zeroc.runtime``.
- What runs a training step never imports planning, tuning or the command lines:
  ``zeroc.world``, ``zeroc.tuning`` and ``zeroc.cli`` are imported only by each other and by
  the package's entry points (``zeroc/__init__.py``, ``zeroc/__main__.py``).
- No import cycles between modules. Imports under ``if TYPE_CHECKING:`` are not imports.
- ``compiler/`` holds subpackages only, besides the package's own three files.
- ``docs/architecture.md`` names every module; no package folder holds more than 20 modules;
  the README and the architecture map stay short.
"""

from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {"compiler": "zeroc", "passes": "zeroc.passes", "codegen": "zeroc.codegen",
           "runtime": "zeroc.runtime"}
LAYERS = ("zeroc.runtime", "zeroc.codegen", "zeroc.passes")  # bottom first; the rest is zeroc
PLANNING = ("zeroc.world", "zeroc.tuning", "zeroc.cli")
ENTRY_POINTS = ("zeroc", "zeroc.__main__")


def _modules() -> dict[str, str]:
    """Every module's dotted name -> its file."""
    found = {}
    for folder, package in FOLDERS.items():
        base = os.path.join(REPO, folder)
        for root, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    relative = os.path.relpath(os.path.join(root, name), base)[:-3]
                    parts = [p for p in relative.split(os.sep) if p != "__init__"]
                    found[".".join([package, *parts])] = os.path.join(root, name)
    return found


def _imports(path: str, modules: dict[str, str]) -> set[str]:
    """The zeroc modules ``path`` imports, anywhere in it, outside ``if TYPE_CHECKING:``."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {owner(a.name) for a in node.names if a.name.startswith("zeroc")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zeroc"):
            for alias in node.names:  # ``from zeroc.world import fake_world`` names a module
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else owner(node.module))
    return found - {"", "zeroc"}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    assert len(modules) > 100 and "zeroc.world.fake_world" in modules
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _layer(module: str) -> int:
    return next((i for i, p in enumerate(LAYERS) if module == p or module.startswith(p + ".")),
                len(LAYERS))


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_imports_go_down_the_layers(graph: dict[str, set[str]]) -> None:
    upward = sorted(f"{a} imports {b}" for a, targets in graph.items() for b in targets
                    if _layer(b) > _layer(a))
    assert not upward, upward


def test_execution_never_imports_planning_tuning_or_the_cli(
        graph: dict[str, set[str]]) -> None:
    crossing = sorted(f"{a} imports {b}" for a, targets in graph.items() for b in targets
                      if _within(b, PLANNING) and not _within(a, PLANNING)
                      and a not in ENTRY_POINTS)
    assert not crossing, crossing


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    # Tarjan's strongly connected components, iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
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
                    cycles.append(sorted(component))
    assert not cycles, cycles


def test_the_checks_see_a_violation() -> None:
    """The rules fail on a graph that breaks them (the checks above are not vacuous)."""
    bad = {"zeroc.runtime.mesh": {"zeroc.passes.zero"}, "zeroc.passes.zero": set(),
           "zeroc.sharding.parallelize": {"zeroc.tuning.tune"}, "zeroc.tuning.tune": set(),
           "zeroc.frontend.a": {"zeroc.frontend.b"}, "zeroc.frontend.b": {"zeroc.frontend.a"}}
    for check in (test_imports_go_down_the_layers,
                  test_execution_never_imports_planning_tuning_or_the_cli, test_no_import_cycles):
        with pytest.raises(AssertionError):
            check(bad)


def test_compiler_holds_subpackages_only() -> None:
    loose = sorted(f for f in os.listdir(os.path.join(REPO, "compiler"))
                   if f.endswith(".py") and f not in ("__init__.py", "__main__.py", "errors.py"))
    assert not loose, loose


def test_the_architecture_map_names_every_module() -> None:
    """``docs/architecture.md`` names every module by its path (``compiler/world/fake_world``)."""
    with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as doc:
        text = doc.read()
    missing = sorted(
        path for path in (os.path.relpath(file, REPO)[:-3].replace(os.sep, "/")
                          for file in _modules().values())
        if not path.endswith("__init__") and f"`{path}`" not in text)
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_no_package_folder_holds_more_than_20_modules() -> None:
    """A newcomer reads a folder at a glance: at most 20 modules at its top (``__init__``
    included); more go into subpackages that name their job."""
    crowded = {}
    for folder in FOLDERS:
        for root, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            count = sum(name.endswith(".py") for name in files)
            if count > 20:
                crowded[os.path.relpath(root, REPO)] = count
    assert not crowded, crowded


@pytest.mark.parametrize(("page", "most"), [("README.md", 250), ("docs/architecture.md", 300)])
def test_the_front_pages_stay_short(page: str, most: int) -> None:
    """The README (what zeroc is, two commands, the loop, links) and the architecture map."""
    with open(os.path.join(REPO, page), encoding="utf-8") as text:
        lines = len(text.read().splitlines())
    assert lines <= most, f"{page} has {lines} lines (at most {most})"
