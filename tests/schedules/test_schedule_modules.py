"""The modules of `spectrax_core.schedules` import each other without a cycle.

Every import statement counts, wherever it sits (module level, inside a function,
under `if TYPE_CHECKING`): a cycle dodged by a late import is still a cycle.
"""

import ast
from pathlib import Path

import spectrax_core.schedules

PACKAGE = Path(spectrax_core.schedules.__file__).parent


def sibling_imports(source: str, siblings: set[str]) -> set[str]:
    """The sibling modules (by file stem) that `source` imports relatively."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is not None:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found & siblings


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


def import_graph(files: dict[str, str]) -> dict[str, set[str]]:
    names = {stem for stem in files if stem != "__init__"}
    return {stem: sibling_imports(src, names) - {stem} for stem, src in files.items() if stem != "__init__"}


def test_the_cycle_finder_sees_a_function_local_import():
    files = {
        "_a": "from ._b import x\n",
        "_b": "def f():\n    from ._c import y\n",
        "_c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._a import z\n",
        "_d": "from . import _a\n",
    }
    cycle = find_cycle(import_graph(files))
    assert cycle is not None and set(cycle) == {"_a", "_b", "_c"} and cycle[0] == cycle[-1]
    del files["_c"]
    assert find_cycle(import_graph(files)) is None


def test_schedule_modules_import_without_a_cycle():
    files = {path.stem: path.read_text() for path in PACKAGE.glob("*.py")}
    graph = import_graph(files)
    assert {"_memory", "_simulate", "_timeline"} <= set(graph)
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"
    assert "_simulate" not in graph["_memory"]
