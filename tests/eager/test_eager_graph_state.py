"""Graph queries (find, pop, iter_modules, live_variables), Module.sow, cycles, every State
method and constructor, Rngs.key / fork / spx.seed, and the jit fast path's cache identity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_eager as spx


class Lin(spx.Module):
    def __init__(self, key, d_in, d_out):
        self.weight = spx.Parameter(jax.random.normal(key, (d_in, d_out)))
        self.bias = spx.Parameter(jnp.zeros(d_out))

    def forward(self, x):
        return x @ self.weight.value + self.bias.value


class Block(spx.Module):
    def __init__(self, key):
        self.fc = Lin(key, 3, 3)
        self.scale = spx.Buffer(jnp.full((3,), 2.0))

    def forward(self, x):
        h = jnp.tanh(self.fc(x))
        self.sow("intermediates", "hidden", h)
        return h * self.scale.value


class Net(spx.Module):
    def __init__(self):
        k1, k2 = jax.random.split(jax.random.key(0))
        self.first = Block(k1)
        self.second = Block(k2)
        self.head = Lin(k2, 3, 1)

    def forward(self, x):
        return self.head(self.second(self.first(x)))


def reference(net, x):
    """The same forward written with jax.numpy on the raw arrays (and its hidden states)."""
    hs = []
    for blk in (net.first, net.second):
        h = jnp.tanh(x @ blk.fc.weight.value + blk.fc.bias.value)
        hs.append(h)
        x = h * blk.scale.value
    return x @ net.head.weight.value + net.head.bias.value, hs


X = jnp.arange(6.0).reshape(2, 3) / 6


def test_iter_modules_find_live_variables():
    net = Net()
    assert [p for p, _ in spx.iter_modules(net)] == ["", "first", "first.fc", "second", "second.fc", "head"]
    assert [p for p, _ in spx.iter_modules(net, select=Block)] == ["first", "second"]
    assert [p for p, _ in spx.iter_modules(net, select=Lin)] == ["first.fc", "second.fc", "head"]
    assert [p for p, _ in spx.iter_modules(net, select=lambda p, m: p.endswith("fc"))] == [
        "first.fc",
        "second.fc",
    ]
    assert [p for p, _ in spx.iter_modules(net, skip_root=True)][0] == "first"
    assert list(spx.iter_modules(net, with_path=False))[:2] == [net, net.first]
    assert spx.find(net, Block) == ("first", net.first)  # the first match
    assert spx.find(net, Lin) == ("first.fc", net.first.fc)
    assert spx.find(net, "buffers") == ("first.scale", net.first.scale)
    assert spx.find(net, spx.path_startswith("head") & spx.path_endswith("bias")) == (
        "head.bias",
        net.head.bias,
    )
    assert spx.find(net, "nothing_here") is None
    live = spx.live_variables(net, "buffers")  # (path, variable) pairs, as the seed library
    assert [p for p, _ in live] == ["first.scale", "second.scale"]
    assert [v for _, v in live] == [net.first.scale, net.second.scale]
    assert spx.live_variables(net) == list(spx.iter_variables(net))
    with pytest.raises(TypeError, match="Module subclass"):
        list(spx.iter_modules(net, select=3))


def test_sow_eager_then_pop():
    net = Net()
    out = net(X)
    want, hs = reference(net, X)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    inter = spx.pop(net, "intermediates")
    assert [p for _, p in inter.paths()] == ["first.hidden", "second.hidden"]
    np.testing.assert_allclose(inter["intermediates"]["first.hidden"][0], hs[0], rtol=1e-6)
    np.testing.assert_allclose(inter["intermediates"]["second.hidden"][0], hs[1], rtol=1e-6)
    assert "hidden" not in net.first.__dict__  # popped: the structure is back to the original
    net(X)
    net(X)  # a second call appends (the default reduce)
    assert len(net.first.hidden.value) == 2


def test_sow_under_jit_returns_intermediates_and_keeps_cache():
    net = Net()
    fwd = spx.jit(lambda m, x: m(x))
    want, hs = reference(net, X)
    for _ in range(3):
        np.testing.assert_allclose(fwd(net, X), want, rtol=1e-6)
        inter = spx.pop(net, "intermediates")
        assert [p for _, p in inter.paths()] == ["first.hidden", "second.hidden"]
        np.testing.assert_allclose(inter["intermediates"]["second.hidden"][0], hs[1], rtol=1e-6)
    assert len(fwd._cache) == 1  # popping restores the structure: one program


def test_sow_inside_grad_records_nothing_so_models_that_sow_still_train():
    net = Net()
    loss = lambda m: jnp.sum(m(X) ** 2)  # noqa: E731

    @spx.jit
    def step(m):
        value, g = spx.value_and_grad(loss)(m)  # sows inside grad: not recorded
        return value, g, m(X)  # this call sows directly under spx.jit: recorded

    def head_input(x):
        for blk in (net.first, net.second):
            x = jnp.tanh(x @ blk.fc.weight.value + blk.fc.bias.value) * blk.scale.value
        return x

    want_g = jax.grad(lambda w: jnp.sum((head_input(X) @ w + net.head.bias.value) ** 2))(
        net.head.weight.value
    )
    _, g, _ = step(net)
    np.testing.assert_allclose(g["parameters"]["head.weight"], want_g, rtol=1e-5)
    inter = spx.pop(net, "intermediates")
    assert [p for _, p in inter.paths()] == ["first.hidden", "second.hidden"]
    assert len(inter["intermediates"]["first.hidden"]) == 1  # only the direct call
    g_eager = spx.grad(loss)(net)  # eager grad: traced values are not recorded either
    np.testing.assert_allclose(g_eager["parameters"]["head.weight"], want_g, rtol=1e-5)
    assert spx.pop(net, "intermediates").paths() == ()


def test_cycle_is_an_error():
    net = Net()
    net.first.back = net  # a child referring to its ancestor
    with pytest.raises(spx.CyclicGraphError, match="own ancestor"):
        spx.tree_state(net)
    del net.first.back
    spx.tree_state(net)
    net.again = net.first  # sharing (not a cycle) stays allowed
    assert [p for p, _ in spx.iter_modules(net, select=Block)] == ["first", "second"]


def test_state_constructor_and_methods():
    w, b = jnp.ones((2, 2)), jnp.zeros(2)
    s = spx.State({"parameters": {"fc.weight": w, "fc.bias": b}, "buffers": {"mean": jnp.ones(1)}})
    assert list(s) == ["parameters", "buffers"]
    assert s.paths() == (("parameters", "fc.weight"), ("parameters", "fc.bias"), ("buffers", "mean"))
    assert s.paths("buffers") == (("buffers", "mean"),) and s.collections() == {"parameters", "buffers"}
    assert [(c, p) for c, p, _ in s.items()] == list(s.paths())
    assert s.items()[0][2] is w and s.get("parameters", "fc.weight") is w and s.get("x", "y", 3) == 3
    flat = s.flatten()
    assert list(flat) == [("parameters", "fc.weight"), ("parameters", "fc.bias"), ("buffers", "mean")]
    back = spx.State.from_flat(flat)
    assert back.flatten().keys() == flat.keys() and all(back.flatten()[k] is v for k, v in flat.items())
    doubled = s.map(lambda v: v * 2)
    np.testing.assert_allclose(doubled["parameters"]["fc.weight"], 2 * w)
    tagged = s.map(lambda p, v: p, with_path=True)
    assert tagged["buffers"]["mean"] == "mean"
    assert s.map(lambda p, v: p)["buffers"]["mean"] == "mean"  # two required arguments: the path too
    only = s.map(lambda v: v * 0, "buffers")
    assert only["parameters"]["fc.weight"] is w and float(only["buffers"]["mean"][0]) == 0.0
    assert (
        s.filter("parameters", "buffers").paths() == s.paths()
        and s.exclude("buffers").paths() == s.paths()[:2]
    )
    t = s.set("fc.bias", jnp.ones(2))
    np.testing.assert_allclose(t["parameters"]["fc.bias"], 1.0)
    np.testing.assert_allclose(s["parameters"]["fc.bias"], 0.0)  # immutable: s unchanged
    added = s.set(("lora", "fc.a"), jnp.ones(3))
    assert added.paths()[-1] == ("lora", "fc.a") and "lora" in added
    assert s.set("lora", "fc.a", jnp.ones(3)).paths() == added.paths()
    with pytest.raises(KeyError, match="no entry 'nope'"):
        s.set("nope", 1)
    over = s.overlay(spx.State({"parameters": {"fc.bias": jnp.full(2, 5.0)}, "lora": {"x": jnp.ones(1)}}))
    assert [p for _, p in over.paths()] == ["fc.weight", "fc.bias", "mean", "x"]
    np.testing.assert_allclose(over["parameters"]["fc.bias"], 5.0)
    with pytest.raises(ValueError, match="one collection"):
        s.overlay(spx.State({"buffers": {"fc.bias": b}}))
    with pytest.raises(ValueError, match="one collection"):
        spx.State({"parameters": {"a": w}, "buffers": {"a": w}})
    with pytest.raises(TypeError, match="mapping"):
        spx.State([w])
    assert len(spx.State()) == 0


def test_state_methods_on_a_model_state_keep_the_pytree():
    net = Net()
    params = spx.tree_state(net).filter("parameters")
    scaled = params.map(lambda v: v * 0.5)
    assert jax.tree.structure(scaled) == jax.tree.structure(params)
    spx.update(net, scaled.set("head.bias", jnp.full(1, 3.0)))
    np.testing.assert_allclose(net.head.bias.value, 3.0)
    np.testing.assert_allclose(net.head.weight.value, params["parameters"]["head.weight"] * 0.5)
    rebuilt = spx.bind(
        spx.export(net)[0], spx.tree_state(net).overlay(spx.State({"buffers": {"first.scale": jnp.ones(3)}}))
    )
    np.testing.assert_allclose(rebuilt.first.scale.value, 1.0)


def test_rngs_key_fork_seed():
    rngs = spx.Rngs(0, dropout=1)
    k_default = spx.Rngs(0).key()
    np.testing.assert_array_equal(jax.random.key_data(rngs.key()), jax.random.key_data(k_default))
    d1, d2 = rngs.key("dropout"), rngs.key("dropout")
    assert not np.array_equal(jax.random.key_data(d1), jax.random.key_data(d2))
    np.testing.assert_array_equal(  # an unknown name falls back to the default stream
        jax.random.key_data(spx.Rngs(0).key("params")), jax.random.key_data(k_default)
    )
    parts = rngs.fork(3)
    assert len(parts) == 3 and all(set(p.streams()) == {"default", "dropout"} for p in parts)
    draws = {tuple(np.asarray(jax.random.key_data(p.key("dropout"))).ravel()) for p in parts}
    assert len(draws) == 3  # independent streams
    one = rngs.fork()
    assert isinstance(one, spx.Rngs)
    with pytest.raises(ValueError, match="positive"):
        rngs.fork(0)
    assert spx.current_rngs() is None
    with spx.seed(7) as r:
        assert spx.current_rngs() is r
        with rngs, r:  # nested, the same object twice: each block restores its outer one
            assert spx.current_rngs() is r
        assert spx.current_rngs() is r
        np.testing.assert_array_equal(jax.random.key_data(r.key()), jax.random.key_data(spx.Rngs(7).key()))
    assert spx.current_rngs() is None


def test_jit_fast_path_follows_values_models_and_argument_types():
    f = spx.jit(lambda m, x: m(x))
    a, b = Net(), Net()
    spx.pop(a, "intermediates"), spx.pop(b, "intermediates")
    b.head.bias.value = jnp.full(1, 10.0)
    for _ in range(2):
        np.testing.assert_allclose(f(a, X), reference(a, X)[0], rtol=1e-6)
        spx.pop(a, "intermediates")
        np.testing.assert_allclose(f(b, X), reference(b, X)[0], rtol=1e-6)
        spx.pop(b, "intermediates")
    a.head.bias.value = jnp.full(1, -1.0)  # a value write: no retrace, the new value is read
    np.testing.assert_allclose(f(a, X), reference(a, X)[0], rtol=1e-6)
    spx.pop(a, "intermediates")
    assert len(f._cache) == 1
    np.testing.assert_allclose(f(a, np.asarray(X)), reference(a, X)[0], rtol=1e-6)  # numpy input
    spx.pop(a, "intermediates")
    np.testing.assert_allclose(f(a, X), reference(a, X)[0], rtol=1e-6)  # and back


def test_jit_fast_path_compares_modules_by_identity():
    class Picky(Lin):
        def __eq__(self, other):
            raise AssertionError("modules are matched by identity, never compared with ==")

        __hash__ = object.__hash__

    a, b = Picky(jax.random.key(1), 3, 2), Picky(jax.random.key(2), 3, 2)
    f = spx.jit(lambda m, x: m(x))
    for m in (a, b, a):
        np.testing.assert_allclose(f(m, X), X @ m.weight.value + m.bias.value, rtol=1e-6)
