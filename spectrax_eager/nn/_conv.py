"""Eager convolutions over channels-last inputs: Conv1d/2d/3d and ConvTranspose1d/2d/3d.

Inputs are `(batch, *spatial, channels)`; weights `(*kernel, c_in, c_out)`
(the core layout). `sharding=` names the logical axes of the (in, out) channel
axes of the weight (kernel axes unsharded), or of every weight axis.
"""

from __future__ import annotations

from typing import Any, Unpack

import spectrax_core as sc

from .._sharding.rules import annotation_axes
from ._base import CoreLayer, LayerOptions, also_named, annotate


def _weight_sharding(where: str, sharding: Any, w_init: Any) -> tuple[Any, tuple]:
    """`(names for the whole weight or None, (in, out) channel names)` from `sharding=`, which
    names either the two channel axes or every axis of the `(*kernel, in, out)` weight."""
    names = annotation_axes(where, sharding if sharding is not None else getattr(w_init, "sharding", None))
    if names is None:
        return None, (None, None)
    if len(names) == 2:
        return None, names
    return names, (None, None)


def _build_conv(
    layer: CoreLayer, sizes: tuple, geometry: dict, sharding: Any, bias_sharding: Any, options: dict
):
    """Build a (transposed) convolution's params from its `(c_in, c_out, kernel_size)`, its
    geometry keywords and its annotations."""
    where = type(layer).__name__
    whole, axes = _weight_sharding(where, sharding, options.get("w_init"))
    layer._build(*sizes, axes=axes, options=options, **geometry)
    annotate(layer, where, weight=whole, bias=bias_sharding)


@also_named(in_channels="c_in", out_channels="c_out")
class _ConvLayer(CoreLayer):
    def __init__(
        self,
        c_in: int,
        c_out: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: Any = "VALID",
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        *,
        use_bias: bool = True,
        sharding: tuple | None = None,
        bias_sharding: Any = None,
        **options: Unpack[LayerOptions],
    ):
        geometry = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, use_bias=use_bias)
        _build_conv(self, (c_in, c_out, kernel_size), geometry, sharding, bias_sharding, options)


class Conv1d(_ConvLayer):
    """1-d convolution over `(batch, length, c_in)`. `padding`: "VALID" (default), "SAME", an int
    (both sides, as PyTorch) or one int / (low, high) pair per axis; `groups` as PyTorch.
    `sharding` names the (in, out) channel axes or every weight axis; `bias_sharding` the bias's."""

    core_cls = sc.nn.Conv1d


class Conv2d(_ConvLayer):
    """2-d convolution over `(batch, height, width, c_in)`; arguments as `Conv1d`."""

    core_cls = sc.nn.Conv2d


class Conv3d(_ConvLayer):
    """3-d convolution over `(batch, depth, height, width, c_in)`; arguments as `Conv1d`."""

    core_cls = sc.nn.Conv3d


class Conv(_ConvLayer):
    """A convolution whose spatial rank is that of `kernel_size`: an int is 1-d, a tuple of `n`
    sizes is `n`-d (1 to 3); otherwise as `Conv1d`."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _ConvLayer:
        kernel = args[2] if len(args) > 2 else kwargs.get("kernel_size")
        rank = 1 if isinstance(kernel, int) else len(tuple(kernel))
        if rank not in (1, 2, 3):
            raise ValueError(
                f"Conv: kernel_size={kernel!r} gives a {rank}-d convolution; 1 to 3 are supported."
            )
        return (Conv1d, Conv2d, Conv3d)[rank - 1](*args, **kwargs)


@also_named(in_channels="c_in", out_channels="c_out")
class _ConvTransposeLayer(CoreLayer):
    def __init__(
        self,
        c_in: int,
        c_out: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] = 0,
        output_padding: int | tuple[int, ...] = 0,
        dilation: int | tuple[int, ...] = 1,
        *,
        use_bias: bool = True,
        sharding: tuple | None = None,
        bias_sharding: Any = None,
        **options: Unpack[LayerOptions],
    ):
        geometry = dict(stride=stride, padding=padding, output_padding=output_padding, dilation=dilation)
        _build_conv(
            self,
            (c_in, c_out, kernel_size),
            dict(geometry, use_bias=use_bias),
            sharding,
            bias_sharding,
            options,
        )


class ConvTranspose1d(_ConvTransposeLayer):
    """1-d transposed convolution over `(batch, length, c_in)`; output length
    `(L-1)·stride - 2·padding + dilation·(kernel-1) + output_padding + 1`, as PyTorch."""

    core_cls = sc.nn.ConvTranspose1d


class ConvTranspose2d(_ConvTransposeLayer):
    """2-d transposed convolution over `(batch, height, width, c_in)`; arguments as `ConvTranspose1d`."""

    core_cls = sc.nn.ConvTranspose2d


class ConvTranspose3d(_ConvTransposeLayer):
    """3-d transposed convolution over `(batch, depth, height, width, c_in)`; arguments as `ConvTranspose1d`."""

    core_cls = sc.nn.ConvTranspose3d
