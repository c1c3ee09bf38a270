"""Shape checks: cheap explicit checks always, full jaxtyping+beartype checks on demand.

Every layer calls `check_last_dim` / `check_rank` on its input: plain Python on
static shapes, so it costs nothing inside a compiled program. The layer's typed
apply function is additionally wrapped with `jaxtyping.jaxtyped(typechecker=beartype)`
when runtime checking is switched on (`enable_runtime_checks()` or the
environment variable `SPECTRAX_RUNTIME_CHECKS=1`); it is off by default.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

_ENV = "SPECTRAX_RUNTIME_CHECKS"


def runtime_checks_enabled() -> bool:
    """Whether jaxtyping+beartype checks run on every typed layer call."""
    return os.environ.get(_ENV, "0") not in ("", "0", "false", "False")


def enable_runtime_checks(on: bool = True) -> None:
    """Switch jaxtyping+beartype shape checking of layer calls on or off."""
    os.environ[_ENV] = "1" if on else "0"


def typechecked(fn: F) -> F:
    """Check `fn`'s jaxtyping annotations with beartype when runtime checks are on."""
    from beartype import beartype
    from jaxtyping import jaxtyped

    checked = jaxtyped(typechecker=beartype)(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if runtime_checks_enabled():
            return checked(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def check_rank(layer: str, x, min_rank: int) -> None:
    """Raise `ValueError` if `x` has fewer than `min_rank` axes."""
    if x.ndim < min_rank:
        raise ValueError(
            f"{layer}: expected an input with at least {min_rank} axes, "
            f"received shape {tuple(x.shape)}."
        )


def check_last_dim(layer: str, x, size: int, *, what: str = "features") -> None:
    """Raise `ValueError` if the last axis of `x` is not `size`."""
    if x.ndim < 1 or x.shape[-1] != size:
        raise ValueError(
            f"{layer}: expected input with {what} = {size} on the last axis, "
            f"received shape {tuple(x.shape)}; pass an input of shape (..., {size})."
        )
