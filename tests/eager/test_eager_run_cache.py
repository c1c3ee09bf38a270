"""The `spx.run` runner cache is keyed by value: an inline loss function or a mesh built per call
reuses the compiled runner; a loss whose code, closure values, defaults or globals differ gets
its own; the cache is bounded. Every result is checked against `spx.value_and_grad` of the same
loss on one device."""

from __future__ import annotations

import functools
import sys
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_eager as spx
from spectrax_eager._pipeline import run as _run
from spectrax_eager._pipeline.key import mesh_key

X = jax.random.normal(jax.random.key(1), (8, 4))
Y = jax.random.normal(jax.random.key(2), (8, 4))
SCALE = 1.0


class Net(spx.Module):
    def __init__(self):
        rngs = spx.Rngs(0)
        self.blocks = spx.nn.ModuleList([spx.nn.Linear(4, 4, rngs=rngs) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = jnp.tanh(block(x))
        return x


def pipeline():
    return spx.create_mesh((2, 1, -1, 1, 1, 1), mpmd_axis="pp")


@functools.cache
def spmd():
    return spx.create_mesh((1, 2, -1, 1, 1, 1))


def mse(out, target):
    return jnp.mean((out - target) ** 2)


def runner_ids() -> set[int]:
    return {id(runner) for runner, _ in _run._runners.values()}


def run_checked(model, loss_fn, mesh, x=X, y=Y):
    """`spx.run` with `loss_fn`, checked against `spx.value_and_grad` on one device; returns the loss."""
    loss, grads = spx.run(model, inputs=x, targets=y, mesh=mesh, loss_fn=loss_fn, microbatches=2)
    ref_loss, ref_grads = spx.value_and_grad(lambda m: loss_fn(m(x), y))(model)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return float(loss)


def test_inline_loss_and_a_mesh_built_per_call_reuse_one_runner():
    model, before = Net(), runner_ids()
    losses = [run_checked(model, lambda o, t: jnp.mean((o - t) ** 2), pipeline()) for _ in range(3)]
    assert len(runner_ids() - before) == 1
    assert losses[0] == losses[1] == losses[2]


def scaled_by_closure(w):
    return lambda o, t: w * mse(o, t)


def scaled_by_default(w):
    return lambda o, t, w=w: w * mse(o, t)


def scaled_by_kwdefault(w):
    def loss(o, t, *, w=w):
        return w * mse(o, t)

    return loss


def scaled_by_array(w):
    weights = jnp.full((4,), w)
    return lambda o, t: jnp.mean(weights * (o - t) ** 2)


def scaled_by_list(w):
    config = [{"w": w}]
    return lambda o, t: config[0]["w"] * mse(o, t)


def scaled_by_inner_function(w):
    inner = scaled_by_closure(w)
    return lambda o, t: inner(o, t)


def scaled_by_partial(w):
    return functools.partial(lambda o, t, w: w * mse(o, t), w=w)


def scaled_by_global(w):
    setattr(sys.modules[__name__], "SCALE", w)
    return lambda o, t: SCALE * mse(o, t)


def scaled_by_global_helper(w):
    setattr(sys.modules[__name__], "SCALE", w)
    return lambda o, t: global_helper(o, t)


def global_helper(o, t):
    return SCALE * mse(o, t)


FACTORIES = [
    scaled_by_closure,
    scaled_by_default,
    scaled_by_kwdefault,
    scaled_by_array,
    scaled_by_list,
    scaled_by_inner_function,
    scaled_by_partial,
    scaled_by_global,
    scaled_by_global_helper,
]


@pytest.mark.parametrize("make", FACTORIES, ids=[f.__name__ for f in FACTORIES])
def test_a_different_value_read_by_the_loss_never_reuses_a_runner(make):
    model, before = Net(), runner_ids()
    one = run_checked(model, make(1.0), spmd())
    three = run_checked(model, make(3.0), spmd())
    assert three == pytest.approx(3 * one, rel=1e-5)
    assert len(runner_ids() - before) == 2
    again = runner_ids()
    assert run_checked(model, make(1.0), spmd()) == one  # a fresh but equal function: reused
    assert runner_ids() == again


def test_int_and_float_closure_values_are_different_keys():
    model, before = Net(), runner_ids()
    run_checked(model, scaled_by_closure(2), spmd())
    run_checked(model, scaled_by_closure(2.0), spmd())
    assert len(runner_ids() - before) == 2


def test_a_retrace_of_a_cached_runner_calls_the_current_loss():
    """A cached runner retraces for a new batch shape with the loss of the call that reuses it."""
    model = Net()
    shared = [1.0]
    first = scaled_by_list_object(shared)
    run_checked(model, first, spmd())
    shared[0] = 5.0  # `first` now reads 5.0: a different key, a new runner
    run_checked(model, first, spmd())
    fresh = scaled_by_list_object([1.0])  # equal to `first`'s original key: reuses that runner ...
    run_checked(model, fresh, spmd(), x=X[:4], y=Y[:4])  # ... and retraces with `fresh`, not `first`


def scaled_by_list_object(config):
    return lambda o, t: config[0] * mse(o, t)


def test_a_loss_reading_a_module_is_not_cached_and_sees_its_new_values():
    model, regularised = Net(), Net()

    def loss(o, t):
        return mse(o, t) + jnp.sum(regularised.blocks[0].weight.value ** 2)

    before = runner_ids()
    first = run_checked(model, loss, spmd())
    regularised.blocks[0].weight.value = regularised.blocks[0].weight.value * 2.0
    second = run_checked(model, loss, spmd())
    assert second > first and runner_ids() == before


def test_the_cache_is_bounded_and_drops_the_least_recently_used(monkeypatch):
    monkeypatch.setattr(_run, "MAX_RUNNERS", 2)
    monkeypatch.setattr(_run, "_runners", OrderedDict())
    model = Net()
    for w in (1.0, 2.0, 1.0, 3.0):  # 1.0 was used again after 2.0, so 2.0 is dropped for 3.0
        run_checked(model, scaled_by_closure(w), spmd())
        assert len(_run._runners) <= 2
    assert [key.loss[2] for key in _run._runners] == [(("float", 1.0),), (("float", 3.0),)]


def test_mesh_keys_are_values():
    devices = jax.devices()
    assert mesh_key(pipeline()) == mesh_key(pipeline())
    assert mesh_key(pipeline()) != mesh_key(spx.create_mesh((2, 1, -1, 1, 1, 1), devices=devices[::-1],
                                                            mpmd_axis="pp"))
    assert mesh_key(pipeline()) != mesh_key(spx.create_mesh((2, 1, -1, 1, 1, 1)))  # no pipeline axis
    assert mesh_key(pipeline()) != mesh_key(spx.create_mesh((2, 1, -1, 1, 1, 1), mpmd_axis="pp",
                                                            devices=devices[:4]))
    assert mesh_key(pipeline()) != mesh_key(pipeline().jax_mesh)
