"""Losses: softmax cross-entropy with integer labels (mask / ignore index) and MSE.

Both return a scalar mean. Shapes must match exactly; nothing is broadcast
silently.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int

from ._checks import typechecked


def softmax_cross_entropy(
    logits: Array, labels: Array, *, mask: Array | None = None, ignore_index: int | None = None
) -> Array:
    """Mean cross-entropy of `logits` `(..., vocab)` against integer `labels` `(...)`.

    Positions where `mask` (broadcastable to `labels`) is False or `labels == ignore_index` are not counted;
    the mean is over the counted positions (0 when none is counted). Computed in
    at least float32.
    """
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"softmax_cross_entropy: labels of shape {tuple(labels.shape)} do not match logits of "
            f"shape {tuple(logits.shape)}; labels must have the logits' shape without the last "
            f"(vocab) axis, i.e. {tuple(logits.shape[:-1])}."
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"softmax_cross_entropy: labels must be integer class ids, received dtype {labels.dtype}."
        )
    if mask is not None and not _broadcasts_to(mask.shape, labels.shape):
        raise ValueError(
            f"softmax_cross_entropy: mask of shape {tuple(mask.shape)} does not broadcast to labels of "
            f"shape {tuple(labels.shape)}; pass a mask of the labels' shape (or one with size-1 axes)."
        )
    counted = jnp.ones(labels.shape, bool)
    if mask is not None:
        counted = jnp.broadcast_to(mask.astype(bool), labels.shape)
    if ignore_index is not None:
        counted = counted & (labels != ignore_index)
        labels = jnp.where(labels == ignore_index, 0, labels)
    return _masked_xent(logits, labels, counted)


@typechecked
def _masked_xent(
    logits: Float[Array, "*batch vocab"], labels: Int[Array, "*batch"], counted: Bool[Array, "*batch"]
) -> Float[Array, ""]:
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    total = jnp.sum(jnp.where(counted, per_token, 0.0))
    return total / jnp.maximum(jnp.sum(counted), 1).astype(total.dtype)


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return jnp.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
    except ValueError:
        return False


def mse(pred: Array, target: Array) -> Array:
    """Mean squared error over all elements; `pred` and `target` must have the same shape."""
    if tuple(pred.shape) != tuple(target.shape):
        raise ValueError(
            f"mse: pred of shape {tuple(pred.shape)} and target of shape {tuple(target.shape)} "
            "differ; reshape one so they match (no broadcasting is applied)."
        )
    return _mse(pred, target)


@typechecked
def _mse(pred: Float[Array, "*shape"], target: Float[Array, "*shape"]) -> Float[Array, ""]:
    return jnp.mean(jnp.square(pred - target))


__all__ = ["softmax_cross_entropy", "mse"]
