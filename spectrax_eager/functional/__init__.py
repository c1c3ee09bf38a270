"""`spx.functional`: the stateless operations called inside `forward` (activations, linear,
dropout, normalisations, convolutions, pooling, attention).

They are `spectrax_core.functional`'s, spelled as the eager facade's users call them: weights as
`w` / `b`, convolutions without padding by default (`"VALID"`), pooling `strides=`, the
normalisations over any `axis`, and `gelu` exact unless `approximate=True`. Inputs are channels
last; `scaled_dot_product_attention` takes `(batch, length, heads, head_dim)`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from spectrax_core import functional as _core
from spectrax_core.functional import *  # noqa: F401,F403
from spectrax_core.functional import __all__ as _core_names

from .._compat.paths import keep_names


def gelu(x: jax.Array, approximate: bool = False) -> jax.Array:
    """GELU, exact (erf) by default; `approximate=True` is the tanh form."""
    return jax.nn.gelu(x, approximate=approximate)


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """`x @ w + b` with `w` `(d_in, d_out)`."""
    return _core.linear(x, w, b)


def conv(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    stride: int | Sequence[int] = 1,
    padding: Any = "VALID",
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> jax.Array:
    """Convolution of `(batch, *spatial, c_in)` by `w` `(*kernel, c_in / groups, c_out)`;
    `padding` "VALID" (default), "SAME", an int or one int / (low, high) pair per axis."""
    return _core.conv(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)


def conv_transpose(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    stride: int | Sequence[int] = 1,
    padding: Any = "VALID",
    output_padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
) -> jax.Array:
    """Transposed convolution (PyTorch's output size); `padding` "VALID" (no padding, the default)
    or ints removed from both ends of each output axis."""
    if isinstance(padding, str):
        if padding.upper() != "VALID":
            raise ValueError(
                f"conv_transpose: padding={padding!r}; use 'VALID' or ints (removed from both ends of each "
                "output axis, as PyTorch's padding=)."
            )
        padding = 0
    return _core.conv_transpose(
        x, w, b, stride=stride, padding=padding, output_padding=output_padding, dilation=dilation
    )


def pool(
    x: jax.Array,
    init_value: Any,
    reduce_fn: Callable[[jax.Array, jax.Array], jax.Array],
    window_shape: Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: Any = "VALID",
    *,
    strides: int | Sequence[int] | None = None,
) -> jax.Array:
    """`reduce_fn` over each window of `(batch, *spatial, channels)`; `strides` (or `stride`)
    defaults to the window."""
    return _core.pool(x, init_value, reduce_fn, window_shape, _stride(stride, strides), padding)


def max_pool(
    x: jax.Array,
    window_shape: Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: Any = "VALID",
    *,
    strides: int | Sequence[int] | None = None,
) -> jax.Array:
    """Maximum over each window; `strides` (or `stride`) defaults to the window."""
    return _core.max_pool(x, window_shape, _stride(stride, strides), padding)


def avg_pool(
    x: jax.Array,
    window_shape: Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: Any = "VALID",
    *,
    strides: int | Sequence[int] | None = None,
    count_include_pad: bool = True,
) -> jax.Array:
    """Mean over each window (`count_include_pad` as PyTorch); `strides` (or `stride`)
    defaults to the window."""
    return _core.avg_pool(
        x, window_shape, _stride(stride, strides), padding, count_include_pad=count_include_pad
    )


def _stride(stride: Any, strides: Any) -> Any:
    if stride is not None and strides is not None:
        raise TypeError("pooling: give stride= or strides=, not both.")
    return strides if stride is None else stride


def layer_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    axis: int = -1,
    eps: float = 1e-5,
) -> jax.Array:
    """`(x - mean) / sqrt(var + eps) · scale + bias` over `axis`."""
    moved = jnp.moveaxis(x, axis, -1)
    return jnp.moveaxis(_core.layer_norm(moved, scale, bias, eps=eps), -1, axis)


def rms_norm(x: jax.Array, scale: jax.Array | None = None, *, axis: int = -1, eps: float = 1e-6) -> jax.Array:
    """`x / sqrt(mean(x²) + eps) · scale` over `axis`."""
    return jnp.moveaxis(_core.rms_norm(jnp.moveaxis(x, axis, -1), scale, eps=eps), -1, axis)


def promote_dtype(*arrays: Any, dtype: Any = None) -> tuple[jax.Array, ...]:
    """`arrays` cast to `dtype`, or to their common (promoted) dtype."""
    dtype = jnp.result_type(*arrays) if dtype is None else dtype
    return tuple(jnp.asarray(a, dtype) for a in arrays)


__all__ = sorted({*_core_names, "pool", "promote_dtype"})

# `spectrax-lib`'s module paths `spectrax.functional.conv`, ... hold these names too; each submodule
# named like one of this module's functions is loaded now, the function kept under its name.
keep_names(__name__, ("conv", "dropout", "linear", "pool"))
