"""Core layers, functional ops and initializers against formulas written here with numpy.

The PyTorch-shaped layers are checked against the definitions in PyTorch's
documentation (transposed convolution as a scatter-add, adaptive pooling bins,
batch-norm running statistics with the unbiased variance, LSTM/GRU gate
equations), written independently of the library code.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_core as sc
from spectrax_core import functional as F
from spectrax_core import nn

RTOL, ATOL = 1e-5, 1e-5


def _rand(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol)


def _randomize(params, seed):
    """Random values in every array of `params` (an instance or its `eval_shape`)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), params)


def _params(init, seed):
    """`_randomize` on the structure of `init()`, traced on shapes only (no initializer runs)."""
    return _randomize(jax.eval_shape(init), seed)


@functools.lru_cache(maxsize=None)
def _jitted(static: tuple):
    return jax.jit(lambda p, arrays, *a: sc.apply(p, *a, **arrays, **dict(static)))


def _apply(params, *args, **kwargs):
    """`sc.apply` compiled as one program (faster on CPU than many eager ops)."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
    return _jitted(static)(params, arrays, *args)


# ---------------------------------------------------------------- convolutions


def _conv_ref(x, w, b, stride, pads, dilation, groups):
    """Direct N-d convolution loop: out[o] = Σ_k x[o·s + k·d - pad_lo] · w[k] per group."""
    n = w.ndim - 2
    x = np.pad(x, ((0, 0), *pads, (0, 0)))
    k = w.shape[:n]
    out_sp = [(x.shape[1 + i] - dilation[i] * (k[i] - 1) - 1) // stride[i] + 1 for i in range(n)]
    cg_in, c_out = w.shape[-2], w.shape[-1]
    cg_out = c_out // groups
    y = np.zeros((x.shape[0], *out_sp, c_out))
    for o in np.ndindex(*out_sp):
        for t in np.ndindex(*k):
            idx = tuple(o[i] * stride[i] + t[i] * dilation[i] for i in range(n))
            patch = x[(slice(None), *idx)]  # (batch, c_in)
            for g in range(groups):
                xs = patch[:, g * cg_in : (g + 1) * cg_in]
                y[(slice(None), *o, slice(g * cg_out, (g + 1) * cg_out))] += (
                    xs @ w[(*t, slice(None), slice(g * cg_out, (g + 1) * cg_out))]
                )
    return y + b


def _conv_transpose_ref(x, w, b, stride, pad, out_pad, dilation):
    """PyTorch's ConvTranspose as a scatter-add: y[i·s + k·d - p] += x[i] · w[k]."""
    n = w.ndim - 2
    k = w.shape[:n]
    L = x.shape[1 : 1 + n]
    full = [(L[i] - 1) * stride[i] + dilation[i] * (k[i] - 1) + 1 + out_pad[i] for i in range(n)]
    y = np.zeros((x.shape[0], *full, w.shape[-1]))
    for i in np.ndindex(*L):
        for t in np.ndindex(*k):
            o = tuple(i[a] * stride[a] + t[a] * dilation[a] for a in range(n))
            y[(slice(None), *o)] += x[(slice(None), *i)] @ w[t]
    crop = tuple(slice(pad[a], full[a] - pad[a]) for a in range(n))
    return y[(slice(None), *crop)] + b


