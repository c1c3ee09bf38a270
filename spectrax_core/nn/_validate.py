"""Input checks shared by the layers: exact rank, integer tokens, boolean masks."""

from __future__ import annotations

import jax.numpy as jnp


def check_ndim(layer: str, x, ndim: int, layout: str) -> None:
    """Raise `ValueError` unless `x` has exactly `ndim` axes laid out as `layout`."""
    if x.ndim != ndim:
        raise ValueError(
            f"{layer}: expected an input of rank {ndim} laid out as {layout}, "
            f"received shape {tuple(x.shape)}; reshape the input to {layout}."
        )


def check_integer(layer: str, x, what: str = "tokens") -> None:
    """Raise `TypeError` unless `x` holds integers."""
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(
            f"{layer}: {what} must be an integer array, received dtype {x.dtype} "
            f"with shape {tuple(x.shape)}; cast with `.astype(jnp.int32)`."
        )


def check_mask(layer: str, mask, target: tuple[int, ...], layout: str) -> None:
    """Raise unless `mask` is boolean and broadcastable to `target`."""
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"{layer}: mask must be boolean (True = may attend), received dtype {mask.dtype}; "
            "build it with a comparison or `.astype(bool)`."
        )
    try:
        ok = jnp.broadcast_shapes(mask.shape, target) == tuple(target)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"{layer}: mask of shape {tuple(mask.shape)} does not broadcast to {layout} "
            f"= {tuple(target)}; a padding mask of shape (batch, kv_len) is passed as "
            "mask[:, None, None, :]."
        )
