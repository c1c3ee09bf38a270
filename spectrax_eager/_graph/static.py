"""Immutable copies of the lists, dicts and sets a module or Variable holds as static values.

A compiled program (`spx.jit`, or `jax.jit` over a module pytree) reads a
static value's content when it traces, and its cache key holds that content.
An in-place edit (`model.scales[0] = 3.0`) changes neither the structure epoch
nor anything a cached program can see, so the old program would run on. A
list, dict or set assigned to a module attribute (or given as Variable
metadata) is therefore stored as an immutable copy, nested containers included
(also those inside tuples). An in-place edit raises `StaticEditError` naming
the attribute; assigning a new value is a structural change and retraces.
"""

from __future__ import annotations

from typing import Any, Iterable

from .._errors import StaticEditError


_SPELLING = {"__setitem__": "x[k] = v", "__delitem__": "del x[k]", "__iadd__": "x += y", "__imul__": "x *= n",
             "__ior__": "x |= y", "__iand__": "x &= y", "__isub__": "x -= y", "__ixor__": "x ^= y"}


def _refuse(op: str):
    spelled = _SPELLING.get(op, f"x.{op}(...)")

    def method(self, *args: Any, **kwargs: Any):
        path, fix = self._where
        raise StaticEditError(
            f"{path}: `{spelled}` would edit a static {_KIND[type(self)]} in place. A module's static "
            "lists, dicts and sets (also nested ones, and those in Variable metadata) are stored "
            "immutable, since compiled programs (spx.jit, jax.jit) read their content when they trace "
            f"and would not see an in-place edit. Edit a copy (list(...), dict(...), set(...)) and {fix}; "
            "the next call retraces."
        )

    method.__name__ = op
    return method


def _init(base: type):
    def __init__(self, items: Iterable = (), where: tuple[str, str] = ("a static value", "assign it")):
        try:
            self._where
        except AttributeError:
            base.__init__(self, items)
            self._where = where
            return
        _refuse("__init__")(self)

    return __init__


def _reduce(base: type):
    def __reduce__(self):
        return (type(self), (base(self), self._where))

    return __reduce__


_LIST_EDITS = ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop",
               "remove", "clear", "sort", "reverse")
_DICT_EDITS = ("__setitem__", "__delitem__", "__ior__", "clear", "pop", "popitem", "setdefault", "update")
_SET_EDITS = ("__ior__", "__iand__", "__isub__", "__ixor__", "add", "discard", "remove", "pop", "clear",
              "update", "difference_update", "intersection_update", "symmetric_difference_update")


def _immutable_class(name: str, base: type, edits: tuple[str, ...]) -> type:
    namespace = {op: _refuse(op) for op in edits}
    namespace.update(
        __slots__=("_where",),
        __init__=_init(base),
        __reduce__=_reduce(base),
        __doc__=f"A {base.__name__} that refuses in-place edits (a module's static value).",
        __module__=__name__,
    )
    return type(name, (base,), namespace)


StaticList = _immutable_class("StaticList", list, _LIST_EDITS)
StaticDict = _immutable_class("StaticDict", dict, _DICT_EDITS)
StaticSet = _immutable_class("StaticSet", set, _SET_EDITS)
StaticSet.__repr__ = lambda self: repr(set(self))
_KIND = {StaticList: "list", StaticDict: "dict", StaticSet: "set"}


def immutable(value: Any, path: str, fix: str) -> Any:
    """`value` with every list, dict and set in it (also inside tuples) replaced by an immutable copy.

    `path` names the value in errors (`Net.cfg`); `fix` says how to change it
    (`assign it to the attribute (`model.cfg = new`)`). Other values come back as they are.
    """
    if isinstance(value, dict):
        items = ((k, immutable(v, f"{path}[{k!r}]", fix)) for k, v in value.items())
        return StaticDict(items, (path, fix))
    if isinstance(value, list):
        return StaticList((immutable(v, f"{path}[{i}]", fix) for i, v in enumerate(value)), (path, fix))
    if isinstance(value, set):
        return StaticSet(value, (path, fix))
    if isinstance(value, tuple):
        items = tuple(immutable(v, f"{path}[{i}]", fix) for i, v in enumerate(value))
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)._make(items) if hasattr(type(value), "_make") else type(value)(items)
    return value
