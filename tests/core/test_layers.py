"""Numerics of the non-attention layers and the losses against plain jax.numpy formulas."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_core as sc
from spectrax_core import losses, nn

RTOL = 1e-5
ATOL = 1e-6
TOKENS = ("BATCH", "LENGTH", "EMBED", "HEAD", "KV_HEAD", "MLP", "VOCAB", "EXPERT")


def _rand(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _with_random(params, seed):
    """Replace every array leaf by random values so that zero biases / unit scales test nothing for free."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), params)


def _random_params(init, seed):
    """`_with_random` on the structure of `init()`, traced on shapes only (no initializer is compiled)."""
    return _with_random(jax.eval_shape(init), seed)


# ---------------------------------------------------------------- Linear, Embed


def test_linear_matches_formula():
    p = _random_params(lambda: nn.Linear.init(jax.random.key(0), 5, 3), 1)
    x = _rand(2, (2, 4, 5))
    _close(sc.apply(p, x), np.einsum("bli,io->blo", x, p.weight) + np.asarray(p.bias)[None, None, :])
    q = nn.Linear.init(jax.random.key(0), 5, 3, use_bias=False)
    assert q.bias is None
    _close(sc.apply(q, x), np.einsum("bli,io->blo", x, q.weight))


def test_embed_lookup_and_attend():
    p = nn.Embed.init(jax.random.key(0), 11, 6)
    assert p.table.shape == (11, 6)
    tokens = jnp.array([[0, 3, 10], [7, 7, 1]], jnp.int32)
    onehot = (np.asarray(tokens)[..., None] == np.arange(11)).astype(np.float32)
    _close(sc.apply(p, tokens), np.einsum("blv,vd->bld", onehot, p.table))
    x = _rand(1, (2, 3, 6))
    _close(nn.attend(p, x), np.einsum("bld,vd->blv", x, p.table))
    out_of_range = sc.apply(p, jnp.array([11, -12], jnp.int32))
    assert bool(jnp.all(jnp.isnan(out_of_range)))


# ---------------------------------------------------------------- norms


def test_layer_norm_matches_formula():
    p = _random_params(lambda: nn.LayerNorm.init(None, 8, eps=1e-3), 3)
    x = 3.0 + 2.0 * _rand(4, (3, 5, 8))
    xn = np.asarray(x, np.float64)
    mean = xn.sum(-1, keepdims=True) / 8
    var = ((xn - mean) ** 2).sum(-1, keepdims=True) / 8
    _close(sc.apply(p, x), (xn - mean) / np.sqrt(var + 1e-3) * p.scale + p.bias)


def test_rms_norm_matches_formula():
    p = _random_params(lambda: nn.RMSNorm.init(None, 8), 3)
    x = _rand(4, (3, 5, 8))
    xn = np.asarray(x, np.float64)
    rms = np.sqrt((xn * xn).sum(-1, keepdims=True) / 8 + 1e-6)
    _close(sc.apply(p, x), xn / rms * p.scale)


def test_norm_keeps_low_precision_dtype():
    x = _rand(0, (2, 8)).astype(jnp.bfloat16)
    assert sc.apply(nn.RMSNorm.init(None, 8), x).dtype == jnp.bfloat16
    assert sc.apply(nn.LayerNorm.init(None, 8), x).dtype == jnp.bfloat16


# ---------------------------------------------------------------- MLPs


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _silu(x):
    return x / (1.0 + np.exp(-x))


def test_mlp_matches_formula():
    p = _random_params(lambda: nn.MLP.init(jax.random.key(0), 6, 10), 5)
    x = _rand(6, (2, 3, 6))
    w = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    h = _gelu_tanh(np.asarray(x, np.float64) @ w.up.weight + w.up.bias)
    _close(sc.apply(p, x), h @ w.down.weight + w.down.bias)


def test_mlp_activation_choice_and_unknown_name():
    p = _random_params(lambda: nn.MLP.init(jax.random.key(0), 6, 10, activation="relu", use_bias=False), 5)
    x = _rand(6, (4, 6))
    w = jax.tree.map(np.asarray, p)
    _close(sc.apply(p, x), np.maximum(np.asarray(x) @ w.up.weight, 0.0) @ w.down.weight)
    with pytest.raises(ValueError, match="activation 'swish2' is not known"):
        nn.MLP.init(jax.random.key(0), 6, 10, activation="swish2")


def test_gated_mlp_matches_formula():
    p = nn.GatedMLP.init(jax.random.key(0), 6, 10)
    assert p.gate.bias is None and p.up.bias is None and p.down.bias is None
    x = _rand(6, (2, 3, 6))
    w = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    xn = np.asarray(x, np.float64)
    h = _silu(xn @ w.gate.weight) * (xn @ w.up.weight)
    _close(sc.apply(p, x), h @ w.down.weight)


