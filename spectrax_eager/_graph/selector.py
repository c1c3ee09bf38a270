"""Selectors: one way to name a subset of a model's Variables.

The same selector serves `grad(wrt=)`, `jit(mutable=)`, `Optimizer(wrt=)`,
`freeze`, `iter_variables(select=)` and `State.filter`. Sugar accepted
wherever a selector is expected:

* a collection name (`"parameters"`, `"buffers"`, a user `default_kind`);
  a string containing `*`, `?`, `[` or `.` is a path glob instead
  (`"*.weight"`, `"blocks.0.*"`; fnmatch on the dotted path);
* a Variable subclass (instances of it), or a Module subclass (variables
  anywhere under an instance of it);
* a predicate `fn(path, variable) -> bool`;
* a list/tuple of the above (their union); `True` / `...` (everything);
  `None` / `False` (nothing);
* a `Selector` built with `select()` and combined with `| & - ~`, or with
  `all_of`, `any_of`, `not_`; `Everything` / `Nothing` (the class or an instance).
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Any, Callable

from .._errors import SelectorError
from .module import plan_of, require_module
from .structure import VarInfo, thaw
from .variable import Variable, _new_like

_GLOB = set("*?[.")


class Selector:
    """A predicate over variables; build with `select()` and the chainable methods below."""

    def match(self, info: VarInfo, var: Variable) -> bool:
        raise TypeError(f"{type(self).__name__} is abstract")

    def __or__(self, other: Any) -> Selector:
        return _or(self, as_selector(other))

    def __ror__(self, other: Any) -> Selector:
        return _or(as_selector(other), self)

    def __and__(self, other: Any) -> Selector:
        return _and(self, as_selector(other))

    def __rand__(self, other: Any) -> Selector:
        return _and(as_selector(other), self)

    def __sub__(self, other: Any) -> Selector:
        return _and(self, _not(as_selector(other)))

    def __rsub__(self, other: Any) -> Selector:
        return _and(as_selector(other), _not(self))

    def __invert__(self) -> Selector:
        return _not(self)

    def at_instances_of(self, *module_types: type) -> Selector:
        """Keep variables that live (at any depth) under an instance of one of `module_types`."""
        return _and(self, _at_instances(module_types))

    def of_type(self, *variable_types: type) -> Selector:
        """Keep variables that are instances of one of `variable_types`."""
        return _and(self, _of_type(variable_types))

    def in_collection(self, *kinds: str) -> Selector:
        """Keep variables whose collection is one of `kinds`."""
        return _and(self, _collection(kinds))

    variables = in_collection  # the seed library's name

    def apply(self, module: Any) -> list[tuple[str, Variable]]:
        """`[(path, variable)]` of the module's variables this selector matches."""
        plan = plan_of(require_module(module, "Selector.apply"))
        return [(i.path, v) for i, v, keep in zip(plan.infos, plan.vars, mask(plan, self)) if keep]

    def partition_state(self, module: Any, state: Any) -> tuple[Any, Any]:
        """`(matched, rest)`: `state` (of `module`) split by this selector."""
        keep = {(var.kind, path) for path, var in self.apply(module)}
        picked = [(i.kind, i.path) in keep for i in state._infos]
        parts = []
        for want in (True, False):
            infos = tuple(i for i, k in zip(state._infos, picked) if k is want)
            parts.append(type(state)(infos, [v for v, k in zip(state._values, picked) if k is want]))
        return parts[0], parts[1]

    def not_instances_of(self, *module_types: type) -> Selector:
        """Drop variables that live (at any depth) under an instance of one of `module_types`."""
        return _and(self, _not(_at_instances(module_types)))

    def at_path(self, *globs: str) -> Selector:
        """Keep variables whose dotted path matches one of the fnmatch `globs`."""
        return _and(self, _path(globs))

    def where(self, predicate: Callable[[str, Variable], bool]) -> Selector:
        """Keep variables for which `predicate(path, variable)` is true."""
        return _and(self, _where(predicate))


class Everything(Selector):
    """Matches every variable (`spx.Everything` or `spx.Everything()`)."""

    def match(self, info, var):
        return True

    def __repr__(self):
        return "Everything()"


class Nothing(Selector):
    """Matches no variable (`spx.Nothing` or `spx.Nothing()`)."""

    def match(self, info, var):
        return False

    def __repr__(self):
        return "Nothing()"


class _Test(Selector):
    """The selector of a test `(info, var) -> bool`, shown as `text` (every selector below)."""

    def __init__(self, test: Callable[[VarInfo, Variable], bool], text: str):
        self.test, self.text = test, text

    def match(self, info, var):
        return self.test(info, var)

    def __repr__(self):
        return self.text


def _names(types: tuple) -> str:
    return ", ".join(t.__name__ for t in types)


def _collection(kinds) -> Selector:
    kinds = frozenset(kinds)
    return _Test(lambda info, var: info.kind in kinds, f"in_collection{tuple(sorted(kinds))}")


def _of_type(types) -> Selector:
    types = tuple(types)
    return _Test(lambda info, var: issubclass(info.type, types), f"of_type({_names(types)})")


