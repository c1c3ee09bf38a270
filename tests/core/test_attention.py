"""Attention, Block and BlockStack against explicit per-head formulas written here."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_core as sc
from spectrax_core import nn

RTOL = 1e-5
ATOL = 1e-6
B, L, D = 2, 6, 16


def _close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _x(seed=0, length=L):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, length, D)), jnp.float32)


def _params(init, seed):
    """Params of `init()`'s structure filled with seeded random values (fan-in scaled).

    Numerics tests need arbitrary weights, not the initializer's: building them
    from shapes avoids compiling every initializer eagerly.
    """
    rng = np.random.default_rng(seed)

    def fill(a):
        scale = 1.0 / np.sqrt(a.shape[-2]) if len(a.shape) >= 2 else 1.0
        return jnp.asarray(scale * rng.standard_normal(a.shape) + (len(a.shape) == 1), a.dtype)

    return jax.tree.map(fill, jax.eval_shape(init))


# ------------------------------------------------------------ independent formulas


def _rope_formula(t, positions, theta):
    """Rotate (t_i, t_{i+h}) as the complex number t_i + j t_{i+h} times exp(j pos theta^(-2i/d))."""
    d = t.shape[-1]
    half = d // 2
    z = t[..., :half] + 1j * t[..., half:]
    freq = theta ** (-2.0 * np.arange(half) / d)
    rot = np.exp(1j * np.asarray(positions)[:, None] * freq[None, :])  # (length, half)
    z = np.asarray(z) * rot[None, :, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def _attention_formula(p, x, *, causal, rope_theta=None, mask=None, kv_heads=None):
    """Loop over heads: softmax(Q Kᵀ / sqrt(d)) V with query head h reading kv head h // group."""
    x = np.asarray(x, np.float64)
    n_heads, d = p.n_heads, p.head_dim
    kvh = kv_heads or p.n_kv_heads
    q = (x @ np.asarray(p.q.weight, np.float64)).reshape(B, -1, n_heads, d)
    k = (x @ np.asarray(p.k.weight, np.float64)).reshape(B, -1, kvh, d)
    v = (x @ np.asarray(p.v.weight, np.float64)).reshape(B, -1, kvh, d)
    length = x.shape[1]
    if rope_theta is not None:
        pos = np.arange(length)
        q, k = _rope_formula(q, pos, rope_theta), _rope_formula(k, pos, rope_theta)
    out = np.zeros((B, length, n_heads, d))
    for b in range(B):
        for h in range(n_heads):
            g = h // (n_heads // kvh)
            s = q[b, :, h] @ k[b, :, g].T / math.sqrt(d)
            allowed = np.ones((length, length), bool)
            if causal:
                allowed &= np.tril(np.ones((length, length), bool))
            if mask is not None:
                allowed &= np.broadcast_to(np.asarray(mask), (B, n_heads, length, length))[b, h]
            s = np.where(allowed, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            w = w / w.sum(-1, keepdims=True)
            out[b, :, h] = w @ v[b, :, g]
    return out.reshape(B, length, n_heads * d) @ np.asarray(p.o.weight, np.float64)


# ------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def gqa():
    return _params(lambda: nn.Attention.init(jax.random.key(1), D, 4, n_kv_heads=2, rope=True), 1)


# ------------------------------------------------------------ attention numerics


@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_formula(causal):
    p = _params(lambda: nn.Attention.init(jax.random.key(0), D, 4, causal=causal), 0)
    _close(sc.apply(p, _x()), _attention_formula(p, _x(), causal=causal))


def test_attention_with_padding_mask():
    p = _params(lambda: nn.Attention.init(jax.random.key(0), D, 4), 0)
    keep = jnp.arange(L)[None, :] < jnp.array([[L], [3]])  # second example: keys 3.. are padding
    mask = keep[:, None, None, :]
    _close(sc.apply(p, _x(), mask=mask), _attention_formula(p, _x(), causal=True, mask=mask))


def test_gqa_equals_mha_with_repeated_kv_heads():
    p = _params(lambda: nn.Attention.init(jax.random.key(2), D, 4, n_kv_heads=2), 2)
    group, hd = 2, p.head_dim

    def repeat(lin):
        w = lin.weight.reshape(D, 2, hd)
        w = jnp.repeat(w, group, axis=1).reshape(D, 4 * hd)
        return nn.Linear(weight=w, bias=None, d_in=D, d_out=4 * hd)

    mha = nn.Attention(
        q=p.q, k=repeat(p.k), v=repeat(p.v), o=p.o, d_model=D, n_heads=4, n_kv_heads=4, head_dim=hd
    )
    _close(sc.apply(p, _x()), sc.apply(mha, _x()))
    _close(sc.apply(p, _x()), _attention_formula(p, _x(), causal=True))


def test_rope_matches_complex_rotation_formula(gqa):
    _close(sc.apply(gqa, _x()), _attention_formula(gqa, _x(), causal=True, rope_theta=10000.0))
    t = jnp.asarray(np.random.default_rng(3).standard_normal((1, 5, 2, 8)), jnp.float32)
    pos = jnp.array([0, 1, 7, 30, 500], jnp.int32)
    # At position 500 the float32 angle itself carries ~500 * 2**-24 ≈ 3e-5 rad of rounding (the
    # float64 formula has none), so the rotated values differ by up to ~3e-6: atol 1e-5, not 1e-6.
    _close(nn.rope(t, pos, 500.0), _rope_formula(t, pos, 500.0), atol=1e-5)


# ------------------------------------------------------------ KV cache


def test_kv_cache_decode_equals_full_forward(gqa):
    full = sc.apply(gqa, _x())
    step = jax.jit(lambda p, x, c: sc.apply(p, x, cache=c))
    cache = gqa.init_cache(B, 8)
    y, cache = step(gqa, _x()[:, :2], cache)  # a two-token prefill, then one token at a time
    outs = [y]
    for t in range(2, L):
        y, cache = step(gqa, _x()[:, t : t + 1], cache)
        outs.append(y)
    assert int(cache.index) == L
    _close(jnp.concatenate(outs, axis=1), full)


def test_kv_cache_non_causal_prefill_ignores_empty_slots():
    p = _params(lambda: nn.Attention.init(jax.random.key(0), D, 4, causal=False), 0)
    y, cache = sc.apply(p, _x(), cache=p.init_cache(B, 9))
    _close(y, sc.apply(p, _x()))
    assert int(cache.index) == L


def test_kv_cache_overflow_and_mismatch_errors(gqa):
    cache = gqa.init_cache(B, 4)
    with pytest.raises(ValueError, match="overflows max_len 4"):
        sc.apply(gqa, _x(length=3), cache=nn.KVCache(k=cache.k, v=cache.v, index=jnp.array(2, jnp.int32)))
    with pytest.raises(
        ValueError, match=r"expected \(batch, max_len, n_kv_heads, head_dim\) = \(2, 4, 2, 4\)"
    ):
        sc.apply(gqa, _x(length=1), cache=nn.KVCache.init(B, 4, 4, 4))


# ------------------------------------------------------------ Block and BlockStack


def _rms(x, scale, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(scale)


def _swiglu(p, x):
    w = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    g = x @ w.gate.weight
    return (g / (1 + np.exp(-g)) * (x @ w.up.weight)) @ w.down.weight


def _block_formula(blk, x):
    x = np.asarray(x, np.float64)
    x = x + _attention_formula(blk.attn, _rms(x, blk.norm1.scale), causal=True, rope_theta=10000.0)
    return x + _swiglu(blk.mlp, _rms(x, blk.norm2.scale))


@pytest.fixture(scope="module")
def stack():
    kw = dict(d_model=D, n_heads=4, d_ff=32, n_kv_heads=2, rope=True, norm="rms", gated=True)
    return _params(lambda: nn.BlockStack.init(jax.random.key(4), 3, **kw), 4)


def test_block_matches_formula(stack):
    blk = stack.layer(1)
    assert (
        isinstance(blk, nn.Block) and isinstance(blk.norm1, nn.RMSNorm) and isinstance(blk.mlp, nn.GatedMLP)
    )
    _close(sc.apply(blk, _x()), _block_formula(blk, _x()))


def test_classic_block_defaults():
    blk = jax.eval_shape(lambda: nn.Block.init(jax.random.key(0), D, 4, 32))
    assert isinstance(blk.norm1, nn.LayerNorm) and isinstance(blk.mlp, nn.MLP)
    assert blk.attn.causal and not blk.attn.rope


def test_block_stack_scan_equals_unrolled_layers(stack):
    assert stack.n_layers == 3 and stack.layers.attn.q.weight.shape == (3, D, D)
    h = _x()
    for i in range(stack.n_layers):
        h = sc.apply(stack.layer(i), h)
    _close(sc.apply(stack, _x()), h)
    _close(sc.apply(stack.slice(1, 3), sc.apply(stack.layer(0), _x())), h)
    rebuilt = nn.BlockStack.from_blocks([stack.layer(i) for i in range(3)])
    assert jax.tree.structure(rebuilt) == jax.tree.structure(stack)
    _close(sc.apply(rebuilt, _x()), h)


def test_block_stack_decode_through_scan(stack):
    cache = stack.init_cache(B, L)
    assert cache.k.shape == (3, B, L, 2, 4) and cache.index.shape == (3,)
    y0, cache = sc.apply(stack, _x()[:, :4], cache=cache)
    y1, cache = sc.apply(stack, _x()[:, 4:], cache=cache)
    _close(jnp.concatenate([y0, y1], axis=1), sc.apply(stack, _x()))
    with pytest.raises(ValueError, match="overflows max_len 6"):
        sc.apply(stack, _x()[:, :1], cache=cache)


def test_block_stack_index_errors(stack):
    with pytest.raises(IndexError, match="index 3 out of range for 3 layers"):
        stack.layer(3)
    with pytest.raises(IndexError, match=r"received \(2, 2\)"):
        stack.slice(2, 2)
