"""`spx.scope` values (the public face is `spx.context`): each block's `{name: value}` dict is
a frame on the ambient record, innermost last; `get` reads the innermost frame binding a name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from . import ambient

_MISSING = object()


@contextlib.contextmanager
def _bound(values: dict) -> Iterator[None]:
    with ambient.pushing("frames", values):
        yield


def scope(**values: Any) -> contextlib.AbstractContextManager:
    """A block in which `get(name)` returns `values[name]` (`with spx.scope(mask=m): ...`)."""
    return _bound(dict(values))


def get(key: str, default: Any = _MISSING) -> Any:
    """The value the innermost enclosing `scope` binds to `key`; `default` when none does (a
    `KeyError` naming the bound keys when no default is given)."""
    for frame in reversed(ambient.current().frames):
        if key in frame:
            return frame[key]
    if default is _MISSING:
        raise KeyError(
            f"spx.scope.get({key!r}): no enclosing spx.scope binds it; bound: {sorted(snapshot())}."
        )
    return default


def active() -> bool:
    """Whether any `scope` block is open (one context-variable read)."""
    return bool(ambient.current().frames)


def snapshot() -> dict[str, Any]:
    """Every bound name with the value `get` returns for it now."""
    out: dict[str, Any] = {}
    for frame in ambient.current().frames:
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
