"""The keywords with which every layer's `init` makes its parameters, declared once.

A layer's `init` ends in `**options: Unpack[ParamOptions]` (or `WeightOptions` for a layer
without a bias) and is decorated with `with_options`, which makes it the layer's classmethod
constructor: its signature then names each keyword
with its default, as if written out, a keyword it does not take is refused as Python refuses
one, and the body receives every option filled in.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import jax.numpy as jnp


class WeightOptions(TypedDict, total=False):
    """`dtype`: the parameters' storage dtype (float32). `w_init`: the weights' initializer
    `(key, shape, dtype)`, None for the layer's default. `compute_dtype`: None computes in the
    input's dtype; a dtype casts the input and the parameters to it first."""

    dtype: Any
    w_init: Any
    compute_dtype: Any


class ParamOptions(WeightOptions, total=False):
    """`WeightOptions` and `b_init`, the biases' initializer (None: the layer's default, zeros)."""

    b_init: Any


DEFAULTS = {"dtype": jnp.float32, "w_init": None, "b_init": None, "compute_dtype": None}


def option_values(options: Mapping) -> tuple:
    """`(dtype, w_init, b_init, compute_dtype)` of a layer's options (`b_init` None where the
    layer takes none)."""
    return tuple(options.get(name, default) for name, default in DEFAULTS.items())


def with_options(init: Callable) -> classmethod:
    """A layer's `init(cls, key, ...)` whose last parameter is `**options: Unpack[...]`, as the
    layer's classmethod constructor (see the module)."""
    sig = inspect.signature(init)
    var = list(sig.parameters.values())[-1]
    declared = init.__globals__[var.annotation.removeprefix("Unpack[").removesuffix("]")]
    names = tuple(declared.__annotations__)
    spelled = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=DEFAULTS[n]) for n in names]
    signature = sig.replace(parameters=[*list(sig.parameters.values())[:-1], *spelled])

    @functools.wraps(init)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{init.__qualname__}(): {e}") from None
        options = {n: bound.arguments.get(n, DEFAULTS[n]) for n in names}
        return init(*args, **{k: v for k, v in kwargs.items() if k not in options}, **options)

    checked.__signature__ = signature
    return classmethod(checked)
