"""Eager attention layers: MultiheadAttention (PyTorch-shaped), CausalSelfAttention (GPT-2
style) and MLPBlock (MLP followed by dropout). The math is `spectrax_core.nn.MultiHeadAttention`
and `spectrax_core.nn.MLP`."""

from __future__ import annotations

from typing import Any, Unpack

import jax
import jax.numpy as jnp

import spectrax_core as sc

from .._graph.rngs import Rngs
from ._base import CoreLayer, LayerOptions, also_named, annotate
from ._layers import MLP


def _check_rate(where: str, rate: float) -> float:
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{where}: dropout must lie in [0, 1), received {rate}.")
    return float(rate)


def _dropout_key(layer: CoreLayer, where: str) -> jax.Array | None:
    """A key from `rngs.dropout()` when the layer drops in this mode, else None."""
    if not layer.training or layer.dropout == 0.0:
        return None
    if layer.rngs is None:
        raise ValueError(
            f"{where}: dropout in training mode needs rngs=spx.Rngs(...) at construction "
            "(or call model.eval())."
        )
    return layer.rngs.dropout()


def _torch_mask(mask: jax.Array | None, target: tuple[int, ...], what: str) -> tuple[Any, Any]:
    """A PyTorch-convention mask (bool True = excluded, or float added) as `(allowed, bias)`."""
    if mask is None:
        return None, None
    if mask.ndim == 3:  # (batch * heads, L, S), heads fastest as PyTorch lays them out
        mask = mask.reshape(target[0], target[1], *mask.shape[1:])
    try:
        jnp.broadcast_shapes(mask.shape, target)
    except ValueError:
        raise ValueError(
            f"MultiheadAttention: {what} of shape {tuple(mask.shape)} does not broadcast to "
            f"(batch, num_heads, L, S) = {target}."
        ) from None
    if mask.dtype == jnp.bool_:
        return ~mask, None
    return None, mask


def _annotate_projections(layer: CoreLayer, qkv: Any, out: Any, qkv_bias: Any, out_bias: Any) -> None:
    """`*_sharding=` of an attention layer: the q/k/v projections share `qkv`, the output one `out`."""
    where = type(layer).__name__
    annotate(layer, where, q__weight=qkv, k__weight=qkv, v__weight=qkv, o__weight=out)
    annotate(layer, where, q__bias=qkv_bias, k__bias=qkv_bias, v__bias=qkv_bias, o__bias=out_bias)


def _no_cache(where: str, decode: bool) -> None:
    """These layers keep no KV cache, so `cache_sharding` (the cache's annotation) has nothing to
    annotate and is accepted as is; `decode=True` is refused."""
    if decode:
        raise ValueError(
            f"{where}: decode=True asks for a KV cache, which this layer does not keep; decode with "
            "the core attention layers (spectrax_core.nn.MultiHeadAttention with a cache) or run the "
            "whole prefix each step."
        )


