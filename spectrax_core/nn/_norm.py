"""Normalisation layers over the last axis: LayerNorm and RMSNorm.

Statistics are computed in at least float32 (a bfloat16 input is upcast and the
result cast back, or cast to `compute_dtype` when one is set), so low-precision
activations keep accurate variances.
"""

from __future__ import annotations

from typing import Any, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._apply import register_apply
from .._checks import check_last_dim, typechecked
from ..init import initialize
from ._options import ParamOptions, WeightOptions, option_values, with_options


def _compute_dtype(x: Array):
    return jnp.promote_types(x.dtype, jnp.float32)


def _need_key(key: PRNGKeyArray | None, layer: str) -> PRNGKeyArray:
    if key is None:
        raise ValueError(f"{layer}: w_init / b_init need a key; pass init(key, ...) a jax.random key.")
    return key


def _out(y: Array, compute_dtype: Any) -> Array:
    return y if compute_dtype is None else y.astype(compute_dtype)


class LayerNorm(eqx.Module):
    """Parameters of `(x - mean) / sqrt(var + eps) * scale + bias` over the last axis."""

    scale: Float[Array, " d"]
    bias: Float[Array, " d"]
    d: int = eqx.field(static=True)
    eps: float = eqx.field(static=True, default=1e-5)
    compute_dtype: Any = eqx.field(static=True, default=None)

    @with_options
    def init(
        cls, key: PRNGKeyArray | None, d: int, *, eps: float = 1e-5, **options: Unpack[ParamOptions]
    ) -> "LayerNorm":
        """Unit scale, zero bias (or `w_init` / `b_init`); `key` feeds those initializers only."""
        dtype, w_init, b_init, compute_dtype = option_values(options)
        scale, bias = jnp.ones((d,), dtype), jnp.zeros((d,), dtype)
        if w_init is not None:
            scale = initialize(w_init, _need_key(key, "LayerNorm"), (d,), dtype, where="LayerNorm: w_init")
        if b_init is not None:
            bkey = jax.random.fold_in(_need_key(key, "LayerNorm"), 1)
            bias = initialize(b_init, bkey, (d,), dtype, where="LayerNorm: b_init")
        return cls(scale=scale, bias=bias, d=d, eps=float(eps), compute_dtype=compute_dtype)

    def logical_axes(self) -> dict[str, tuple]:
        """Logical axes of each array field (see `spectrax_core.sharding`)."""
        return {"scale": ("EMBED",), "bias": ("EMBED",)}


class RMSNorm(eqx.Module):
    """Parameters of `x / sqrt(mean(x²) + eps) * scale` over the last axis."""

    scale: Float[Array, " d"]
    d: int = eqx.field(static=True)
    eps: float = eqx.field(static=True, default=1e-6)
    compute_dtype: Any = eqx.field(static=True, default=None)

    @with_options
    def init(
        cls, key: PRNGKeyArray | None, d: int, *, eps: float = 1e-6, **options: Unpack[WeightOptions]
    ) -> "RMSNorm":
        """Unit scale (or `w_init`); `key` feeds that initializer only."""
        dtype, w_init, _, compute_dtype = option_values(options)
        scale = jnp.ones((d,), dtype)
        if w_init is not None:
            scale = initialize(w_init, _need_key(key, "RMSNorm"), (d,), dtype, where="RMSNorm: w_init")
        return cls(scale=scale, d=d, eps=float(eps), compute_dtype=compute_dtype)

    def logical_axes(self) -> dict[str, tuple]:
        """Logical axes of each array field (see `spectrax_core.sharding`)."""
        return {"scale": ("EMBED",)}


@typechecked
def _layer_norm(
    x: Float[Array, "*batch d"], scale: Float[Array, " d"], bias: Float[Array, " d"], eps: float
) -> Float[Array, "*batch d"]:
    xf = x.astype(_compute_dtype(x))
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale + bias).astype(x.dtype)


@typechecked
def _rms_norm(x: Float[Array, "*batch d"], scale: Float[Array, " d"], eps: float) -> Float[Array, "*batch d"]:
    xf = x.astype(_compute_dtype(x))
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


@register_apply(LayerNorm)
def apply_layer_norm(params: LayerNorm, x: Array) -> Array:
    """Normalise `x` of shape `(..., d)` over its last axis."""
    check_last_dim("LayerNorm", x, params.d)
    return _out(_layer_norm(x, params.scale, params.bias, params.eps), params.compute_dtype)


@register_apply(RMSNorm)
def apply_rms_norm(params: RMSNorm, x: Array) -> Array:
    """Normalise `x` of shape `(..., d)` by its root mean square over the last axis."""
    check_last_dim("RMSNorm", x, params.d)
    return _out(_rms_norm(x, params.scale, params.eps), params.compute_dtype)
