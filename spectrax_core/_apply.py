"""One entry point, `apply`, that runs any params pytree.

`apply` dispatches on the type of its first argument. Every layer of
`spectrax_core.nn` registers its own function; a third-party library adds its
params type the same way::

    import spectrax_core as sc

    @sc.register_apply(MyParams)
    def _(params: MyParams, x, **kw):
        ...

    sc.apply(MyParams(...), x)
"""

from __future__ import annotations

import functools
from typing import Any, Callable


@functools.singledispatch
def apply(params: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    """Run `params` on `x`; the function registered for `type(params)` does the work."""
    raise TypeError(
        f"apply: no function registered for params of type {type(params).__name__}. "
        "Register one with `spectrax_core.register_apply(YourParams)(fn)`."
    )


def register_apply(cls: type) -> Callable[[Callable], Callable]:
    """Decorator registering `fn(params, x, ...)` as `apply` for params of type `cls`."""
    return apply.register(cls)
