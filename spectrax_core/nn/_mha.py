"""Multi-head attention over separate query / key / value inputs (cross- or self-attention),
with masks, an additive bias, causality, dropout on the weights and the weights returned
on request. Inputs are batch-first: `(batch, length, features)`."""

from __future__ import annotations

from typing import Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from ._composite import Composite
from .._apply import register_apply
from .._checks import check_last_dim
from ._linear import Linear, _linear
from ._options import ParamOptions, with_options
from ._sdpa import scaled_dot_product_attention
from ._validate import check_ndim


class MultiHeadAttention(Composite):
    """Parameters of multi-head attention: `q: embed_dim → embed_dim`, `k: kdim → embed_dim`,
    `v: vdim → embed_dim`, `o: embed_dim → embed_dim`, split into `num_heads` heads."""

    q: Linear
    k: Linear
    v: Linear
    o: Linear
    embed_dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)

    @with_options
    def init(
        cls,
        key: PRNGKeyArray,
        embed_dim: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        use_bias: bool = True,
        **options: Unpack[ParamOptions],
    ) -> "MultiHeadAttention":
        """Lecun-normal projections and zero biases (or `w_init` / `b_init`); `kdim` / `vdim`
        (default `embed_dim`) are the key and value input widths."""
        if num_heads < 1 or embed_dim % num_heads:
            raise ValueError(
                f"MultiHeadAttention: embed_dim={embed_dim} must be divisible by num_heads={num_heads}."
            )
        kq, kk, kv, ko = jax.random.split(key, 4)
        kw = dict(use_bias=use_bias, **options)
        return cls(
            q=Linear.init(kq, embed_dim, embed_dim, **kw, axes=("EMBED", "HEAD")),
            k=Linear.init(kk, kdim or embed_dim, embed_dim, **kw, axes=("EMBED", "HEAD")),
            v=Linear.init(kv, vdim or embed_dim, embed_dim, **kw, axes=("EMBED", "HEAD")),
            o=Linear.init(ko, embed_dim, embed_dim, **kw, axes=("HEAD", "EMBED")),
            embed_dim=embed_dim,
            num_heads=num_heads,
        )

    @property
    def head_dim(self) -> int:
        """Features per head."""
        return self.embed_dim // self.num_heads


@register_apply(MultiHeadAttention)
def apply_multi_head_attention(
    params: MultiHeadAttention,
    query: Array,
    key_input: Array | None = None,
    value_input: Array | None = None,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    is_causal: bool = False,
    dropout_rate: float = 0.0,
    key: PRNGKeyArray | None = None,
    need_weights: bool = False,
    average_weights: bool = True,
) -> Array | tuple[Array, Array]:
    """Attend from `query` `(batch, q_len, embed_dim)` to `key_input` `(batch, kv_len, kdim)` with
    values from `value_input` `(batch, kv_len, vdim)`; both default to `query` (self-attention).

    `mask` (boolean, True = may attend) and `bias` (float, added to the logits)
    broadcast to `(batch, num_heads, q_len, kv_len)`. `dropout_rate` drops
    attention weights (needs `key`). With `need_weights`, returns `(y, weights)`,
    the weights `(batch, q_len, kv_len)` averaged over heads, or
    `(batch, num_heads, q_len, kv_len)` with `average_weights=False`.
    """
    key_input = query if key_input is None else key_input
    value_input = key_input if value_input is None else value_input
    for name, x, width in (
        ("query", query, params.q.d_in),
        ("key", key_input, params.k.d_in),
        ("value", value_input, params.v.d_in),
    ):
        check_ndim(f"MultiHeadAttention {name}", x, 3, "(batch, length, features)")
        check_last_dim(f"MultiHeadAttention {name}", x, width)
    if key_input.shape[:2] != value_input.shape[:2] or key_input.shape[0] != query.shape[0]:
        raise ValueError(
            f"MultiHeadAttention: query {tuple(query.shape)}, key {tuple(key_input.shape)} and value "
            f"{tuple(value_input.shape)} must share batch, and key and value their length."
        )
    b, q_len, _ = query.shape
    kv_len = key_input.shape[1]
    h, d = params.num_heads, params.head_dim
    q = _linear(params.q, query).reshape(b, q_len, h, d)
    k = _linear(params.k, key_input).reshape(b, kv_len, h, d)
    v = _linear(params.v, value_input).reshape(b, kv_len, h, d)
    out = scaled_dot_product_attention(
        q,
        k,
        v,
        mask,
        bias,
        is_causal=is_causal,
        dropout_rate=dropout_rate,
        key=key,
        return_weights=need_weights,
    )
    out, weights = out if need_weights else (out, None)
    y = _linear(params.o, out.reshape(b, q_len, h * d))
    if not need_weights:
        return y
    return y, (jnp.mean(weights, axis=1) if average_weights else weights)
