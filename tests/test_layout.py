"""The packages' layout: no import cycle inside a package, the MPMD folders and the eager facade's
parts imported in order (a part never imports one above it), only the facade's `_pipeline` importing
`spectrax_mpmd`, and only its public names (and `import spectrax_eager` not importing it at all),
the facade's ambient state
in one context variable, and every module, class and function within its size budget.

Every import statement counts, wherever it sits (module level, inside a function, under
`if TYPE_CHECKING`): a cycle dodged by a late import is still a cycle.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_import_direction import ROOT, _package_of, _resolve_relative, imported_modules

PACKAGES = ("spectrax_core", "spectrax_mpmd", "spectrax_eager")

# spectrax_mpmd's parts in import order, lower first: each may import only parts listed before it
MPMD_ORDER = (
    "errors",
    "_env",
    "_buckets",
    "_trace",
    "_compile",
    "_comm",
    "_mesh",
    "_settings",
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
# spectrax_eager's parts in import order, lower first. `_transforms` sits above `_pipeline`: `spx.jit`
# on an MPMD mesh compiles through the pipeline runtime, which needs no transform.
EAGER_ORDER = (
    "_errors",
    "_compat",
    "_scope",
    "_sharding",
    "_graph",
    "nn",
    "contrib",
    "_pipeline",
    "_transforms",
    "common_types",
    "context",
    "functional",
    "hooks",
    "init",
    "inspect",
    "runtime",
    "sharding",
    "typing",
    "api",
    "core",
    "lint",
    "loggers",
    "rng",
    "serialization",
    "transforms",
    "__init__",
)
MPMD_IMPORTING_PART = "_pipeline"  # the one part of spectrax_eager that may import spectrax_mpmd
AMBIENT = "spectrax_eager/_scope/ambient.py"  # the one module of spectrax_eager holding a context variable
# Module-level state of spectrax_eager besides the ambient record: caches and a registry, each
# commented where it is defined (every "current" setting lives in the ambient record instead).
EAGER_MODULE_STATE = (
    "spectrax_eager/_graph/structure.py epoch",  # the structure epoch cached plans are checked against
    "spectrax_eager/_pipeline/run.py _runners",  # compiled runners of `spx.run`
    "spectrax_eager/nn/_base.py _EAGER_OF",  # the eager layer class of each core params class
    "spectrax_eager/nn/_base.py _FIELDS",  # the init fields of each core params class
)
BUDGETED = ("spectrax_mpmd", "spectrax_core/schedules", "spectrax_eager")
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 200
FUNCTION_CHECKED = ("spectrax_core", "spectrax_mpmd", "spectrax_eager")
MAX_FUNCTION_CODE_LINES = 80


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


def order_violations(graph: dict[str, set[str]], order: tuple[str, ...] = MPMD_ORDER) -> list[str]:
    """Imports that reach a part listed after the importer's own part in `order`."""
    rank = {part: k for k, part in enumerate(order)}
    found = []
    for module, targets in sorted(graph.items()):
        mine = part_of(module)
        for target in sorted(targets):
            theirs = part_of(target)
            if theirs != mine and rank.get(theirs, -1) > rank.get(mine, len(rank)):
                found.append(f"{module} ({mine}) imports {target} ({theirs}), a part above it")
    return found


def mpmd_importers(root: Path = ROOT) -> list[str]:
    """Modules of spectrax_eager outside `MPMD_IMPORTING_PART` that import spectrax_mpmd (any import
    statement, wherever it sits)."""
    return [
        f"{name} imports {target}"
        for name, path in _modules(root, "spectrax_eager").items()
        if part_of(name) != MPMD_IMPORTING_PART
        for target in sorted(imported_modules(path))
        if target.split(".")[0] == "spectrax_mpmd"
    ]


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def private_mpmd_uses(root: Path = ROOT) -> list[str]:
    """Where spectrax_eager reaches past `spectrax_mpmd`'s public names: an import of a private
    module or name (`spectrax_mpmd._trace`, `from spectrax_mpmd import _mesh`), or a private
    attribute of the imported package (`mp._comm`)."""
    found = []
    for name, path in _modules(root, "spectrax_eager").items():
        private = {t for t in imported_modules(path) if t.split(".")[0] == "spectrax_mpmd" and _private(t)}
        found += [  # `from spectrax_mpmd._x import y` once, as `spectrax_mpmd._x`
            f"{name} imports {target}"
            for target in sorted(private)
            if not any(target.startswith(other + ".") for other in private)
        ]
        tree = ast.parse(path.read_text())
        aliases = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
            if alias.name == "spectrax_mpmd"
        }
        found += [
            f"{name} reads {node.value.id}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _private(node.attr)
        ]
    return found


