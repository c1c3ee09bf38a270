"""Forward hooks: functions called before / after a module's forward.

A module's hooks live in its `_spx_hooks` attribute as a tuple of `Hook`
entries. That attribute is part of the module's structure (GraphDef): the
modules a transform rebuilds carry the same hooks, so hooks run eagerly and
are traced into `spx.jit` programs; adding or removing one retraces. A module
without hooks has no such attribute, and its calls do no hook work.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable

from . import structure

HOOKS = "_spx_hooks"


class Hook:
    """One registered hook (hashed by identity, so a GraphDef holds it as is)."""

    __slots__ = ("fn", "pre", "with_kwargs", "__weakref__")

    def __init__(self, fn: Callable, pre: bool, with_kwargs: bool):
        self.fn, self.pre, self.with_kwargs = fn, pre, with_kwargs

    def __repr__(self) -> str:
        kind = "forward_pre_hook" if self.pre else "forward_hook"
        return f"{kind}({getattr(self.fn, '__name__', self.fn)})"


class RemovableHandle:
    """Returned by `register_forward_hook` / `register_forward_pre_hook`: `remove()` unregisters.

    Also a context manager: the hook is removed when the `with` block ends.
    """

    __slots__ = ("_module", "_hook")

    def __init__(self, module: Any, hook: Hook):
        self._module = weakref.ref(module)
        self._hook = hook

    def remove(self) -> None:
        """Unregister the hook (a no-op when already removed)."""
        module = self._module()
        if module is None:
            return
        hooks = module.__dict__.get(HOOKS, ())
        if self._hook in hooks:
            rest = tuple(h for h in hooks if h is not self._hook)
            if rest:
                module.__dict__[HOOKS] = rest
            else:
                del module.__dict__[HOOKS]
            structure.bump()

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def add_hook(
    module: Any, fn: Callable, *, pre: bool, with_kwargs: bool | None, prepend: bool
) -> RemovableHandle:
    """Register `fn` on `module` (a structural change: jitted callers retrace once).

    `with_kwargs=None` takes it from `fn`'s signature: a hook requiring one more positional
    argument than PyTorch's form (`(module, args, kwargs)` before, `(module, args, kwargs,
    output)` after: the seed library's form) is given the keyword arguments."""
    if not callable(fn):
        raise TypeError(
            f"register_forward_{'pre_' if pre else ''}hook: expected a callable, received {fn!r}."
        )
    if with_kwargs is None:
        with_kwargs = required_positional(fn) == (3 if pre else 4)
    hook = Hook(fn, pre, bool(with_kwargs))
    hooks = module.__dict__.get(HOOKS, ())
    module.__dict__[HOOKS] = (hook, *hooks) if prepend else (*hooks, hook)
    structure.bump()
    return RemovableHandle(module, hook)


def call_with_hooks(fn: Callable, module: Any, hooks: tuple[Hook, ...], args: tuple, kwargs: dict) -> Any:
    """`fn(module, *args, **kwargs)` with the pre-hooks applied to the inputs and the
    forward hooks to the output (each may return a replacement, or None to keep it)."""
    for h in hooks:
        if not h.pre:
            continue
        if h.with_kwargs:
            res = h.fn(module, args, kwargs)
            if res is not None:
                if not (isinstance(res, tuple) and len(res) == 2):
                    raise TypeError(
                        f"{h!r} (with_kwargs=True) must return None or (args, kwargs); received "
                        f"{type(res).__name__}."
                    )
                args, kwargs = tuple(res[0]), dict(res[1])
        else:
            res = h.fn(module, args)
            if res is not None:
                args = res if isinstance(res, tuple) else (res,)
    out = fn(module, *args, **kwargs)
    for h in hooks:
        if h.pre:
            continue
        res = h.fn(module, args, kwargs, out) if h.with_kwargs else h.fn(module, args, out)
        if res is not None:
            out = res
    return out


def required_positional(fn: Callable) -> int | None:
    """How many positional arguments `fn` requires (None when its signature cannot be read): tells
    which calling convention a user callback follows."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds and p.default is inspect.Parameter.empty for p in params)
