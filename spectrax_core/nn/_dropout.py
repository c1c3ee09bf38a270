"""Dropout: zero each element with probability `rate`, scale the rest by `1/(1-rate)`."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray, Shaped

from ._composite import Composite
from .._apply import register_apply
from .._checks import typechecked


class Dropout(Composite):
    """Dropout with a static `rate`; holds no arrays. Randomness comes from an explicit `key=`."""

    rate: float = eqx.field(static=True)

    def __check_init__(self):
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"Dropout: rate must lie in [0, 1], received {self.rate}.")

    @classmethod
    def init(cls, key: PRNGKeyArray | None, rate: float) -> "Dropout":
        """Dropout with probability `rate`; `key` is accepted for the uniform `init` signature and unused."""
        del key
        return cls(rate=float(rate))


@typechecked
def _dropout(x: Shaped[Array, "*shape"], key: PRNGKeyArray, rate: float) -> Shaped[Array, "*shape"]:
    if rate == 1.0:
        return jnp.zeros_like(x)
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


@register_apply(Dropout)
def apply_dropout(
    params: Dropout, x: Array, *, key: PRNGKeyArray | None = None, deterministic: bool = False
) -> Array:
    """Drop elements of `x` at random; identity when `deterministic=True` or `rate == 0`.

    A non-deterministic call needs `key=` (a `jax.random` key).
    """
    if deterministic or params.rate == 0.0:
        return x
    if key is None:
        raise ValueError(
            "Dropout: deterministic=False needs a random key; pass key=jax.random.key(...) "
            "or deterministic=True for evaluation."
        )
    return _dropout(x, key, params.rate)