def context_variables(root: Path, package: str) -> list[str]:
    """Where the modules of `package` make a `ContextVar` or a `threading.local` (ambient state)."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("ContextVar", "local"):
                found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return found


def _empty_container(value: ast.AST | None) -> bool:
    """Whether `value` makes an empty container (or `[None]`, a one-slot cell) to be filled later."""
    if isinstance(value, ast.List | ast.Set):
        return all(isinstance(e, ast.Constant) and e.value is None for e in value.elts)
    if isinstance(value, ast.Dict):
        return not value.keys
    func = value.func if isinstance(value, ast.Call) else None
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("list", "dict", "set", "OrderedDict", "defaultdict", "deque") and not value.args


def module_state(root: Path, package: str) -> list[str]:
    """`"path name"` of each module-level name of `package` bound to an empty container (state
    filled as the program runs) or rebound through a `global` statement."""
    found = set()
    for path in sorted((root / package).rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if isinstance(node, ast.Assign | ast.AnnAssign) and _empty_container(node.value):
                found.update(f"{path.relative_to(root)} {t.id}" for t in targets if isinstance(t, ast.Name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.update(f"{path.relative_to(root)} {name}" for name in node.names)
    return sorted(found)


def code_lines(node: ast.AST, lines: list[str]) -> int:
    """Lines of `node` holding code: neither blank, nor only a comment, nor part of a docstring
    (its own or a nested function's or class's)."""
    docstrings = set()
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    docstrings.update(range(first.lineno, first.end_lineno + 1))
    return sum(
        1
        for n in range(node.lineno, node.end_lineno + 1)
        if n not in docstrings and lines[n - 1].strip() and not lines[n - 1].strip().startswith("#")
    )


def long_functions(paths: list[Path], root: Path = ROOT, limit: int = MAX_FUNCTION_CODE_LINES) -> list[str]:
    """Functions (nested ones included, counted within their parent too) of more than `limit`
    lines of code."""
    found = []
    for path in paths:
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (size := code_lines(node, lines)) > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} {size} lines of code")
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


def test_planted_eager_violations_are_found(tmp_path, monkeypatch):
    """An upward import between the facade's parts, an import of spectrax_mpmd outside `_pipeline`
    (also inside a function), a context variable outside the ambient module and module-level state
    (an empty container to fill, a `[None]` cell, a `global`) are each reported."""
    _plant(
        tmp_path,
        {
            "spectrax_eager/__init__.py": "from ._graph import module\n",
            "spectrax_eager/_graph/__init__.py": "",
            "spectrax_eager/_graph/module.py": "def f():\n    from .._transforms import jit\n",
            "spectrax_eager/_transforms/__init__.py": "",
            "spectrax_eager/_transforms/jit.py": "def g():\n    import spectrax_mpmd\n",
            "spectrax_eager/_pipeline/__init__.py": "",
            "spectrax_eager/_pipeline/run.py": "import spectrax_mpmd._comm\nimport contextvars\n",
            "spectrax_eager/_scope/__init__.py": "",
            "spectrax_eager/_scope/ambient.py": "import contextvars\nA = contextvars.ContextVar('a')\n",
            "spectrax_eager/_scope/lazy.py": "from contextvars import ContextVar\nB = ContextVar('b')\n",
            "spectrax_eager/_sharding/rules.py": "_stack: list = []\n_latest = [None]\nTABLE = {'a': 1}\n",
            "spectrax_eager/_graph/structure.py": "n = 0\ndef bump():\n    global n\n    n += 1\n",
        },
    )
    monkeypatch.setattr("test_import_direction.ROOT", tmp_path)
    graph = import_graph(tmp_path, "spectrax_eager")
    assert order_violations(graph, EAGER_ORDER) == [
        "spectrax_eager._graph.module (_graph) imports spectrax_eager._transforms.jit (_transforms), a part above it"
    ]
    assert mpmd_importers(tmp_path) == ["spectrax_eager._transforms.jit imports spectrax_mpmd"]
    assert private_mpmd_uses(tmp_path) == ["spectrax_eager._pipeline.run imports spectrax_mpmd._comm"]
    assert context_variables(tmp_path, "spectrax_eager") == [
        "spectrax_eager/_scope/ambient.py:2 ContextVar",
        "spectrax_eager/_scope/lazy.py:2 ContextVar",
    ]
    assert module_state(tmp_path, "spectrax_eager") == [
        "spectrax_eager/_graph/structure.py n",
        "spectrax_eager/_sharding/rules.py _latest",
        "spectrax_eager/_sharding/rules.py _stack",
    ]


def test_eager_parts_import_only_parts_below_them():
    graph = import_graph(ROOT, "spectrax_eager")
    unknown = sorted({part_of(m) for m in graph} - set(EAGER_ORDER))
    assert not unknown, f"place {unknown} in EAGER_ORDER"
    found = order_violations(graph, EAGER_ORDER)
    assert not found, "\n".join(found)


def test_only_the_eager_pipeline_part_imports_spectrax_mpmd():
    found = mpmd_importers()
    assert not found, "\n".join(found)


def test_planted_private_mpmd_uses_are_found(tmp_path, monkeypatch):
    """Each way of reaching a private part of spectrax_mpmd from the facade is reported; public
    names are not."""
    _plant(
        tmp_path,
        {
            "spectrax_eager/__init__.py": "",
            "spectrax_eager/_pipeline/__init__.py": "",
            "spectrax_eager/_pipeline/a.py": "def f():\n    from spectrax_mpmd._trace.jaxpr import name_stack\n",
            "spectrax_eager/_pipeline/b.py": "from spectrax_mpmd import _mesh, MpmdMesh\n",
            "spectrax_eager/_pipeline/c.py": "import spectrax_mpmd as mp\nx = mp._comm.Exchange\ny = mp.run\n",
            "spectrax_eager/_pipeline/d.py": "import spectrax_mpmd\nfrom spectrax_mpmd import sxjit\n",
        },
    )
    monkeypatch.setattr("test_import_direction.ROOT", tmp_path)
    assert private_mpmd_uses(tmp_path) == [
        "spectrax_eager._pipeline.a imports spectrax_mpmd._trace.jaxpr",
        "spectrax_eager._pipeline.b imports spectrax_mpmd._mesh",
        "spectrax_eager._pipeline.c reads mp._comm",
    ]


def test_the_facade_uses_only_public_names_of_spectrax_mpmd():
    found = private_mpmd_uses()
    assert not found, "\n".join(found)


def test_import_spectrax_eager_does_not_import_spectrax_mpmd():
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    check = (
        "import spectrax_eager, sys; assert 'spectrax_mpmd' not in sys.modules, 'spectrax_mpmd was imported'"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


def test_eager_ambient_state_is_one_context_variable():
    found = context_variables(ROOT, "spectrax_eager")
    assert [line.split(":")[0] for line in found] == [AMBIENT], found
    state = module_state(ROOT, "spectrax_eager")
    assert sorted(state) == sorted(EAGER_MODULE_STATE), "module-level state outside the ambient record"


def test_functions_stay_within_budget(tmp_path):
    planted = tmp_path / "long.py"
    body = "".join(
        f"    x{k} = {k}  # counted\n    # not counted\n\n" for k in range(MAX_FUNCTION_CODE_LINES)
    )
    planted.write_text(
        f'def long():\n    """A docstring\n\n    of lines."""\n{body}\n\ndef short():\n    pass\n'
    )
    assert long_functions([planted], tmp_path) == [
        f"long.py:1 long {MAX_FUNCTION_CODE_LINES + 1} lines of code"
    ]
    files = [path for folder in FUNCTION_CHECKED for path in sorted((ROOT / folder).rglob("*.py"))]
    found = long_functions(files)
    assert not found, "\n".join(found)
