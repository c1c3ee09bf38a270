"""The decoder-only LM: composition, tied head, causality, KV-cache decode, and that it trains."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spectrax_core as sc
from spectrax_core import nn
from spectrax_core.models import TransformerLM, init_cache, lm_embed, lm_head, lm_loss

RTOL = 1e-5
ATOL = 1e-6
VOCAB, D, LAYERS, HEADS = 16, 32, 2, 4


def _close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def lm():
    return TransformerLM.init(
        jax.random.key(0), vocab_size=VOCAB, d_model=D, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=2, d_ff=64
    )


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (2, 8), 0, VOCAB)


def test_structure(lm):
    assert isinstance(lm.embed, nn.Embed) and isinstance(lm.blocks, nn.BlockStack)
    assert isinstance(lm.norm, nn.RMSNorm) and isinstance(lm.head, nn.Linear)
    assert lm.n_layers == LAYERS and lm.blocks.layers.attn.n_kv_heads == 2 and lm.blocks.layers.attn.rope


forward = jax.jit(sc.apply)


def _rms_head(x, scale, weight_t):
    return (x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale) @ weight_t


@jax.jit
def _pieces(lm, tokens):
    """The model cut the way a pipeline cuts it: embed, one block at a time, head."""
    x = lm_embed(lm, tokens)
    for i in range(lm.n_layers):
        x = sc.apply(lm.blocks.layer(i), x)
    return x, lm_head(lm, x)


def test_forward_is_embed_blocks_head(lm, tokens):
    logits = forward(lm, tokens)
    assert logits.shape == (2, 8, VOCAB)
    x, head_logits = _pieces(lm, tokens)
    expected = _rms_head(x, lm.norm.scale, lm.head.weight)
    _close(head_logits, expected)
    _close(logits, expected)


def test_causal(lm, tokens):
    changed = tokens.at[:, 5:].set((tokens[:, 5:] + 1) % VOCAB)
    a, b = forward(lm, tokens), forward(lm, changed)
    _close(a[:, :5], b[:, :5])
    assert not np.allclose(a[:, 5:], b[:, 5:])


def test_tied_embeddings():
    lm = jax.eval_shape(
        lambda: TransformerLM.init(
            jax.random.key(0),
            vocab_size=VOCAB,
            d_model=D,
            n_layers=1,
            n_heads=HEADS,
            d_ff=64,
            tie_embeddings=True,
        )
    )
    assert lm.head is None
    rng = np.random.default_rng(0)
    lm = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), lm)
    x = jnp.asarray(rng.standard_normal((2, 3, D)), jnp.float32)
    _close(jax.jit(lm_head)(lm, x), _rms_head(x, lm.norm.scale, lm.embed.table.T))


def test_lm_loss(lm, tokens):
    targets = jnp.roll(tokens, -1, axis=1)
    mask = np.arange(8)[None, :] < 7  # one mask row for the whole batch
    logits = np.asarray(forward(lm, tokens), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    per_token = logz - np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
    expected = (per_token * mask).sum() / (2 * mask.sum())
    _close(jax.jit(lm_loss)(lm, tokens, targets, jnp.asarray(mask)), expected)


def test_kv_cache_decode_equals_full_forward(lm, tokens):
    full = forward(lm, tokens)
    step = jax.jit(lambda p, t, c: sc.apply(p, t, cache=c))
    cache = init_cache(lm, 2, 10)
    assert cache.k.shape == (LAYERS, 2, 10, 2, D // HEADS)
    logits, cache = step(lm, tokens[:, :3], cache)  # prompt, then token by token
    outs = [logits]
    for t in range(3, 8):
        logits, cache = step(lm, tokens[:, t : t + 1], cache)
        outs.append(logits)
    np.testing.assert_array_equal(np.asarray(cache.index), [8, 8])
    _close(jnp.concatenate(outs, axis=1), full)


def _repeating_batch(batch=8, length=16, period=4):
    """Each row repeats a fixed random motif: after one period the next token is determined."""
    motif = jax.random.randint(jax.random.key(7), (batch, period), 0, VOCAB)
    seq = jnp.tile(motif, (1, (length + 1) // period + 1))[:, : length + 1]
    return seq[:, :-1], seq[:, 1:]


def test_lm_trains_with_adamw(lm):
    """d=32, 2 layers, vocab 16, seq 16, batch 8: 100 jitted AdamW steps at least halve the loss."""
    tx = optax.adamw(3e-3)
    tokens, targets = _repeating_batch()

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(lm_loss)(params, tokens, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state = lm, tx.init(lm)
    first = None
    for _ in range(100):
        params, opt_state, loss = step(params, opt_state)
        first = float(loss) if first is None else first
    final = float(lm_loss(params, tokens, targets))
    assert final < 0.5 * first, (first, final)
