"""Multi-head attention with a causal mask, grouped-query heads, RoPE and a KV cache.

Layout: inputs are `(batch, length, d_model)`; per-head tensors are
`(batch, length, heads, head_dim)`. With `n_kv_heads < n_heads` each key/value
head serves `n_heads // n_kv_heads` consecutive query heads (query head `h`
reads key/value head `h // group`, i.e. `jnp.repeat(k, group, axis=2)`).

RoPE uses the "rotate half" pairing: feature `i` and feature `i + head_dim/2`
form the pair rotated by angle `position * theta**(-2i/head_dim)`.
"""

from __future__ import annotations

import math
from typing import Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._composite import Composite
from .._apply import register_apply
from .._checks import check_last_dim, typechecked
from ._linear import Linear, _linear
from ._options import ParamOptions, with_options
from ._validate import check_mask, check_ndim


class KVCache(eqx.Module):
    """Key/value buffers for step-by-step decoding of one attention layer.

    `index` is the number of positions already written (shared by the batch);
    the next call writes at `index` and attends to slots `< index + length`.
    A stack of caches (one per layer, for `BlockStack`) has one more leading axis
    on every field.
    """

    k: Float[Array, "*layers batch max_len kv_heads head_dim"]
    v: Float[Array, "*layers batch max_len kv_heads head_dim"]
    index: Int[Array, "*layers"]

    @classmethod
    def init(cls, batch: int, max_len: int, n_kv_heads: int, head_dim: int, dtype=jnp.float32) -> "KVCache":
        """Empty buffers of shape `(batch, max_len, n_kv_heads, head_dim)`, `index = 0`."""
        shape = (batch, max_len, n_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), index=jnp.zeros((), jnp.int32))

    @property
    def max_len(self) -> int:
        """Number of positions the buffers hold."""
        return self.k.shape[-3]

    def logical_axes(self) -> dict[str, tuple]:
        """Logical axes of each array field; a stacked cache's leading layer axes are None."""
        lead = (None,) * (self.k.ndim - 4)
        kv = lead + ("BATCH", "LENGTH", "KV_HEAD", None)
        return {"k": kv, "v": kv, "index": lead}


class KVCacheSlot(eqx.Module):
    """Layer `layer`'s slot in a stacked KVCache, as `BlockStack` hands it to each layer.

    The attention writes its new keys/values into the stacked buffers at
    `(layer, :, index)` and reads that layer's slice, so a scan carrying the
    stack updates it in place instead of rebuilding every layer's buffers.
    """

    k: Float[Array, "layers batch max_len kv_heads head_dim"]
    v: Float[Array, "layers batch max_len kv_heads head_dim"]
    index: Int[Array, ""]
    layer: Int[Array, ""]

    @property
    def max_len(self) -> int:
        """Number of positions each layer's buffers hold."""
        return self.k.shape[-3]


