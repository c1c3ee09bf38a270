"""Eager LoRA (collection "lora") and FP8 (collection "fp8_meta") over the core layers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spectrax_core as sc
import spectrax_eager as spx


class Net(spx.Module):
    def __init__(self, rngs):
        self.attn = spx.nn.Attention(8, 2, rngs=rngs)
        self.fc = spx.nn.Linear(8, 8, rngs=rngs)
        self.head = spx.nn.Linear(8, 3, rngs=rngs)

    def forward(self, x):
        return self.head(jnp.tanh(self.fc(self.attn(x))))


X = jax.random.normal(jax.random.key(1), (4, 3, 8))
Y = jax.random.normal(jax.random.key(2), (4, 3, 3))


def mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def test_wrap_lora_starts_as_base_and_only_lora_trains():
    base = spx.nn.Linear(8, 6, rngs=spx.Rngs(0))
    layer = spx.nn.wrap_lora(base, rank=2, alpha=4.0, rngs=spx.Rngs(1))
    assert layer.a.kind == "lora" and layer.b.kind == "lora" and layer.base is base
    x = X[0]
    np.testing.assert_array_equal(layer(x), base(x))
    grads = spx.grad(lambda m: jnp.sum(m(x) ** 2), wrt="lora")(layer)
    assert set(grads) == {"lora"} and set(grads["lora"]) == {"a", "b"}
    # d/db of sum((xW + s·xAb)^2) at b = 0 is s·(xA)^T 2(xW + bias)
    expected = 2.0 * (x @ layer.a.value).T @ (2.0 * base(x))
    np.testing.assert_allclose(grads["lora"]["b"], expected, rtol=1e-5, atol=1e-5)


def test_inject_train_merge():
    model = Net(spx.Rngs(0))
    before = mse(model, X, Y)
    hits = spx.nn.inject_lora(
        model, rank=2, alpha=4.0, where=lambda p, m: p in ("attn.q", "attn.v", "fc"), rngs=spx.Rngs(3)
    )
    assert sorted(hits) == ["attn.q", "attn.v", "fc"]
    assert isinstance(model.attn.q, spx.nn.LoRALinear) and isinstance(model.fc, spx.nn.LoRALinear)
    np.testing.assert_array_equal(mse(model, X, Y), before)
    frozen = {p: np.asarray(v) for p, v in spx.tree_state(model)["parameters"].items()}
    opt = spx.Optimizer(model, optax.adam(1e-2), wrt="lora")

    @spx.jit(mutable=("lora", "opt_state"))
    def step(model, opt, x, y):
        loss, grads = spx.value_and_grad(mse, wrt="lora")(model, x, y)
        opt.update(model, grads)
        return loss, grads

    for _ in range(5):
        loss, grads = step(model, opt, X, Y)
    assert set(grads) == {"lora"} and len(grads["lora"]) == 6
    after = spx.tree_state(model)
    for p, v in after["parameters"].items():
        np.testing.assert_array_equal(v, frozen[p])
    assert np.any(np.asarray(model.fc.b.value)) and mse(model, X, Y) < before

    wrapped = model(X)
    spx.nn.merge_lora(model)
    assert type(model.attn.q) is spx.nn.Linear and type(model.fc) is spx.nn.Linear
    assert "lora" not in spx.tree_state(model)
    np.testing.assert_allclose(model(X), wrapped, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="merge_lora: Net holds no LoRA layers"):
        spx.nn.merge_lora(model)


def test_lora_bad_input():
    r = spx.Rngs(0)
    with pytest.raises(
        TypeError, match="wrap_lora: received LayerNorm; wrap_lora accepts an initialised spx.nn.Linear"
    ):
        spx.nn.wrap_lora(spx.nn.LayerNorm(4), rank=1, rngs=r)
    with pytest.raises(ValueError, match=r"rank must be an int with 1 <= rank <= min\(d_in, d_out\) = 3"):
        spx.nn.wrap_lora(spx.nn.Linear(8, 3, rngs=r), rank=4, rngs=r)
    with pytest.raises(ValueError, match="rank must be"):
        spx.nn.wrap_lora(spx.nn.Linear(8, 3, rngs=r), rank=0, rngs=r)
    with pytest.raises(ValueError, match="inject_lora: no Linear in Net matched where='nothing.*'"):
        spx.nn.inject_lora(Net(r), rank=1, where="nothing.*", rngs=r)
    with pytest.raises(TypeError, match="pass rngs=spx.Rngs"):
        spx.nn.inject_lora(Net(r), rank=1)
    net = Net(r)
    with pytest.raises(ValueError, match=r"min\(d_in, d_out\) = 3"):  # head is 8 -> 3
        spx.nn.inject_lora(net, rank=4, rngs=r)
    assert type(net.fc) is spx.nn.Linear and type(net.attn.q) is spx.nn.Linear  # nothing half-done
    layer = spx.nn.wrap_lora(spx.nn.Linear(8, 3, rngs=r), rank=1, rngs=r)
    merged = spx.nn.merge_lora(layer)
    with pytest.raises(ValueError, match="merge_lora: Linear holds no LoRA layers"):
        spx.nn.merge_lora(merged)


class Mlp(spx.Module):
    def __init__(self, rngs):
        self.fc1 = spx.nn.Linear(8, 16, rngs=rngs)
        self.fc2 = spx.nn.Linear(16, 3, rngs=rngs)

    def forward(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def test_fp8_step_matches_core_and_updates_meta():
    model = Mlp(spx.Rngs(0))
    core = {"fc1": model.fc1.core_params(), "fc2": model.fc2.core_params()}
    assert spx.nn.to_fp8(model, history_len=4) == ["fc1", "fc2"]
    assert model.fc1.amax_history.kind == "fp8_meta" and model.fc1.amax_history.shape == (3, 4)
    core = {k: sc.nn.Fp8Linear.from_linear(v, history_len=4) for k, v in core.items()}
    x, y = X[:, 0], Y[:, 0]

    @spx.jit(mutable=("parameters", "fp8_meta"))
    def step(model, x, y):
        loss, grads = spx.value_and_grad(mse, wrt=("parameters", "fp8_meta"))(model, x, y)
        grads = spx.nn.fp8_update(model, grads)
        spx.update(
            model, jax.tree.map(lambda p, g: p - 0.1 * g, spx.tree_state(model).filter("parameters"), grads)
        )
        return loss

    @jax.jit
    def core_step(p):
        def loss(p):
            return jnp.mean((sc.apply(p["fc2"], jnp.tanh(sc.apply(p["fc1"], x))) - y) ** 2)

        value, g = jax.value_and_grad(loss)(p)
        new = sc.nn.fp8_update(p, g)
        mask = sc.nn.fp8_meta_mask(p)
        stepped = jax.tree.map(lambda a, b, m: a if m else a - 0.1 * b, new, g, mask)
        return value, stepped

    for _ in range(3):
        loss = step(model, x, y)
        ref_loss, core = core_step(core)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for name in ("fc1", "fc2"):
        eager, ref = getattr(model, name), core[name]
        np.testing.assert_allclose(eager.amax_history.value, ref.amax_history, rtol=1e-6)
        np.testing.assert_allclose(eager.scale.value, ref.scale, rtol=1e-6)
        np.testing.assert_allclose(eager.weight.value, ref.weight, rtol=1e-5, atol=1e-6)
    h = np.asarray(model.fc1.amax_history.value)
    assert np.all(h[:, :3] > 0) and np.all(h[:, 3] == 0)  # three steps recorded, one slot still empty
    np.testing.assert_allclose(h[0, 0], np.max(np.abs(x)), rtol=1e-6)


def test_fp8_bad_input():
    r = spx.Rngs(0)
    with pytest.raises(ValueError, match="to_fp8: 'attn.q' is a projection inside the Attention"):
        spx.nn.to_fp8(Net(r), where="attn.*")
    net = Net(r)
    assert spx.nn.to_fp8(net) == ["fc", "head"]  # attention projections stay as they are
    with pytest.raises(ValueError, match="history_len must be an int >= 1"):
        spx.nn.Fp8Linear(4, 3, history_len=0, rngs=r)
    with pytest.raises(TypeError, match="input x must be floating"):
        spx.nn.Fp8Linear(4, 3, rngs=r)(jnp.ones((2, 4), jnp.int32))
    mlp = Mlp(r)
    spx.nn.to_fp8(mlp, "fc2")
    grads = spx.grad(lambda m: jnp.sum(m(jnp.ones((2, 8)))))(mlp)  # parameters only
    with pytest.raises(ValueError, match="grads hold no 'fc2.amax_history' in collection 'fp8_meta'"):
        spx.nn.fp8_update(mlp, grads)
