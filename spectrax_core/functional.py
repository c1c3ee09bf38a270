"""Stateless operations called inside a model's forward: activations, linear, dropout,
normalisations, convolutions, pooling and attention.

Activations are `jax.nn`'s; the rest are the functions the layers of
`spectrax_core.nn` run, exposed with the layer's conventions (channels-last
inputs, weights `(d_in, d_out)` / `(*kernel, c_in, c_out)`, attention tensors
`(batch, length, heads, head_dim)`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from .nn._batchnorm import group_norm
from .nn._conv import conv, conv_transpose
from .nn._dropout import _dropout
from .nn._norm import _layer_norm, _rms_norm
from .nn._pool import adaptive_avg_pool, avg_pool, max_pool, pool
from .nn._sdpa import scaled_dot_product_attention

relu = jax.nn.relu
relu6 = jax.nn.relu6
gelu = jax.nn.gelu
silu = jax.nn.silu
swish = jax.nn.swish
sigmoid = jax.nn.sigmoid
tanh = jnp.tanh
softmax = jax.nn.softmax
log_softmax = jax.nn.log_softmax
leaky_relu = jax.nn.leaky_relu
elu = jax.nn.elu
selu = jax.nn.selu
celu = jax.nn.celu
mish = jax.nn.mish
glu = jax.nn.glu
hard_sigmoid = jax.nn.hard_sigmoid
hard_silu = jax.nn.hard_silu
hard_swish = jax.nn.hard_swish
hard_tanh = jax.nn.hard_tanh
soft_sign = jax.nn.soft_sign
softplus = jax.nn.softplus
log_sigmoid = jax.nn.log_sigmoid
one_hot = jax.nn.one_hot


def prelu(x: Array, alpha: Array | float) -> Array:
    """`x` where `x >= 0`, else `alpha · x`; `alpha` is a scalar or broadcasts against `x`
    (one value per channel on the last axis)."""
    return jnp.where(x >= 0, x, alpha * x)


def linear(x: Array, weight: Array, bias: Array | None = None) -> Array:
    """`x @ weight + bias` with `weight` `(d_in, d_out)` (the layout of `nn.Linear`)."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"linear: x has {x.shape[-1]} features on its last axis but weight is {tuple(weight.shape)} "
            "(d_in, d_out); transpose a PyTorch-layout (d_out, d_in) weight with weight.T."
        )
    y = x @ weight
    return y if bias is None else y + bias


def dropout(x: Array, rate: float, key: PRNGKeyArray | None = None, deterministic: bool = False) -> Array:
    """Zero each element with probability `rate` and scale the rest by `1/(1-rate)`;
    identity when `deterministic` or `rate == 0`. Needs `key` otherwise."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"dropout: rate must lie in [0, 1], received {rate}.")
    if deterministic or rate == 0.0:
        return x
    if key is None:
        raise ValueError("dropout: pass key=jax.random.key(...) or deterministic=True for evaluation.")
    return _dropout(x, key, float(rate))


def layer_norm(
    x: Array, scale: Array | None = None, bias: Array | None = None, *, eps: float = 1e-5
) -> Array:
    """`(x - mean) / sqrt(var + eps) · scale + bias` over the last axis (statistics in >= float32)."""
    d = x.shape[-1]
    scale = jnp.ones((d,), x.dtype) if scale is None else scale
    bias = jnp.zeros((d,), x.dtype) if bias is None else bias
    return _layer_norm(x, scale, bias, eps)


def rms_norm(x: Array, scale: Array | None = None, *, eps: float = 1e-6) -> Array:
    """`x / sqrt(mean(x²) + eps) · scale` over the last axis (statistics in >= float32)."""
    return _rms_norm(x, jnp.ones((x.shape[-1],), x.dtype) if scale is None else scale, eps)


__all__ = [
    "adaptive_avg_pool",
    "avg_pool",
    "celu",
    "conv",
    "conv_transpose",
    "dropout",
    "elu",
    "gelu",
    "glu",
    "group_norm",
    "hard_sigmoid",
    "hard_silu",
    "hard_swish",
    "hard_tanh",
    "layer_norm",
    "leaky_relu",
    "linear",
    "log_sigmoid",
    "log_softmax",
    "max_pool",
    "mish",
    "one_hot",
    "pool",
    "prelu",
    "relu",
    "relu6",
    "rms_norm",
    "scaled_dot_product_attention",
    "selu",
    "sigmoid",
    "silu",
    "soft_sign",
    "softmax",
    "softplus",
    "swish",
    "tanh",
]
