"""`variable_init_placement`: a hook that places (or converts) every newly built Variable's value.

Placing at construction matters when a model is too large for one device: the
hook sees each value as it is made, with its metadata (logical `axes`, ...),
and returns it placed (`jax.device_put` with a sharding) or None to keep it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from . import ambient

#: `hook(value, metadata, explicit_sharding) -> new value | None`; `explicit_sharding` is True
#: when the Variable was given `sharding=` / `axis_names=` itself.
InitPlacementHook = Callable[[Any, dict, bool], Any]


@contextlib.contextmanager
def variable_init_placement(hook: InitPlacementHook) -> Iterator[None]:
    """While the block runs, every Variable built gets `hook(value, metadata, explicit_sharding)`
    as its value unless the hook returns None. The innermost block's hook is the one used."""
    if not callable(hook):
        raise TypeError(f"variable_init_placement: hook must be callable, received {hook!r}.")
    with ambient.setting("placement", hook):
        yield


def placed(value: Any, metadata: dict, explicit_sharding: bool) -> Any:
    """`value` as the active hook places it (unchanged without a hook, or when it returns None)."""
    hook = ambient.current().placement
    if hook is None:
        return value
    new = hook(value, dict(metadata), explicit_sharding)
    return value if new is None else new
