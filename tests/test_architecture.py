"""The layers of the core package, as docs/design.md draws them, checked on the import graph.

Every import counts, also one inside a function, except those under ``if TYPE_CHECKING:``
(annotations only). A floor may import the floors below it, never one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cacheblend_rag"

# What each part of the core may import from the package (besides itself).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors"},
    "data": set(),
    "concurrency": set(),
    "models": {"errors"},
    "engine": {"config", "errors", "models"},
    "store": {"engine", "config", "errors", "models", "prompting"},  # prompting: the CLI's warm
    "prompting": {"engine"},
    "testing": {"engine", "config"},
    "serving": {"engine", "store", "prompting", "config", "errors", "models", "concurrency", "testing"},
    "bench": {"engine", "store", "prompting", "config", "errors", "models", "data", "cli", "__init__"},
    "cli": {"store", "bench", "errors"},
    "__init__": {"config", "engine", "errors", "models"},
}
FRAMEWORKS = ("llama_index", "langchain", "langchain_core", "langchain_cacheblend")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports, outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            # ``from cacheblend_rag.engine import gate`` imports the module cacheblend_rag.engine.gate
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: {i for i in _imports(path) if i in MODULES and i != name} for name, path in MODULES.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_stay_on_their_floor(module):
    own = _part(module)
    if own not in ALLOWED:
        pytest.fail(f"{module} belongs to no layer of tests/test_architecture.py; add its folder to ALLOWED")
    reaching_up = sorted(i for i in GRAPH[module] if _part(i) != own and _part(i) not in ALLOWED[own])
    assert not reaching_up, f"{module} imports {reaching_up}, above or beside its layer ({own})"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_core_never_imports_a_framework(module):
    frameworks = sorted(i for i in _imports(MODULES[module]) if i.split(".")[0] in FRAMEWORKS)
    assert not frameworks, f"{module} imports {frameworks}: framework code belongs in integrations/"


def test_no_import_cycles():
    """Depth-first search for a cycle among the package's own modules."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(GRAPH[module]):
            # A package's __init__ importing its own submodules is how it re-exports them, not a cycle.
            if module == imported.rpartition(".")[0] or MODULES[module].name == "__init__.py" and \
                    imported.startswith(module + "."):
                continue
            if state.get(imported) == 1:
                return path[path.index(imported):] + [imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(MODULES):
        if module not in state and (cycle := visit(module)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_no_library_function_is_longer_than_80_lines():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, f"split these into named steps: {long}"
