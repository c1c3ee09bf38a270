"""Optimizer.create and MultiOptimizer (disjoint selectors, each its own optax transformation)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spectrax_eager as spx


class Lora(spx.Variable):
    default_kind = "lora"


class Net(spx.Module):
    def __init__(self):
        k1, k2 = jax.random.split(jax.random.key(3))
        self.w = spx.Parameter(jax.random.normal(k1, (3, 2)))
        self.b = spx.Parameter(jnp.zeros(2))
        self.a = Lora(jax.random.normal(k2, (3, 2)) * 0.1)

    def forward(self, x):
        return x @ (self.w.value + self.a.value) + self.b.value


X = jnp.arange(12.0).reshape(4, 3) / 12
Y = jnp.ones((4, 2))


def loss(m):
    return jnp.mean((m(X) - Y) ** 2)


def raw_loss(p):
    return jnp.mean((X @ (p["w"] + p["a"]) + p["b"] - Y) ** 2)


def test_create_is_the_constructor():
    a, b = Net(), Net()
    opt_a = spx.Optimizer.create(a, optax.sgd(0.1), wrt="parameters")
    opt_b = spx.Optimizer(b, optax.sgd(0.1), wrt="parameters")
    for m, o in ((a, opt_a), (b, opt_b)):
        o.update(m, spx.grad(loss, wrt="parameters")(m))
    np.testing.assert_array_equal(a.w.value, b.w.value)
    assert opt_a.wrt == "parameters" and int(opt_a.step.value) == 1


def test_multi_optimizer_matches_separate_optax_steps():
    net = Net()
    opt = spx.MultiOptimizer(net, {"lora": optax.adam(1e-2), "parameters": optax.sgd(0.5)})
    step = spx.jit(
        lambda m, o: (lambda l, g: (o.update(m, g), l)[1])(*spx.value_and_grad(loss, wrt=o.wrt)(m)),
        mutable=("parameters", "lora", "opt_state"),
    )
    p = {"w": net.w.value, "b": net.b.value, "a": net.a.value}
    adam, sgd = optax.adam(1e-2), optax.sgd(0.5)
    sa, ss = adam.init({"a": p["a"]}), sgd.init({"w": p["w"], "b": p["b"]})
    for _ in range(3):
        step(net, opt)
        g = jax.grad(raw_loss)(p)
        ua, sa = adam.update({"a": g["a"]}, sa, {"a": p["a"]})
        us, ss = sgd.update({"w": g["w"], "b": g["b"]}, ss, {"w": p["w"], "b": p["b"]})
        p = {**optax.apply_updates({"w": p["w"], "b": p["b"]}, us), **optax.apply_updates({"a": p["a"]}, ua)}
    np.testing.assert_allclose(net.a.value, p["a"], rtol=1e-6)
    np.testing.assert_allclose(net.w.value, p["w"], rtol=1e-6)
    np.testing.assert_allclose(net.b.value, p["b"], rtol=1e-6)
    assert [int(o.step.value) for o in opt.optimizers] == [3, 3]


def test_multi_optimizer_rejects_overlap_and_bad_input():
    net = Net()
    with pytest.raises(ValueError, match="matched by both"):
        spx.MultiOptimizer(net, [("parameters", optax.sgd(1.0)), (spx.path_startswith("w"), optax.sgd(1.0))])
    with pytest.raises(ValueError, match="matches no trainable"):
        spx.MultiOptimizer(net, {"buffers": optax.sgd(1.0)})
    with pytest.raises(TypeError, match="GradientTransformation"):
        spx.MultiOptimizer(net, {"parameters": "sgd"})
    opt = spx.MultiOptimizer(net, {"parameters": optax.sgd(1.0), "lora": optax.sgd(1.0)})
    with pytest.raises(ValueError, match="grads lack"):
        opt.update(net, spx.grad(loss, wrt="parameters")(net))
