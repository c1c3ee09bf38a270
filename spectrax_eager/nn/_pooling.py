"""Pooling modules over channels-last inputs `(batch, *spatial, channels)`.

`kernel_size`, `stride` (default: `kernel_size`) and `padding` (an int pads
both sides of every spatial axis, as PyTorch) follow PyTorch's names; the math
is `spectrax_core.functional.max_pool` / `avg_pool` / `adaptive_avg_pool`.
"""

from __future__ import annotations

from typing import Any

import jax

import spectrax_core as sc

from .._graph.module import Module


def _window(where: str, value: Any, n: int) -> tuple[int, ...]:
    out = (value,) * n if isinstance(value, int) else tuple(value)
    if len(out) != n or any(not isinstance(v, int) or v < 1 for v in out):
        raise ValueError(
            f"{where}: kernel_size must be a positive int or {n} positive ints, received {value!r}."
        )
    return out


class _Pool(Module):
    """A window reduction; `count_include_pad` (as PyTorch) matters to the average pools only (a
    maximum never sees padding)."""

    ndim: int

    def __init__(
        self,
        kernel_size: int | tuple[int, ...],
        stride: Any = None,
        padding: Any = 0,
        count_include_pad: bool = True,
    ):
        self.kernel_size = _window(type(self).__name__, kernel_size, self.ndim)
        self.stride = (
            None if stride is None else (stride,) * self.ndim if isinstance(stride, int) else tuple(stride)
        )
        self.padding = padding if isinstance(padding, int | str) else tuple(padding)
        self.count_include_pad = bool(count_include_pad)


class _MaxPool(_Pool):
    def forward(self, x: jax.Array) -> jax.Array:
        return sc.functional.max_pool(x, self.kernel_size, self.stride, self.padding)


class _AvgPool(_Pool):
    def forward(self, x: jax.Array) -> jax.Array:
        return sc.functional.avg_pool(
            x, self.kernel_size, self.stride, self.padding, count_include_pad=self.count_include_pad
        )


def _per_rank(base: type, doc: str) -> tuple[type, ...]:
    """The 1-, 2- and 3-d classes of `base`, named after it (`_MaxPool` gives `MaxPool1d`, ...),
    each documented by `doc` with its input's shape."""
    return tuple(
        type(
            f"{base.__name__.lstrip('_')}{n}d",
            (base,),
            {"ndim": n, "__doc__": doc.format(shape=_SHAPES[n]), "__module__": __name__},
        )
        for n in (1, 2, 3)
    )


_SHAPES = {
    1: "(batch, length, channels)",
    2: "(batch, height, width, channels)",
    3: "(batch, depth, height, width, channels)",
}
MaxPool1d, MaxPool2d, MaxPool3d = _per_rank(_MaxPool, "Maximum over windows of `{shape}`.")
AvgPool1d, AvgPool2d, AvgPool3d = _per_rank(
    _AvgPool, "Mean over windows of `{shape}`; `count_include_pad` as PyTorch."
)


class _AdaptiveAvgPool(Module):
    ndim: int

    def __init__(self, output_size: int | tuple[int, ...]):
        self.output_size = _window(type(self).__name__, output_size, self.ndim)

    def forward(self, x: jax.Array) -> jax.Array:
        if x.ndim != self.ndim + 2:
            raise ValueError(
                f"{type(self).__name__}: expected (batch, *{self.ndim} spatial axes, channels), "
                f"received shape {tuple(x.shape)}."
            )
        return sc.functional.adaptive_avg_pool(x, self.output_size)


AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveAvgPool3d = _per_rank(
    _AdaptiveAvgPool, "Average `{shape}` into `output_size` windows along its spatial axes."
)


__all__ = [
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AdaptiveAvgPool3d",
    "AvgPool1d",
    "AvgPool2d",
    "AvgPool3d",
    "MaxPool1d",
    "MaxPool2d",
    "MaxPool3d",
]
