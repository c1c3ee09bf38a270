"""Normalisation layers over the last axis: LayerNorm and RMSNorm.

Statistics are computed in at least float32 (a bfloat16 input is upcast and the
result cast back), so low-precision activations keep accurate variances.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._apply import register_apply
from .._checks import check_last_dim, typechecked


def _compute_dtype(x: Array):
    return jnp.promote_types(x.dtype, jnp.float32)


class LayerNorm(eqx.Module):
    """Parameters of `(x - mean) / sqrt(var + eps) * scale + bias` over the last axis."""

    scale: Float[Array, " d"]
    bias: Float[Array, " d"]
    d: int = eqx.field(static=True)
    eps: float = eqx.field(static=True, default=1e-5)

    @classmethod
    def init(cls, key: PRNGKeyArray | None, d: int, *, eps: float = 1e-5, dtype=jnp.float32) -> "LayerNorm":
        """Unit scale, zero bias; `key` is accepted for the uniform `init` signature and unused."""
        del key
        return cls(scale=jnp.ones((d,), dtype), bias=jnp.zeros((d,), dtype), d=d, eps=float(eps))

    def logical_axes(self) -> dict[str, tuple]:
        """Logical axes of each array field (see `spectrax_core.sharding`)."""
        return {"scale": ("EMBED",), "bias": ("EMBED",)}


class RMSNorm(eqx.Module):
    """Parameters of `x / sqrt(mean(x²) + eps) * scale` over the last axis."""

    scale: Float[Array, " d"]
    d: int = eqx.field(static=True)
    eps: float = eqx.field(static=True, default=1e-6)

    @classmethod
    def init(cls, key: PRNGKeyArray | None, d: int, *, eps: float = 1e-6, dtype=jnp.float32) -> "RMSNorm":
        """Unit scale; `key` is accepted for the uniform `init` signature and unused."""
        del key
        return cls(scale=jnp.ones((d,), dtype), d=d, eps=float(eps))

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
    return _layer_norm(x, params.scale, params.bias, params.eps)


@register_apply(RMSNorm)
def apply_rms_norm(params: RMSNorm, x: Array) -> Array:
    """Normalise `x` of shape `(..., d)` by its root mean square over the last axis."""
    check_last_dim("RMSNorm", x, params.d)
    return _rms_norm(x, params.scale, params.eps)
