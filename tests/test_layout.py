"""The folder tree is the architecture: these rules keep it that way.

- `supervisor/` keeps at most 12 top-level modules; concerns live in its rooms.
- Code outside a subpackage imports it through its `__init__` only (its API),
  never from the modules inside it.
- No import cycle between modules: module-level imports, those under `if TYPE_CHECKING:` (or any
  other module-level block) included, since a type-only cycle still ties two modules together.
- No function of the product longer than 60 lines.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gpuherd", "supervisor", "worker", "dataset_cache")
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imports(path: Path, module_level_only: bool, entered: bool = False) -> list[tuple[str, int]]:
    """Absolute names this module imports. `entered`: the module an import goes into
    (`from a.b import c` enters a.b); otherwise what it binds (a.b.c where that is a module)."""
    tree = ast.parse(path.read_text())
    nodes = list(_module_level(tree)) if module_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                bound = full if full in MODULES and MODULES[node.module].name != "__init__.py" else node.module
                found.append((node.module if entered else bound, node.lineno))
    return [(name, line) for name, line in found if name.split(".")[0] in PACKAGES]


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


def test_no_import_cycles():
    graph = defaultdict(set)
    for mod, path in MODULES.items():
        for name, _ in _imports(path, module_level_only=True):
            target = name
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != mod and not mod.startswith(target + "."):
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

    for mod in sorted(MODULES):
        if mod not in state:
            visit(mod, [])
    assert not cycles, "\n".join(cycles)


def test_no_function_over_sixty_lines():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines")
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
