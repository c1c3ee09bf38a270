"""Imports flow one way: spectrax_core <- spectrax_mpmd <- spectrax_eager.

Every module file of the three packages is parsed with `ast`; every import
statement counts, wherever it sits (module level, inside functions, under
`if TYPE_CHECKING`), relative imports are resolved against the module's
package, and `importlib.import_module("...")` / `__import__("...")` calls with
a literal name count too.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spectrax_core", "spectrax_mpmd", "spectrax_eager")
FORBIDDEN = {
    "spectrax_core": {"spectrax_mpmd", "spectrax_eager"},
    "spectrax_mpmd": {"spectrax_eager"},
    "spectrax_eager": set(),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(path: Path, module: str) -> str:
    """The package relative imports in `path` resolve against."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve_relative(package: str, level: int, name: str | None) -> str:
    base = package.split(".")
    if level > len(base):
        raise ValueError(f"relative import beyond the top-level package from {package!r}")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module that `path` imports."""
    module = _module_name(path)
    package = _package_of(path, module)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = _resolve_relative(package, node.level, node.module)
            else:
                target = node.module
            found.add(target)
            # `from pkg import sub` may import the sub-module `pkg.sub`.
            found.update(f"{target}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if called in ("import_module", "__import__") and isinstance(first, ast.Constant):
                if isinstance(first.value, str):
                    found.add(first.value)
    return found


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_helpers_resolve_relative_imports():
    assert _resolve_relative("spectrax_core.nn", 1, "_linear") == "spectrax_core.nn._linear"
    assert _resolve_relative("spectrax_core.nn", 2, "_apply") == "spectrax_core._apply"
    assert _resolve_relative("spectrax_core.nn", 2, None) == "spectrax_core"
    init = ROOT / "spectrax_core" / "nn" / "__init__.py"
    assert _package_of(init, _module_name(init)) == "spectrax_core.nn"
    linear = ROOT / "spectrax_core" / "nn" / "_linear.py"
    assert _package_of(linear, _module_name(linear)) == "spectrax_core.nn"
    assert "spectrax_core._apply" in imported_modules(linear)


def test_detector_sees_every_kind_of_import(tmp_path, monkeypatch):
    """A planted file with each import form must be caught (the check can fail)."""
    pkg = tmp_path / "spectrax_core" / "sub"
    pkg.mkdir(parents=True)
    planted = pkg / "_bad.py"
    planted.write_text(
        "import importlib\n"
        "from .. import sharding\n"
        "from ._sibling import thing\n"
        "def f():\n"
        "    import spectrax_eager.nn\n"
        "    from spectrax_mpmd import sxjit\n"
        "    return importlib.import_module('spectrax_eager'), __import__('spectrax_mpmd.x')\n"
    )
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert imported_modules(planted) == {
        "importlib",
        "spectrax_core",
        "spectrax_core.sharding",
        "spectrax_core.sub._sibling",
        "spectrax_core.sub._sibling.thing",
        "spectrax_eager.nn",
        "spectrax_mpmd",
        "spectrax_mpmd.sxjit",
        "spectrax_eager",
        "spectrax_mpmd.x",
    }
    with pytest.raises(ValueError, match="beyond the top-level package"):
        _resolve_relative("spectrax_core.sub", 3, "_x")


def violations(package: str) -> tuple[int, list[str]]:
    """(number of module files of `package`, the forbidden imports found in them)."""
    files = _files(package)
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in sorted(imported_modules(path))
        if name.split(".")[0] in FORBIDDEN[package]
    ]
    return len(files), found


def test_planted_violation_is_reported(tmp_path, monkeypatch):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("import jax\n")
    (tmp_path / "spectrax_core" / "_x.py").write_text("def f():\n    import spectrax_eager\n")
    (tmp_path / "spectrax_mpmd" / "_y.py").write_text("import spectrax_core\n")
    (tmp_path / "spectrax_eager" / "_z.py").write_text("import spectrax_mpmd, spectrax_core\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert violations("spectrax_core") == (2, ["spectrax_core/_x.py imports spectrax_eager"])
    assert violations("spectrax_mpmd") == (2, [])
    assert violations("spectrax_eager") == (2, [])


@pytest.mark.parametrize("package", PACKAGES)
def test_import_direction(package):
    assert (ROOT / package / "__init__.py").is_file(), f"{package}/__init__.py is missing"
    n_files, found = violations(package)
    assert n_files > 0, f"no module files found under {ROOT / package}"
    assert not found, f"{package} must not import {sorted(FORBIDDEN[package])}:\n" + "\n".join(found)

