"""Calls written for the seed library's API: optimizers on States, layer keywords and attributes,
`nn.LoRA`, initializers, functional spellings, loop and transform call forms."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spectrax_eager as spx
from spectrax_eager import nn


class Net(spx.Module):
    def __init__(self, rngs):
        self.fc1 = nn.Linear(4, 8, rngs=rngs)
        self.fc2 = nn.Linear(8, 2, rngs=rngs)

    def forward(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


X = jnp.linspace(-1, 1, 12).reshape(3, 4)


def loss(model, x):
    return jnp.sum(model(x) ** 2)


def _params(model):
    return {p: np.asarray(v) for _, p, v in spx.tree_state(model).filter("parameters").items()}


def test_optimizer_update_on_a_state_returns_new_params_and_optimizer():
    model = Net(spx.Rngs(0))
    before = _params(model)
    grads = spx.grad(loss)(model, X)
    opt = spx.contrib.Optimizer.create(model, optax.sgd(0.1))
    new_params, new_opt = opt.update(spx.tree_state(model).filter("parameters"), grads)
    g = {p: np.asarray(v) for _, p, v in grads.items()}
    for _, p, v in new_params.items():  # sgd: p - 0.1 g, computed here independently
        np.testing.assert_allclose(v, before[p] - 0.1 * g[p], rtol=1e-6)
    assert int(new_opt.step.value) == 1 and int(opt.step.value) == 0
    for p, v in _params(model).items():  # nothing changed in place
        np.testing.assert_array_equal(v, before[p])
    in_place = spx.clone(model)
    opt.apply_eager(in_place, grads)  # the in-place form gives the same values
    for p, v in _params(in_place).items():
        np.testing.assert_allclose(v, new_params.get("parameters", p), rtol=1e-6)

    @spx.jit(mutable="parameters")
    def step(model, opt, x):
        value, grads = spx.value_and_grad(loss)(model, x)
        params, opt = opt.update(spx.tree_state(model).filter("parameters"), grads)
        spx.update(model, params)
        return value, opt

    adam = spx.Optimizer(model, optax.adam(1e-2))
    reference = optax.adam(1e-2)
    state = reference.init(before)
    for _ in range(2):
        g = {p: np.asarray(v) for _, p, v in spx.grad(loss)(model, X).items()}
        updates, state = reference.update(g, state, _params(model))
        want = optax.apply_updates(_params(model), updates)
        _, adam = step(model, adam, X)
        for p, v in _params(model).items():
            np.testing.assert_allclose(v, want[p], rtol=1e-5, atol=1e-7)
    assert int(adam.step.value) == 2


def test_multi_optimizer_create_and_functional_update():
    model = Net(spx.Rngs(1))
    before = _params(model)
    opt = spx.MultiOptimizer.create(model, {"fc1.*": optax.sgd(0.1), "fc2.*": optax.sgd(0.01)})
    grads = spx.grad(loss, wrt=opt.wrt)(model, X)
    new_params, _ = opt.update(spx.tree_state(model).filter("parameters"), grads)
    for _, p, g in grads.items():
        lr = 0.1 if p.startswith("fc1") else 0.01
        np.testing.assert_allclose(new_params.get("parameters", p), before[p] - lr * np.asarray(g), rtol=1e-6)


def test_layer_keywords_and_attributes():
    r = spx.Rngs(0)
    lin = nn.Linear(in_features=4, out_features=8, rngs=r)
    assert (lin.in_features, lin.out_features, lin.use_bias) == (4, 8, True)
    mlp = nn.MLPBlock(features=4, hidden_features=8, rngs=r)
    assert (mlp.fc1.in_features, mlp.fc1.out_features, mlp.fc2.out_features) == (4, 8, 4)
    assert nn.MLPBlock(4, rngs=r).hidden_features == 16
    with pytest.raises(ValueError, match="out_features=3"):
        nn.MLPBlock(4, 8, out_features=3, rngs=r)
    emb = nn.Embed(num_embeddings=10, features=4, rngs=r)
    assert emb.num_embeddings == 10 and emb.weight is emb.table
    assert nn.Conv2d(in_channels=3, out_channels=5, kernel_size=3, rngs=r).in_channels == 3
    assert type(nn.Conv(3, 5, (3, 3), rngs=r)) is nn.Conv2d and type(nn.Conv(3, 5, 3, rngs=r)) is nn.Conv1d
    assert nn.Conv2d(3, 5, 3, rngs=r)(jnp.ones((1, 6, 6, 3))).shape == (1, 4, 4, 5)  # VALID by default
    attn = nn.MultiheadAttention(8, 2, rngs=r)
    assert attn.q_proj is attn.q and attn.out_proj is attn.o
    ln = nn.LayerNorm(features=4, elementwise_affine=False)
    x = jnp.arange(8.0).reshape(2, 4)
    assert spx.count_parameters(ln) == 0 and isinstance(ln.scale, spx.Buffer)
    np.testing.assert_allclose(
        ln(x), (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)
    )
    assert spx.count_parameters(nn.LayerNorm(4, use_bias=False)) == 4
    assert list(nn.ModuleList(items=[lin]))[0] is lin


def test_lora_is_the_injected_adapter_class():
    model = Net(spx.Rngs(0))
    want = model(X)
    nn.inject_lora(model, rank=2, rngs=spx.Rngs(1))
    assert isinstance(model.fc1, nn.LoRA) and isinstance(model.fc1, nn.LoRALinear)
    np.testing.assert_allclose(model(X), want, rtol=1e-6)  # b starts at zero
    base = nn.Linear(4, 3, rngs=spx.Rngs(2))
    lora = nn.LoRA(4, 2, 3, base_module=base, b_init=spx.init.constant(1.0), rngs=spx.Rngs(3))
    a, b = np.asarray(lora.a.value), np.asarray(lora.b.value)
    np.testing.assert_allclose(lora(X), np.asarray(base(X)) + (np.asarray(X) @ a @ b), rtol=1e-5)
    merged = nn.merge_lora(model)
    assert type(merged.fc1) is nn.Linear


def _stats(x):
    x = np.asarray(x)
    return float(x.mean()), float(x.std()), float(x.min()), float(x.max())


def test_init_factories_follow_their_formulas():
    key, shape = jax.random.key(0), (400, 300)
    mean, std, _, _ = _stats(spx.init.normal(2.0, 1.0)(key, shape))
    assert abs(mean - 1.0) < 0.02 and abs(std - 2.0) < 0.02
    _, _, lo, hi = _stats(spx.init.uniform(0.5)(key, shape))
    assert -0.5 <= lo < -0.49 and 0.49 < hi <= 0.5
    for init, want in (
        (spx.init.kaiming_normal(), math.sqrt(2 / 400)),
        (spx.init.kaiming_normal("tanh", mode="fan_out"), 5 / 3 / math.sqrt(300)),
        (spx.init.xavier_normal(2.0), 2 * math.sqrt(2 / 700)),
        (spx.init.kaiming_uniform("linear"), 1 / math.sqrt(400)),
    ):
        assert abs(_stats(init(key, shape))[1] / want - 1) < 0.02
    with pytest.raises(TypeError, match="call it to get an initializer"):
        nn.Linear(3, 2, w_init=spx.init.xavier_uniform, rngs=spx.Rngs(0))


def test_functional_spellings():
    f = spx.functional
    x = jnp.linspace(-3, 3, 24).reshape(1, 4, 3, 2)
    erf = np.vectorize(math.erf)
    xn = np.asarray(x, np.float64)
    np.testing.assert_allclose(f.gelu(x), xn * 0.5 * (1 + erf(xn / math.sqrt(2))), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        f.layer_norm(x, axis=1), jnp.moveaxis(f.layer_norm(jnp.moveaxis(x, 1, -1)), -1, 1)
    )
    np.testing.assert_allclose(f.avg_pool(x, (2, 1), strides=(2, 1)), f.avg_pool(x, (2, 1), (2, 1)))
    np.testing.assert_allclose(f.pool(x, -jnp.inf, jax.lax.max, (2, 3)), f.max_pool(x, (2, 3)))
    w = jnp.ones((3, 3, 2, 5))
    assert f.conv(x, w).shape == (1, 2, 1, 5) and f.conv(x, w, padding="SAME").shape == (1, 4, 3, 5)
    a, b = f.promote_dtype(jnp.ones(2, jnp.bfloat16), jnp.ones(2, jnp.float32))
    assert a.dtype == b.dtype == jnp.float32


def test_loops_and_transforms_in_the_seed_call_forms():
    lin = nn.Linear(2, 2, rngs=spx.Rngs(0))
    carry = jnp.ones(2)
    want = carry
    for _ in range(3):
        want = want + lin(want)
    np.testing.assert_allclose(spx.fori_loop(0, 3, lambda i, m, c: c + m(c), lin, carry), want, rtol=1e-6)
    n, _ = spx.while_loop(lambda m, c: c[0] < 3, lambda m, c: (c[0] + 1, m(c[1])), lin, (0, carry))
    assert int(n) == 3
    model = Net(spx.Rngs(0))
    remat_net = spx.remat(Net)(spx.Rngs(0))
    g1 = spx.grad(loss)(model, X)
    g2 = spx.grad(loss)(remat_net, X)
    for (_, _, u), (_, _, v) in zip(g1.items(), g2.items()):
        np.testing.assert_allclose(u, v, rtol=1e-6)
    g3 = spx.grad(lambda x, m: loss(m, x), argnum=1)(X, model)
    np.testing.assert_allclose(
        g3.get("parameters", "fc1.weight"), g1.get("parameters", "fc1.weight"), rtol=1e-6
    )
    out, tangent, aux = spx.jvp(lambda x: (jnp.sin(x), 2.0), (X,), (jnp.ones_like(X),), has_aux=True)
    np.testing.assert_allclose(tangent, jnp.cos(X), rtol=1e-6)
    assert aux == 2.0
    scale = nn.Linear(1, 1, use_bias=False, w_init=spx.init.constant(2.0), rngs=spx.Rngs(0))
    prefix = spx.associative_scan(lambda m, a, b: jnp.maximum(a, b) * (m.weight.value[0, 0] / 2), scale, X[0])
    np.testing.assert_allclose(prefix, np.maximum.accumulate(np.asarray(X[0])))

    def writes(m, a, b):
        m.weight.value = m.weight.value + 1
        return a + b

    with pytest.raises(spx.IllegalMutationError, match="wrote"):
        spx.associative_scan(writes, scale, X[0])


def test_graph_helpers():
    model = Net(spx.Rngs(0))
    model.tied = model.fc1
    assert spx.check_unintentional_sharing(model) == [
        ("tied.weight", "fc1.weight"),
        ("tied.bias", "fc1.bias"),
    ]
    model.fc1.weight.set_metadata(tie_group="embed")
    assert spx.check_unintentional_sharing(model) == [("tied.bias", "fc1.bias")]
    dense = nn.DenseGeneral(5, rngs=spx.Rngs(3))  # contracted sizes read from the first call
    explicit = nn.DenseGeneral(5, in_shape=4, rngs=spx.Rngs(3))
    np.testing.assert_allclose(dense(X), explicit(X), rtol=1e-6)
    e1 = nn.Einsum("bd,dk->bk", (4, 3), rngs=spx.Rngs(4))
    e2 = nn.Einsum((4, 3), "bd,dk->bk", rngs=spx.Rngs(4))
    np.testing.assert_allclose(e1(X), e2(X))


def test_recurrent_additions_against_their_formulas():
    cell = nn.ConvLSTMCell(3, 4, 3, rngs=spx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 5, 3))
    h, c = jnp.zeros((2, 5, 5, 4)), jnp.full((2, 5, 5, 4), 0.5)
    (h2, c2), y = cell((h, c), x)
    z = jax.lax.conv_general_dilated(
        jnp.concatenate([x, h], -1),
        cell.weight.value,
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    i, f, g, o = np.split(np.asarray(z + cell.bias.value, np.float64), 4, -1)
    sig = lambda a: 1 / (1 + np.exp(-a))  # noqa: E731
    want_c = sig(f) * 0.5 + sig(i) * np.tanh(g)
    np.testing.assert_allclose(c2, want_c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, sig(o) * np.tanh(want_c), rtol=1e-5, atol=1e-6)
    fwd = nn.RNN(nn.GRUCell(3, 4, rngs=spx.Rngs(2)))
    bwd = nn.RNN(nn.GRUCell(3, 4, rngs=spx.Rngs(3)))
    xs = jax.random.normal(jax.random.key(4), (2, 6, 3))
    both = nn.Bidirectional(fwd, bwd)(xs)
    backward = jnp.flip(bwd(jnp.flip(xs, 1)), 1)  # the reverse pass, by reversing the sequence
    np.testing.assert_allclose(both, jnp.concatenate([fwd(xs), backward], -1), rtol=1e-5, atol=1e-6)


def test_vmap_state_axes_maps_chosen_collections():
    lin = nn.Linear(3, 2, rngs=spx.Rngs(0))
    w, b = np.asarray(lin.weight.value), np.asarray(lin.bias.value)
    lin.weight.value = jnp.stack([w, 2 * w])  # an ensemble of two along axis 0
    lin.bias.value = jnp.stack([b, 2 * b])
    x = jnp.ones((4, 3))
    out = spx.vmap(lambda m, x: m(x), in_axes=(spx.StateAxes({"parameters": 0}), None))(lin, x)
    np.testing.assert_allclose(out, np.stack([x @ w + b, x @ (2 * w) + 2 * b]), rtol=1e-6)
    with pytest.raises(TypeError, match="collection name"):
        spx.StateAxes({"parameters": "x"})
