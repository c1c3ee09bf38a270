"""The packages' layout: no import cycle inside a package, the MPMD folders imported in pipeline
order (a folder never imports one above it), and every module and class within its size budget.

Every import statement counts, wherever it sits (module level, inside a function, under
`if TYPE_CHECKING`): a cycle dodged by a late import is still a cycle.
"""

import ast
from pathlib import Path

import pytest
from test_import_direction import ROOT, _package_of, _resolve_relative, imported_modules

PACKAGES = ("spectrax_core", "spectrax_mpmd", "spectrax_eager")

# spectrax_mpmd's parts in import order, lower first: each may import only parts listed before it
MPMD_ORDER = (
    "errors",
    "_env",
    "_trace",
    "_compile",
    "_comm",
    "_mesh",
    "_runtime",
    "_plan",
    "_stages",
    "_optim",
    "_api",
    "_planner",
    "_facade",
    "_checkpoint",
    "launch",
    "__init__",
)
BUDGETED = ("spectrax_mpmd", "spectrax_core/schedules")
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 200


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` under `root`."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _submodule_only(path: Path, name: str, modules: dict) -> set[str]:
    """Packages that `path` names only to import their submodules (`from . import _graph`):
    that binds a submodule and runs no more of the package, so it is no edge to the package."""
    package = _package_of(path, name)
    named, other = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = _resolve_relative(package, node.level, node.module) if node.level else node.module
            subs = all(f"{target}.{alias.name}" in modules for alias in node.names)
            (named if subs else other).add(target)
        elif isinstance(node, ast.Import):
            other.update(alias.name for alias in node.names)
    return named - other


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Each module of `package` -> the modules of `package` it imports (a package's `__init__`
    counts as the package)."""
    modules = _modules(root, package)
    return {
        name: {m for m in imported_modules(path) if m in modules} - {name} - _submodule_only(path, name, modules)
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` (its nodes in order, the first repeated last), or None."""
    finished: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in finished:
            return None
        for nxt in sorted(graph[node]):
            if (cycle := visit(nxt, path + [node])) is not None:
                return cycle
        finished.add(node)
        return None

    for node in sorted(graph):
        if (cycle := visit(node, [])) is not None:
            return cycle
    return None


def part_of(module: str) -> str:
    """The part of spectrax_mpmd (`MPMD_ORDER`) a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def order_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports of spectrax_mpmd that reach a part listed after the importer's own part."""
    rank = {part: k for k, part in enumerate(MPMD_ORDER)}
    found = []
    for module, targets in sorted(graph.items()):
        mine = part_of(module)
        for target in sorted(targets):
            theirs = part_of(target)
            if theirs != mine and rank.get(theirs, -1) > rank.get(mine, len(rank)):
                found.append(f"{module} ({mine}) imports {target} ({theirs}), a part above it")
    return found


def _over_budget(path: Path, root: Path = ROOT) -> list[str]:
    lines = path.read_text().splitlines()
    where = path.relative_to(root)
    found = [f"{where}: {len(lines)} lines"] if len(lines) > MAX_FILE_LINES else []
    for node in ast.walk(ast.parse("\n".join(lines))):
        size = node.end_lineno - node.lineno + 1 if isinstance(node, ast.ClassDef) else 0
        if size > MAX_CLASS_LINES:
            found.append(f"{where}: class {node.name} {size} lines")
    return found


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_planted_cycle_a_function_local_import_and_an_upward_import_are_found(tmp_path, monkeypatch):
    _plant(
        tmp_path,
        {
            "spectrax_mpmd/__init__.py": "from ._api import x\n",
            "spectrax_mpmd/_api/__init__.py": "from .grad import x\n",
            "spectrax_mpmd/_api/grad.py": "def f():\n    from .jit import y\n",
            "spectrax_mpmd/_api/jit.py": "from . import grad\n",
            "spectrax_mpmd/_trace/__init__.py": "",
            "spectrax_mpmd/_trace/split.py": "from .._plan import build\n",
            "spectrax_mpmd/_plan/__init__.py": "from .._trace import split\n",
        },
    )
    monkeypatch.setattr("test_import_direction.ROOT", tmp_path)
    graph = import_graph(tmp_path, "spectrax_mpmd")
    assert find_cycle(graph) is not None
    assert order_violations(graph) == [
        "spectrax_mpmd._trace.split (_trace) imports spectrax_mpmd._plan (_plan), a part above it"
    ]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_a_package(package):
    graph = import_graph(ROOT, package)
    assert len(graph) > 1
    cycle = find_cycle(graph)
    assert cycle is None, f"{package} has an import cycle: {' -> '.join(cycle)}"


def test_mpmd_parts_import_only_parts_below_them():
    graph = import_graph(ROOT, "spectrax_mpmd")
    unknown = sorted({part_of(m) for m in graph} - set(MPMD_ORDER))
    assert not unknown, f"place {unknown} in MPMD_ORDER"
    found = order_violations(graph)
    assert not found, "\n".join(found)


def test_modules_and_classes_stay_within_budget(tmp_path):
    planted = tmp_path / "big.py"
    planted.write_text("class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES)
    assert _over_budget(planted, tmp_path) == [f"big.py: class Big {MAX_CLASS_LINES + 1} lines"]
    files = [path for folder in BUDGETED for path in sorted((ROOT / folder).rglob("*.py"))]
    found = [line for path in files for line in _over_budget(path)]
    assert not found, "\n".join(found)
