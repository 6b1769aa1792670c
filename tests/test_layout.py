"""The folder tree is the architecture: these rules keep it that way.

- `supervisor/` keeps at most 12 top-level modules; concerns live in its rooms.
- Code outside a subpackage imports it through its `__init__` only (its API),
  never from the modules inside it.
- No import cycle between modules: module-level imports, those under `if TYPE_CHECKING:` (or any
  other module-level block) included, since a type-only cycle still ties two modules together;
  nor through imports deferred into functions. `from pkg import mod` ties a module to pkg/mod.py.
- No function of the product longer than 50 lines, no class longer than 400 (one named exception,
  with what is left to do about it).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gpuherd", "supervisor", "worker", "dataset_cache")
MAX_FUNCTION_LINES = 50
MAX_CLASS_LINES = 400
# Over the class cap today, and why: each entry holds its size then, so it may shrink, never grow.
LONG_CLASSES: dict[str, int] = {}  # a class allowed past MAX_CLASS_LINES, with the reason; none today


def _modules(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imports(path: Path, module_level_only: bool, entered: bool = False,
             modules: dict[str, Path] = MODULES) -> list[tuple[str, int]]:
    """Absolute names this module imports. `entered`: the module an import goes into
    (`from a.b import c` enters a.b); otherwise every module the import runs and binds:
    `from a.b import c` runs a.b, and a.b.c too where that is a module (`modules`), so
    `from supervisor.rendezvous import regroup_agent` ties this module to regroup_agent.py."""
    tree = ast.parse(path.read_text())
    nodes = list(_module_level(tree)) if module_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
            if not entered:
                found += [(f"{node.module}.{a.name}", node.lineno) for a in node.names
                          if f"{node.module}.{a.name}" in modules]
    roots = {mod.split(".")[0] for mod in modules}
    return list(dict.fromkeys((name, line) for name, line in found if name.split(".")[0] in roots))


def _module_level(node: ast.AST):
    """Every statement that runs (or, under `if TYPE_CHECKING:`, is read by a type checker) when
    the module is imported: the body and its blocks (if/try/with), never a function's body."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        yield child
        yield from _module_level(child)


def _subpackage_of(name: str) -> str | None:
    """The innermost package (below a top-level one) that contains `name`, if any."""
    parts = name.split(".")
    for n in range(len(parts) - 1, 1, -1):
        pkg = ".".join(parts[:n])
        if pkg in MODULES and MODULES[pkg].name == "__init__.py":
            return pkg
    return None


def test_supervisor_top_level_stays_small():
    top = [p.name for p in (REPO / "supervisor").glob("*.py")]
    assert len(top) <= 12, sorted(top)


def test_subpackages_are_entered_through_their_init():
    offenders = []
    for mod, path in MODULES.items():
        for name, line in _imports(path, module_level_only=False, entered=True):
            pkg = _subpackage_of(name)
            if pkg is None or name == pkg or mod == pkg or mod.startswith(pkg + "."):
                continue
            offenders.append(f"{path.relative_to(REPO)}:{line} imports {name} (use {pkg})")
    assert not offenders, "\n".join(offenders)


def _cycles(modules: dict[str, Path], module_level_only: bool = True) -> list[str]:
    """Import circles among `modules`, each as a -> b -> a (at least one per circle). An import
    ties a module to what it names and to the packages above that (their `__init__` runs first),
    never to a package the module itself is in (that one is being imported already)."""
    graph = defaultdict(set)
    for mod, path in modules.items():
        for name, _ in _imports(path, module_level_only=module_level_only, modules=modules):
            parts = name.split(".")
            for target in (".".join(parts[:n]) for n in range(len(parts), 0, -1)):
                if target in modules and target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt]) if nxt in stack else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for mod in sorted(modules):
        if mod not in state:
            visit(mod, [])
    return cycles


def test_no_import_cycles():
    cycles = _cycles(MODULES)
    assert not cycles, "\n".join(cycles)


def test_no_import_cycles_through_imports_deferred_into_functions_either():
    """An import put inside a function (torch, a heavy module, loaded only when needed) is fine; one
    put there to dodge a circle still ties the two modules together, and is one too."""
    cycles = _cycles(MODULES, module_level_only=False)
    assert not cycles, "\n".join(cycles)


def test_no_function_over_fifty_lines():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "\n".join(long)


def test_no_class_over_four_hundred_lines():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                name = f"{path.relative_to(REPO)}::{node.name}"
                if lines > LONG_CLASSES.get(name, MAX_CLASS_LINES):
                    long.append(f"{name}: {lines} lines")
    assert not long, "\n".join(long)


def test_type_only_and_block_imports_count_for_cycles(tmp_path):
    """A cycle through `if TYPE_CHECKING:` (or a try/except import) is still a cycle; an import
    inside a function (run later, on purpose) is not a module-level one."""
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    from worker.train import Trainer\n"
                    "try:\n    import dataset_cache\nexcept ImportError:\n    pass\n"
                    "def later():\n    from supervisor import main\n")
    assert _imports(path, module_level_only=True) == [("worker.train", 3), ("dataset_cache", 5)]
    assert ("supervisor", 9) in _imports(path, module_level_only=False)


def test_a_circle_through_from_package_import_module_is_caught(tmp_path):
    """The node agent's old circle, planted: `agent.py` takes its friend with `from pkg import friend`,
    the friend names `Agent` under `if TYPE_CHECKING:`. The checker used to resolve
    `from pkg import friend` to the package `pkg` alone, and an edge from a module into its own
    package is dropped (the package is being imported already), so it saw no edge agent -> friend and
    no circle. It resolves the name to the module pkg/friend.py now, where one exists."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""A package."""\n')
    (pkg / "agent.py").write_text("from pkg import friend\n\n\nclass Agent:\n    pass\n")
    (pkg / "friend.py").write_text("from typing import TYPE_CHECKING\n\n"
                                   "if TYPE_CHECKING:\n    from pkg.agent import Agent\n")
    modules = _modules(tmp_path, ("pkg",))
    assert ("pkg.friend", 1) in _imports(pkg / "agent.py", module_level_only=True, modules=modules)
    assert _cycles(modules) == ["pkg.agent -> pkg.friend -> pkg.agent"]

    (pkg / "agent.py").write_text("from pkg import VERSION\n")  # a name, not a module: the package alone
    assert _imports(pkg / "agent.py", module_level_only=True, modules=modules) == [("pkg", 1)]
    assert _cycles(modules) == []
