"""The layers of the core package, as docs/design.md draws them, checked on the import graph.

Every import counts: at module level, inside a function, under ``if TYPE_CHECKING:`` (a reader
follows a type-only import as far as any other) and a module named in a string (``importlib``
over a table of plugin modules). A floor may import the floors below it, never one above, and no
module of the package or of the integration packages reaches itself through its imports.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cacheblend_rag"

# What each part of the core may import from the package (besides itself).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors"},
    "data": set(),
    "concurrency": set(),
    "models": {"errors"},
    "kv": {"errors"},  # segments and chunk K/V, what the engine and the store both speak
    # The saved calibration settings, which the engine reads: a floor of its own below the engine, while the rest of
    # calibration/ (measuring, choosing, the command) stands on the benchmark harness, above it.
    "calibration.lookup": {"config", "errors", "models"},
    # The text-to-token mapping of prompt K/V reuse: a floor of its own below the engine, which tokenizes with it.
    "reuse.text": {"errors"},
    "engine": {"config", "errors", "models", "kv", "calibration.lookup", "reuse.text"},
    "store": {"kv", "config", "errors", "models"},  # no module of engine/ (issue 72, item 3)
    # Prompt K/V reuse, one room: the prompt split, the announced chunks, the prefix and segment caches, and the plan
    # of where each span's K/V comes from (issue 72, item 2).
    "reuse": {"engine", "kv", "store", "config", "errors", "models", "reuse.text"},
    # `cacheblend-rag warm` and `cache stats`: an engine computes what the store keeps.
    "store_commands": {"store", "engine", "reuse", "kv", "config", "errors", "models"},
    "testing": {"engine", "config", "models"},
    "testing_tools": {"testing"},
    # No production module imports testing (the tiny-* names load from models.tiny and engine.tiny).
    "serving": {"engine", "store", "kv", "reuse", "config", "errors", "models", "concurrency", "calibration.lookup"},
    "bench": {"engine", "store", "kv", "reuse", "config", "errors", "models", "data", "__init__", "calibration.lookup"},
    "calibration": {"bench", "engine", "store", "kv", "reuse", "config", "errors", "models", "data",
                    "calibration.lookup"},
    # The HTTP server: a client of the serving layer, as the integrations are.
    "server": {"serving", "engine", "store", "reuse", "config", "errors", "models", "concurrency"},
    "cli": {"store_commands", "bench", "calibration", "models", "errors", "server"},  # the command groups, imported by name
    "__init__": {"config", "engine", "errors", "models"},
}
# Modules that are a floor of their own inside a room (the name ALLOWED knows them by).
OWN_FLOORS = {"cacheblend_rag.calibration.lookup": "calibration.lookup", "cacheblend_rag.reuse.text": "reuse.text"}
# A floor of its own inside a room is still the room's to its users: who may import reuse/ may import reuse.text.
for _allowed in ALLOWED.values():
    if "reuse" in _allowed:
        _allowed.add("reuse.text")
FRAMEWORKS = ("llama_index", "langchain", "langchain_core", "langchain_cacheblend")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _integration_sources() -> dict[str, Path]:
    """The integration packages' modules (each distribution's folder is its import root), tests aside."""
    sources = {}
    for dist in sorted(p for p in (ROOT / "integrations").iterdir() if p.is_dir()):
        for path in dist.rglob("*.py"):
            if "tests" not in path.relative_to(dist).parts:
                sources[_module_name(path, dist)] = path
    return sources


MODULES = {_module_name(p, ROOT): p for p in PACKAGE.rglob("*.py")}
EVERY_MODULE = {**MODULES, **_integration_sources()}


def _import_nodes(tree: ast.AST):
    """Each node of ``tree`` with how it runs: ``""`` (on import), ``"in a function"`` or ``"type-only"``."""
    todo = [(child, "") for child in ast.iter_child_nodes(tree)]
    while todo:
        node, kind = todo.pop()
        yield node, kind
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += [(child, "type-only") for child in node.body] + [(child, kind) for child in node.orelse]
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind != "type-only":
            kind = "in a function"
        todo += [(child, kind) for child in ast.iter_child_nodes(node)]


def _imports(module: str, path: Path, known: dict[str, Path] = EVERY_MODULE) -> dict[str, set[str]]:
    """Absolute names of what ``module`` (at ``path``) imports, each with how (see :func:`_import_nodes`,
    and ``"by name"`` for a string that spells the dotted name of a module in ``known``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, set[str]] = {}
    for node, kind in _import_nodes(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # ``from cacheblend_rag.engine import gate`` imports the module gate; the package's
            # __init__ counts only for a name it defines itself.
            submodules = [f"{origin}.{alias.name}" for alias in node.names if f"{origin}.{alias.name}" in known]
            names = submodules + ([origin] if len(submodules) < len(node.names) else [])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in known:
            # A dotted name only: a bare package name is as often a label (a version key, a namespace).
            names, kind = [node.value], "by name"
        for name in names:
            if name != module:
                found.setdefault(name, set()).add(kind)
    return found


IMPORTS = {name: _imports(name, path) for name, path in EVERY_MODULE.items()}
# module -> module it imports -> how
GRAPH = {name: {i: kinds for i, kinds in imported.items() if i in EVERY_MODULE} for name, imported in IMPORTS.items()}


def _part(module: str) -> str:
    if module in OWN_FLOORS:
        return OWN_FLOORS[module]
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
    frameworks = sorted(i for i in IMPORTS[module] if i.split(".")[0] in FRAMEWORKS)
    assert not frameworks, f"{module} imports {frameworks}: framework code belongs in integrations/"


INTEGRATION_MODULES = sorted(_integration_sources())


@pytest.mark.parametrize("module", INTEGRATION_MODULES)
def test_the_integrations_use_only_what_the_serving_layer_exports(module):
    """The integrations stand on ``cacheblend_rag.serving``'s exported names, so the core can move its
    modules without breaking them (issue 68)."""
    reached = sorted(i for i in IMPORTS[module] if i.split(".")[0] == "cacheblend_rag" and i != "cacheblend_rag.serving")
    assert not reached, f"{module} imports {reached}; import those names from cacheblend_rag.serving (export them there)"


def _reached_from(start: str) -> set[str]:
    reached, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += GRAPH.get(module, {})
    return reached


def test_bench_holds_only_what_the_bench_command_runs():
    """Measurement stays out of the wheel (issue 72): every module of ``cacheblend_rag/bench`` is reached from the
    ``cacheblend-rag bench`` command; what only the root benchmark scripts use lives in ``benchmarks/bench_support``,
    and calibration, a product feature, in ``cacheblend_rag/calibration``."""
    unreached = sorted(m for m in MODULES if m.startswith("cacheblend_rag.bench.")
                       and m not in _reached_from("cacheblend_rag.bench.commands"))
    assert not unreached, f"{unreached} are not run by `cacheblend-rag bench`; move them to benchmarks/bench_support"


# research/: the experiments behind research/quality_notebook.md. They import the package; the package and the
# integrations never import them (by package, by a script's module name, which they import each other by, or named
# in a string).
RESEARCH_SCRIPTS = {path.stem for path in (ROOT / "research").glob("*.py")}


@pytest.mark.parametrize("module", sorted(EVERY_MODULE))
def test_the_package_never_imports_research(module):
    imported = {name for name in IMPORTS[module] if name.split(".")[0] in RESEARCH_SCRIPTS | {"research"}}
    named = {node.value for node in ast.walk(ast.parse(EVERY_MODULE[module].read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and (node.value in RESEARCH_SCRIPTS or node.value.startswith("research."))}
    assert not imported | named, f"{module} imports {sorted(imported | named)}: research code stays out of the package"


def test_the_research_check_knows_the_research_scripts():
    assert {"fidelity_explore", "fidelity_oracle", "speed_fidelity"} <= RESEARCH_SCRIPTS


def _cycles(graph: dict[str, dict[str, set[str]]]) -> list[str]:
    """One loop per knot of mutually importing modules (a strongly connected component), shortest
    from its first module, as ``a -> b (type-only) -> a``: each step says how it imports, if not on
    import, and the knot's other modules follow."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    knots: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            knot = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(knot) > 1:
                knots.append(sorted(knot))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    loops = []
    for knot in sorted(knots):
        first, members = knot[0], set(knot)
        came_from: dict[str, str] = {}
        queue = deque([first])
        while first not in came_from:
            node = queue.popleft()
            for nxt in sorted(graph[node]):
                if nxt in members and nxt not in came_from:
                    came_from[nxt] = node
                    queue.append(nxt)
        path = [first]
        while len(path) == 1 or path[-1] != first:
            path.append(came_from[path[-1]])
        path.reverse()
        steps = [path[0]]
        for a, b in zip(path, path[1:]):
            how = ", ".join(sorted(k for k in graph[a][b] if k))
            steps.append(f"{b} ({how})" if how else b)
        others = sorted(members - set(path))
        loops.append(" -> ".join(steps) + (f"; in the same knot: {', '.join(others)}" if others else ""))
    return loops


def test_no_import_cycles():
    """Across the package and the integration packages, type-only and by-name imports included; a
    package's __init__ re-exporting its modules counts too, so a module importing its own package's
    __init__ is a cycle (it works only in the order the __init__ happens to import things)."""
    loops = _cycles(GRAPH)
    assert not loops, "import cycles:\n  " + "\n  ".join(loops)


def test_the_layers_are_floors():
    """No layer may import, itself or through others, a layer allowed to import it."""
    loops = _cycles({part: {other: {""} for other in allowed} for part, allowed in ALLOWED.items()})
    assert not loops, "ALLOWED lets layers import each other:\n  " + "\n  ".join(loops)


def test_the_graph_counts_every_kind_of_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "from cacheblend_rag.engine import gate, CacheBlendEngine\n"
        "if TYPE_CHECKING:\n"
        "    from cacheblend_rag.engine.blend import CacheBlendEngine\n"
        "else:\n"
        "    import cacheblend_rag.errors\n"
        "def later():\n"
        "    from .config import BlendConfig\n"
        "PLUGINS = ('cacheblend_rag.cli',)\n"
    )
    imports = _imports("cacheblend_rag.probe", probe)
    assert {name: kinds for name, kinds in imports.items() if name.startswith("cacheblend_rag")} == {
        "cacheblend_rag.engine.gate": {""},
        "cacheblend_rag.engine": {""},  # for CacheBlendEngine, which the package's __init__ defines
        "cacheblend_rag.engine.blend": {"type-only"},
        "cacheblend_rag.errors": {""},
        "cacheblend_rag.config": {"in a function"},
        "cacheblend_rag.cli": {"by name"},
    }


def test_a_cycle_names_its_modules_and_how_they_import():
    graph = {"a": {"b": {""}}, "b": {"c": {"in a function"}}, "c": {"a": {"type-only"}, "d": {""}}, "d": {}}
    assert _cycles(graph) == ["a -> b -> c (in a function) -> a (type-only)"]
    graph["a"]["e"], graph["e"] = {""}, {"a": {""}}
    assert _cycles(graph) == ["a -> e -> a; in the same knot: b, c"]


def test_no_library_function_is_longer_than_80_lines():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, f"split these into named steps: {long}"
