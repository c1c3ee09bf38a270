"""Forward hooks and pre-hooks: eager and traced into spx.jit, replacement results, removal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_eager as spx


class Lin(spx.Module):
    def __init__(self, w):
        self.weight = spx.Parameter(w)

    def forward(self, x, *, shift=0.0):
        return x @ self.weight.value + shift


class Net(spx.Module):
    def __init__(self):
        self.a = Lin(jnp.arange(6.0).reshape(2, 3) / 6)
        self.b = Lin(jnp.ones((3, 1)))

    def forward(self, x):
        return self.b(jax.nn.relu(self.a(x)))


X = jnp.array([[1.0, -2.0], [0.5, 3.0]])


def formula(net, x, a_in=lambda v: v, a_out=lambda v: v):
    h = a_out(a_in(x) @ net.a.weight.value)
    return jax.nn.relu(h) @ net.b.weight.value


def test_hooks_eager_and_jitted_see_and_replace():
    net = Net()
    seen = []
    h_pre = net.a.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    h_out = net.a.register_forward_hook(lambda m, args, out: out - 1.0)
    h_obs = net.b.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    want = formula(net, X, a_in=lambda v: v * 2, a_out=lambda v: v - 1.0)
    np.testing.assert_allclose(net(X), want, rtol=1e-6)
    fwd = spx.jit(lambda m, x: m(x))
    np.testing.assert_allclose(fwd(net, X), want, rtol=1e-6)  # traced into the program
    np.testing.assert_allclose(fwd(net, X), want, rtol=1e-6)  # and run from it
    assert seen == [(2, 1), (2, 1)]  # eager call + the one trace; compiled calls run no Python
    for h in (h_pre, h_out, h_obs):
        h.remove()
    h_pre.remove()  # removing twice is a no-op
    assert "_spx_hooks" not in net.a.__dict__  # no hooks: nothing left on the module
    np.testing.assert_allclose(fwd(net, X), formula(net, X), rtol=1e-6)  # removal retraces
    assert len(fwd._cache) == 2


def test_hooks_under_grad_and_order():
    net = Net()
    order = []
    net.a.register_forward_hook(lambda m, a, o: order.append("second") or o * 3.0)
    net.a.register_forward_hook(lambda m, a, o: order.append("first") or None, prepend=True)
    g = spx.grad(lambda m: jnp.sum(m(X)))(net)
    want = jax.grad(lambda w: jnp.sum(jax.nn.relu((X @ w) * 3.0) @ net.b.weight.value))(net.a.weight.value)
    np.testing.assert_allclose(g["parameters"]["a.weight"], want, rtol=1e-6)
    assert order == ["first", "second"]


def test_with_kwargs_and_context_manager():
    net = Net()

    def pre(m, args, kwargs):
        return args, {**kwargs, "shift": 10.0}

    def post(m, args, kwargs, out):
        assert kwargs["shift"] == 10.0
        return out

    with (
        net.a.register_forward_pre_hook(pre, with_kwargs=True),
        net.a.register_forward_hook(post, with_kwargs=True),
    ):
        np.testing.assert_allclose(net(X), formula(net, X, a_out=lambda v: v + 10.0), rtol=1e-6)
    np.testing.assert_allclose(net(X), formula(net, X), rtol=1e-6)
    handle = spx.hooks.register_forward_hook(net.b, lambda m, a, o: o * 0)
    assert len(spx.hooks.hooks_of(net.b)) == 1
    np.testing.assert_allclose(net(X), 0.0)
    handle.remove()
    calls = []  # the seed library's forms, (module, args, kwargs[, out]), known by their arity
    with (
        spx.hooks.register_forward_pre_hook(net.a, lambda m, a, k: calls.append(("pre", dict(k)))),
        net.a.register_forward_hook(lambda m, a, k, o: calls.append(("post", dict(k))) or o * 2),
    ):
        np.testing.assert_allclose(net(X), formula(net, X, a_out=lambda v: v * 2), rtol=1e-6)
    assert calls == [("pre", {}), ("post", {})]
    with pytest.raises(TypeError, match="callable"):
        net.a.register_forward_hook(3)
    net.a.register_forward_pre_hook(lambda m, a, k: "bad", with_kwargs=True)
    with pytest.raises(TypeError, match=r"\(args, kwargs\)"):
        net(X)


def test_hooks_survive_clone_and_pytree_roundtrip():
    net = Net()
    net.a.register_forward_hook(lambda m, a, o: o + 1.0)
    want = formula(net, X, a_out=lambda v: v + 1.0)
    np.testing.assert_allclose(spx.clone(net)(X), want, rtol=1e-6)
    leaves, tdef = jax.tree.flatten(net)
    np.testing.assert_allclose(jax.tree.unflatten(tdef, leaves)(X), want, rtol=1e-6)
