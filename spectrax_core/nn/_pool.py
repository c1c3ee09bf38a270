"""Pooling over the spatial axes of channels-last inputs `(batch, *spatial, channels)`.

`max_pool` and `avg_pool` slide a window (`lax.reduce_window`); the number of
spatial axes is `len(window)`. `adaptive_avg_pool` averages the input into a
fixed output size, bin `i` covering `[floor(i·L/out), ceil((i+1)·L/out))` of an
axis of length `L`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

Padding = str | int | Sequence[int] | Sequence[tuple[int, int]]


def _ints(where: str, name: str, value: int | Sequence[int], n: int, minimum: int = 1) -> tuple[int, ...]:
    out = (value,) * n if isinstance(value, int) else tuple(value)
    if len(out) != n or any(not isinstance(v, int) or v < minimum for v in out):
        raise ValueError(
            f"{where}: {name} must be an int >= {minimum} or {n} such ints (one per spatial axis), "
            f"received {value!r}."
        )
    return out


def spatial_padding(where: str, padding: Padding, n: int) -> str | tuple[tuple[int, int], ...]:
    """Normalise a padding to `"SAME"`, `"VALID"` or one `(low, high)` pair per spatial axis.

    An int `p` pads `p` on both sides of every spatial axis (PyTorch's `padding=p`).
    """
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(
                f"{where}: padding must be one of ('SAME', 'VALID'), an int or one int / (low, high) pair "
                f"per spatial axis, received {padding!r}."
            )
        return padding.upper()
    if isinstance(padding, int):
        padding = (padding,) * n
    pads = tuple(padding)
    if len(pads) != n:
        raise ValueError(f"{where}: padding {padding!r} must give one entry per spatial axis ({n}).")
    out = []
    for p in pads:
        pair = (p, p) if isinstance(p, int) else tuple(p)
        if len(pair) != 2 or any(not isinstance(v, int) or v < 0 for v in pair):
            raise ValueError(
                f"{where}: each padding entry must be an int >= 0 or a (low, high) pair of them, received {p!r}."
            )
        out.append(pair)
    return tuple(out)


def _window_args(where, x, window, stride, padding):
    n = len(window) if not isinstance(window, int) else None
    if n is None:
        raise TypeError(
            f"{where}: window must be a tuple with one size per spatial axis, received {window!r}."
        )
    if x.ndim != n + 2:
        raise ValueError(
            f"{where}: a {n}-d window needs an input (batch, *{n} spatial axes, channels) of rank {n + 2}, "
            f"received shape {tuple(x.shape)}."
        )
    window = _ints(where, "window", window, n)
    stride = window if stride is None else _ints(where, "stride", stride, n)
    pads = spatial_padding(where, padding, n)
    dims, strides = (1, *window, 1), (1, *stride, 1)
    pad = pads if isinstance(pads, str) else ((0, 0), *pads, (0, 0))
    return dims, strides, pad


def _identity(value: Any, dtype: Any) -> np.ndarray:
    """The reduction's initial value as a NumPy constant: `jax.grad` of a max / sum window
    reduction needs to recognise it, which a jax array made under `jit` (a traced value) defeats."""
    return np.asarray(value, dtype)


def pool(
    x: Array,
    init_value: Any,
    reduce_fn: Callable[[Array, Array], Array],
    window: Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: Padding = "VALID",
) -> Array:
    """`reduce_fn` (associative, with identity `init_value`) over each window of `x`
    `(batch, *spatial, channels)`; `stride` defaults to `window`."""
    dims, strides, pad = _window_args("pool", x, window, stride, padding)
    return lax.reduce_window(x, _identity(init_value, x.dtype), reduce_fn, dims, strides, pad)


def max_pool(
    x: Array, window: Sequence[int], stride: int | Sequence[int] | None = None, padding: Padding = "VALID"
) -> Array:
    """Maximum over each window; padded positions never win. `stride` defaults to `window`."""
    dims, strides, pad = _window_args("max_pool", x, window, stride, padding)
    init = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
    return lax.reduce_window(x, _identity(init, x.dtype), lax.max, dims, strides, pad)


def avg_pool(
    x: Array,
    window: Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: Padding = "VALID",
    *,
    count_include_pad: bool = True,
) -> Array:
    """Mean over each window. `count_include_pad=True` divides by the window size (padded zeros
    count); False divides by the number of real elements in the window."""
    dims, strides, pad = _window_args("avg_pool", x, window, stride, padding)
    zero = _identity(0, x.dtype)
    total = lax.reduce_window(x, zero, lax.add, dims, strides, pad)
    if count_include_pad:
        return total / math.prod(dims)
    ones = jnp.ones(x.shape[1:-1], x.dtype)[None, ..., None]
    count = lax.reduce_window(ones, zero, lax.add, dims, strides, pad)
    return total / count


def adaptive_avg_pool(x: Array, output_size: int | Sequence[int]) -> Array:
    """Average `x` `(batch, *spatial, channels)` into `(batch, *output_size, channels)`."""
    n = x.ndim - 2
    if n < 1:
        raise ValueError(
            f"adaptive_avg_pool: expected (batch, *spatial, channels), received shape {tuple(x.shape)}."
        )
    sizes = _ints("adaptive_avg_pool", "output_size", output_size, n)
    for axis, out in enumerate(sizes, start=1):
        length = x.shape[axis]
        bins = [
            jnp.mean(
                lax.slice_in_dim(x, (i * length) // out, -((-(i + 1) * length) // out), axis=axis),
                axis=axis,
                keepdims=True,
            )
            for i in range(out)
        ]
        x = jnp.concatenate(bins, axis=axis)
    return x
