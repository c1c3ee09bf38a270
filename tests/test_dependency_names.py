"""Every module-level name the packages read from their dependencies (`optax.tree.norm`,
`jax.sharding.get_mesh`, `from jaxtyping import Array`, ...) exists in the installed versions.

Run on the oldest supported versions (CI's second step), this catches a declared lower bound that
lacks a name some rarely exercised path reads, which a quick subset of the suite would miss.
Imports inside a `try` (feature detection with a fallback) are exempt; attributes of classes and
functions are not followed (they may be set per instance)."""

import ast
import importlib
import types
from pathlib import Path

from test_import_direction import ROOT

DEPENDENCIES = ("jax", "jaxlib", "optax", "equinox", "jaxtyping", "beartype", "orbax", "numpy")
PACKAGES = ("spectrax_core", "spectrax_mpmd", "spectrax_eager")


def _resolve(base: str, chain: list[str]) -> str | None:
    """The first prefix of `base.chain` that does not exist (None: all exist, or the walk reached a
    class or function, whose attributes are not followed)."""
    try:
        obj = importlib.import_module(base)
    except ImportError:
        module, _, name = base.rpartition(".")
        obj = getattr(importlib.import_module(module), name, None)
        if obj is None:
            return base
    for k, name in enumerate(chain):
        if not isinstance(obj, types.ModuleType):
            return None
        nxt = getattr(obj, name, None)
        if nxt is None:
            try:
                nxt = importlib.import_module(f"{obj.__name__}.{name}")
            except ImportError:
                return ".".join([base, *chain[: k + 1]])
        obj = nxt
    return None


def _guarded(tree: ast.AST) -> set[int]:
    """ids of the nodes inside a `try` statement (feature detection and its fallback)."""
    return {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for n in ast.walk(t)}


def _dependency_import(node: ast.AST) -> bool:
    """Whether `node` is a `from <dependency> import ...`."""
    return isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] in DEPENDENCIES


def _aliases(tree: ast.AST, guarded: set[int]) -> dict[str, str]:
    """Local name -> dotted name, for every unguarded import of a dependency."""
    found = {}
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in DEPENDENCIES:
                    found[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif _dependency_import(node):
            found.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return found


def missing_names(path: Path) -> list[str]:
    """`"dotted.name (line)"` for each name `path` reads from a dependency that does not exist."""
    tree = ast.parse(path.read_text())
    guarded = _guarded(tree)
    aliases, inner, found = _aliases(tree, guarded), set(), []
    for node in ast.walk(tree):
        if _dependency_import(node) and id(node) not in guarded:
            for a in node.names:
                if (gone := _resolve(f"{node.module}.{a.name}", [])) is not None:
                    found.append(f"{gone} ({node.lineno})")
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        chain, head = [], node
        while isinstance(head, ast.Attribute):
            inner.add(id(head.value))
            chain.append(head.attr)
            head = head.value
        gone = _resolve(aliases[head.id], chain[::-1]) if getattr(head, "id", None) in aliases else None
        if gone is not None:
            found.append(f"{gone} ({node.lineno})")
    return sorted(set(found))


def test_a_planted_missing_name_is_found(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text(
        "import jax\nimport optax as ox\nfrom jax import numpy as jnp, no_such_name\n"
        "try:\n    from jax import also_missing\nexcept ImportError:\n    also_missing = None\n"
        "x = jax.sharding.NamedSharding.anything, jnp.zeros, ox.tree_missing.norm, jax.lax.not_here\n"
    )
    assert missing_names(planted) == [
        "jax.lax.not_here (8)",
        "jax.no_such_name (3)",
        "optax.tree_missing (8)",
    ]


def test_every_name_read_from_a_dependency_exists():
    files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    found = [f"{p.relative_to(ROOT)}: {name}" for p in files for name in missing_names(p)]
    assert not found, "names missing from the installed versions:\n" + "\n".join(found)
