"""BlockStack decoding with a stacked KV cache against its blocks decoded one by one.

The reference runs each Block in order with its own unstacked `KVCache` (the
single-layer write in `apply_attention`); the stack runs one `lax.scan` that
writes every layer's new positions into the stacked buffers. Outputs and every
layer's keys, values and index must agree for a prefill followed by decode
steps, with a padding mask, for several block counts and for layers whose
caches hold different numbers of positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_core as sc
from spectrax_core import nn
from spectrax_core.nn._attention import KVCacheSlot

B, D, MAX_LEN = 2, 8, 12
CONFIGS = {
    "gqa-rope": dict(n_heads=4, n_kv_heads=2, rope=True, norm="rms", gated=True),
    "classic": dict(n_heads=2),
}


def _stack(n: int, config: str) -> nn.BlockStack:
    return nn.BlockStack.init(jax.random.key(n), n, d_model=D, d_ff=16, **CONFIGS[config])


def _x(seed: int, length: int) -> jax.Array:
    return jax.random.normal(jax.random.key(100 + seed), (B, length, D))


def _pad_mask(starts: list[int]) -> jax.Array:
    return (jnp.arange(MAX_LEN)[None, :] >= jnp.asarray(starts)[:, None])[:, None, None, :]


@jax.jit
def _apply(module, x, mask, cache):
    """One compiled call (the stack's scan body is compiled too, so both round alike)."""
    return sc.apply(module, x, mask=mask, cache=cache)


def _one_by_one(blocks, x, caches, mask):
    """Each block in order with its own cache: `(y, new caches)`."""
    new = []
    for blk, cache in zip(blocks, caches):
        x, cache = _apply(blk, x, mask, cache)
        new.append(cache)
    return x, new


def _assert_same(y, stacked: nn.KVCache, y_ref, caches: list[nn.KVCache]):
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=0)
    for i, cache in enumerate(caches):
        np.testing.assert_array_equal(stacked.index[i], cache.index)
        np.testing.assert_allclose(stacked.k[i], cache.k, rtol=1e-6, atol=0)
        np.testing.assert_allclose(stacked.v[i], cache.v, rtol=1e-6, atol=0)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("n", [1, 2, 4])
def test_stacked_decode_equals_blocks_one_by_one(n, config):
    stack = _stack(n, config)
    blocks = [stack.layer(i) for i in range(n)]
    stacked, caches = stack.init_cache(B, MAX_LEN), [blk.init_cache(B, MAX_LEN) for blk in blocks]
    mask = _pad_mask([0, 2])  # the second sequence left-padded by two slots
    for step, length in enumerate([5, 1, 1, 3, 1]):  # a prefill, then decode steps
        x = _x(step, length)
        y, stacked = _apply(stack, x, mask, stacked)
        y_ref, caches = _one_by_one(blocks, x, caches, mask)
        _assert_same(y, stacked, y_ref, caches)
    assert stacked.index.tolist() == [11] * n


@pytest.mark.parametrize("n", [2, 4])
def test_stacked_decode_with_layers_at_different_indices(n):
    """Layer `i` already holds `i + 1` positions of its own: each writes at its own index."""
    stack = _stack(n, "gqa-rope")
    blocks = [stack.layer(i) for i in range(n)]
    caches = [
        sc.apply(blk, _x(10 + i, i + 1), cache=blk.init_cache(B, MAX_LEN))[1] for i, blk in enumerate(blocks)
    ]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *caches)
    for step in range(3):
        x = _x(20 + step, 2 - step % 2)
        y, stacked = _apply(stack, x, None, stacked)
        y_ref, caches = _one_by_one(blocks, x, caches, None)
        _assert_same(y, stacked, y_ref, caches)


def test_slot_with_wrong_shape_is_refused():
    stack = _stack(2, "classic")
    cache = stack.init_cache(B, MAX_LEN)
    slot = KVCacheSlot(k=cache.k, v=cache.v, index=cache.index[0], layer=jnp.int32(0))
    with pytest.raises(ValueError, match="do not fit this layer"):
        sc.apply(stack.layer(0), _x(0, 1)[:1], cache=slot)