@pytest.mark.parametrize(
    "cls, x_shape, kernel, kw, pads",
    [
        (nn.Conv1d, (2, 9, 4), 3, dict(padding=2, dilation=2, groups=2), ((2, 2),)),
        (nn.Conv1d, (2, 8, 3), 2, dict(padding=((1, 0),), stride=2), ((1, 0),)),
        (nn.Conv2d, (1, 5, 6, 2), (2, 3), dict(padding=1, stride=(2, 1)), ((1, 1), (1, 1))),
        (nn.Conv3d, (1, 4, 3, 4, 2), (2, 2, 3), dict(padding="VALID"), ((0, 0),) * 3),
    ],
)
def test_conv_matches_direct_loop(cls, x_shape, kernel, kw, pads):
    c_in = x_shape[-1]
    p = _params(lambda: cls.init(jax.random.key(0), c_in, 4, kernel, **kw), 1)
    x = _rand(2, x_shape)
    n = len(x_shape) - 2
    ref = _conv_ref(
        *map(np.asarray, (x, p.weight, p.bias)),
        p.stride,
        pads,
        p.dilation,
        kw.get("groups", 1),
    )
    _close(_apply(p, x), ref)
    assert p.weight.shape == (*p.kernel_size, c_in // kw.get("groups", 1), 4) and len(p.kernel_size) == n


@pytest.mark.parametrize(
    "cls, x_shape, kernel, kw",
    [
        (nn.ConvTranspose1d, (2, 5, 3), 3, dict(stride=2, padding=1, output_padding=1)),
        (nn.ConvTranspose1d, (1, 4, 2), 2, dict(stride=1, padding=0, dilation=2)),
        (
            nn.ConvTranspose2d,
            (1, 3, 4, 2),
            (3, 2),
            dict(stride=(2, 3), padding=(1, 0), output_padding=(1, 2)),
        ),
        (nn.ConvTranspose3d, (1, 2, 3, 2, 2), 2, dict(stride=2)),
    ],
)
def test_conv_transpose_matches_scatter_add(cls, x_shape, kernel, kw):
    p = _params(lambda: cls.init(jax.random.key(0), x_shape[-1], 3, kernel, **kw), 3)
    x = _rand(4, x_shape)
    ref = _conv_transpose_ref(
        *map(np.asarray, (x, p.weight, p.bias)), p.stride, p.padding, p.output_padding, p.dilation
    )
    y = _apply(p, x)
    assert y.shape == ref.shape
    _close(y, ref)


def test_conv_rejects_bad_groups_and_output_padding():
    with pytest.raises(ValueError, match="groups=3 must be a positive int dividing"):
        nn.Conv1d.init(jax.random.key(0), 4, 4, 3, groups=3)
    with pytest.raises(ValueError, match="output_padding"):
        nn.ConvTranspose1d.init(jax.random.key(0), 2, 2, 3, stride=2, output_padding=2)
    with pytest.raises(ValueError, match="channels = 2"):
        _apply(nn.Conv3d.init(jax.random.key(0), 2, 2, 1), jnp.ones((1, 2, 2, 2, 3)))


# ---------------------------------------------------------------- pooling


def _pool_ref(x, window, stride, pad, op, count_include_pad=True):
    fill = -np.inf if op == "max" else 0.0
    xp = np.pad(x, ((0, 0), *[(p, p) for p in pad], (0, 0)), constant_values=fill)
    real = np.pad(np.ones(x.shape[1:-1]), [(p, p) for p in pad])
    n = len(window)
    out_sp = [(xp.shape[1 + i] - window[i]) // stride[i] + 1 for i in range(n)]
    y = np.zeros((x.shape[0], *out_sp, x.shape[-1]))
    for o in np.ndindex(*out_sp):
        sl = tuple(slice(o[i] * stride[i], o[i] * stride[i] + window[i]) for i in range(n))
        win = xp[(slice(None), *sl)]
        axes = tuple(range(1, n + 1))
        if op == "max":
            y[(slice(None), *o)] = win.max(axis=axes)
        else:
            count = math.prod(window) if count_include_pad else real[sl].sum()
            y[(slice(None), *o)] = win.sum(axis=axes) / count
    return y


def test_max_and_avg_pool_match_window_loops():
    x = _rand(0, (2, 5, 6, 3))
    xn = np.asarray(x)
    _close(F.max_pool(x, (2, 3), (2, 2), 1), _pool_ref(xn, (2, 3), (2, 2), (1, 1), "max"))
    _close(F.avg_pool(x, (3, 2), None, 1), _pool_ref(xn, (3, 2), (3, 2), (1, 1), "avg"))
    _close(
        F.avg_pool(x, (3, 3), (1, 2), 1, count_include_pad=False),
        _pool_ref(xn, (3, 3), (1, 2), (1, 1), "avg", count_include_pad=False),
    )
    x1 = _rand(1, (2, 7, 2))
    _close(F.max_pool(x1, (3,), (2,)), _pool_ref(np.asarray(x1), (3,), (2,), (0,), "max"))
    x3 = _rand(2, (1, 4, 4, 4, 2))
    _close(F.avg_pool(x3, (2, 2, 2)), _pool_ref(np.asarray(x3), (2, 2, 2), (2, 2, 2), (0, 0, 0), "avg"))


def test_adaptive_avg_pool_uses_pytorch_bins():
    x = _rand(3, (2, 7, 5, 3))
    xn = np.asarray(x)
    out = (3, 2)
    ref = np.zeros((2, *out, 3))
    for i in range(out[0]):
        h0, h1 = (i * 7) // out[0], math.ceil((i + 1) * 7 / out[0])
        for j in range(out[1]):
            w0, w1 = (j * 5) // out[1], math.ceil((j + 1) * 5 / out[1])
            ref[:, i, j] = xn[:, h0:h1, w0:w1].mean(axis=(1, 2))
    _close(F.adaptive_avg_pool(x, out), ref)
    _close(F.adaptive_avg_pool(x, 1), xn.mean(axis=(1, 2), keepdims=True))


def test_pool_rejects_bad_window():
    with pytest.raises(ValueError, match="rank 4"):
        F.max_pool(jnp.ones((2, 3, 4)), (2, 2))
    with pytest.raises(ValueError, match="padding must be one of"):
        F.avg_pool(jnp.ones((2, 4, 4, 1)), (2, 2), padding="FULL")


# ---------------------------------------------------------------- normalisation


def test_batch_norm_train_and_eval_follow_pytorch():
    p = _params(lambda: nn.BatchNorm.init(None, 3, momentum=0.2), 5)
    p = jax.tree.map(lambda a: a, p)
    p = type(p)(p.scale, p.bias, jnp.abs(p.mean), jnp.abs(p.var) + 0.5, 3, 1e-5, 0.2)
    x = _rand(6, (4, 5, 3))
    xn = np.asarray(x, np.float64).reshape(-1, 3)
    y, new = _apply(p, x, training=True)
    mean, var = xn.mean(0), xn.var(0)
    ref = (xn - mean) / np.sqrt(var + 1e-5) * np.asarray(p.scale) + np.asarray(p.bias)
    _close(y.reshape(-1, 3), ref)
    n = xn.shape[0]
    _close(new.mean, 0.8 * np.asarray(p.mean) + 0.2 * mean)
    _close(new.var, 0.8 * np.asarray(p.var) + 0.2 * var * n / (n - 1))
    y_eval = _apply(new, x)
    ref_eval = (xn - np.asarray(new.mean)) / np.sqrt(np.asarray(new.var) + 1e-5) * np.asarray(p.scale)
    _close(y_eval.reshape(-1, 3), ref_eval + np.asarray(p.bias))
    plain = nn.BatchNorm.init(None, 3, affine=False)
    assert plain.scale is None and plain.bias is None
    with pytest.raises(ValueError, match="more than one value per channel"):
        _apply(plain, jnp.ones((1, 3)), training=True)


def test_group_and_instance_norm_match_formula():
    x = _rand(7, (2, 4, 3, 6))
    xn = np.asarray(x, np.float64)
    p = _params(lambda: nn.GroupNorm.init(None, 2, 6), 8)
    g = xn.reshape(2, 4, 3, 2, 3)
    mean = g.mean(axis=(1, 2, 4), keepdims=True)
    var = g.var(axis=(1, 2, 4), keepdims=True)
    ref = ((g - mean) / np.sqrt(var + 1e-5)).reshape(xn.shape) * np.asarray(p.scale) + np.asarray(p.bias)
    _close(_apply(p, x), ref)
    inst = nn.InstanceNorm.init(None, 6)
    m, v = xn.mean(axis=(1, 2), keepdims=True), xn.var(axis=(1, 2), keepdims=True)
    _close(_apply(inst, x), (xn - m) / np.sqrt(v + 1e-5))
    with pytest.raises(ValueError, match="divide num_channels"):
        nn.GroupNorm.init(None, 4, 6)


# ---------------------------------------------------------------- general linear maps


def test_einsum_dense_general_and_bilinear():
    key = jax.random.key(0)
    x = _rand(9, (2, 3, 4))
    xn = np.asarray(x, np.float64)
    e = _params(lambda: nn.Einsum.init(key, (4, 2, 5), "btd,dhk->bthk", bias_shape=(2, 5)), 10)
    _close(_apply(e, x), np.einsum("btd,dhk->bthk", xn, np.asarray(e.weight)) + np.asarray(e.bias))
    d = _params(lambda: nn.DenseGeneral.init(key, (3, 4), (2, 5), axis=(1, 2)), 11)
    ref = np.einsum("bij,ijkl->bkl", xn, np.asarray(d.weight)) + np.asarray(d.bias)
    _close(_apply(d, x), ref)
    d1 = _params(lambda: nn.DenseGeneral.init(key, 3, 2, axis=1), 12)
    _close(_apply(d1, x), np.einsum("bij,ik->bjk", xn, np.asarray(d1.weight)) + np.asarray(d1.bias))
    b = _params(lambda: nn.Bilinear.init(key, 4, 3, 2), 13)
    x2 = _rand(14, (2, 3, 3))
    w, bb = np.asarray(b.weight), np.asarray(b.bias)
    ref = np.zeros((2, 3, 2))
    for k in range(2):
        ref[..., k] = np.einsum("...i,ij,...j->...", xn, w[:, :, k], np.asarray(x2)) + bb[k]
    _close(_apply(b, x, x2), ref)
    with pytest.raises(ValueError, match="expected in_features"):
        _apply(d, _rand(0, (2, 4, 4)))
    with pytest.raises(ValueError, match="one weight letter per axis"):
        nn.Einsum.init(key, (4, 2), "btd,dhk->bthk")


# ---------------------------------------------------------------- attention


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def test_scaled_dot_product_attention_mask_bias_causal_gqa():
    q, k, v = _rand(15, (2, 4, 4, 3)), _rand(16, (2, 5, 2, 3)), _rand(17, (2, 5, 2, 2))
    mask = jnp.asarray(np.random.default_rng(0).random((2, 1, 4, 5)) > 0.3)
    bias = _rand(18, (1, 4, 4, 5))
    out, w = F.scaled_dot_product_attention(q, k, v, mask, bias, is_causal=True, return_weights=True)
    qn, kn, vn = (np.asarray(t, np.float64) for t in (q, k, v))
    ref = np.zeros((2, 4, 4, 2))
    for h in range(4):
        kv = h // 2
        logits = np.einsum("bqd,bkd->bqk", qn[:, :, h], kn[:, :, kv]) / math.sqrt(3) + np.asarray(bias)[:, h]
        allowed = np.asarray(mask)[:, 0] & (np.arange(5)[None, :] <= np.arange(4)[:, None])[None]
        logits = np.where(allowed, logits, -1e30)
        probs = _softmax(logits)
        _close(w[:, h], probs)
        ref[:, :, h] = np.einsum("bqk,bkd->bqd", probs, vn[:, :, kv])
    _close(out, ref)


def test_sdpa_dropout_drops_weights_at_the_rate():
    q = k = v = jnp.ones((1, 64, 1, 4))
    out, w = F.scaled_dot_product_attention(
        q, k, v, dropout_rate=0.25, key=jax.random.key(3), return_weights=True
    )
    dropped = float(jnp.mean(w == 0.0))
    assert abs(dropped - 0.25) < 0.03  # 4096 draws: sigma 0.007
    _close(w[w != 0], np.full(int(jnp.sum(w != 0)), 1 / 64 / 0.75))
    with pytest.raises(ValueError, match="needs key"):
        F.scaled_dot_product_attention(q, k, v, dropout_rate=0.1)


def test_multi_head_attention_cross_and_weights():
    p = _params(lambda: nn.MultiHeadAttention.init(jax.random.key(0), 6, 2, kdim=4, vdim=5), 19)
    query, key_in, value_in = _rand(20, (2, 3, 6)), _rand(21, (2, 4, 4)), _rand(22, (2, 4, 5))
    mask = jnp.asarray([[True, True, False, True], [True, False, True, True]])[:, None, None, :]
    y, w = _apply(p, query, key_in, value_in, mask=mask, need_weights=True)
    W = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    qh = (np.asarray(query) @ W.q.weight + W.q.bias).reshape(2, 3, 2, 3)
    kh = (np.asarray(key_in) @ W.k.weight + W.k.bias).reshape(2, 4, 2, 3)
    vh = (np.asarray(value_in) @ W.v.weight + W.v.bias).reshape(2, 4, 2, 3)
    logits = np.einsum("bqhd,bkhd->bhqk", qh, kh) / math.sqrt(3)
    probs = _softmax(np.where(np.asarray(mask), logits, -1e30))
    heads = np.einsum("bhqk,bkhd->bqhd", probs, vh).reshape(2, 3, 6)
    _close(y, heads @ W.o.weight + W.o.bias)
    _close(w, probs.mean(axis=1))
    _, per_head = _apply(p, query, key_in, value_in, mask=mask, need_weights=True, average_weights=False)
    _close(per_head, probs)


# ---------------------------------------------------------------- recurrent cells


def _sig(z):
    return 1 / (1 + np.exp(-z))


def test_recurrent_cells_follow_pytorch_equations():
    key = jax.random.key(0)
    x, h0 = _rand(23, (2, 3)), _rand(24, (2, 4))
    xn, hn = np.asarray(x, np.float64), np.asarray(h0, np.float64)

    def parts(cell, k):
        W = jax.tree.map(lambda a: np.asarray(a, np.float64), cell)
        a, b = xn @ W.ih.weight + W.ih.bias, hn @ W.hh.weight + W.hh.bias
        return np.split(a, k, -1), np.split(b, k, -1)

    rnn = _params(lambda: nn.SimpleRNNCell.init(key, 3, 4), 25)
    (a,), (b,) = parts(rnn, 1)
    _close(_apply(rnn, h0, x)[0], np.tanh(a + b))

    lstm = _params(lambda: nn.LSTMCell.init(key, 3, 4), 26)
    c0 = _rand(27, (2, 4))
    (ai, af, ag, ao), (bi, bf, bg, bo) = parts(lstm, 4)
    c1 = _sig(af + bf) * np.asarray(c0) + _sig(ai + bi) * np.tanh(ag + bg)
    (h1, c1_got), y = _apply(lstm, (h0, c0), x)
    _close(c1_got, c1)
    _close(h1, _sig(ao + bo) * np.tanh(c1))
    _close(y, h1)

    gru = _params(lambda: nn.GRUCell.init(key, 3, 4), 28)
    (ar, az, an), (br, bz, bn) = parts(gru, 3)
    r, z = _sig(ar + br), _sig(az + bz)
    n = np.tanh(an + r * bn)
    _close(_apply(gru, h0, x)[0], (1 - z) * n + z * hn)


def test_rnn_scan_equals_step_loop_and_reverse():
    cell = _params(lambda: nn.GRUCell.init(jax.random.key(0), 3, 4), 29)
    xs = _rand(30, (2, 5, 3))
    carry, ys = nn.rnn(cell, xs)
    h = cell.initialize_carry((2,))
    outs = []
    for t in range(5):
        h, y = _apply(cell, h, xs[:, t])
        outs.append(y)
    _close(ys, jnp.stack(outs, 1))
    _close(carry, h)
    carry_r, ys_r = nn.rnn(cell, xs, reverse=True)
    h = cell.initialize_carry((2,))
    for t in reversed(range(5)):
        h, y = _apply(cell, h, xs[:, t])
        _close(ys_r[:, t], y)
    _close(carry_r, h)
    tm_carry, tm = nn.rnn(cell, jnp.swapaxes(xs, 0, 1), time_major=True)
    _close(jnp.swapaxes(tm, 0, 1), ys)


# ---------------------------------------------------------------- functional


def test_activations_match_formulas():
    x = jnp.linspace(-3, 3, 13)
    xn = np.asarray(x, np.float64)
    erf = np.vectorize(math.erf)
    _close(F.gelu(x, approximate=False), xn * 0.5 * (1 + erf(xn / math.sqrt(2))))
    _close(F.mish(x), xn * np.tanh(np.log1p(np.exp(xn))))
    _close(F.prelu(x, 0.25), np.where(xn >= 0, xn, 0.25 * xn))
    _close(F.hard_sigmoid(x), np.clip(xn + 3, 0, 6) / 6)
    _close(F.hard_tanh(x), np.clip(xn, -1, 1))
    _close(F.soft_sign(x), xn / (1 + np.abs(xn)))
    _close(F.log_sigmoid(x), -np.log1p(np.exp(-xn)))
    _close(F.leaky_relu(x, 0.1), np.where(xn >= 0, xn, 0.1 * xn))
    _close(F.celu(x, 0.5), np.maximum(xn, 0) + np.minimum(0, 0.5 * (np.exp(xn / 0.5) - 1)))
    alpha, scale = 1.6732632423543772, 1.0507009873554805
    _close(F.selu(x), scale * np.where(xn > 0, xn, alpha * (np.exp(xn) - 1)))
    pair = _rand(31, (3, 4))
    a, b = np.split(np.asarray(pair), 2, -1)
    _close(F.glu(pair), a * _sig(b))
    _close(F.softmax(pair), _softmax(np.asarray(pair, np.float64)))


def test_linear_dropout_and_norm_functions():
    x, w, b = _rand(32, (2, 3)), _rand(33, (3, 4)), _rand(34, (4,))
    _close(F.linear(x, w, b), np.asarray(x) @ np.asarray(w) + np.asarray(b))
    with pytest.raises(ValueError, match="transpose a PyTorch-layout"):
        F.linear(x, w.T)
    assert F.dropout(x, 0.5, deterministic=True) is x
    y = F.dropout(jnp.ones((100, 100)), 0.5, jax.random.key(0))
    assert abs(float(jnp.mean(y == 0)) - 0.5) < 0.03
    xn = np.asarray(x, np.float64)
    _close(F.layer_norm(x), (xn - xn.mean(-1, keepdims=True)) / np.sqrt(xn.var(-1, keepdims=True) + 1e-5))
    _close(F.rms_norm(x, eps=1e-6), xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-6))


# ---------------------------------------------------------------- initializers


def test_initializer_statistics():
    key = jax.random.key(0)
    shape = (128, 256)
    fan_in, fan_out = shape
    w = sc.init.normal(0.5)(key, shape)
    assert abs(float(w.std()) - 0.5) < 0.01 and abs(float(w.mean())) < 0.01
    t = sc.init.truncated_normal(1.0, lower=-1.5, upper=1.5)(key, shape)
    assert float(jnp.abs(t).max()) <= 1.5
    u = sc.init.uniform(0.3)(key, shape)
    assert 0.0 <= float(u.min()) and float(u.max()) < 0.3 and abs(float(u.mean()) - 0.15) < 0.005
    xu = sc.init.xavier_uniform()(key, shape)
    limit = math.sqrt(6 / (fan_in + fan_out))
    assert float(jnp.abs(xu).max()) <= limit and abs(float(xu.std()) - limit / math.sqrt(3)) < 0.002
    xn = sc.init.xavier_normal()(key, shape)
    assert abs(float(xn.std()) - math.sqrt(2 / (fan_in + fan_out))) < 0.002
    kn = sc.init.kaiming_normal()(key, shape)
    assert abs(float(kn.std()) - math.sqrt(2 / fan_in)) < 0.003
    ku = sc.init.kaiming_uniform()(key, shape)
    assert float(jnp.abs(ku).max()) <= math.sqrt(6 / fan_in)
    o = sc.init.orthogonal()(key, (64, 32))
    _close(o.T @ o, np.eye(32), atol=1e-5)
    c = sc.init.constant(0.7)(key, (3,))
    _close(c, [0.7, 0.7, 0.7])
    assert float(sc.init.zeros(key, (2,)).sum()) == 0 and float(sc.init.ones(key, (2,)).sum()) == 2


def test_layers_take_initializers_and_compute_dtype():
    key = jax.random.key(0)
    lin = nn.Linear.init(
        key, 3, 2, w_init=sc.init.constant(0.5), b_init=sc.init.ones, compute_dtype=jnp.bfloat16
    )
    _close(lin.weight, np.full((3, 2), 0.5))
    _close(lin.bias, np.ones(2))
    y = _apply(lin, jnp.ones((1, 3)))
    assert y.dtype == jnp.bfloat16 and lin.weight.dtype == jnp.float32
    _close(y.astype(jnp.float32), [[2.5, 2.5]])
    conv = nn.Conv2d.init(key, 2, 3, 1, w_init=sc.init.ones, b_init=sc.init.constant(-1.0))
    _close(_apply(conv, jnp.ones((1, 2, 2, 2))), np.ones((1, 2, 2, 3)))
    emb = nn.Embed.init(key, 5, 2, w_init=sc.init.constant(3.0))
    _close(_apply(emb, jnp.array([1, 4])), np.full((2, 2), 3.0))
    ln = nn.LayerNorm.init(key, 4, w_init=sc.init.constant(2.0), b_init=sc.init.constant(1.0))
    _close(ln.scale, np.full(4, 2.0))
    _close(ln.bias, np.ones(4))
    with pytest.raises(TypeError, match="call it to get an initializer"):
        nn.Linear.init(key, 3, 2, w_init=sc.init.xavier_uniform)
    with pytest.raises(TypeError, match="must be an initializer"):
        nn.Linear.init(key, 3, 2, w_init="xavier")
    with pytest.raises(ValueError, match="need a key"):
        nn.RMSNorm.init(None, 4, w_init=sc.init.ones)


def test_new_layers_declare_logical_axes_for_param_specs():
    key = jax.random.key(0)
    rules = sc.sharding.Rules.default()
    P = jax.sharding.PartitionSpec
    conv = jax.eval_shape(lambda: nn.Conv3d.init(key, 4, 8, 2, axes=(None, "MLP")))
    specs = sc.sharding.param_specs(conv, rules)
    assert specs.weight == P(None, None, None, None, "tp") and specs.bias == P("tp")
    dg = jax.eval_shape(lambda: nn.DenseGeneral.init(key, 8, (2, 4), axes=("EMBED", "HEAD", None)))
    assert sc.sharding.param_specs(dg, rules).weight == P("fsdp", "tp", None)
    mha = jax.eval_shape(lambda: nn.MultiHeadAttention.init(key, 8, 2))
    specs = sc.sharding.param_specs(mha, rules)
    assert specs.q.weight == P("fsdp", "tp") and specs.o.weight == P("tp", "fsdp")
    bn = jax.eval_shape(lambda: nn.BatchNorm.init(None, 4))
    assert sc.sharding.param_specs(bn, rules).mean == P(None)
    gru = jax.eval_shape(lambda: nn.GRUCell.init(key, 3, 4))
    assert sc.sharding.param_specs(gru, rules).ih.weight == P(None, None)
