"""Convolutions over channels-last inputs `(batch, *spatial, channels)`: Conv1d/2d/3d and
ConvTranspose1d/2d/3d.

Weights are laid out `(*kernel, c_in_per_group, c_out)` for a convolution and
`(*kernel, c_in, c_out)` for a transposed one. A transposed convolution is the
adjoint of a convolution with the same hyper-parameters: input position `i`,
kernel tap `k` and output position `o` meet where `o = i·stride + k·dilation -
padding`, and the output length is `(L-1)·stride - 2·padding + dilation·(k-1)
+ output_padding + 1` (PyTorch's `ConvTranspose`).
"""

from __future__ import annotations

from typing import Any, Sequence, Unpack

import equinox as eqx
import jax
from jax import lax
from jaxtyping import Array, Float, PRNGKeyArray

from .._apply import register_apply
from .._checks import check_last_dim
from ..init import initialize, lecun_normal, zeros
from ._options import ParamOptions, option_values, with_options
from ._pool import Padding, spatial_padding
from ._validate import check_ndim

_LAYOUTS = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC"), 3: ("NDHWC", "DHWIO", "NDHWC")}
_SPATIAL = {
    1: "(batch, width, c_in)",
    2: "(batch, height, width, c_in)",
    3: "(batch, depth, height, width, c_in)",
}


def _as_tuple(where: str, name: str, value: int | Sequence[int], n: int, minimum: int = 1) -> tuple[int, ...]:
    out = (value,) * n if isinstance(value, int) else tuple(value)
    if len(out) != n or any(not isinstance(v, int) or v < minimum for v in out):
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(
            f"{where}: {name} must be {what} or {n} {'positive ' if minimum == 1 else ''}ints, received {value!r}."
        )
    return out


