"""Building and context names written for `spectrax-lib`: `spx.scope` under `spx.jit`,
`spx.Policy`, `variable_init_placement`, `DeferredParameter` / `DeferredBuffer`, `lazy_init`
with `Module.init`, and the `Module` conveniences. References are computed by hand (numpy /
plain jax on the same arrays)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_eager as spx

RTOL, ATOL = 1e-5, 1e-6


def _close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=atol)


class Scaled(spx.Module):
    """`(x @ w) * scale (+ bias when bound)`, reading its settings from `spx.scope`."""

    def __init__(self):
        self.lin = spx.nn.Linear(3, 3, use_bias=False, rngs=spx.Rngs(0))

    def forward(self, x):
        y = self.lin(x) * spx.scope.get("scale", 1.0)
        return y + spx.scope.get("bias") if spx.scope.get("add", False) else y


def test_scope_values_reach_a_jitted_call_and_never_go_stale():
    model, x = Scaled(), jnp.arange(6.0).reshape(2, 3)
    w = np.asarray(model.lin.weight.value)
    traces = []
    step = spx.jit(lambda m, x: (traces.append(1), m(x))[1])
    _close(step(model, x), x @ w)
    with spx.scope(scale=2.0):
        _close(step(model, x), 2 * (x @ w))  # a new static value: a new program
        for bias in (jnp.ones(3), jnp.full(3, 5.0, jnp.float32)):
            with spx.scope(add=True, bias=bias):  # arrays are inputs: no stale constant
                _close(step(model, x), 2 * (x @ w) + bias)
    _close(step(model, x), x @ w)
    assert len(traces) == 3
    with pytest.raises(KeyError, match="no enclosing spx.scope binds it"):
        spx.scope.get("bias")
    with spx.scope(bad=[1, 2]), pytest.raises(TypeError, match="neither an array nor hashable"):
        step(model, x)
    assert spx.context.snapshot() == {}


def test_policy_casts_the_layers_below_and_the_output():
    class Net(spx.Module):
        def __init__(self):
            self.lin = spx.nn.Linear(4, 4, rngs=spx.Rngs(0))
            self.norm = spx.nn.LayerNorm(4)

        def forward(self, x):
            return self.norm(self.lin(x))

    net, x = Net(), jax.random.normal(jax.random.key(1), (2, 4))
    net.policy = spx.Policy(compute_dtype=jnp.bfloat16)
    out = net(x)
    bf = jnp.bfloat16
    h = x.astype(bf) @ net.lin.weight.value.astype(bf) + net.lin.bias.value.astype(bf)
    assert out.dtype == bf and net.lin.weight.value.dtype == jnp.float32
    mean, var = h.astype(jnp.float32).mean(-1, keepdims=True), h.astype(jnp.float32).var(-1, keepdims=True)
    _close(out, (h - mean) / jnp.sqrt(var + 1e-5), rtol=3e-2, atol=3e-2)
    net.policy = spx.Policy(compute_dtype=bf, output_dtype=jnp.float32)
    assert spx.jit(lambda m, x: m(x))(net, x).dtype == jnp.float32
    net.policy = None
    assert net(x).dtype == jnp.float32
    net.policy = spx.nn.Linear(4, 4, rngs=spx.Rngs(1))  # a sub-module named policy is just that
    assert net(x).dtype == jnp.float32 and "policy" in dict(spx.iter_modules(net))


def test_variable_init_placement_sees_every_new_variable():
    seen = []

    def hook(value, metadata, explicit):
        if not jnp.issubdtype(value.dtype, jnp.floating):
            return None  # keep the rng keys as they are
        seen.append((metadata.get("axes"), explicit))
        return value * 0 + 7

    with spx.variable_init_placement(hook):
        lin = spx.nn.Linear(2, 3, rngs=spx.Rngs(0))
        p = spx.Parameter(jnp.ones(2), sharding=("embed",))
    assert seen == [(("EMBED", "MLP"), False), (("MLP",), False), (("embed",), True)]
    assert float(lin.weight.value.sum()) == 42 and float(p.value.sum()) == 14
    assert float(spx.nn.Linear(2, 3, rngs=spx.Rngs(0)).weight.value.sum()) != 42
    with pytest.raises(TypeError, match="callable"):
        with spx.variable_init_placement(3):
            pass


class LazyNet(spx.Module):
    def __init__(self):
        self.a = spx.nn.Linear(None, 4, rngs=spx.Rngs(0))
        self.w = spx.DeferredParameter((None,), jax.nn.initializers.normal(1.0), spx.Rngs(5), jnp.float32)

    def forward(self, x):
        h = self.a(x)
        self.w.resolve_shape(h.shape[-1:])
        return h * self.w.value


def test_deferred_parameter_and_lazy_init():
    x = jnp.ones((2, 3))
    w_ref = jax.nn.initializers.normal(1.0)(spx.Rngs(5).params(), (4,), jnp.float32)
    with spx.lazy_init():
        net = LazyNet()
    with pytest.raises(RuntimeError, match="built under spx.lazy_init"):
        net(x)
    with pytest.raises(RuntimeError, match="not materialized"):
        net.w.value  # its shape is not known yet
    net.init(spx.Rngs(9), x)  # materializes the Linear and the deferred parameter
    _close(net.w.value, w_ref)
    _close(net(x), (x @ net.a.weight.value + net.a.bias.value) * w_ref)
    assert isinstance(net.rngs, spx.Rngs)
    with pytest.raises(TypeError, match="spx.Rngs"):
        net.init(3)
    eager = LazyNet()  # outside lazy_init the first call makes both
    _close(eager(x), (x @ eager.a.weight.value + eager.a.bias.value) * w_ref)
    assert eager.w.is_materialized
    buf = spx.DeferredBuffer((2, None), jax.nn.initializers.zeros, 0, jnp.float32)
    with pytest.raises(RuntimeError, match="resolve_shape"):
        buf.materialize()
    with pytest.raises(ValueError, match="does not fit"):
        buf.resolve_shape((3, 1))
    buf.value = jnp.ones((2, 2))  # a value given by hand materializes it
    assert buf.is_materialized and buf.value.shape == (2, 2)


def test_a_deferred_parameter_materialized_inside_a_transform_is_refused():
    net = LazyNet()
    net.a(jnp.ones((1, 3)))
    net.w.resolve_shape((4,))
    with pytest.raises(spx.LazyInitUnderTransformError):
        spx.jit(lambda m: m.materialize() and 0)(net)


def test_module_conveniences():
    class Net(spx.Module):
        def __init__(self):
            self.lin = spx.nn.Linear(2, 2, rngs=spx.Rngs(0))
            self.deterministic = False

        def forward(self, x):
            return jnp.sum(self.perturb("h", self.lin(x)) ** 2)

    net, x = Net(), jnp.array([[1.0, 2.0]])
    structure, shapes = net.structure_hash(), net.shape_hash()
    assert structure == Net().structure_hash() and len(structure) == 64
    net.set_attributes(deterministic=True, unknown=1)
    assert net.deterministic is True and not hasattr(net, "unknown")
    assert net.structure_hash() != structure and net.shape_hash() != shapes
    net(x)  # makes the perturbation variable
    grads = spx.grad(lambda m: m(x), wrt="perturbations")(net)
    h = x @ net.lin.weight.value + net.lin.bias.value
    _close(grads["perturbations"]["perturb_h"], 2 * h)  # d sum(h^2) / dh