def _at_instances(types) -> Selector:
    types = tuple(types)
    return _Test(
        lambda info, var: any(issubclass(o, types) for o in info.owners), f"at_instances_of({_names(types)})"
    )


def _path(globs) -> Selector:
    globs = tuple(globs)
    return _Test(lambda info, var: any(fnmatch.fnmatchcase(info.path, g) for g in globs), f"at_path{globs}")


def _path_test(name: str, text: str, test: Callable[[str, str], bool]) -> Selector:
    return _Test(lambda info, var: test(info.path, text), f"{name}({text!r})")


def _where(predicate) -> Selector:
    text = f"where({getattr(predicate, '__name__', predicate)})"
    return _Test(lambda info, var: bool(predicate(info.path, var)), text)


def _or(a: Selector, b: Selector) -> Selector:
    return _Test(lambda info, var: a.match(info, var) or b.match(info, var), f"({a!r} | {b!r})")


def _and(a: Selector, b: Selector) -> Selector:
    return _Test(lambda info, var: a.match(info, var) and b.match(info, var), f"({a!r} & {b!r})")


def _not(a: Selector) -> Selector:
    return _Test(lambda info, var: not a.match(info, var), f"~{a!r}")


def select() -> Selector:
    """A selector of every variable, to refine with `.of_type(...)`, `.at_path(...)`, ..."""
    return Everything()


def path_contains(text: str) -> Selector:
    """Variables whose dotted path contains `text`."""
    return _path_test("path_contains", text, lambda p, t: t in p)


def path_startswith(prefix: str) -> Selector:
    """Variables whose dotted path starts with `prefix`."""
    return _path_test("path_startswith", prefix, str.startswith)


def path_endswith(suffix: str) -> Selector:
    """Variables whose dotted path ends with `suffix`."""
    return _path_test("path_endswith", suffix, str.endswith)


def of_type(*variable_types: type) -> Selector:
    """Variables that are instances of one of `variable_types`."""
    return _of_type(variable_types)


def all_of(*selectors: Any) -> Selector:
    """Variables every one of `selectors` matches (`Everything` when none is given)."""
    sels = [as_selector(s) for s in selectors]
    return functools.reduce(_and, sels) if sels else Everything()


def any_of(*selectors: Any) -> Selector:
    """Variables at least one of `selectors` matches (`Nothing` when none is given)."""
    sels = [as_selector(s) for s in selectors]
    return functools.reduce(_or, sels) if sels else Nothing()


def not_(selector: Any) -> Selector:
    """Variables `selector` does not match."""
    return _not(as_selector(selector))


def as_selector(spec: Any) -> Selector:
    """Turn selector sugar (see the module docstring) into a `Selector`."""
    from .module import Module

    if isinstance(spec, Selector):
        return spec
    if isinstance(spec, type) and issubclass(spec, Everything | Nothing):
        return spec()
    if spec is True or spec is Ellipsis:
        return Everything()
    if spec is None or spec is False:
        return Nothing()
    if isinstance(spec, str):
        return _path((spec,)) if _GLOB & set(spec) else _collection((spec,))
    if isinstance(spec, type) and issubclass(spec, Variable):
        return _of_type((spec,))
    if isinstance(spec, type) and issubclass(spec, Module):
        return _at_instances((spec,))
    if isinstance(spec, list | tuple | set | frozenset):
        out: Selector = Nothing()
        for s in spec:
            out = _or(out, as_selector(s)) if not isinstance(out, Nothing) else as_selector(s)
        return out
    if callable(spec):
        return _where(spec)
    raise SelectorError(
        f"selector: expected a collection name, path glob, Variable or Module subclass, predicate "
        f"fn(path, variable), list of those, or spx.select(); received {spec!r}."
    )


def _cache_key(spec: Any) -> Any:
    if isinstance(spec, list | set):
        return (type(spec).__name__, tuple(spec) if isinstance(spec, list) else frozenset(spec))
    try:
        hash(spec)
        return spec
    except TypeError:
        return None


def mask(plan, spec: Any) -> tuple[bool, ...]:
    """Which of `plan.vars` the selector matches (cached on the plan for hashable specs)."""
    key = ("sel", _cache_key(spec))
    hit = plan.masks.get(key) if key[1] is not None else None
    if hit is not None:
        return hit
    sel = as_selector(spec)
    out = tuple(sel.match(i, v) for i, v in zip(plan.infos, plan.vars))
    if key[1] is not None:
        plan.masks[key] = out
    return out


def info_variable(info: VarInfo, value: Any) -> Variable:
    """A detached Variable with `info`'s class, collection and metadata (for predicates on a State)."""
    return _new_like(info.type, value, info.kind, {k: thaw(v) for k, v in info.metadata})


__all__ = [
    "Everything",
    "Nothing",
    "Selector",
    "all_of",
    "any_of",
    "as_selector",
    "not_",
    "of_type",
    "path_contains",
    "path_endswith",
    "path_startswith",
    "select",
]
