"""Scaled dot-product attention with masks, an additive bias, causality, grouped-query heads,
dropout on the weights, and the weights returned on request.

Layout (as `dot_product_attention` and `jax.nn.dot_product_attention`):
`q` is `(batch, q_len, heads, head_dim)`, `k` `(batch, kv_len, kv_heads,
head_dim)`, `v` `(batch, kv_len, kv_heads, v_dim)`; query head `h` reads
key/value head `h // (heads // kv_heads)`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from ._validate import check_mask, check_ndim


def scaled_dot_product_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None = None,
    bias: Array | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    key: PRNGKeyArray | None = None,
    return_weights: bool = False,
) -> Array | tuple[Array, Array]:
    """`softmax(q kᵀ · scale + bias) v` per head.

    Args:
        q, k, v: see the module docstring; `heads` must be a multiple of `kv_heads`.
        mask: boolean, broadcastable to `(batch, heads, q_len, kv_len)`, True = may attend.
        bias: float, broadcastable to `(batch, heads, q_len, kv_len)`, added to the logits.
        is_causal: query `i` attends keys `j <= i` (top-left aligned).
        scale: logit scale, default `1/sqrt(head_dim)`.
        dropout_rate: probability of zeroing each attention weight (kept ones scaled by
            `1/(1-rate)`); needs `key` when positive.
        return_weights: also return the weights `(batch, heads, q_len, kv_len)` (after dropout).

    The softmax runs in at least float32. A row whose keys are all masked gives
    the mean of `v` over all keys rather than NaN.
    """
    check_ndim("scaled_dot_product_attention", q, 4, "(batch, q_len, heads, head_dim)")
    check_ndim("scaled_dot_product_attention", k, 4, "(batch, kv_len, kv_heads, head_dim)")
    check_ndim("scaled_dot_product_attention", v, 4, "(batch, kv_len, kv_heads, v_dim)")
    b, q_len, heads, d = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[3] != d:
        raise ValueError(
            f"scaled_dot_product_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "disagree; k and v share (batch, kv_len, kv_heads), q and k share batch and head_dim."
        )
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"scaled_dot_product_attention: q has {heads} heads, not a multiple of k's {kv_heads} heads."
        )
    target = (b, heads, q_len, kv_len)
    layout = "(batch, heads, q_len, kv_len)"
    if mask is not None:
        check_mask("scaled_dot_product_attention", mask, target, layout)
    if bias is not None:
        try:
            ok = jnp.broadcast_shapes(bias.shape, target) == target
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"scaled_dot_product_attention: bias of shape {tuple(bias.shape)} does not broadcast to "
                f"{layout} = {target}."
            )
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(
            f"scaled_dot_product_attention: dropout_rate must lie in [0, 1), received {dropout_rate}."
        )
    if dropout_rate and key is None:
        raise ValueError(
            "scaled_dot_product_attention: dropout_rate > 0 needs key=jax.random.key(...) "
            "(or dropout_rate=0.0 for evaluation)."
        )
    group = heads // kv_heads
    qg = q.reshape(b, q_len, kv_heads, group, d)
    logits = jnp.einsum("blkgd,bskd->bkgls", qg, k).reshape(target)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    logits = logits * (1.0 / math.sqrt(d) if scale is None else scale)
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    allowed = mask
    if is_causal:
        causal = jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None]
        allowed = causal if allowed is None else allowed & causal
    if allowed is not None:
        logits = jnp.where(allowed, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits, axis=-1)
    if dropout_rate:
        keep = jax.random.bernoulli(key, 1.0 - dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    weights = weights.astype(v.dtype)
    wg = weights.reshape(b, kv_heads, group, q_len, kv_len)
    out = jnp.einsum("bkgls,bskd->blkgd", wg, v).reshape(b, q_len, heads, v.shape[-1])
    return (out, weights) if return_weights else out
