"""A stack of identical blocks with stacked parameters, run by `lax.scan`.

Every array of `layers` has a leading axis of size `n_layers`, so the whole
stack compiles as one block body however deep it is. `layer(i)` and
`slice(start, stop)` cut it for pipeline stages.
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, PRNGKeyArray

from ._composite import Composite
from .._apply import apply, register_apply
from .._checks import check_last_dim
from ._attention import KVCache, KVCacheSlot
from ._block import Block
from ._validate import check_ndim


class BlockStack(Composite):
    """`n_layers` Blocks whose parameters are stacked along a leading axis of `layers`."""

    stacked_fields: ClassVar[tuple[str, ...]] = ("layers",)

    layers: Block
    n_layers: int = eqx.field(static=True)

    @classmethod
    def init(cls, key: PRNGKeyArray, n_layers: int, **block_kwargs) -> "BlockStack":
        """Initialise `n_layers` Blocks (`Block.init(key_i, **block_kwargs)`) under `jit(vmap)`."""
        if n_layers < 1:
            raise ValueError(f"BlockStack: n_layers must be at least 1, received {n_layers}.")
        keys = jax.random.split(key, n_layers)
        layers = jax.jit(jax.vmap(lambda k: Block.init(k, **block_kwargs)))(keys)
        return cls(layers=layers, n_layers=n_layers)

    @classmethod
    def from_blocks(cls, blocks: list[Block] | tuple[Block, ...]) -> "BlockStack":
        """Stack identically shaped Blocks (the inverse of `[stack.layer(i) for i in ...]`)."""
        if not blocks:
            raise ValueError("BlockStack.from_blocks: received no blocks; pass at least one Block.")
        layers = jax.tree.map(lambda *leaves: jnp.stack(leaves), *blocks)
        return cls(layers=layers, n_layers=len(blocks))

    @property
    def d_model(self) -> int:
        """Width of the residual stream."""
        return self.layers.d_model

    def layer(self, i: int) -> Block:
        """The `i`-th Block (negative `i` counts from the end)."""
        if not -self.n_layers <= i < self.n_layers:
            raise IndexError(f"BlockStack.layer: index {i} out of range for {self.n_layers} layers.")
        return jax.tree.map(lambda a: a[i], self.layers)

    def slice(self, start: int, stop: int) -> "BlockStack":
        """Layers `start … stop-1` as a smaller BlockStack (a pipeline stage's share)."""
        if not 0 <= start < stop <= self.n_layers:
            raise IndexError(
                f"BlockStack.slice: need 0 <= start < stop <= {self.n_layers}, received ({start}, {stop})."
            )
        return BlockStack(layers=jax.tree.map(lambda a: a[start:stop], self.layers), n_layers=stop - start)

    def init_cache(self, batch: int, max_len: int, *, dtype=None) -> KVCache:
        """Stacked empty caches, one per layer (a leading `n_layers` axis on every field)."""
        one = self.layer(0).init_cache(batch, max_len, dtype=dtype)
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (self.n_layers, *a.shape)), one)


@register_apply(BlockStack)
def apply_block_stack(
    params: BlockStack,
    x: Array,
    *,
    mask: Array | None = None,
    cache: KVCache | None = None,
    positions: Array | None = None,
) -> Array | tuple[Array, KVCache]:
    """Run the layers in order over `x` of shape `(batch, length, d_model)` with `lax.scan`.

    With stacked `cache` (from `init_cache`), returns `(y, new_caches)`. The scan
    carries the stacked buffers and each layer writes only its new positions into
    them (a `KVCacheSlot`), so a step costs what its layers cost: under `jit` with
    the cache donated the buffers are updated in place, not rebuilt per layer.
    `positions` `(batch, length)`: each token's own position (see `apply_attention`).
    """
    check_ndim("BlockStack", x, 3, "(batch, length, d_model)")
    check_last_dim("BlockStack", x, params.d_model)
    if cache is None:
        y, _ = lax.scan(
            lambda h, blk: (apply(blk, h, mask=mask, positions=positions), None), x, params.layers
        )
        return y
    if cache.index.shape != (params.n_layers,):
        raise ValueError(
            f"BlockStack: cache index of shape {tuple(cache.index.shape)} is not a stack of "
            f"{params.n_layers} caches; build one with `stack.init_cache(batch, max_len)`."
        )
    max_len = cache.k.shape[-3]
    concrete = positions is None and not isinstance(cache.index, jax.core.Tracer)
    if concrete and int(cache.index.max()) + x.shape[1] > max_len:
        raise ValueError(
            f"BlockStack: writing {x.shape[1]} positions at cache index {int(cache.index.max())} "
            f"overflows max_len {max_len}; allocate a longer cache."
        )

    def step(carry, xs):
        h, k, v = carry
        layer, i, index = xs
        slot = KVCacheSlot(k=k, v=v, index=index, layer=i)
        h, slot = apply(layer, h, mask=mask, cache=slot, positions=positions)
        return (h, slot.k, slot.v), slot.index

    layer_ids = jnp.arange(params.n_layers, dtype=jnp.int32)
    (y, k, v), index = lax.scan(step, (x, cache.k, cache.v), (params.layers, layer_ids, cache.index))
    return y, KVCache(k=k, v=v, index=index)
