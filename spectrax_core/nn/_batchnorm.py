"""Normalisation with statistics over the batch (BatchNorm) or within one example (GroupNorm,
InstanceNorm), for channels-last inputs `(batch, *spatial, channels)`.

BatchNorm keeps running statistics in the params (`mean`, `var`): training
normalises with the batch's biased variance and returns params whose running
statistics moved by `momentum` towards the batch's mean and unbiased variance
(`running = (1 - momentum) · running + momentum · batch`, as PyTorch);
evaluation normalises with the running statistics. Statistics are computed in
at least float32.
"""

from __future__ import annotations

from typing import Any, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, PRNGKeyArray

from .._apply import register_apply
from .._checks import check_last_dim, check_rank
from ..init import initialize
from ._options import ParamOptions, option_values, with_options


def _affine(key, c, affine, dtype, w_init, b_init, where):
    if not affine:
        return None, None
    scale, bias = jnp.ones((c,), dtype), jnp.zeros((c,), dtype)
    if w_init is not None or b_init is not None:
        if key is None:
            raise ValueError(f"{where}: w_init / b_init need a key; pass init(key, ...) a jax.random key.")
        if w_init is not None:
            scale = initialize(w_init, key, (c,), dtype, where=f"{where}: w_init")
        if b_init is not None:
            bias = initialize(b_init, jax.random.fold_in(key, 1), (c,), dtype, where=f"{where}: b_init")
    return scale, bias


def _finish(y, x, scale, bias, compute_dtype):
    if scale is not None:
        y = y * scale.astype(y.dtype) + bias.astype(y.dtype)
    return y.astype(x.dtype if compute_dtype is None else compute_dtype)


class BatchNorm(eqx.Module):
    """Parameters of batch normalisation over `num_features` channels (the last axis).

    `scale` / `bias` are the affine parameters (None when `affine=False`);
    `mean` / `var` are the running statistics, not trained.
    """

    scale: Float[Array, " c"] | None
    bias: Float[Array, " c"] | None
    mean: Float[Array, " c"]
    var: Float[Array, " c"]
    num_features: int = eqx.field(static=True)
    eps: float = eqx.field(static=True, default=1e-5)
    momentum: float = eqx.field(static=True, default=0.1)
    compute_dtype: Any = eqx.field(static=True, default=None)

    @with_options
    def init(
        cls,
        key: PRNGKeyArray | None,
        num_features: int,
        *,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
        **options: Unpack[ParamOptions],
    ) -> "BatchNorm":
        """Unit scale, zero bias (or `w_init` / `b_init`, which need `key`), running mean 0, variance 1."""
        dtype, w_init, b_init, compute_dtype = option_values(options)
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"BatchNorm: momentum must lie in [0, 1], received {momentum}.")
        scale, bias = _affine(key, num_features, affine, dtype, w_init, b_init, "BatchNorm")
        return cls(
            scale=scale,
            bias=bias,
            mean=jnp.zeros((num_features,), jnp.float32),
            var=jnp.ones((num_features,), jnp.float32),
            num_features=num_features,
            eps=float(eps),
            momentum=float(momentum),
            compute_dtype=compute_dtype,
        )

    def logical_axes(self) -> dict[str, tuple]:
        """Channels are replicated."""
        return {"scale": (None,), "bias": (None,), "mean": (None,), "var": (None,)}


@register_apply(BatchNorm)
def apply_batch_norm(
    params: BatchNorm, x: Array, *, training: bool = False
) -> Array | tuple[Array, BatchNorm]:
    """Normalise `x` `(batch, ..., num_features)` per channel.

    `training=False`: with the running statistics; returns `y`.
    `training=True`: with the statistics of `x` over every axis but the last;
    returns `(y, params)` with the running statistics updated.
    """
    check_rank("BatchNorm", x, 2)
    check_last_dim("BatchNorm", x, params.num_features, what="channels")
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    axes = tuple(range(x.ndim - 1))
    if not training:
        y = (xf - params.mean) * lax.rsqrt(params.var + params.eps)
        return _finish(y, x, params.scale, params.bias, params.compute_dtype)
    n = x.size // params.num_features
    if n < 2:
        raise ValueError(
            f"BatchNorm: training needs more than one value per channel, received shape {tuple(x.shape)}; "
            "use a larger batch or evaluate with training=False."
        )
    mean = jnp.mean(xf, axis=axes)
    var = jnp.mean(jnp.square(xf - mean), axis=axes)
    y = (xf - mean) * lax.rsqrt(var + params.eps)
    m = params.momentum
    new_mean = (1.0 - m) * params.mean + m * lax.stop_gradient(mean)
    new_var = (1.0 - m) * params.var + m * lax.stop_gradient(var) * (n / (n - 1))
    updated = eqx.tree_at(lambda p: (p.mean, p.var), params, (new_mean, new_var))
    return _finish(y, x, params.scale, params.bias, params.compute_dtype), updated


