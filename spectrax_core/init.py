"""Parameter initializers: short names over `jax.nn.initializers`.

Every name is a `jax.nn.initializers.Initializer` — a function `(key, shape,
dtype) -> array` — or a factory returning one, exactly as in JAX; no new math.
Layers take them as `w_init=` / `b_init=`; any other function with that
signature (a `jax.nn.initializers` one included) works too.

Weight layouts put the input features on axis -2 and the output features on
axis -1 (`Linear`: `(d_in, d_out)`, convolutions: `(*kernel, c_in, c_out)`),
which is what the variance-scaling initializers assume for their fan-in and
fan-out.

    ones, zeros                       initializers (pass them uncalled)
    constant(value)                   every element `value`
    normal(stddev=1e-2)               N(0, stddev²)
    truncated_normal(stddev=1e-2, lower=-2.0, upper=2.0)   cut at lower/upper standard deviations
    uniform(scale=1e-2)               U[0, scale)
    xavier_uniform(), xavier_normal() Glorot: variance 2 / (fan_in + fan_out)
    kaiming_uniform(), kaiming_normal()  He: variance 2 / fan_in
    lecun_uniform(), lecun_normal()   variance 1 / fan_in (the layers' default weight init)
    orthogonal(scale=1.0)             a (scaled) orthogonal matrix
"""

from __future__ import annotations

from typing import Any

import jax

Initializer = jax.nn.initializers.Initializer

zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones
constant = jax.nn.initializers.constant
normal = jax.nn.initializers.normal
truncated_normal = jax.nn.initializers.truncated_normal
uniform = jax.nn.initializers.uniform
xavier_uniform = jax.nn.initializers.glorot_uniform
xavier_normal = jax.nn.initializers.glorot_normal
kaiming_uniform = jax.nn.initializers.he_uniform
kaiming_normal = jax.nn.initializers.he_normal
lecun_uniform = jax.nn.initializers.lecun_uniform
lecun_normal = jax.nn.initializers.lecun_normal
orthogonal = jax.nn.initializers.orthogonal
variance_scaling = jax.nn.initializers.variance_scaling

_FACTORIES = {
    normal,
    truncated_normal,
    uniform,
    xavier_uniform,
    xavier_normal,
    kaiming_uniform,
    kaiming_normal,
    lecun_uniform,
    lecun_normal,
    orthogonal,
    constant,
    variance_scaling,
}


def initialize(init: Any, key: jax.Array, shape: tuple[int, ...], dtype: Any, *, where: str) -> jax.Array:
    """`init(key, shape, dtype)`, checked: a clear error for a factory passed uncalled or a bad result.

    `where` names the layer and argument (`"Linear: w_init"`) in the message.
    """
    if init in _FACTORIES:
        raise TypeError(
            f"{where} received the factory {getattr(init, '__name__', init)!r} itself; call it to get "
            f"an initializer, e.g. {where.split(': ')[-1]}={_public_name(init)}() from spectrax_core.init "
            "(spx.init)."
        )
    if not callable(init):
        raise TypeError(
            f"{where} must be an initializer `(key, shape, dtype) -> array` (from spx.init or "
            f"jax.nn.initializers), received {type(init).__name__}."
        )
    value = init(key, tuple(shape), dtype)
    if not hasattr(value, "shape") or tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"{where} returned {getattr(value, 'shape', type(value).__name__)}, expected an array of shape "
            f"{tuple(shape)}; an initializer is called as init(key, shape, dtype)."
        )
    return value.astype(dtype)


def _public_name(init: Any) -> str:
    for name in __all__:
        if globals()[name] is init:
            return name
    return getattr(init, "__name__", "initializer")


__all__ = [
    "Initializer",
    "constant",
    "initialize",
    "kaiming_normal",
    "kaiming_uniform",
    "lecun_normal",
    "lecun_uniform",
    "normal",
    "ones",
    "orthogonal",
    "truncated_normal",
    "uniform",
    "variance_scaling",
    "xavier_normal",
    "xavier_uniform",
    "zeros",
]
