"""`spx.scope` / `spx.context`: values bound for the duration of a block, read anywhere below it.

`with spx.scope(mask=m, training=False): model(x)` makes `spx.scope.get("mask")`
return `m` in any code the block calls (inner blocks shadow outer ones; the
binding is per thread and per asyncio task). Under `spx.jit`, array values are
inputs of the compiled program (a new array is not a new program) and the other
values are part of its cache key (a new value is a new program), so a jitted
call always sees the values bound at the call.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_frames: contextvars.ContextVar[tuple[dict, ...]] = contextvars.ContextVar("spectrax_scope", default=())
_MISSING = object()


@contextlib.contextmanager
def _bound(values: dict) -> Iterator[None]:
    token = _frames.set((*_frames.get(), values))
    try:
        yield
    finally:
        _frames.reset(token)


def scope(**values: Any) -> contextlib.AbstractContextManager:
    """A block in which `get(name)` returns `values[name]` (`with spx.scope(mask=m): ...`)."""
    return _bound(dict(values))


def get(key: str, default: Any = _MISSING) -> Any:
    """The value the innermost enclosing `scope` binds to `key`; `default` when none does (a
    `KeyError` naming the bound keys when no default is given)."""
    for frame in reversed(_frames.get()):
        if key in frame:
            return frame[key]
    if default is _MISSING:
        raise KeyError(
            f"spx.scope.get({key!r}): no enclosing spx.scope binds it; bound: {sorted(snapshot())}."
        )
    return default


def active() -> bool:
    """Whether any `scope` block is open (one context-variable read)."""
    return bool(_frames.get())


def snapshot() -> dict[str, Any]:
    """Every bound name with the value `get` returns for it now."""
    out: dict[str, Any] = {}
    for frame in _frames.get():
        out.update(frame)
    return out


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def partition(snap: dict[str, Any]) -> tuple[dict[str, Any], tuple[tuple[str, Any], ...]]:
    """`(arrays, others)`: the array values by name, and the other `(name, value)` pairs sorted
    by name (hashable: a compiled program's cache key holds them)."""
    arrays = {k: v for k, v in snap.items() if _is_array(v)}
    others = tuple(sorted((k, v) for k, v in snap.items() if k not in arrays))
    for k, v in others:
        try:
            hash(v)
        except TypeError:
            raise TypeError(
                f"spx.scope: {k}={v!r} is neither an array nor hashable, so a jitted call cannot key its "
                "program on it; bind an array, a hashable value (a tuple, not a list), or pass it as an "
                "argument."
            ) from None
    return arrays, others


scope.get = get  # `spx.scope.get(name)`

__all__ = ["active", "get", "partition", "scope", "snapshot"]
