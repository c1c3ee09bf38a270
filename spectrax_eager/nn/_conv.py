"""Eager convolutions over channels-last inputs: Conv1d/2d/3d and ConvTranspose1d/2d/3d.

Inputs are `(batch, *spatial, channels)`; weights `(*kernel, c_in, c_out)`
(the core layout). `sharding=` names the logical axes of the (in, out) channel
axes of the weight; kernel axes are never sharded.
"""

from __future__ import annotations

from typing import Any

import spectrax_core as sc

from .._rngs import Rngs
from ._base import PARAM_DTYPE, CoreLayer, also_named, dtype_kwargs, key_from, sharding_axes


@also_named(in_channels="c_in", out_channels="c_out")
class _ConvLayer(CoreLayer):
    def __init__(
        self,
        c_in: int,
        c_out: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: Any = "SAME",
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        *,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = PARAM_DTYPE,
        w_init: Any = None,
        b_init: Any = None,
        sharding: tuple | None = None,
        rngs: Rngs | None = None,
    ):
        where = type(self).__name__
        axes = sharding_axes(where, sharding, 2, w_init) or (None, None)
        self._adopt(
            self.core_cls.init(
                key_from(rngs, where),
                c_in,
                c_out,
                kernel_size,
                stride=stride,
                padding=padding,
                dilation=dilation,
                groups=groups,
                use_bias=use_bias,
                axes=axes,
                **dtype_kwargs(dtype, param_dtype, w_init, b_init),
            )
        )


class Conv1d(_ConvLayer):
    """1-d convolution over `(batch, length, c_in)`. `padding`: "SAME" (default), "VALID", an int
    (both sides, as PyTorch) or one int / (low, high) pair per axis; `groups` as PyTorch."""

    core_cls = sc.nn.Conv1d


class Conv2d(_ConvLayer):
    """2-d convolution over `(batch, height, width, c_in)`; arguments as `Conv1d`."""

    core_cls = sc.nn.Conv2d


class Conv3d(_ConvLayer):
    """3-d convolution over `(batch, depth, height, width, c_in)`; arguments as `Conv1d`."""

    core_cls = sc.nn.Conv3d


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
        dtype: Any = None,
        param_dtype: Any = PARAM_DTYPE,
        w_init: Any = None,
        b_init: Any = None,
        sharding: tuple | None = None,
        rngs: Rngs | None = None,
    ):
        where = type(self).__name__
        axes = sharding_axes(where, sharding, 2, w_init) or (None, None)
        self._adopt(
            self.core_cls.init(
                key_from(rngs, where),
                c_in,
                c_out,
                kernel_size,
                stride=stride,
                padding=padding,
                output_padding=output_padding,
                dilation=dilation,
                use_bias=use_bias,
                axes=axes,
                **dtype_kwargs(dtype, param_dtype, w_init, b_init),
            )
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