class GroupNorm(eqx.Module):
    """Parameters of group normalisation: the channels (last axis) split into `num_groups`
    groups, each normalised over the spatial axes and its own channels, per example."""

    scale: Float[Array, " c"] | None
    bias: Float[Array, " c"] | None
    num_groups: int = eqx.field(static=True)
    num_channels: int = eqx.field(static=True)
    eps: float = eqx.field(static=True, default=1e-5)
    compute_dtype: Any = eqx.field(static=True, default=None)

    @with_options
    def init(
        cls,
        key: PRNGKeyArray | None,
        num_groups: int,
        num_channels: int,
        *,
        eps: float = 1e-5,
        affine: bool = True,
        **options: Unpack[ParamOptions],
    ) -> "GroupNorm":
        """Unit scale and zero bias (or `w_init` / `b_init`, which need `key`); none when `affine=False`."""
        dtype, w_init, b_init, compute_dtype = option_values(options)
        if num_groups < 1 or num_channels % num_groups:
            raise ValueError(
                f"GroupNorm: num_groups={num_groups} must be positive and divide num_channels={num_channels}."
            )
        scale, bias = _affine(key, num_channels, affine, dtype, w_init, b_init, "GroupNorm")
        return cls(scale, bias, num_groups, num_channels, float(eps), compute_dtype)

    def logical_axes(self) -> dict[str, tuple]:
        """Channels are replicated."""
        return {"scale": (None,), "bias": (None,)}


class InstanceNorm(eqx.Module):
    """Parameters of instance normalisation: each channel of each example normalised over the
    spatial axes (GroupNorm with one channel per group). Not affine by default, as PyTorch."""

    scale: Float[Array, " c"] | None
    bias: Float[Array, " c"] | None
    num_features: int = eqx.field(static=True)
    eps: float = eqx.field(static=True, default=1e-5)
    compute_dtype: Any = eqx.field(static=True, default=None)

    @with_options
    def init(
        cls,
        key: PRNGKeyArray | None,
        num_features: int,
        *,
        eps: float = 1e-5,
        affine: bool = False,
        **options: Unpack[ParamOptions],
    ) -> "InstanceNorm":
        """No affine parameters unless `affine=True` (unit scale, zero bias, or `w_init` / `b_init`)."""
        dtype, w_init, b_init, compute_dtype = option_values(options)
        scale, bias = _affine(key, num_features, affine, dtype, w_init, b_init, "InstanceNorm")
        return cls(scale, bias, num_features, float(eps), compute_dtype)

    def logical_axes(self) -> dict[str, tuple]:
        """Channels are replicated."""
        return {"scale": (None,), "bias": (None,)}


def group_norm(
    x: Array,
    num_groups: int,
    scale: Array | None = None,
    bias: Array | None = None,
    *,
    eps: float = 1e-5,
) -> Array:
    """Group normalisation of `x` `(batch, *spatial, channels)` with optional per-channel affine."""
    check_rank("group_norm", x, 2)
    c = x.shape[-1]
    if num_groups < 1 or c % num_groups:
        raise ValueError(f"group_norm: num_groups={num_groups} must be positive and divide the {c} channels.")
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    g = xf.reshape(*x.shape[:-1], num_groups, c // num_groups)
    axes = tuple(range(1, x.ndim - 1)) + (x.ndim,)
    mean = jnp.mean(g, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(g - mean), axis=axes, keepdims=True)
    y = ((g - mean) * lax.rsqrt(var + eps)).reshape(xf.shape)
    if scale is not None:
        y = y * scale.astype(y.dtype)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(x.dtype)


@register_apply(GroupNorm)
def apply_group_norm(params: GroupNorm, x: Array) -> Array:
    """Normalise `x` `(batch, *spatial, num_channels)` per example and group."""
    check_last_dim("GroupNorm", x, params.num_channels, what="channels")
    y = group_norm(x, params.num_groups, params.scale, params.bias, eps=params.eps)
    return y if params.compute_dtype is None else y.astype(params.compute_dtype)


@register_apply(InstanceNorm)
def apply_instance_norm(params: InstanceNorm, x: Array) -> Array:
    """Normalise `x` `(batch, *spatial, num_features)` per example and channel over the spatial axes."""
    check_rank("InstanceNorm", x, 3)
    check_last_dim("InstanceNorm", x, params.num_features, what="channels")
    y = group_norm(x, params.num_features, params.scale, params.bias, eps=params.eps)
    return y if params.compute_dtype is None else y.astype(params.compute_dtype)
