"""Convolutions over channels-last inputs: Conv1d (NWC) and Conv2d (NHWC)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, PRNGKeyArray

from .._apply import register_apply
from .._checks import check_last_dim, typechecked
from ._validate import check_ndim

_PADDINGS = ("SAME", "VALID")


def _as_tuple(name: str, value: int | tuple[int, ...], n: int) -> tuple[int, ...]:
    out = (value,) * n if isinstance(value, int) else tuple(value)
    if len(out) != n or any(not isinstance(v, int) or v < 1 for v in out):
        raise ValueError(f"Conv{n}d: {name} must be a positive int or {n} positive ints, received {value!r}.")
    return out


def _init_conv(key, n, c_in, c_out, kernel_size, stride, padding, use_bias, dtype, axes):
    kernel = _as_tuple("kernel_size", kernel_size, n)
    if padding not in _PADDINGS:
        raise ValueError(f"Conv{n}d: padding must be one of {_PADDINGS}, received {padding!r}.")
    # lecun_normal over (*kernel, c_in, c_out) uses fan_in = prod(kernel) * c_in.
    weight = jax.nn.initializers.lecun_normal()(key, (*kernel, c_in, c_out), dtype)
    bias = jnp.zeros((c_out,), dtype) if use_bias else None
    return dict(
        weight=weight,
        bias=bias,
        c_in=c_in,
        c_out=c_out,
        kernel_size=kernel,
        stride=_as_tuple("stride", stride, n),
        padding=padding,
        axes=tuple(axes),
    )


class Conv1d(eqx.Module):
    """Parameters of a 1-d convolution: `weight` `(kernel, c_in, c_out)`, optional `bias`.

    `axes` names the logical axes of the (in, out) channel axes; the kernel axis
    is never sharded. Default: replicated channels.
    """

    weight: Float[Array, "kernel c_in c_out"]
    bias: Float[Array, " c_out"] | None
    c_in: int = eqx.field(static=True)
    c_out: int = eqx.field(static=True)
    kernel_size: tuple[int] = eqx.field(static=True)
    stride: tuple[int] = eqx.field(static=True)
    padding: str = eqx.field(static=True)
    axes: tuple[str | None, str | None] = eqx.field(static=True, default=(None, None))

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        c_in: int,
        c_out: int,
        kernel_size: int | tuple[int],
        *,
        stride: int | tuple[int] = 1,
        padding: str = "SAME",
        use_bias: bool = True,
        dtype=jnp.float32,
        axes: tuple[str | None, str | None] = (None, None),
    ) -> "Conv1d":
        """Lecun-normal weight (fan-in = kernel · c_in), zero bias."""
        return cls(**_init_conv(key, 1, c_in, c_out, kernel_size, stride, padding, use_bias, dtype, axes))

    def logical_axes(self) -> dict[str, tuple]:
        """Logical axes of each array field (see `spectrax_core.sharding`)."""
        return {"weight": (None, *self.axes), "bias": (self.axes[1],)}


class Conv2d(eqx.Module):
    """Parameters of a 2-d convolution: `weight` `(kh, kw, c_in, c_out)`, optional `bias`.

    `axes` names the logical axes of the (in, out) channel axes; kernel axes are
    never sharded. Default: replicated channels.
    """

    weight: Float[Array, "kh kw c_in c_out"]
    bias: Float[Array, " c_out"] | None
    c_in: int = eqx.field(static=True)
    c_out: int = eqx.field(static=True)
    kernel_size: tuple[int, int] = eqx.field(static=True)
    stride: tuple[int, int] = eqx.field(static=True)
    padding: str = eqx.field(static=True)
    axes: tuple[str | None, str | None] = eqx.field(static=True, default=(None, None))

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        c_in: int,
        c_out: int,
        kernel_size: int | tuple[int, int],
        *,
        stride: int | tuple[int, int] = 1,
        padding: str = "SAME",
        use_bias: bool = True,
        dtype=jnp.float32,
        axes: tuple[str | None, str | None] = (None, None),
    ) -> "Conv2d":
        """Lecun-normal weight (fan-in = kh · kw · c_in), zero bias."""
        return cls(**_init_conv(key, 2, c_in, c_out, kernel_size, stride, padding, use_bias, dtype, axes))

    def logical_axes(self) -> dict[str, tuple]:
        """Logical axes of each array field (see `spectrax_core.sharding`)."""
        return {"weight": (None, None, *self.axes), "bias": (self.axes[1],)}


@typechecked
def _conv1d(
    x: Float[Array, "batch width c_in"],
    weight: Float[Array, "kernel c_in c_out"],
    bias: Float[Array, " c_out"] | None,
    stride: tuple[int],
    padding: str,
) -> Float[Array, "batch out_width c_out"]:
    y = lax.conv_general_dilated(x, weight, stride, padding, dimension_numbers=("NWC", "WIO", "NWC"))
    return y if bias is None else y + bias


@typechecked
def _conv2d(
    x: Float[Array, "batch height width c_in"],
    weight: Float[Array, "kh kw c_in c_out"],
    bias: Float[Array, " c_out"] | None,
    stride: tuple[int, int],
    padding: str,
) -> Float[Array, "batch out_height out_width c_out"]:
    y = lax.conv_general_dilated(x, weight, stride, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y if bias is None else y + bias


@register_apply(Conv1d)
def apply_conv1d(params: Conv1d, x: Array) -> Array:
    """Convolve `x` of shape `(batch, width, c_in)`, giving `(batch, out_width, c_out)`."""
    check_ndim("Conv1d", x, 3, "(batch, width, c_in)")
    check_last_dim("Conv1d", x, params.c_in, what="channels")
    return _conv1d(x, params.weight, params.bias, params.stride, params.padding)


@register_apply(Conv2d)
def apply_conv2d(params: Conv2d, x: Array) -> Array:
    """Convolve `x` of shape `(batch, height, width, c_in)`, giving `(batch, out_h, out_w, c_out)`."""
    check_ndim("Conv2d", x, 4, "(batch, height, width, c_in)")
    check_last_dim("Conv2d", x, params.c_in, what="channels")
    return _conv2d(x, params.weight, params.bias, params.stride, params.padding)