class Attention(Composite):
    """Parameters of multi-head attention: projections `q`, `k`, `v` and output `o`.

    `q: d_model → n_heads·head_dim`, `k`/`v: d_model → n_kv_heads·head_dim`,
    `o: n_heads·head_dim → d_model`. `causal`, `rope` and `rope_theta` are static.
    """

    q: Linear
    k: Linear
    v: Linear
    o: Linear
    d_model: int = eqx.field(static=True)
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True, default=True)
    rope: bool = eqx.field(static=True, default=False)
    rope_theta: float = eqx.field(static=True, default=10000.0)

    @with_options
    def init(
        cls,
        key: PRNGKeyArray,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        causal: bool = True,
        rope: bool = False,
        rope_theta: float = 10000.0,
        use_bias: bool = False,
        **options: Unpack[ParamOptions],
    ) -> "Attention":
        """Lecun-normal projections (or `w_init` / `b_init`; `compute_dtype` goes to each).
        `n_kv_heads` defaults to `n_heads` (plain multi-head), `head_dim` to `d_model // n_heads`."""
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(
                    f"Attention: d_model={d_model} is not divisible by n_heads={n_heads}; "
                    "pass head_dim= explicitly or choose n_heads dividing d_model."
                )
            head_dim = d_model // n_heads
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(
                f"Attention: n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads} "
                "(each key/value head serves a whole group of query heads)."
            )
        if rope and head_dim % 2:
            raise ValueError(f"Attention: rope=True needs an even head_dim, received head_dim={head_dim}.")
        kq, kk, kv, ko = jax.random.split(key, 4)
        q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
        kw = dict(use_bias=use_bias, **options)
        return cls(
            q=Linear.init(kq, d_model, q_dim, **kw, axes=("EMBED", "HEAD")),
            k=Linear.init(kk, d_model, kv_dim, **kw, axes=("EMBED", "KV_HEAD")),
            v=Linear.init(kv, d_model, kv_dim, **kw, axes=("EMBED", "KV_HEAD")),
            o=Linear.init(ko, q_dim, d_model, **kw, axes=("HEAD", "EMBED")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            causal=bool(causal),
            rope=bool(rope),
            rope_theta=float(rope_theta),
        )

    def init_cache(self, batch: int, max_len: int, *, dtype=None) -> KVCache:
        """An empty `KVCache` for this layer (dtype defaults to the projection weights')."""
        dtype = self.k.weight.dtype if dtype is None else dtype
        return KVCache.init(batch, max_len, self.n_kv_heads, self.head_dim, dtype)


@typechecked
def rope(
    x: Float[Array, "batch length heads head_dim"],
    positions: Int[Array, " length"] | Int[Array, "batch length"],
    theta: float,
) -> Float[Array, "batch length heads head_dim"]:
    """Rotate feature pairs `(i, i + head_dim/2)` of `x` by `position * theta**(-2i/head_dim)`;
    `positions` shared by the batch or one row per sequence."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / x.shape[-1])
    angle = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angle)[..., None, :], jnp.sin(angle)[..., None, :]
    if positions.ndim == 1:
        cos, sin = cos[None], sin[None]
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@typechecked
def dot_product_attention(
    q: Float[Array, "batch q_len heads head_dim"],
    k: Float[Array, "batch kv_len kv_heads head_dim"],
    v: Float[Array, "batch kv_len kv_heads head_dim"],
    mask: Bool[Array, "#batch #heads #q_len #kv_len"] | None = None,
) -> Float[Array, "batch q_len heads head_dim"]:
    """`softmax(q kᵀ / sqrt(head_dim)) v` per head, grouped-query aware; `mask` True = may attend.

    The softmax runs in at least float32. A row with every key masked gives the
    mean of `v` over all keys rather than NaN.
    """
    b, q_len, heads, d = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    qg = q.reshape(b, q_len, kv_heads, group, d)
    logits = jnp.einsum("blkgd,bskd->bkgls", qg, k).reshape(b, heads, q_len, kv_len)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32)) / math.sqrt(d)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgls,bskd->blkgd", probs.reshape(b, kv_heads, group, q_len, kv_len), v)
    return out.reshape(b, q_len, heads, d)


@register_apply(Attention)
def apply_attention(
    params: Attention,
    x: Array,
    *,
    mask: Array | None = None,
    cache: KVCache | KVCacheSlot | None = None,
    positions: Array | None = None,
) -> Array | tuple[Array, KVCache | KVCacheSlot]:
    """Self-attention over `x` of shape `(batch, length, d_model)`.

    `mask`: optional boolean array broadcastable to `(batch, n_heads, length,
    kv_len)`, True where a query may attend a key; it is combined with the
    causal mask. `kv_len` is `length` without a cache and `cache.max_len` with one.

    With `cache`, the new keys/values are written at `cache.index`, positions
    (for RoPE and the causal mask) start at `cache.index`, attention covers the
    slots written so far, and `(y, new_cache)` is returned. The caller keeps
    `cache.index + length <= cache.max_len`; it is checked when `index` is concrete.
    A `KVCacheSlot` is written and read in its stack (see `_write_cache`).

    `positions` `(batch, length)` (with a cache only) gives each token its own
    position instead: row b's keys/values are written at `positions[b]`, RoPE
    and the causal mask use them (a query at p sees the slots <= p), and the
    returned index is one past the largest position written. The caller keeps
    them below `max_len` (a write past it is dropped).
    """
    check_ndim("Attention", x, 3, "(batch, length, d_model)")
    check_last_dim("Attention", x, params.d_model)
    b, length, _ = x.shape
    if cache is not None:
        _check_cache(params, cache, b, length)
    _check_positions(positions, cache, b, length)
    if mask is not None:
        kv_len = length if cache is None else cache.max_len
        check_mask("Attention", mask, (b, params.n_heads, length, kv_len), "(batch, n_heads, length, kv_len)")
    q = _linear(params.q, x).reshape(b, length, params.n_heads, params.head_dim)
    k = _linear(params.k, x).reshape(b, length, params.n_kv_heads, params.head_dim)
    v = _linear(params.v, x).reshape(b, length, params.n_kv_heads, params.head_dim)

    if positions is None:
        offset = jnp.zeros((), jnp.int32) if cache is None else cache.index
        positions = offset + jnp.arange(length, dtype=jnp.int32)
    if params.rope:
        q = rope(q, positions, params.rope_theta)
        k = rope(k, positions, params.rope_theta)

    if cache is None:
        key_pos = positions
        written = None
    else:
        k, v, cache = (
            _write_cache(cache, k, v) if positions.ndim == 1 else _write_rows(cache, k, v, positions)
        )
        key_pos = jnp.arange(cache.max_len, dtype=jnp.int32)
        seen = cache.index if positions.ndim == 1 else jnp.max(positions, axis=1, keepdims=True) + 1
        written = key_pos < seen

    allowed = _position_mask(positions, key_pos, params.causal, written)
    if mask is not None:
        allowed = mask if allowed is None else allowed & mask
    y = dot_product_attention(q, k, v, allowed)
    y = _linear(params.o, y.reshape(b, length, params.n_heads * params.head_dim))
    return y if cache is None else (y, cache)


def _write_cache(
    cache: KVCache | KVCacheSlot, k: Array, v: Array
) -> tuple[Array, Array, KVCache | KVCacheSlot]:
    """Write `k`, `v` `(batch, length, kv_heads, head_dim)` at `cache.index`: the layer's full
    buffers to attend to, and the cache with `index` advanced by `length`."""
    index = cache.index + k.shape[1]
    if isinstance(cache, KVCache):
        k = lax.dynamic_update_slice_in_dim(cache.k, k.astype(cache.k.dtype), cache.index, axis=1)
        v = lax.dynamic_update_slice_in_dim(cache.v, v.astype(cache.v.dtype), cache.index, axis=1)
        return k, v, KVCache(k=k, v=v, index=index)
    zero = jnp.zeros((), jnp.int32)
    at = (cache.layer, zero, cache.index, zero, zero)
    k_all = lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype)[None], at)
    v_all = lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype)[None], at)
    new = KVCacheSlot(k=k_all, v=v_all, index=index, layer=cache.layer)
    return k_all[cache.layer], v_all[cache.layer], new


def _write_rows(cache: KVCache | KVCacheSlot, k: Array, v: Array, positions: Array) -> tuple:
    """`_write_cache` at each token's own position: row b's token j goes to slot `positions[b, j]`;
    the index becomes one past the largest position written."""
    rows = jnp.arange(k.shape[0])[:, None]
    index = jnp.max(positions) + 1
    if isinstance(cache, KVCache):
        k_all = cache.k.at[rows, positions].set(k.astype(cache.k.dtype), mode="drop")
        v_all = cache.v.at[rows, positions].set(v.astype(cache.v.dtype), mode="drop")
        return k_all, v_all, KVCache(k=k_all, v=v_all, index=index)
    k_all = cache.k.at[cache.layer, rows, positions].set(k.astype(cache.k.dtype), mode="drop")
    v_all = cache.v.at[cache.layer, rows, positions].set(v.astype(cache.v.dtype), mode="drop")
    new = KVCacheSlot(k=k_all, v=v_all, index=index, layer=cache.layer)
    return k_all[cache.layer], v_all[cache.layer], new


def _position_mask(q_pos: Array, key_pos: Array, causal: bool, written: Array | None) -> Array | None:
    """`(1 or batch, 1, q_len, kv_len)` mask from causality (`q_pos` shared or per row) and cache
    occupancy, or None when all may attend."""
    allowed = None
    if causal:
        allowed = key_pos <= q_pos[..., None]
    elif written is not None:
        allowed = jnp.broadcast_to(written[..., None, :], (*q_pos.shape, key_pos.shape[0]))
    if allowed is None:
        return None
    return allowed[:, None] if allowed.ndim == 3 else allowed[None, None]


def _check_positions(positions: Array | None, cache, batch: int, length: int) -> None:
    if positions is None:
        return
    if cache is None or jnp.shape(positions) != (batch, length):
        raise ValueError(
            f"Attention: positions= must be (batch, length) = {(batch, length)} and come with a cache, "
            f"received shape {jnp.shape(positions)}{'' if cache is not None else ' without a cache'}; "
            "leave positions out to count them from the cache's index."
        )


def _check_cache(params: Attention, cache: KVCache | KVCacheSlot, batch: int, length: int) -> None:
    expected = (batch, cache.max_len, params.n_kv_heads, params.head_dim)
    layout = "(batch, max_len, n_kv_heads, head_dim)"
    if isinstance(cache, KVCacheSlot):
        expected, layout = (cache.k.shape[0], *expected), "(layers, batch, max_len, n_kv_heads, head_dim)"
    if cache.k.shape != expected or cache.v.shape != expected or cache.index.shape != ():
        raise ValueError(
            f"Attention: cache buffers of shape {tuple(cache.k.shape)} / index {tuple(cache.index.shape)} "
            f"do not fit this layer and input; expected {layout} = {expected} "
            "and a scalar index. Build one with `attn.init_cache(batch, max_len)`."
        )
    if length > cache.max_len:
        raise ValueError(f"Attention: input length {length} exceeds the cache's max_len {cache.max_len}.")
    if not isinstance(cache.index, jax.core.Tracer) and int(cache.index) + length > cache.max_len:
        raise ValueError(
            f"Attention: writing {length} positions at cache index {int(cache.index)} overflows "
            f"max_len {cache.max_len}; allocate a longer cache."
        )