@also_named(q_proj="q", k_proj="k", v_proj="v", out_proj="o")
class MultiheadAttention(CoreLayer):
    """Multi-head attention with PyTorch's arguments: `embed_dim`, `num_heads`, `dropout` on the
    weights, `kdim` / `vdim`, and `forward(query, key, value, key_padding_mask, need_weights,
    attn_mask, average_attn_weights, is_causal)`. It returns the output, whichever inputs are
    given (`attn(x)`, `attn(q, kv)`, `attn(q, k, v)`), and `(output, weights)` when asked with
    `need_weights=True`.

    Inputs are batch-first `(batch, length, features)` by default; pass
    `batch_first=False` for `(length, batch, features)`. Masks follow PyTorch:
    a boolean True excludes a key, a float mask is added to the logits;
    `attn_mask` is `(L, S)` or `(batch·num_heads, L, S)`, `key_padding_mask`
    `(batch, S)`. A query whose keys are all excluded gets the mean of the
    values rather than NaN.
    """

    core_cls = sc.nn.MultiHeadAttention
    # defaults for a layer built by `from_core` (no constructor run)
    dropout: float = 0.0
    batch_first: bool = True
    rngs: Rngs | None = None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        use_bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = True,
        *,
        qkv_sharding: Any = None,
        out_sharding: Any = None,
        qkv_bias_sharding: Any = None,
        out_bias_sharding: Any = None,
        decode: bool = False,
        cache_sharding: Any = None,
        **options: Unpack[LayerOptions],
    ):
        _no_cache(type(self).__name__, decode)
        del cache_sharding  # see _no_cache
        self._build(embed_dim, num_heads, kdim=kdim, vdim=vdim, use_bias=use_bias, options=options)
        _annotate_projections(self, qkv_sharding, out_sharding, qkv_bias_sharding, out_bias_sharding)
        self.dropout = _check_rate(type(self).__name__, dropout)
        self.batch_first = bool(batch_first)
        self.rngs = options.get("rngs")

    def forward(
        self,
        query: jax.Array,
        key: jax.Array | None = None,
        value: jax.Array | None = None,
        key_padding_mask: jax.Array | None = None,
        need_weights: bool = False,
        attn_mask: jax.Array | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        mask: jax.Array | None = None,
        rngs: Rngs | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Attend `query` to `key` (default `query`) and `value` (default `key`).

        Returns the output `(batch, L, embed_dim)`; with `need_weights=True`, `(output,
        weights)`, the weights `(batch, L, S)` averaged over heads (`(batch, heads, L, S)` with
        `average_attn_weights=False`). `mask` (boolean, True = may attend) broadcasts to
        `(batch, heads, L, S)` and combines with the PyTorch masks; `rngs` gives this call's
        dropout key.
        """
        key = query if key is None else key
        value = key if value is None else value
        if not self.batch_first:
            query, key, value = (jnp.swapaxes(t, 0, 1) for t in (query, key, value))
        target = (query.shape[0], self.num_heads, query.shape[1], key.shape[1])
        allowed, bias = _torch_mask(attn_mask, target, "attn_mask")
        if key_padding_mask is not None:
            pad_allowed, pad_bias = _torch_mask(
                key_padding_mask[:, None, None, :], target, "key_padding_mask"
            )
            allowed = _both(allowed, pad_allowed)
            bias = pad_bias if bias is None else bias if pad_bias is None else bias + pad_bias
        if mask is not None:
            allowed = _both(allowed, jnp.broadcast_to(jnp.asarray(mask, bool), target))
        if rngs is not None and self.training and self.dropout > 0.0:
            rng = rngs.dropout()
        else:
            rng = _dropout_key(self, "MultiheadAttention")
        out = sc.apply(
            self.core_params(),
            query,
            key,
            value,
            mask=allowed,
            bias=bias,
            is_causal=is_causal,
            dropout_rate=self.dropout if rng is not None else 0.0,
            key=rng,
            need_weights=need_weights,
            average_weights=average_attn_weights,
        )
        y, weights = out if need_weights else (out, None)
        if not self.batch_first:
            y = jnp.swapaxes(y, 0, 1)
        return (y, weights) if need_weights else y


def _both(a: jax.Array | None, b: jax.Array | None) -> jax.Array | None:
    """The conjunction of two optional boolean masks."""
    return b if a is None else a if b is None else a & b


@also_named(q_proj="q", k_proj="k", v_proj="v", out_proj="o")
class CausalSelfAttention(CoreLayer):
    """GPT-2 style causal self-attention over `(batch, length, embed_dim)`: query `i` attends
    positions `<= i`; `dropout` applies to the attention weights and to the output.

    `forward(x, mask=None)`: `mask` (boolean, True = may attend) broadcasts to
    `(batch, num_heads, length, length)`, e.g. a padding mask `m[:, None, None, :]`.
    """

    core_cls = sc.nn.MultiHeadAttention

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        *,
        use_bias: bool = True,
        qkv_sharding: Any = None,
        out_sharding: Any = None,
        qkv_bias_sharding: Any = None,
        out_bias_sharding: Any = None,
        cache_sharding: Any = None,
        **options: Unpack[LayerOptions],
    ):
        del cache_sharding  # no KV cache to annotate (see _no_cache)
        self._build(embed_dim, num_heads, use_bias=use_bias, options=options)
        _annotate_projections(self, qkv_sharding, out_sharding, qkv_bias_sharding, out_bias_sharding)
        self.dropout = _check_rate("CausalSelfAttention", dropout)
        self.rngs = options.get("rngs")

    def forward(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        rng = _dropout_key(self, "CausalSelfAttention")
        if rng is None:
            return sc.apply(self.core_params(), x, mask=mask, is_causal=True)
        attn_key, out_key = jax.random.split(rng)
        y = sc.apply(
            self.core_params(), x, mask=mask, is_causal=True, dropout_rate=self.dropout, key=attn_key
        )
        return sc.functional.dropout(y, self.dropout, out_key)


@also_named(d_model=("features", None), d_ff=("hidden_features", None))
class MLPBlock(MLP):
    """`dropout(down(activation(up(x))))`: the transformer feed-forward block with its dropout
    (active in `train()` mode, keys from `rngs.dropout()`). `hidden_features` defaults to
    `4 * features`; `fc1` / `fc2` read `up` / `down`."""

    fc1 = property(lambda self: self.up, doc="`up`.")
    fc2 = property(lambda self: self.down, doc="`down`.")
    features = property(lambda self: self.d_model, doc="`d_model`.")
    hidden_features = property(lambda self: self.d_ff, doc="`d_ff`.")
    out_features = property(lambda self: self.d_model, doc="`d_model` (the block maps back to it).")

    def __init__(
        self,
        features: int,
        hidden_features: int | None = None,
        activation: str = "gelu",
        dropout: float = 0.0,
        *,
        out_features: int | None = None,
        use_bias: bool = True,
        fc1_sharding: Any = None,
        fc2_sharding: Any = None,
        fc1_bias_sharding: Any = None,
        fc2_bias_sharding: Any = None,
        **options: Unpack[LayerOptions],
    ):
        if out_features not in (None, features):
            raise ValueError(
                f"MLPBlock: out_features={out_features} differs from features={features}; the block maps "
                "back to its input width (stack an nn.Linear after it to change the width)."
            )
        super().__init__(
            features,
            4 * features if hidden_features is None else hidden_features,
            activation=activation,
            use_bias=use_bias,
            **options,
        )
        annotate(
            self,
            "MLPBlock",
            up__weight=fc1_sharding,
            down__weight=fc2_sharding,
            up__bias=fc1_bias_sharding,
            down__bias=fc2_bias_sharding,
        )
        self.dropout = _check_rate("MLPBlock", dropout)
        self.rngs = options.get("rngs")

    def forward(self, x: jax.Array) -> jax.Array:
        y = super().forward(x)
        rng = _dropout_key(self, "MLPBlock")
        return y if rng is None else sc.functional.dropout(y, self.dropout, rng)
