"""The module paths of `spectrax-lib` kept here (`spectrax_eager.core.graph`, ...): each module
holds the names this project builds, and refuses the others of that path with an error naming
what to use (`not_built`). `keep_names` loads a package's submodules that share a name with one
of the package's own attributes (`functional.conv`, the module and the function) or a builtin
(`inspect.repr`)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any


def not_built(module: str, use: str) -> Callable[[str], Any]:
    """A module `__getattr__` for `module`: a public name it lacks raises `ImportError` (what
    `from module import name` raises) saying `use`; a private one, `AttributeError`."""

    def __getattr__(name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        raise ImportError(f"cannot import name {name!r} from {module!r}: {use}.", name=module)

    return __getattr__


def keep_names(package: str, submodules: Iterable[str]) -> None:
    """Load the `submodules` of `package` now and keep the package's namespace as it was (its own
    attribute of such a name, or none, so that a builtin such as `repr` stays in reach): loading a
    submodule binds it on its package, so one loaded later would replace them."""
    namespace = vars(sys.modules[package])
    for name in submodules:
        had, own = name in namespace, namespace.get(name)
        importlib.import_module(f"{package}.{name}")
        if had:
            namespace[name] = own
        else:
            del namespace[name]
