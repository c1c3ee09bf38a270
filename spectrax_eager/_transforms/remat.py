"""`remat` (`jax.checkpoint`) and `eval_shape` over functions that take modules: the modules are
inputs of the transformed function, and writes `mutable=` allows come back as its outputs."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from .._graph.module import Module
from .lift import Split, allowed, fn_name, pure_call


def remat(
    fn: Callable | type | None = None,
    *,
    policy: Callable | None = None,
    prevent_cse: bool = True,
    mutable: Any = None,
    static_argnums: int | tuple[int, ...] = (),
) -> Callable:
    """`jax.checkpoint` for functions that take modules: recompute `fn` in the backward pass.

    Given a Module subclass, returns a subclass whose `forward` is checkpointed.
    `static_argnums` positions are passed as they are (Python values the function
    branches on), not traced.
    """
    opts = dict(policy=policy, prevent_cse=prevent_cse, mutable=mutable, static_argnums=static_argnums)
    if fn is None:
        return functools.partial(remat, **opts)
    if isinstance(fn, type):
        return _remat_class(fn, opts)
    fixed = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        held = {i: args[i] for i in fixed}

        def call(*traced: Any, **kw: Any) -> Any:
            it = iter(traced)
            return fn(*(held[i] if i in held else next(it) for i in range(len(args))), **kw)

        split = Split(tuple(a for i, a in enumerate(args) if i not in held), kwargs)
        ok = allowed(split.plan, mutable)
        pure = pure_call(call, split, ok, f"spx.remat({fn_name(fn)})", mutable, False)
        out, upd = jax.checkpoint(pure, policy=policy, prevent_cse=prevent_cse)(split.values, split.leaves)
        if upd:
            split.write_back(upd)
        return out

    return wrapped


def _remat_class(cls: type, opts: dict) -> type:
    """A subclass of Module class `cls` whose `forward` runs under `remat`."""
    if not issubclass(cls, Module):
        raise TypeError(f"spx.remat: a class must be an spx.Module subclass; received {cls.__name__}.")
    if cls.forward is Module.forward:
        raise TypeError(
            f"spx.remat({cls.__name__}): the class checkpoints `forward`, which {cls.__name__} does not define "
            "(it defines `__call__`); wrap the function that calls it with spx.remat(fn) instead."
        )
    checkpointed = remat(cls.forward, **opts)

    def forward(self: Module, *args: Any, **kwargs: Any) -> Any:
        return checkpointed(self, *args, **kwargs)

    return type(
        cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__, "__doc__": cls.__doc__}
    )


def eval_shape(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """`jax.eval_shape` for functions that take modules (nothing is computed or written)."""
    split = Split(args, kwargs)
    ok = allowed(split.plan, True)
    pure = pure_call(fn, split, ok, f"spx.eval_shape({fn_name(fn)})", True, False)
    out, _ = jax.eval_shape(pure, split.values, split.leaves)
    return out
