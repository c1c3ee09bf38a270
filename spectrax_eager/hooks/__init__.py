"""`spx.hooks`: forward hooks on modules (see `Module.register_forward_hook`).

`register_forward_hook(module, fn)` and `register_forward_pre_hook(module, fn)`
are the function forms of the Module methods; both return a `RemovableHandle`.
"""

from __future__ import annotations

from typing import Callable

from .._graph.hooks import Hook, RemovableHandle, add_hook
from .._graph.module import Module


def _module(module: Module, where: str) -> Module:
    if not isinstance(module, Module):
        raise TypeError(f"{where}: expected an spx.Module, received {type(module).__name__}.")
    return module


def register_forward_hook(
    module: Module, hook: Callable, *, prepend: bool = False, with_kwargs: bool | None = None
) -> RemovableHandle:
    """`module.register_forward_hook(hook, ...)`."""
    return add_hook(
        _module(module, "register_forward_hook"), hook, pre=False, with_kwargs=with_kwargs, prepend=prepend
    )


def register_forward_pre_hook(
    module: Module, hook: Callable, *, prepend: bool = False, with_kwargs: bool | None = None
) -> RemovableHandle:
    """`module.register_forward_pre_hook(hook, ...)`."""
    return add_hook(
        _module(module, "register_forward_pre_hook"), hook, pre=True, with_kwargs=with_kwargs, prepend=prepend
    )


def hooks_of(module: Module) -> tuple[Hook, ...]:
    """The hooks registered on `module`, in call order (pre-hooks run before, the others after)."""
    return tuple(_module(module, "hooks_of").__dict__.get("_spx_hooks", ()))


#: The handle a registration returns (`handle.remove()` unregisters).
Handle = RemovableHandle

__all__ = [
    "Handle",
    "Hook",
    "RemovableHandle",
    "hooks_of",
    "register_forward_hook",
    "register_forward_pre_hook",
]