# ---------------------------------------------------------------- convolutions


def _same_pads(size, k, s):
    out = -(-size // s)
    total = max((out - 1) * s + k - size, 0)
    return total // 2, total - total // 2


def _conv1d_loop(x, w, b, stride, padding):
    k = w.shape[0]
    if padding == "SAME":
        x = np.pad(x, ((0, 0), _same_pads(x.shape[1], k, stride), (0, 0)))
    n_out = (x.shape[1] - k) // stride + 1
    cols = [np.einsum("bki,kio->bo", x[:, i * stride : i * stride + k], w) for i in range(n_out)]
    return np.stack(cols, axis=1) + b


def _conv2d_loop(x, w, b, stride, padding):
    kh, kw = w.shape[:2]
    if padding == "SAME":
        pads_h, pads_w = _same_pads(x.shape[1], kh, stride[0]), _same_pads(x.shape[2], kw, stride[1])
        x = np.pad(x, ((0, 0), pads_h, pads_w, (0, 0)))
    oh = (x.shape[1] - kh) // stride[0] + 1
    ow = (x.shape[2] - kw) // stride[1] + 1
    rows = []
    for i in range(oh):
        row = []
        for j in range(ow):
            patch = x[:, i * stride[0] : i * stride[0] + kh, j * stride[1] : j * stride[1] + kw]
            row.append(np.einsum("bhwi,hwio->bo", patch, w))
        rows.append(np.stack(row, axis=1))
    return np.stack(rows, axis=1) + b


@pytest.mark.parametrize("padding,stride", [("VALID", 1), ("SAME", 1), ("SAME", 2), ("VALID", 2)])
def test_conv1d_matches_loop(padding, stride):
    p = _random_params(lambda: nn.Conv1d.init(jax.random.key(0), 3, 4, 3, stride=stride, padding=padding), 1)
    x = _rand(2, (2, 9, 3))
    _close(sc.apply(p, x), _conv1d_loop(*map(np.asarray, (x, p.weight, p.bias)), stride, padding))


@pytest.mark.parametrize("padding,stride", [("VALID", (1, 1)), ("SAME", (2, 1))])
def test_conv2d_matches_loop(padding, stride):
    init = functools.partial(nn.Conv2d.init, jax.random.key(0), 2, 3, (3, 2), stride=stride, padding=padding)
    p = _random_params(init, 1)
    x = _rand(2, (2, 6, 5, 2))
    _close(sc.apply(p, x), _conv2d_loop(*map(np.asarray, (x, p.weight, p.bias)), stride, padding))


def test_conv_rejects_bad_hyper_parameters():
    with pytest.raises(ValueError, match="padding must be one of"):
        nn.Conv1d.init(jax.random.key(0), 3, 4, 3, padding="FULL")
    with pytest.raises(ValueError, match="kernel_size must be a positive int or 2"):
        nn.Conv2d.init(jax.random.key(0), 3, 4, (3, 3, 3))


# ---------------------------------------------------------------- dropout


def test_dropout_rate_scaling_and_identity():
    d = nn.Dropout.init(None, 0.25)
    x = jnp.ones((200, 500))
    y = sc.apply(d, x, key=jax.random.key(0))
    dropped = float(jnp.mean(y == 0.0))
    # 1e5 Bernoulli draws: standard deviation of the fraction is 0.0014, so 0.01 is ~7 sigma.
    assert abs(dropped - 0.25) < 0.01
    kept = y[y != 0.0]
    _close(kept, jnp.full(kept.shape, 1.0 / 0.75))
    y2 = sc.apply(d, x, key=jax.random.key(1))
    assert bool(jnp.any((y2 == 0.0) != (y == 0.0)))
    assert sc.apply(d, x, deterministic=True) is x
    assert sc.apply(nn.Dropout(rate=0.0), x) is x
    assert bool(jnp.all(sc.apply(nn.Dropout(rate=1.0), x, key=jax.random.key(0)) == 0.0))
    assert jax.tree.leaves(d) == []


def test_dropout_errors():
    with pytest.raises(ValueError, match="deterministic=False needs a random key"):
        sc.apply(nn.Dropout(rate=0.5), jnp.ones(3))
    with pytest.raises(ValueError, match=r"rate must lie in \[0, 1\], received 1.5"):
        nn.Dropout(rate=1.5)


# ---------------------------------------------------------------- losses


def _xent_formula(logits, labels):
    logits, labels = np.asarray(logits, np.float64), np.asarray(labels)
    logz = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    picked = np.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return logz - picked


def test_softmax_cross_entropy_mean_mask_and_ignore_index():
    logits = 3.0 * _rand(0, (4, 5, 7))
    rng = np.random.default_rng(1)
    labels = jnp.asarray(rng.integers(0, 7, (4, 5)), jnp.int32)
    per = _xent_formula(logits, labels)
    _close(losses.softmax_cross_entropy(logits, labels), per.mean())
    mask = jnp.asarray(rng.random((4, 5)) < 0.5)
    _close(losses.softmax_cross_entropy(logits, labels, mask=mask), (per * mask).sum() / mask.sum())
    ignored = jnp.where(mask, labels, -100)
    _close(losses.softmax_cross_entropy(logits, ignored, ignore_index=-100), (per * mask).sum() / mask.sum())
    row = mask[:1]  # one mask row broadcast over the batch
    _close(losses.softmax_cross_entropy(logits, labels, mask=row), (per * row).sum() / (4 * row.sum()))
    nothing = jnp.zeros((4, 5), bool)
    assert float(losses.softmax_cross_entropy(logits, labels, mask=nothing)) == 0.0


def test_softmax_cross_entropy_shape_errors():
    with pytest.raises(
        ValueError, match=r"labels of shape \(4, 6\) do not match logits of shape \(4, 5, 7\)"
    ):
        losses.softmax_cross_entropy(jnp.zeros((4, 5, 7)), jnp.zeros((4, 6), jnp.int32))
    with pytest.raises(TypeError, match="labels must be integer"):
        losses.softmax_cross_entropy(jnp.zeros((4, 7)), jnp.zeros((4,)))
    with pytest.raises(
        ValueError, match=r"mask of shape \(5,\) does not broadcast to labels of shape \(4,\)"
    ):
        losses.softmax_cross_entropy(jnp.zeros((4, 7)), jnp.zeros((4,), jnp.int32), mask=jnp.ones(5, bool))


def test_mse():
    a, b = _rand(0, (3, 4)), _rand(1, (3, 4))
    _close(losses.mse(a, b), ((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2).sum() / 12)
    with pytest.raises(ValueError, match=r"pred of shape \(3, 4\) and target of shape \(4,\) differ"):
        losses.mse(a, b[0])


# ---------------------------------------------------------------- logical axes


def _check_axes(module, stacked=0):
    """Every array field of every module is declared, with one valid token per axis."""
    import equinox as eqx

    axes = module.logical_axes()
    stacked_fields = getattr(module, "stacked_fields", ())
    for name, value in vars(module).items():
        if isinstance(value, (jax.Array, jax.ShapeDtypeStruct)):
            spec = axes[name]
            assert len(spec) + stacked == value.ndim, (type(module).__name__, name, spec, value.shape)
            assert all(t is None or t in TOKENS for t in spec)
        elif isinstance(value, eqx.Module):
            _check_axes(value, stacked + 1 if name in stacked_fields else stacked)
        elif value is not None:
            assert name not in axes


def test_logical_axes_cover_every_array_field():
    from spectrax_core.models import TransformerLM, init_cache

    key = jax.random.key(0)
    # Abstract params (shapes only): the protocol is about shapes, no need to compute values.
    lm = jax.eval_shape(
        lambda: TransformerLM.init(key, vocab_size=16, d_model=8, n_layers=2, n_heads=2, d_ff=16)
    )
    for module in [
        lm,
        jax.eval_shape(lambda: nn.Block.init(key, 8, 2, 16)),
        jax.eval_shape(lambda: nn.Conv1d.init(key, 2, 3, 3)),
        jax.eval_shape(lambda: nn.Conv2d.init(key, 2, 3, 3, axes=(None, "MLP"))),
        nn.LayerNorm.init(None, 4),
        nn.Dropout(rate=0.1),
        nn.KVCache.init(1, 4, 2, 4),
    ]:
        _check_axes(module)
    stacked_cache = jax.eval_shape(lambda m: init_cache(m, 1, 4), lm)
    assert stacked_cache.logical_axes()["k"] == (None, "BATCH", "LENGTH", "KV_HEAD", None)
    assert lm.blocks.layers.attn.q.logical_axes()["weight"] == ("EMBED", "HEAD")
    assert lm.blocks.layers.attn.o.logical_axes()["weight"] == ("HEAD", "EMBED")
    assert lm.blocks.layers.mlp.down.logical_axes()["weight"] == ("MLP", "EMBED")
    assert lm.head.logical_axes()["weight"] == ("EMBED", "VOCAB")
