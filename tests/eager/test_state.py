"""Module graph, pytree behaviour, export/bind, selectors, freeze and the jit cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_eager as spx


class Lora(spx.Variable):
    default_kind = "lora"


class Lin(spx.Module):
    def __init__(self, key, d_in, d_out):
        self.weight = spx.Parameter(jax.random.normal(key, (d_in, d_out)), axes=("EMBED", "MLP"))
        self.bias = spx.Parameter(jnp.zeros(d_out))
        self.d_out = d_out

    def forward(self, x):
        return x @ self.weight.value + self.bias.value


class Net(spx.Module):
    def __init__(self):
        k1, k2 = jax.random.split(jax.random.key(0))
        self.fc1 = Lin(k1, 3, 4)
        self.fc2 = Lin(k2, 4, 2)
        self.mean = spx.Buffer(jnp.zeros(4))
        self.adapter = Lora(jnp.ones(2))

    def forward(self, x):
        h = jnp.tanh(self.fc1(x))
        return self.fc2(h) * self.adapter.value


def paths(state):
    return sorted(f"{k}/{p}" for k, p in state.flat())


def test_pytree_and_export_bind_roundtrip():
    net = Net().eval()
    leaves = jax.tree.leaves(net)
    assert len(leaves) == 6
    doubled = jax.tree.map(lambda x: 2 * x, net)
    assert isinstance(doubled, Net) and doubled.training is False
    np.testing.assert_array_equal(doubled.fc1.weight.value, 2 * net.fc1.weight.value)
    gd, state = spx.export(net)
    assert hash(gd) == hash(spx.export(Net().eval())[0]) and gd == spx.export(Net().eval())[0]
    with pytest.raises(AttributeError):
        gd.specs = ()
    assert set(state) == {"parameters", "buffers", "lora"}
    assert set(state["parameters"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    back = spx.bind(gd, state)
    assert back is not net and back.training is False and back.fc1.d_out == 4
    assert back.fc1.weight.metadata == {"axes": ("EMBED", "MLP")}
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(net)):
        np.testing.assert_array_equal(a, b)
    x = jnp.ones((2, 3))
    np.testing.assert_array_equal(jax.jit(lambda m, x: m(x))(net, x), net(x))
    c = spx.clone(net)
    c.fc1.bias.value = c.fc1.bias.value + 1
    assert float(net.fc1.bias.value.sum()) == 0.0


def test_shared_variable_appears_once():
    net = Net()
    net.tied = net.fc1
    gd, state = spx.export(net)
    assert len(state.flat()) == 6
    back = spx.bind(gd, state)
    assert back.tied is back.fc1


def test_selectors_forms_and_algebra():
    net = Net()
    ts = spx.tree_state(net)
    assert paths(ts.filter("parameters")) == [
        "parameters/fc1.bias",
        "parameters/fc1.weight",
        "parameters/fc2.bias",
        "parameters/fc2.weight",
    ]
    assert paths(ts.filter(spx.Buffer)) == ["buffers/mean"]
    assert paths(ts.filter(Lora)) == ["lora/adapter"] == paths(ts.filter("lora"))
    assert paths(ts.filter("*.weight")) == ["parameters/fc1.weight", "parameters/fc2.weight"]
    assert paths(ts.filter(lambda p, v: v.value.ndim == 1 and "fc2" in p)) == ["parameters/fc2.bias"]
    assert paths(ts.filter(spx.path_startswith("fc2"))) == ["parameters/fc2.bias", "parameters/fc2.weight"]
    assert paths(ts.filter(spx.path_endswith("bias"))) == ["parameters/fc1.bias", "parameters/fc2.bias"]
    assert paths(ts.filter(spx.path_contains("ea"))) == ["buffers/mean"]
    assert paths(ts.filter(Lin)) == paths(ts.filter("parameters"))
    sel = spx.select().at_instances_of(Lin).of_type(spx.Parameter).at_path("fc1.*")
    assert paths(ts.filter(sel)) == ["parameters/fc1.bias", "parameters/fc1.weight"]
    assert paths(ts.filter(spx.of_type(spx.Parameter) - "*.bias")) == [
        "parameters/fc1.weight",
        "parameters/fc2.weight",
    ]
    assert paths(ts.filter(spx.of_type(spx.Buffer) | "lora")) == ["buffers/mean", "lora/adapter"]
    assert paths(ts.filter(spx.select().where(lambda p, v: "fc" in p) & spx.path_endswith("weight"))) == [
        "parameters/fc1.weight",
        "parameters/fc2.weight",
    ]
    assert paths(ts.filter(~spx.as_selector("parameters"))) == ["buffers/mean", "lora/adapter"]
    assert paths(ts.filter(spx.select().where(lambda p, v: v.metadata.get("axes") == ("EMBED", "MLP")))) == [
        "parameters/fc1.weight",
        "parameters/fc2.weight",
    ]
    a, b, rest = spx.partition_state(net, "parameters", "buffers")
    assert len(a.flat()) == 4 and paths(b) == ["buffers/mean"] and paths(rest) == ["lora/adapter"]
    assert [p for p, _ in spx.iter_variables(net, select=spx.Buffer)] == ["mean"]
    with pytest.raises(TypeError, match="selector"):
        spx.as_selector(3.5)


@pytest.mark.parametrize(
    "wrt, expected",
    [
        ("parameters", ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]),
        (spx.Buffer, ["mean"]),
        ("*.weight", ["fc1.weight", "fc2.weight"]),
        (lambda p, v: p.startswith("fc2"), ["fc2.bias", "fc2.weight"]),
        (spx.select().of_type(spx.Parameter).at_path("fc1.*"), ["fc1.bias", "fc1.weight"]),
        (
            spx.as_selector("parameters") | "lora",
            ["adapter", "fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"],
        ),
        (spx.as_selector("parameters") & spx.path_endswith("bias"), ["fc1.bias", "fc2.bias"]),
        (spx.as_selector("parameters") - spx.path_startswith("fc1"), ["fc2.bias", "fc2.weight"]),
    ],
)
def test_grad_wrt_returns_exactly_the_selection(wrt, expected):
    net = Net()
    x = jnp.ones((2, 3))
    g = spx.grad(lambda m: jnp.sum(m(x) ** 2 + m.mean.value.sum()), wrt=wrt)(net)
    assert sorted(p for _, p in g.flat()) == expected
    ref = jax.grad(lambda m: jnp.sum(m(x) ** 2 + m.mean.value.sum()))(net)  # jax.grad over the pytree
    flat = dict(zip([i.path for i in spx.export(net)[1]._infos], jax.tree.leaves(ref)))
    for (_, p), v in g.flat().items():
        np.testing.assert_allclose(v, flat[p], rtol=1e-6)


def test_freeze_removes_variables_from_training():
    net = Net()
    spx.freeze(net, "fc1.*")
    g = spx.grad(lambda m: jnp.sum(m(jnp.ones((1, 3)))))(net)
    assert sorted(p for _, p in g.flat()) == ["fc2.bias", "fc2.weight"]
    spx.unfreeze(net, "fc1.*")
    g = spx.grad(lambda m: jnp.sum(m(jnp.ones((1, 3)))))(net)
    assert len(g.flat()) == 4


def test_bad_attributes_are_rejected():
    net = Net()
    with pytest.raises(TypeError, match="raw arrays"):
        net.w = jnp.ones(3)
    with pytest.raises(TypeError, match="ModuleList"):
        net.layers = [net.fc1]


def test_retrace_only_on_structure_change():
    traces = []

    @spx.jit
    def f(m, x):
        traces.append(1)
        return m(x)

    net, x = Net(), jnp.ones((2, 3))
    f(net, x)
    net.fc1.weight.value = net.fc1.weight.value + 1.0  # value change
    f(net, x)
    f(Net(), x)  # another instance, same structure
    assert len(traces) == 1
    net.fc2 = Lin(jax.random.key(3), 4, 2)  # replaced sub-module, same shapes: structure is identical
    f(net, x)
    assert len(traces) == 1
    net.extra = spx.Buffer(jnp.zeros(1))  # added variable
    f(net, x)
    assert len(traces) == 2
    del net.extra  # removed variable: back to the first structure (cached)
    f(net, x)
    net.fc2 = spx.nn.Linear(4, 2, rngs=spx.Rngs(0))  # replaced by a different class
    f(net, x)
    assert len(traces) == 3
    net.eval()  # static flag
    f(net, x)
    assert len(traces) == 4


def test_illegal_mutation_and_structure_change_errors():
    net = Net()

    def write(m):
        m.fc1.bias.value = m.fc1.bias.value + 1

    with pytest.raises(spx.IllegalMutationError, match="parameters/fc1.bias"):
        spx.jit(write)(net)
    with pytest.raises(spx.IllegalMutationError):
        spx.jit(write, mutable="buffers")(net)
    spx.jit(write, mutable="parameters")(net)
    np.testing.assert_array_equal(net.fc1.bias.value, jnp.ones(4))

    def grow(m):
        m.new = spx.Buffer(jnp.zeros(1))

    with pytest.raises(spx.StructureChangeError):
        spx.jit(grow, mutable=True)(net)
