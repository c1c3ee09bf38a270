"""The call a plan issues for a compiled program: JAX's C++ dispatch, without the Python frame.

`jax.stages.Compiled.__call__` is a Python method in front of a C++ function
(the kind `jax.jit` dispatches through) that its executable makes. A plan calls
each of its programs many times a step, so it makes that C++ function itself
and calls it: about 3 µs less of the issuing thread per call on CPU, the same
work done. That reads private attributes (`_executable.create_cpp_call`,
`_params`, listed in `spectrax_mpmd._trace.jax_private.ATTRIBUTES`), so it is
feature-detected: where either is missing, or JAX makes no C++ function for a
program, the plan calls the `Compiled` object as users do.
"""

from __future__ import annotations

from typing import Callable

import jax


def direct_call(fn: Callable) -> Callable:
    """`fn`'s C++ call where `fn` is a `jax.stages.Compiled` whose executable makes one, else `fn`."""
    if not isinstance(fn, jax.stages.Compiled):
        return fn
    make = getattr(getattr(fn, "_executable", None), "create_cpp_call", None)
    params = getattr(fn, "_params", None)
    made = make(params) if make is not None and params is not None else None
    return made if callable(made) else fn
