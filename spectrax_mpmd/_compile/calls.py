"""The call a plan issues for a compiled program: JAX's C++ dispatch, without the Python frame.

`jax.stages.Compiled.__call__` is a Python method that, once made, hands every
call to a C++ function (the one `jax.jit` dispatches through). A plan calls
each of its programs many times a step, so it calls that C++ function itself:
about 3 µs less of the issuing thread per call on CPU, the same work done.
Reaching it uses private attributes (`_call`, `_executable`, `_params`), so it
is feature-detected: where any is missing, or JAX makes no C++ call for a
program, the plan calls the `Compiled` object as users do.
"""

from __future__ import annotations

from typing import Callable

import jax


def direct_call(fn: Callable) -> Callable:
    """`fn`'s C++ call where `fn` is a `jax.stages.Compiled` that has one, else `fn` itself."""
    if not isinstance(fn, jax.stages.Compiled):
        return fn
    made = getattr(fn, "_call", None)
    if made is None:
        make = getattr(getattr(fn, "_executable", None), "create_cpp_call", None)
        params = getattr(fn, "_params", None)
        if make is None or params is None:
            return fn
        made = make(params)
    return made if callable(made) else fn
