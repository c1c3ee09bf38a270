"""Selector combinators: all_of, any_of, not_, Everything, Nothing, and SelectorError."""

import jax.numpy as jnp
import pytest

import spectrax_eager as spx


class Lora(spx.Variable):
    default_kind = "lora"


class Lin(spx.Module):
    def __init__(self, d_in, d_out):
        self.weight = spx.Parameter(jnp.ones((d_in, d_out)))
        self.bias = spx.Parameter(jnp.zeros(d_out))
        self.a = Lora(jnp.ones(d_out))


class Net(spx.Module):
    def __init__(self):
        self.fc1 = Lin(2, 3)
        self.fc2 = Lin(3, 1)
        self.mean = spx.Buffer(jnp.zeros(3))


ALL = ["fc1.weight", "fc1.bias", "fc1.a", "fc2.weight", "fc2.bias", "fc2.a", "mean"]


def chosen(sel):
    return [p for p, _ in spx.iter_variables(Net(), sel)]


def test_everything_and_nothing_as_class_or_instance():
    for sel in (spx.Everything, spx.Everything()):
        assert chosen(sel) == ALL
    for sel in (spx.Nothing, spx.Nothing()):
        assert chosen(sel) == []
    assert chosen(spx.Everything() - "parameters") == ["fc1.a", "fc2.a", "mean"]


def test_all_of_any_of_not():
    assert chosen(spx.all_of("parameters", spx.path_startswith("fc2"))) == ["fc2.weight", "fc2.bias"]
    assert chosen(spx.all_of("parameters", "*.bias", spx.path_contains("1"))) == ["fc1.bias"]
    assert chosen(spx.any_of("lora", "buffers")) == ["fc1.a", "fc2.a", "mean"]
    assert chosen(spx.any_of(Lora, spx.path_endswith("weight"))) == [
        "fc1.weight",
        "fc1.a",
        "fc2.weight",
        "fc2.a",
    ]
    assert chosen(spx.not_("parameters")) == ["fc1.a", "fc2.a", "mean"]
    assert chosen(spx.not_(spx.Nothing)) == ALL
    assert chosen(spx.all_of()) == ALL and chosen(spx.any_of()) == []
    # combinators compose with the operators and with sugar on either side
    assert chosen(spx.not_(spx.any_of("lora", "buffers")) & "*.weight") == ["fc1.weight", "fc2.weight"]
    assert chosen(spx.all_of(spx.not_(Lora), spx.not_("buffers"))) == chosen("parameters")


def test_combinators_serve_grad_wrt():
    net = Net()
    g = spx.grad(
        lambda m: jnp.sum(m.fc1.weight.value * 2) + jnp.sum(m.fc2.a.value), wrt=spx.any_of("*.weight", Lora)
    )(net)
    assert [p for _, p in g.paths()] == ["fc1.weight", "fc1.a", "fc2.weight", "fc2.a"]
    assert float(jnp.sum(g["parameters"]["fc1.weight"])) == 12.0
    assert float(jnp.sum(g["lora"]["fc2.a"])) == 1.0


def test_selector_error_names_the_value():
    with pytest.raises(spx.SelectorError, match="received 3"):
        spx.as_selector(3)
    with pytest.raises(spx.SelectorError):
        spx.all_of("parameters", 2.5)
    assert issubclass(spx.SelectorError, TypeError)
