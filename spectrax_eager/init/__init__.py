"""`spx.init`: parameter initializers for `w_init=` / `b_init=`.

Each factory returns an initializer `(key, shape, dtype) -> array`; weights put
their input features on axis -2 and output features on axis -1 (convolutions
`(*kernel, c_in, c_out)`), which is what the fan-in / fan-out of the
variance-scaling ones read.

    zeros, ones                          initializers (pass them uncalled)
    constant(value)                      every element `value`
    normal(stddev=1.0, mean=0.0)         N(mean, stddev²)
    uniform(scale=1.0)                   U[-scale, scale]
    truncated_normal(stddev=1.0, lower=-2.0, upper=2.0)   N(0, stddev²) cut at lower/upper stddevs
    xavier_normal(gain=1.0)              N(0, gain² · 2 / (fan_in + fan_out))
    xavier_uniform(gain=1.0)             U with the same variance
    kaiming_normal(nonlinearity="relu", mode="fan_in")    N(0, gain² / fan), gain of the nonlinearity
    kaiming_uniform(nonlinearity="relu", mode="fan_in")   U with the same variance
    lecun_normal(), lecun_uniform()      variance 1 / fan_in (the layers' default weight init)
    orthogonal(gain=1.0)                 gain · a random orthogonal matrix
    variance_scaling(...)                `jax.nn.initializers.variance_scaling`

The gains are PyTorch's: "linear" / "conv*" / "sigmoid" 1, "tanh" 5/3,
"relu" √2, "leaky_relu" √(2 / (1 + 0.01²)), "selu" 3/4. Any function with the
initializer signature (a `jax.nn.initializers` one included) works too.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from spectrax_core import init as core_init
from spectrax_core.init import Initializer, lecun_normal, lecun_uniform, ones, variance_scaling, zeros

from .._compat.paths import keep_names

_GAINS = {"linear": 1.0, "sigmoid": 1.0, "tanh": 5.0 / 3.0, "relu": math.sqrt(2.0), "selu": 0.75}
_GAINS["leaky_relu"] = math.sqrt(2.0 / (1.0 + 0.01**2))
_MODES = ("fan_in", "fan_out")


def _factory(make: Callable[..., Initializer]) -> Callable[..., Initializer]:
    """`make`, refusing to be used uncalled as an initializer (its first argument a PRNG key)."""

    @functools.wraps(make)
    def factory(*args: Any, **kwargs: Any) -> Initializer:
        if args and isinstance(args[0], jax.Array):
            raise TypeError(
                f"spx.init.{make.__name__} is a factory; call it to get an initializer, e.g. "
                f"w_init=spx.init.{make.__name__}()."
            )
        return make(*args, **kwargs)

    return factory


def _gain(nonlinearity: str) -> float:
    if nonlinearity.startswith("conv"):
        return 1.0
    if nonlinearity not in _GAINS:
        raise ValueError(
            f"kaiming: unknown nonlinearity {nonlinearity!r}; use one of {sorted(_GAINS)} or conv*."
        )
    return _GAINS[nonlinearity]


@_factory
def constant(value: float | int) -> Initializer:
    """Every element `value`."""
    return jax.nn.initializers.constant(value)


@_factory
def normal(stddev: float = 1.0, mean: float = 0.0) -> Initializer:
    """N(mean, stddev²)."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return mean + stddev * jax.random.normal(key, shape, dtype)

    return init


@_factory
def uniform(scale: float = 1.0) -> Initializer:
    """U[-scale, scale]."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -scale, scale)

    return init


@_factory
def truncated_normal(stddev: float = 1.0, lower: float = -2.0, upper: float = 2.0) -> Initializer:
    """N(0, stddev²) cut at `lower` / `upper` standard deviations."""
    return jax.nn.initializers.truncated_normal(stddev, lower=lower, upper=upper)


@_factory
def xavier_normal(gain: float = 1.0) -> Initializer:
    """Glorot normal: N(0, gain² · 2 / (fan_in + fan_out))."""
    return variance_scaling(gain**2, "fan_avg", "normal")


@_factory
def xavier_uniform(gain: float = 1.0) -> Initializer:
    """Glorot uniform: variance gain² · 2 / (fan_in + fan_out)."""
    return variance_scaling(gain**2, "fan_avg", "uniform")


def _kaiming(nonlinearity: str, mode: str, distribution: str) -> Initializer:
    if mode not in _MODES:
        raise ValueError(f"kaiming: mode={mode!r}; use one of {_MODES}.")
    return variance_scaling(_gain(nonlinearity) ** 2, mode, distribution)


@_factory
def kaiming_normal(nonlinearity: str = "relu", mode: str = "fan_in") -> Initializer:
    """He normal: N(0, gain² / fan), `fan` the fan-in or fan-out (`mode`)."""
    return _kaiming(nonlinearity, mode, "normal")


@_factory
def kaiming_uniform(nonlinearity: str = "relu", mode: str = "fan_in") -> Initializer:
    """He uniform: variance gain² / fan."""
    return _kaiming(nonlinearity, mode, "uniform")


@_factory
def orthogonal(gain: float = 1.0) -> Initializer:
    """`gain` times a random orthogonal matrix (over the last two axes)."""
    return jax.nn.initializers.orthogonal(scale=gain)


#: The core's initializer names, each here with PyTorch's defaults where they differ.
__all__ = [name for name in core_init.__all__ if name != "initialize"]

# `spectrax-lib`'s module paths `spectrax.init.constant`, ... hold these names too; each submodule
# named like one of this module's functions is loaded now, the function kept under its name.
keep_names(__name__, ("constant", "normal", "orthogonal", "uniform"))