def conv(
    x: Array,
    weight: Array,
    bias: Array | None = None,
    *,
    stride: int | Sequence[int] = 1,
    padding: Padding = "SAME",
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> Array:
    """N-d convolution of `x` `(batch, *spatial, c_in)` with `weight` `(*kernel, c_in/groups, c_out)`.

    `padding`: `"SAME"`, `"VALID"`, an int (both sides of every axis) or one int /
    `(low, high)` pair per spatial axis. `groups` splits the channels into
    independent groups (`groups == c_in` is a depthwise convolution).
    """
    n = weight.ndim - 2
    where = f"conv ({n}-d)"
    if n not in _LAYOUTS:
        raise ValueError(
            f"conv: weight must have rank 3, 4 or 5 ((*kernel, c_in, c_out)), received {weight.shape}."
        )
    check_ndim(where, x, n + 2, _SPATIAL[n])
    if x.shape[-1] != weight.shape[-2] * groups or weight.shape[-1] % groups:
        raise ValueError(
            f"{where}: input channels {x.shape[-1]} must equal weight's c_in {weight.shape[-2]} × groups "
            f"{groups}, and c_out {weight.shape[-1]} must be divisible by groups."
        )
    y = lax.conv_general_dilated(
        x,
        weight,
        _as_tuple(where, "stride", stride, n),
        spatial_padding(where, padding, n),
        rhs_dilation=_as_tuple(where, "dilation", dilation, n),
        dimension_numbers=_LAYOUTS[n],
        feature_group_count=groups,
    )
    return y if bias is None else y + bias


def conv_transpose(
    x: Array,
    weight: Array,
    bias: Array | None = None,
    *,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    output_padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
) -> Array:
    """N-d transposed convolution of `x` `(batch, *spatial, c_in)` with `weight` `(*kernel, c_in, c_out)`.

    `padding` (ints) removes that many positions from both ends of each output
    axis; `output_padding` (< stride or < dilation) adds positions at the high end.
    """
    n = weight.ndim - 2
    where = f"conv_transpose ({n}-d)"
    if n not in _LAYOUTS:
        raise ValueError(
            f"conv_transpose: weight must have rank 3, 4 or 5 ((*kernel, c_in, c_out)), received {weight.shape}."
        )
    check_ndim(where, x, n + 2, _SPATIAL[n])
    check_last_dim(where, x, weight.shape[-2], what="channels")
    stride = _as_tuple(where, "stride", stride, n)
    dilation = _as_tuple(where, "dilation", dilation, n)
    pad = _as_tuple(where, "padding", padding, n, minimum=0)
    out_pad = _as_tuple(where, "output_padding", output_padding, n, minimum=0)
    for op, s, d in zip(out_pad, stride, dilation):
        if op >= max(s, d):
            raise ValueError(
                f"{where}: output_padding {out_pad} must be smaller than stride {stride} or dilation {dilation}."
            )
    kernel = weight.shape[:n]
    edges = tuple(
        (d * (k - 1) - p, d * (k - 1) - p + op) for k, p, op, d in zip(kernel, pad, out_pad, dilation)
    )
    flipped = lax.rev(weight, tuple(range(n)))
    y = lax.conv_general_dilated(
        x,
        flipped,
        (1,) * n,
        edges,
        lhs_dilation=stride,
        rhs_dilation=dilation,
        dimension_numbers=_LAYOUTS[n],
    )
    return y if bias is None else y + bias


def _cast(compute_dtype: Any, *arrays):
    if compute_dtype is None:
        return arrays
    return tuple(None if a is None else a.astype(compute_dtype) for a in arrays)


def _kernel_fields(cls, key, channels: tuple, geometry: tuple, use_bias: bool, axes, options: dict) -> dict:
    """The fields a convolution and a transposed one share. `channels`: `(c_in, c_out, groups)`;
    `geometry`: `(kernel_size, stride, dilation)`; `options`: the layer's `ParamOptions`.
    The weight `(*kernel, c_in / groups, c_out)` comes from `key` (lecun-normal by default), the
    bias from `fold_in(key, 1)` (zeros by default)."""
    (c_in, c_out, groups), (dtype, w_init, b_init, compute_dtype) = channels, option_values(options)
    n, where = cls.ndim, cls.__name__
    kernel, stride, dilation = (_as_tuple(where, k, v, n) for k, v in zip(_GEOMETRY, geometry))
    shape = (*kernel, c_in // groups, c_out)
    weight = initialize(w_init or lecun_normal(), key, shape, dtype, where=f"{where}: w_init")
    bias = None
    if use_bias:
        bias_key = jax.random.fold_in(key, 1)
        bias = initialize(b_init or zeros, bias_key, (c_out,), dtype, where=f"{where}: b_init")
    fields = dict(weight=weight, bias=bias, c_in=c_in, c_out=c_out, kernel_size=kernel, stride=stride)
    return fields | dict(dilation=dilation, axes=tuple(axes), compute_dtype=compute_dtype)


_GEOMETRY = ("kernel_size", "stride", "dilation")


def _conv_axes(params) -> dict[str, tuple]:
    """Logical axes of a convolution's arrays: kernel axes unsharded, then the channel `axes`."""
    return {"weight": (None,) * len(params.kernel_size) + tuple(params.axes), "bias": (params.axes[1],)}


class _Conv(eqx.Module):
    """Shared fields of Conv1d/2d/3d: `weight` `(*kernel, c_in/groups, c_out)`, optional `bias`.

    `axes` names the logical axes of the (in, out) channel axes; kernel axes are
    never sharded. Default: replicated channels. `compute_dtype` (None: as given)
    casts the input and parameters before the convolution.
    """

    weight: Float[Array, "*kernel c_in c_out"]
    bias: Float[Array, " c_out"] | None
    c_in: int = eqx.field(static=True)
    c_out: int = eqx.field(static=True)
    kernel_size: tuple[int, ...] = eqx.field(static=True)
    stride: tuple[int, ...] = eqx.field(static=True)
    padding: Any = eqx.field(static=True)
    axes: tuple[str | None, str | None] = eqx.field(static=True, default=(None, None))
    dilation: tuple[int, ...] = eqx.field(static=True, default=())
    groups: int = eqx.field(static=True, default=1)
    compute_dtype: Any = eqx.field(static=True, default=None)

    @with_options
    def init(
        cls,
        key: PRNGKeyArray,
        c_in: int,
        c_out: int,
        kernel_size: int | tuple[int, ...],
        *,
        stride: int | tuple[int, ...] = 1,
        padding: Padding = "SAME",
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        use_bias: bool = True,
        axes: tuple[str | None, str | None] = (None, None),
        **options: Unpack[ParamOptions],
    ):
        """Lecun-normal weight (fan-in = prod(kernel) · c_in / groups) and zero bias unless
        `w_init` / `b_init` say otherwise; `dtype` is the parameters' dtype."""
        where = cls.__name__
        if not isinstance(groups, int) or groups < 1 or c_in % groups or c_out % groups:
            raise ValueError(
                f"{where}: groups={groups!r} must be a positive int dividing c_in={c_in} and c_out={c_out}."
            )
        geometry = (kernel_size, stride, dilation)
        fields = _kernel_fields(cls, key, (c_in, c_out, groups), geometry, use_bias, axes, options)
        return cls(**fields, padding=spatial_padding(where, padding, cls.ndim), groups=groups)

    logical_axes = _conv_axes


class Conv1d(_Conv):
    """1-d convolution over `(batch, width, c_in)`; weight `(kernel, c_in/groups, c_out)`."""

    ndim = 1


class Conv2d(_Conv):
    """2-d convolution over `(batch, height, width, c_in)`; weight `(kh, kw, c_in/groups, c_out)`."""

    ndim = 2


class Conv3d(_Conv):
    """3-d convolution over `(batch, depth, height, width, c_in)`; weight `(kd, kh, kw, c_in/groups, c_out)`."""

    ndim = 3


class _ConvTranspose(eqx.Module):
    """Shared fields of ConvTranspose1d/2d/3d: `weight` `(*kernel, c_in, c_out)`, optional `bias`."""

    weight: Float[Array, "*kernel c_in c_out"]
    bias: Float[Array, " c_out"] | None
    c_in: int = eqx.field(static=True)
    c_out: int = eqx.field(static=True)
    kernel_size: tuple[int, ...] = eqx.field(static=True)
    stride: tuple[int, ...] = eqx.field(static=True)
    padding: tuple[int, ...] = eqx.field(static=True)
    output_padding: tuple[int, ...] = eqx.field(static=True)
    dilation: tuple[int, ...] = eqx.field(static=True)
    axes: tuple[str | None, str | None] = eqx.field(static=True, default=(None, None))
    compute_dtype: Any = eqx.field(static=True, default=None)

    @with_options
    def init(
        cls,
        key: PRNGKeyArray,
        c_in: int,
        c_out: int,
        kernel_size: int | tuple[int, ...],
        *,
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] = 0,
        output_padding: int | tuple[int, ...] = 0,
        dilation: int | tuple[int, ...] = 1,
        use_bias: bool = True,
        axes: tuple[str | None, str | None] = (None, None),
        **options: Unpack[ParamOptions],
    ):
        """Lecun-normal weight (fan-in = prod(kernel) · c_in) and zero bias unless `w_init` /
        `b_init` say otherwise; `padding` / `output_padding` as PyTorch's ConvTranspose."""
        n, where = cls.ndim, cls.__name__
        geometry = (kernel_size, stride, dilation)
        fields = _kernel_fields(cls, key, (c_in, c_out, 1), geometry, use_bias, axes, options)
        stride_t, dilation_t = fields["stride"], fields["dilation"]
        out_pad = _as_tuple(where, "output_padding", output_padding, n, minimum=0)
        if any(op >= max(s, d) for op, s, d in zip(out_pad, stride_t, dilation_t)):
            raise ValueError(
                f"{where}: output_padding {out_pad} must be smaller than stride {stride_t} or dilation {dilation_t}."
            )
        padding = _as_tuple(where, "padding", padding, n, minimum=0)
        return cls(**fields, padding=padding, output_padding=out_pad)

    logical_axes = _conv_axes


class ConvTranspose1d(_ConvTranspose):
    """1-d transposed convolution over `(batch, width, c_in)`."""

    ndim = 1


class ConvTranspose2d(_ConvTranspose):
    """2-d transposed convolution over `(batch, height, width, c_in)`."""

    ndim = 2


class ConvTranspose3d(_ConvTranspose):
    """3-d transposed convolution over `(batch, depth, height, width, c_in)`."""

    ndim = 3


def _apply_conv(params: _Conv, x: Array) -> Array:
    name = type(params).__name__
    check_ndim(name, x, len(params.kernel_size) + 2, _SPATIAL[len(params.kernel_size)])
    check_last_dim(name, x, params.c_in, what="channels")
    x, weight, bias = _cast(params.compute_dtype, x, params.weight, params.bias)
    return conv(
        x,
        weight,
        bias,
        stride=params.stride,
        padding=params.padding,
        dilation=params.dilation or 1,
        groups=params.groups,
    )


def _apply_conv_transpose(params: _ConvTranspose, x: Array) -> Array:
    name = type(params).__name__
    check_ndim(name, x, len(params.kernel_size) + 2, _SPATIAL[len(params.kernel_size)])
    check_last_dim(name, x, params.c_in, what="channels")
    x, weight, bias = _cast(params.compute_dtype, x, params.weight, params.bias)
    return conv_transpose(
        x,
        weight,
        bias,
        stride=params.stride,
        padding=params.padding,
        output_padding=params.output_padding,
        dilation=params.dilation,
    )


for _cls in (Conv1d, Conv2d, Conv3d):
    register_apply(_cls)(_apply_conv)
for _cls in (ConvTranspose1d, ConvTranspose2d, ConvTranspose3d):
    register_apply(_cls)(_apply_conv_transpose)
