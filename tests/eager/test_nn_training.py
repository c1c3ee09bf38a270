"""Eager layers against the core layers, training loops, optimizer and inspection."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spectrax_core as sc
import spectrax_eager as spx


def same(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "make, x",
    [
        (lambda r: spx.nn.Linear(4, 3, rngs=r), jnp.ones((2, 4))),
        (lambda r: spx.nn.LayerNorm(4), jnp.arange(8.0).reshape(2, 4)),
        (lambda r: spx.nn.RMSNorm(4), jnp.arange(8.0).reshape(2, 4)),
        (lambda r: spx.nn.Embed(10, 4, rngs=r), jnp.array([[1, 2, 9]])),
        (lambda r: spx.nn.MLP(4, 8, rngs=r), jnp.ones((2, 4))),
        (lambda r: spx.nn.GatedMLP(4, 8, rngs=r), jnp.ones((2, 4))),
        (
            lambda r: spx.nn.Attention(8, 2, n_kv_heads=1, rope=True, rngs=r),
            jnp.linspace(0, 1, 48).reshape(2, 3, 8),
        ),
        (
            lambda r: spx.nn.Block(8, 2, 16, norm="rms", gated=True, rngs=r),
            jnp.linspace(0, 1, 48).reshape(2, 3, 8),
        ),
        (lambda r: spx.nn.Conv1d(2, 3, 3, rngs=r), jnp.linspace(0, 1, 20).reshape(2, 5, 2)),
        (lambda r: spx.nn.Conv2d(2, 3, (3, 3), rngs=r), jnp.linspace(0, 1, 64).reshape(2, 4, 4, 2)),
    ],
)
def test_eager_layer_equals_core_layer(make, x):
    layer = make(spx.Rngs(0))
    core = layer.core_params()
    assert isinstance(core, layer.core_cls)
    same(layer(x), sc.apply(core, x))
    same(spx.jit(lambda m, x: m(x))(layer, x), sc.apply(core, x))
    # the eager init is the core init with the stream's first key
    if not isinstance(layer, spx.nn.LayerNorm | spx.nn.RMSNorm):
        key = jax.random.fold_in(jax.random.key(0), 0)
        ref = jax.tree.leaves(make_core(layer, key))
        for a, b in zip(jax.tree.leaves(core), ref):
            np.testing.assert_array_equal(a, b)


def make_core(layer, key):
    statics = {
        spx.nn.Linear: lambda: sc.nn.Linear.init(key, 4, 3),
        spx.nn.Embed: lambda: sc.nn.Embed.init(key, 10, 4),
        spx.nn.MLP: lambda: sc.nn.MLP.init(key, 4, 8),
        spx.nn.GatedMLP: lambda: sc.nn.GatedMLP.init(key, 4, 8),
        spx.nn.Attention: lambda: sc.nn.Attention.init(key, 8, 2, n_kv_heads=1, rope=True),
        spx.nn.Block: lambda: sc.nn.Block.init(key, 8, 2, 16, norm="rms", gated=True),
        spx.nn.Conv1d: lambda: sc.nn.Conv1d.init(key, 2, 3, 3),
        spx.nn.Conv2d: lambda: sc.nn.Conv2d.init(key, 2, 3, (3, 3)),
    }
    return statics[type(layer)]()


def test_embed_attend_and_dropout_match_core():
    r = spx.Rngs(0, dropout=5)
    emb = spx.nn.Embed(10, 4, rngs=r)
    h = jnp.ones((2, 4))
    same(emb.attend(h), sc.nn.attend(emb.core_params(), h))
    drop = spx.nn.Dropout(0.5, rngs=r)
    key = jax.random.fold_in(jax.random.key(5), 0)
    same(drop(jnp.ones((16,))), sc.apply(sc.nn.Dropout.init(None, 0.5), jnp.ones((16,)), key=key))


def test_lazy_linear_and_containers():
    r = spx.Rngs(0)
    model = spx.nn.Sequential(
        spx.nn.Linear(None, 8, rngs=r), spx.nn.ModuleList([spx.nn.Linear(8, 2, rngs=r)])[0]
    )
    x = jnp.ones((3, 5))
    with pytest.raises(spx.StructureChangeError, match="lazy"):
        spx.jit(lambda m, x: m(x))(model, x)
    y = model(x)
    assert model[0].d_in == 5 and model[0].weight.shape == (5, 8) and y.shape == (3, 2)
    same(spx.jit(lambda m, x: m(x))(model, x), y)
    d = spx.nn.ModuleDict({"a": spx.nn.LayerNorm(2)})
    assert d.keys() == ["a"] and isinstance(d["a"], spx.nn.LayerNorm) and len(d) == 1
    pipe = spx.nn.PipelineSequential(spx.nn.Linear(5, 4, rngs=r), spx.nn.Linear(4, 2, rngs=r))
    same(pipe(x), pipe.stages[1](pipe.stages[0](x)))
    assert [p for p, _ in spx.iter_variables(pipe)][:2] == ["0.weight", "0.bias"]


def test_inspection():
    r = spx.Rngs(0)
    model = spx.nn.Sequential(spx.nn.Linear(4, 8, rngs=r), spx.nn.LayerNorm(8), spx.nn.Linear(8, 2, rngs=r))
    assert spx.count_parameters(model) == 4 * 8 + 8 + 16 + 8 * 2 + 2
    assert spx.count_bytes(model) == 4 * spx.count_parameters(model)
    table = spx.summary(model, jnp.ones((3, 4)))
    assert "0      | Linear     | float32[3,8]" in table and "total: 74 parameters" in table
    assert "Linear(d_in=4, d_out=8" in repr(model)


class Regressor(spx.Module):
    def __init__(self, rngs):
        self.l1 = spx.nn.Linear(2, 16, rngs=rngs)
        self.l2 = spx.nn.Linear(16, 1, rngs=rngs)

    def forward(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


X = jax.random.uniform(jax.random.key(1), (64, 2), minval=-1, maxval=1)
Y = (X[:, :1] * X[:, 1:]) + 0.5 * X[:, :1]


def mse(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


def test_train_with_jit_value_and_grad_update():
    model = Regressor(spx.Rngs(0))

    @spx.jit(mutable="parameters")
    def step(m, x, y):
        loss, g = spx.value_and_grad(mse)(m, x, y)
        params = spx.tree_state(m).filter("parameters")
        spx.update(m, jax.tree.map(lambda p, d: p - 0.2 * d, params, g))
        return loss

    first = float(step(model, X, Y))
    for _ in range(300):
        loss = float(step(model, X, Y))
    assert loss < 0.01 < first


def test_train_with_optimizer_adamw():
    model = Regressor(spx.Rngs(0))
    opt = spx.Optimizer(model, optax.adamw(0.02), wrt="parameters")

    @spx.jit(mutable=("parameters", "opt_state"))
    def step(m, opt, x, y):
        loss, g = spx.value_and_grad(mse)(m, x, y)
        opt.update(m, g)
        return loss

    first = float(step(model, opt, X, Y))
    for _ in range(200):
        loss = float(step(model, opt, X, Y))
    assert loss < 0.005 < first
    assert int(opt.step.value) == 201
    with pytest.raises(ValueError, match="grads must be the State"):
        opt.update(model, spx.grad(mse, wrt="*.weight")(model, X, Y))
