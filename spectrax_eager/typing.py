"""`spx.typing`: type aliases for annotating code that uses the facade."""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import jax
import numpy as np

from ._compat.paths import not_built

Array = jax.Array
ArrayLike = jax.typing.ArrayLike
DType = jax.typing.DTypeLike
PRNGKey = jax.Array
Shape = Sequence[int]
PyTree = Any
#: One step of a dotted module path: an attribute name or a container index.
PathComponent = Union[str, int]
Path = tuple[PathComponent, ...]
#: `init(key, shape, dtype) -> array`, as `spx.init` and `jax.nn.initializers` give.
Initializer = Callable[[PRNGKey, Shape, DType], Array]
#: A hook run before a module's forward (see `spx.hooks.register_forward_pre_hook`).
ForwardPreHook = Callable[..., Any]
#: A hook run after a module's forward (see `spx.hooks.register_forward_hook`).
ForwardHook = Callable[..., Any]
#: `fn(path, module) -> bool`, as `spx.iter_modules(select=)` takes.
ModulePredicate = Callable[[str, Any], bool]
#: `fn(path, variable) -> bool`, as the selectors take.
VariablePredicate = Callable[[str, Any], bool]
#: Logical axis names of an array, one per axis (None: unsharded).
AxisNames = tuple[Union[str, None], ...]
Numeric = Union[int, float, np.number]

__getattr__ = not_built(__name__, "variable hooks are not built, so there is no observer type; see spx.hooks")

__all__ = [
    "Array",
    "ArrayLike",
    "AxisNames",
    "DType",
    "ForwardHook",
    "ForwardPreHook",
    "Initializer",
    "ModulePredicate",
    "Numeric",
    "PRNGKey",
    "Path",
    "PathComponent",
    "PyTree",
    "Shape",
    "VariablePredicate",
]
