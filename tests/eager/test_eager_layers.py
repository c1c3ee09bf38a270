"""Eager layers of `spx.nn`: PyTorch-shaped layers against their documented formulas (written
here with numpy), constructor keywords, BatchNorm statistics under `spx.jit`, containers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spectrax_core as sc
import spectrax_eager as spx


def _rand(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _np(v):
    return np.asarray(v.value if isinstance(v, spx.Variable) else v, np.float64)


def _close(a, b, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(_np(a), _np(b), rtol=rtol, atol=atol)


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


# ---------------------------------------------------------------- parameter-free layers


def test_activation_and_identity_modules():
    x = jnp.linspace(-3, 3, 7)
    xn = np.asarray(x, np.float64)
    erf = np.vectorize(math.erf)
    _close(spx.nn.ReLU()(x), np.maximum(xn, 0))
    _close(spx.nn.GELU()(x), xn * 0.5 * (1 + erf(xn / math.sqrt(2))))
    tanh_form = 0.5 * xn * (1 + np.tanh(math.sqrt(2 / math.pi) * (xn + 0.044715 * xn**3)))
    _close(spx.nn.GELU("tanh")(x), tanh_form)
    _close(spx.nn.SiLU()(x), xn / (1 + np.exp(-xn)))
    _close(spx.nn.Tanh()(x), np.tanh(xn))
    _close(spx.nn.Sigmoid()(x), 1 / (1 + np.exp(-xn)))
    assert spx.nn.Identity(3, foo=1)(x, "ignored") is x
    with pytest.raises(ValueError, match="approximate"):
        spx.nn.GELU("erf")


def test_pooling_modules_pytorch_defaults():
    x = _rand(0, (2, 4, 6, 3))
    xn = np.asarray(x, np.float64)
    # stride defaults to the kernel size
    _close(spx.nn.MaxPool2d(2)(x), xn.reshape(2, 2, 2, 3, 2, 3).max(axis=(2, 4)))
    _close(spx.nn.AvgPool2d((2, 3))(x), xn.reshape(2, 2, 2, 2, 3, 3).mean(axis=(2, 4)))
    x1 = _rand(1, (1, 5, 2))
    padded = np.pad(np.asarray(x1, np.float64), ((0, 0), (1, 1), (0, 0)))
    ref = np.stack([padded[:, i : i + 3].sum(1) / 3 for i in range(5)], 1)
    _close(spx.nn.AvgPool1d(3, stride=1, padding=1)(x1), ref)
    ref_excl = np.stack([padded[:, i : i + 3].sum(1) / min(i + 2, 3, 6 - i) for i in range(5)], 1)
    _close(spx.nn.AvgPool1d(3, 1, 1, count_include_pad=False)(x1), ref_excl)
    _close(spx.nn.AdaptiveAvgPool2d(1)(x), xn.mean(axis=(1, 2), keepdims=True))
    _close(spx.nn.AdaptiveAvgPool1d(2)(x1), np.stack([x1[:, :3].mean(1), x1[:, 2:].mean(1)], 1))
    x3 = _rand(2, (1, 2, 4, 4, 1))
    _close(spx.nn.MaxPool3d(2)(x3), np.asarray(x3).reshape(1, 1, 2, 2, 2, 2, 2, 1).max(axis=(2, 4, 6)))
    _close(spx.nn.MaxPool1d(2)(x1[:, :4]), np.asarray(x1[:, :4]).reshape(1, 2, 2, 2).max(2))
    assert spx.nn.AvgPool3d(2)(x3).shape == (1, 1, 2, 2, 1)
    with pytest.raises(ValueError, match="rank 4"):
        spx.nn.MaxPool2d(2)(x1)


# ---------------------------------------------------------------- normalisation


def test_batchnorm_running_statistics_train_eval_and_jit():
    bn = spx.nn.BatchNorm2d(3, momentum=0.5)
    x = _rand(3, (2, 3, 3, 3)) * 2 + 1
    xn = np.asarray(x, np.float64).reshape(-1, 3)
    y = bn(x)
    mean, var, n = xn.mean(0), xn.var(0), xn.shape[0]
    _close(y.reshape(-1, 3), (xn - mean) / np.sqrt(var + 1e-5))
    _close(bn.mean, 0.5 * mean)
    _close(bn.var, 0.5 + 0.5 * var * n / (n - 1))
    assert bn.mean.kind == "batch_stats" and isinstance(bn.mean, spx.nn.BatchStat)
    bn.eval()
    frozen = (_np(bn.mean), _np(bn.var))
    _close(bn(x).reshape(-1, 3), (xn - frozen[0]) / np.sqrt(frozen[1] + 1e-5))
    _close(bn.mean, frozen[0])
    bn.train()
    step = spx.jit(lambda m, x: m(x), mutable="batch_stats")
    step(bn, x)
    _close(bn.mean, 0.5 * frozen[0] + 0.5 * mean)
    with pytest.raises(spx.IllegalMutationError, match="batch_stats"):
        spx.jit(lambda m, x: m(x))(bn, x)
    with pytest.raises(ValueError, match="rank 2 or 3"):
        spx.nn.BatchNorm1d(3)(x)
    mirror = spx.nn.from_core(bn.core_params()).eval()
    assert mirror.mean.kind == "batch_stats"
    _close(mirror(x), bn.eval()(x))


def test_batchnorm_model_trains_with_mutable_batch_stats():
    class Net(spx.Module):
        def __init__(self, rngs):
            self.conv = spx.nn.Conv2d(2, 4, 3, padding=1, rngs=rngs)
            self.bn = spx.nn.BatchNorm2d(4)
            self.pool = spx.nn.AdaptiveAvgPool2d(1)
            self.head = spx.nn.Linear(4, 1, rngs=rngs)
            self.act = spx.nn.ReLU()

        def forward(self, x):
            h = self.pool(self.act(self.bn(self.conv(x))))
            return self.head(h.reshape(h.shape[0], -1))

    model = Net(spx.Rngs(0))
    opt = spx.Optimizer(model, optax.adam(0.05), wrt="parameters")
    x = _rand(4, (8, 4, 4, 2))
    y = jnp.sum(x, axis=(1, 2, 3))[:, None] * 0.1

    @spx.jit(mutable=("parameters", "opt_state", "batch_stats"))
    def step(model, opt, x, y):
        def loss_fn(m):
            return jnp.mean((m(x) - y) ** 2)

        loss, grads = spx.value_and_grad(loss_fn, mutable="batch_stats")(model)
        opt.update(model, grads)
        return loss

    before = _np(model.bn.mean)
    losses = [float(step(model, opt, x, y)) for _ in range(12)]
    assert losses[-1] < 0.5 * losses[0]
    assert not np.allclose(_np(model.bn.mean), before)
    model.eval()
    stats = _np(model.bn.var)
    spx.jit(lambda m, x: m(x))(model, x)  # eval: nothing written, so no mutable= needed
    _close(model.bn.var, stats)


def test_group_and_instance_norm_modules():
    x = _rand(5, (2, 3, 4))
    xn = np.asarray(x, np.float64)
    gn = spx.nn.GroupNorm(2, 4)
    g = xn.reshape(2, 3, 2, 2)
    ref = ((g - g.mean((1, 3), keepdims=True)) / np.sqrt(g.var((1, 3), keepdims=True) + 1e-5)).reshape(
        xn.shape
    )
    _close(gn(x), ref)
    inorm = spx.nn.InstanceNorm(4, affine=True)
    ref = (xn - xn.mean(1, keepdims=True)) / np.sqrt(xn.var(1, keepdims=True) + 1e-5)
    _close(inorm(x), ref)
    assert set(dict(spx.iter_variables(inorm))) == {"scale", "bias"}
    assert dict(spx.iter_variables(spx.nn.InstanceNorm(4))) == {}


# ---------------------------------------------------------------- attention


def _mha_ref(m, q_in, k_in, v_in, allowed=None, bias=None, causal=False):
    W = {n: (_np(getattr(m, n).weight), _np(getattr(m, n).bias)) for n in "qkvo"}
    h = m.num_heads
    d = m.embed_dim // h
    b, L, S = q_in.shape[0], q_in.shape[1], k_in.shape[1]
    q = (np.asarray(q_in) @ W["q"][0] + W["q"][1]).reshape(b, L, h, d)
    k = (np.asarray(k_in) @ W["k"][0] + W["k"][1]).reshape(b, S, h, d)
    v = (np.asarray(v_in) @ W["v"][0] + W["v"][1]).reshape(b, S, h, d)
    logits = np.einsum("blhd,bshd->bhls", q, k) / math.sqrt(d)
    if bias is not None:
        logits = logits + bias
    ok = np.ones(logits.shape, bool)
    if allowed is not None:
        ok &= allowed
    if causal:
        ok &= np.tril(np.ones((L, S), bool))
    probs = _softmax(np.where(ok, logits, -1e30))
    out = np.einsum("bhls,bshd->blhd", probs, v).reshape(b, L, h * d)
    return out @ W["o"][0] + W["o"][1], probs


def test_multihead_attention_pytorch_masks_and_layouts():
    m = spx.nn.MultiheadAttention(6, 2, kdim=4, vdim=5, rngs=spx.Rngs(0))
    q, k, v = _rand(6, (2, 3, 6)), _rand(7, (2, 4, 4)), _rand(8, (2, 4, 5))
    y, w = m(q, k, v, need_weights=True)
    ref, probs = _mha_ref(m, q, k, v)
    _close(y, ref)
    _close(w, probs.mean(1))
    _close(m(q, k, v), ref)  # without need_weights=True: the output alone
    _close(spx.nn.from_core(m.core_params())(q, k, v), ref)
    # boolean attn_mask: True = excluded; key_padding_mask: True = padding
    attn_mask = jnp.asarray(np.random.default_rng(1).random((3, 4)) > 0.6)
    pad = jnp.asarray([[False, False, True, False], [False, False, False, True]])
    y, w = m(
        q, k, v, key_padding_mask=pad, attn_mask=attn_mask, need_weights=True, average_attn_weights=False
    )
    allowed = ~np.asarray(attn_mask)[None, None] & ~np.asarray(pad)[:, None, None, :]
    ref, probs = _mha_ref(m, q, k, v, allowed=allowed)
    _close(y, ref)
    _close(w, probs)
    # float masks are added; a 3-d attn_mask is (batch * heads, L, S)
    float_mask = _rand(9, (4, 3, 4))
    y = m(q, k, v, attn_mask=float_mask, need_weights=False)
    _close(y, _mha_ref(m, q, k, v, bias=np.asarray(float_mask).reshape(2, 2, 3, 4))[0])
    # causal self-attention, sequence-first layout
    seq_first = spx.nn.MultiheadAttention(6, 3, batch_first=False, rngs=spx.Rngs(1))
    y = seq_first(jnp.swapaxes(q, 0, 1), is_causal=True)  # the query alone: the output alone
    _close(jnp.swapaxes(y, 0, 1), _mha_ref(seq_first, q, q, q, causal=True)[0])
    y, w = seq_first(jnp.swapaxes(q, 0, 1), need_weights=True, is_causal=True)
    _close(jnp.swapaxes(y, 0, 1), _mha_ref(seq_first, q, q, q, causal=True)[0])
    # the seed library's mask= (True = may attend) also gives the output alone
    self_attn = spx.nn.MultiheadAttention(6, 2, rngs=spx.Rngs(2))
    keep = jnp.asarray(np.random.default_rng(2).random((3, 3)) > 0.4) | jnp.eye(3, dtype=bool)
    _close(self_attn(q, mask=keep), _mha_ref(self_attn, q, q, q, allowed=np.asarray(keep))[0])


def test_causal_self_attention_and_dropout_modes():
    rngs = spx.Rngs(0)
    attn = spx.nn.CausalSelfAttention(8, 2, dropout=0.5, rngs=rngs)
    x = _rand(10, (2, 5, 8))
    attn.eval()
    _close(attn(x), _mha_ref(attn, x, x, x, causal=True)[0])
    attn.train()
    count = int(rngs.default.count.value)
    y1, y2 = attn(x), attn(x)
    assert int(rngs.default.count.value) == count + 2
    assert not np.allclose(y1, y2)
    assert float(jnp.mean(y1 == 0)) > 0.3  # the output dropout zeroes about half
    attn.rngs = None
    with pytest.raises(ValueError, match="needs rngs"):
        attn(x)


def test_mlp_block_is_mlp_then_dropout():
    blk = spx.nn.MLPBlock(4, 8, activation="relu", dropout=0.5, rngs=spx.Rngs(0))
    x = _rand(11, (3, 4))
    h = np.maximum(np.asarray(x) @ _np(blk.up.weight) + _np(blk.up.bias), 0)
    ref = h @ _np(blk.down.weight) + _np(blk.down.bias)
    _close(blk.eval()(x), ref)
    y = blk.train()(x)
    kept = np.asarray(y) != 0
    _close(np.asarray(y)[kept], 2 * ref[kept])


# ---------------------------------------------------------------- convolutions, general maps, recurrent


def test_conv_and_general_layers_equal_their_core_params():
    r = spx.Rngs(0)
    cases = [
        (spx.nn.ConvTranspose1d(2, 3, 3, 2, 1, 1, rngs=r), (_rand(14, (1, 4, 2)),)),
        (spx.nn.Einsum((4, 2, 3), "btd,dhk->bthk", bias_shape=(2, 3), rngs=r), (_rand(17, (2, 3, 4)),)),
        (spx.nn.DenseGeneral((3, 4), 5, axis=(-2, -1), rngs=r), (_rand(18, (2, 3, 4)),)),
        (spx.nn.Bilinear(3, 2, 4, rngs=r), (_rand(19, (5, 3)), _rand(20, (5, 2)))),
    ]
    for layer, args in cases:
        _close(layer(*args), sc.apply(layer.core_params(), *args))
    conv_t = cases[0][0]
    assert conv_t(cases[0][1][0]).shape == (1, (4 - 1) * 2 - 2 + 2 + 1 + 1, 3)
    bil, (x1, x2) = cases[-1]
    ref = np.einsum("ni,ijk,nj->nk", np.asarray(x1), _np(bil.weight), np.asarray(x2)) + _np(bil.bias)
    _close(bil(x1, x2), ref)


def test_rnn_wrapper_runs_the_cell_over_time():
    cell = spx.nn.LSTMCell(3, 4, rngs=spx.Rngs(0))
    xs = _rand(21, (2, 3, 3))
    carry = cell.initialize_carry((2,))
    outs = []
    for t in range(3):
        carry, y = cell(carry, xs[:, t])
        outs.append(y)
    rnn = spx.nn.RNN(cell, return_carry=True)
    (h, c), ys = rnn(xs)
    _close(ys, jnp.stack(outs, 1))
    _close(h, carry[0])
    _close(c, carry[1])
    time_major = spx.nn.RNN(cell, time_major=True)
    _close(time_major(jnp.swapaxes(xs, 0, 1)), jnp.swapaxes(ys, 0, 1))
    gru = spx.nn.GRUCell(3, 4, b_init=spx.init.normal(0.5), rngs=spx.Rngs(1))
    xr, xz, xn = np.split(np.asarray(xs[:, 0]) @ _np(gru.ih.weight) + _np(gru.ih.bias), 3, -1)
    hr, hz, hn = np.split(_np(gru.hh.bias)[None], 3, -1)  # h = 0: only the recurrent bias remains
    r, z = 1 / (1 + np.exp(-(xr + hr))), 1 / (1 + np.exp(-(xz + hz)))
    _close(gru(jnp.zeros((2, 4)), xs[:, 0])[0], (1 - z) * np.tanh(xn + r * hn))
    simple = spx.nn.SimpleRNNCell(3, 4, activation="relu", rngs=spx.Rngs(2))
    h, y = simple(jnp.zeros((2, 4)), xs[:, 0])
    _close(
        h,
        np.maximum(
            np.asarray(xs[:, 0]) @ _np(simple.ih.weight) + _np(simple.ih.bias) + _np(simple.hh.bias), 0
        ),
    )
    with pytest.raises(TypeError, match="cell must be"):
        spx.nn.RNN(spx.nn.Linear(3, 4, rngs=spx.Rngs(0)))


# ---------------------------------------------------------------- constructor keywords


def test_constructor_keywords_init_dtypes_bias():
    r = spx.Rngs(0)
    lin = spx.nn.Linear(3, 2, w_init=spx.init.constant(0.5), b_init=spx.init.ones, rngs=r)
    _close(lin.weight, np.full((3, 2), 0.5))
    _close(lin.bias, np.ones(2))
    half = spx.nn.Linear(3, 2, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=r)
    assert half.weight.dtype == jnp.float32 and half(jnp.ones((1, 3))).dtype == jnp.bfloat16
    stored = spx.nn.Linear(3, 2, param_dtype=jnp.bfloat16, use_bias=False, rngs=r)
    assert stored.weight.dtype == jnp.bfloat16 and stored.bias is None
    xavier = spx.nn.Linear(20, 30, w_init=jax.nn.initializers.glorot_uniform(), rngs=r)
    assert float(jnp.abs(xavier.weight.value).max()) <= math.sqrt(6 / 50)
    conv = spx.nn.Conv2d(
        2, 3, 3, padding="SAME", w_init=spx.init.zeros, b_init=spx.init.constant(2.0), rngs=r
    )
    _close(conv(jnp.ones((1, 4, 4, 2))), np.full((1, 4, 4, 3), 2.0))
    emb = spx.nn.Embed(5, 4, w_init=spx.init.normal(0.02), param_dtype=jnp.bfloat16, rngs=r)
    assert emb.table.dtype == jnp.bfloat16 and float(jnp.abs(emb.table.value).max()) < 0.2
    ln = spx.nn.LayerNorm(4, w_init=spx.init.constant(3.0), rngs=r)
    _close(ln.scale, np.full(4, 3.0))
    mha = spx.nn.MultiheadAttention(4, 2, use_bias=False, w_init=spx.init.orthogonal(), rngs=r)
    assert mha.q.bias is None
    _close(mha.q.weight.value @ mha.q.weight.value.T, np.eye(4), atol=1e-5)
    mlp = spx.nn.GatedMLP(4, 8, dtype=jnp.bfloat16, w_init=spx.init.normal(0.1), rngs=r)
    assert mlp(jnp.ones((1, 4))).dtype == jnp.bfloat16 and mlp.gate.weight.dtype == jnp.float32
    bn = spx.nn.BatchNorm1d(3, w_init=spx.init.constant(2.0), rngs=r)
    _close(bn.scale, np.full(3, 2.0))
    with pytest.raises(TypeError, match="call it to get an initializer"):
        spx.nn.Linear(3, 2, w_init=spx.init.kaiming_normal, rngs=r)
    with pytest.raises(TypeError, match="rngs"):
        spx.nn.LayerNorm(4, w_init=spx.init.ones)


def test_sharding_keyword_names_axes_and_places_weights():
    r = spx.Rngs(0)
    lin = spx.nn.Linear(8, 16, sharding=("EMBED", "MLP"), rngs=r)
    assert lin.weight.axes == ("EMBED", "MLP") and lin.bias.axes == ("MLP",)
    assert spx.nn.Linear(8, 4, sharding=spx.sharding.Replicated, rngs=r).weight.axes == (None, None)
    typo = spx.nn.Linear(8, 16, sharding=("EMBD", "MLP"), rngs=r)  # names are metadata until placed
    assert typo.weight.axes == ("EMBD", "MLP")
    with pytest.raises(ValueError, match="names 1 axes but the array has 2"):
        spx.nn.Linear(8, 16, sharding=("EMBED",), rngs=r)
    with pytest.raises(TypeError, match="one logical axis name"):
        spx.nn.Linear(8, 16, sharding="EMBED", rngs=r)
    mesh = jax.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    with spx.sharding.logical_axis_rules([]), jax.set_mesh(mesh):  # a mesh and rules: typos are caught
        with pytest.raises(ValueError, match="unknown logical axis token 'EMBD'"):
            spx.nn.Linear(8, 16, sharding=("EMBD", "MLP"), rngs=r)
    rules = sc.sharding.Rules.default()
    with jax.set_mesh(mesh):
        col = spx.nn.Linear(8, 16, sharding=spx.sharding.ColumnWise, rngs=r)
        emb = spx.nn.Embed(32, 8, sharding=("VOCAB", "EMBED"), rngs=r)
        conv = spx.nn.Conv1d(4, 8, 3, sharding=(None, "MLP"), rngs=r)
    for var, axes in (
        (col.weight, ("EMBED", "MLP")),
        (emb.table, ("VOCAB", "EMBED")),
        (conv.weight, (None, None, "MLP")),
    ):
        expected = sc.sharding.spec(axes, rules, mesh=mesh, shape=var.shape)
        assert var.value.sharding.spec == expected and expected != jax.sharding.PartitionSpec()
    with spx.sharding.logical_axis_rules({"MLP": None}), jax.set_mesh(mesh):
        replicated = spx.nn.Linear(8, 16, sharding=("EMBED", "MLP"), rngs=r)
    assert replicated.weight.value.sharding.spec == jax.sharding.PartitionSpec("fsdp", None)


# ---------------------------------------------------------------- containers


def test_parameter_list():
    pl = spx.nn.ParameterList([jnp.ones(2), spx.Parameter(jnp.zeros(3))])
    pl.append(jnp.full((1,), 4.0))
    assert len(pl) == 3 and [p.shape for p in pl] == [(2,), (3,), (1,)]
    assert [path for path, _ in spx.iter_variables(pl)] == ["0", "1", "2"]
    _close(pl[-1], [4.0])
    grads = spx.grad(lambda m: sum(jnp.sum(p.value * 2) for p in m))(pl)
    _close(grads["parameters"]["1"], np.full(3, 2.0))
    with pytest.raises(TypeError, match="array or an spx.Variable"):
        pl.append([1.0])


class _Layer(spx.Module):
    def __init__(self, rngs, rate=0.0):
        self.lin = spx.nn.Linear(4, 4, rngs=rngs)
        self.norm = spx.nn.LayerNorm(4)
        self.drop = spx.nn.Dropout(rate, rngs=rngs)

    def forward(self, x, scale=1.0):
        return x + scale * self.drop(jnp.tanh(self.lin(self.norm(x))))


def test_stacked_module_list_equals_the_loop():
    rngs = spx.Rngs(0)
    blocks = [_Layer(rngs) for _ in range(3)]
    copies = [spx.clone(b) for b in blocks]
    stack = spx.nn.StackedModuleList(blocks)
    assert len(stack) == 3 and stack.layers.lin.weight.shape == (3, 4, 4)
    assert stack.layers.lin.weight.axes == (None, "EMBED", "MLP")
    x = _rand(22, (2, 4))
    ref = x
    for c in copies:
        ref = c(ref, scale=0.5)
    _close(stack(x, scale=0.5), ref)
    _close(spx.jit(lambda s, x: s(x, scale=0.5))(stack, x), ref)
    _close(stack[1].lin.weight, copies[1].lin.weight)
    grads = spx.grad(lambda s: jnp.sum(s(x)))(stack)
    assert grads["parameters"]["layers.lin.weight"].shape == (3, 4, 4)
    with pytest.raises(ValueError, match="differs in structure"):
        spx.nn.StackedModuleList([_Layer(rngs), spx.nn.Linear(4, 4, rngs=rngs)])


def test_stacked_module_list_carries_shared_rng_streams():
    rngs = spx.Rngs(0)
    stack = spx.nn.StackedModuleList([_Layer(rngs, rate=0.5) for _ in range(4)])
    assert "drop.rngs.default.count" not in stack.stacked_paths
    before = int(rngs.default.count.value)
    x = _rand(23, (8, 4))
    y1 = stack(x)
    assert int(rngs.default.count.value) == before + 4  # one dropout key per layer
    y2 = spx.jit(lambda s, x: s(x))(stack, x)
    assert int(rngs.default.count.value) == before + 8
    assert not np.allclose(y1, y2)
    stack.eval()
    _close(stack(x), spx.jit(lambda s, x: s(x))(stack, x))
    assert int(rngs.default.count.value) == before + 8


def test_stacked_module_list_refuses_writes_to_stacked_state():
    stack = spx.nn.StackedModuleList([spx.nn.BatchNorm1d(4) for _ in range(2)])
    with pytest.raises(ValueError, match="read-only inside the scan"):
        stack(jnp.ones((3, 4)))


def test_layers_built_inside_a_seed_block_draw_from_it():
    with spx.seed(3):
        a = spx.nn.Linear(4, 5)
        a2 = spx.nn.Linear(4, 5)
    with spx.seed(3):
        b = spx.nn.Linear(4, 5)
    explicit = spx.nn.Linear(4, 5, rngs=spx.Rngs(3))
    leaves = lambda m: jax.tree.leaves(spx.export(m)[1])  # noqa: E731
    for x, y in zip(leaves(a), leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(leaves(a), leaves(explicit)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    weight = lambda m: next(np.asarray(x) for x in leaves(m) if x.ndim == 2)  # noqa: E731
    assert not np.array_equal(weight(a), weight(a2))  # the block's stream moves on
    with pytest.raises(TypeError, match="spx.seed"):
        spx.nn.Linear(4, 5)
