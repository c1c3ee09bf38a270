"""Residuals the backward makes itself (`spectrax_mpmd._trace.residuals`).

On a vjp's residual leaves, evaluated for real: the leaves rebuilt from the kept ones are
bit-equal to every leaf, for activations whose vjps keep values derived elementwise from other
kept values (tanh, the tanh-approximated GELU, SiLU, ReLU, a product keeping one value twice)
and for ones whose residuals are not (sigmoid alone, softplus's exponentials, a dot's output). Through a
pipelined step: loss and gradients equal the unsplit `jax.value_and_grad`, and the forward cell
of each stage returns none of the values left out; so they do for stages that loop (`lax.scan`),
kept whole or under checkpoint policies (whose residuals come out of call equations).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._trace.jaxpr import producers
from spectrax_mpmd._trace.residuals import EXACT, derived_residuals

ACTIVATIONS = {
    "tanh": jnp.tanh,
    "gelu_tanh": lambda z: jax.nn.gelu(z, approximate=True),
    "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "square_of_tanh": lambda z: jnp.tanh(z) * jnp.tanh(z),
    "softplus": jax.nn.softplus,
    "linear": lambda z: z,
}
# how many residual leaves each leaves out: tanh's `1 - y` (beside `y`), 5 of GELU's 7 products and
# sums of its input and tanh, ReLU's mask (beside its input), the second `tanh` of a square and its
# `1 - y`, SiLU's `1 - sigmoid` (beside the sigmoid); sigmoid alone keeps only `y * (1 - y)`
LEFT_OUT = {
    "tanh": 1, "gelu_tanh": 5, "sigmoid": 0, "silu": 1, "relu": 1, "square_of_tanh": 2, "softplus": 0,
    "linear": 0,
}  # fmt: skip


def layer(act):
    return lambda w, x: act(x @ w)


def probe_of(fn):
    """The vjp's residual leaves as a function of the inputs, and which of them are inputs."""
    sources = []

    def probe(*args):
        leaves = jax.tree.leaves(jax.vjp(fn, *args)[1])
        sources.append([next((k for k, a in enumerate(args) if leaf is a), None) for leaf in leaves])
        return leaves

    return probe, sources


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_rebuilt_residuals_equal_the_vjps_own_bit_for_bit(name):
    w = jax.random.normal(jax.random.key(0), (16, 16)) / 4
    x = jax.random.normal(jax.random.key(1), (4, 16))
    probe, sources = probe_of(layer(ACTIVATIONS[name]))
    closed = jax.make_jaxpr(probe)(w, x)
    produced = [k for k, src in enumerate(sources[0]) if src is None]
    derived = derived_residuals(closed, produced)
    left_out = set(range(len(closed.out_avals))) - set(derived.kept)
    assert left_out <= set(produced)  # an input is never made again
    assert len(left_out) == LEFT_OUT[name], (name, derived.kept, closed)
    leaves = jax.jit(probe)(w, x)
    rebuilt = derived.rebuild([leaves[k] for k in derived.kept])
    assert len(rebuilt) == len(leaves)
    for k, (got, want) in enumerate(zip(rebuilt, leaves)):
        assert np.asarray(got).dtype == np.asarray(want).dtype
        assert np.array_equal(np.asarray(got), np.asarray(want)), (name, k)


def test_a_value_made_by_a_transcendental_or_a_dot_is_kept():
    """Only `EXACT` equations are made again: softplus keeps its exponentials, a dot its output."""

    def fn(w, x):
        z = x @ w
        return jnp.exp(z) * z

    probe, sources = probe_of(fn)
    closed = jax.make_jaxpr(probe)(jnp.ones((3, 3)), jnp.ones((2, 3)))
    produced = [k for k, src in enumerate(sources[0]) if src is None]
    assert produced
    assert derived_residuals(closed, produced).kept == tuple(range(len(closed.out_avals)))
    made_by = producers(closed.jaxpr.eqns)
    names = {closed.jaxpr.eqns[made_by[closed.jaxpr.outvars[k]]].primitive.name for k in produced}
    assert names.isdisjoint(EXACT)


def mlp_loss(params, batch, act):
    x, y = batch
    h = x
    for k, p in enumerate(params):
        h = act(h @ p["w"] + p["b"])
        if k < len(params) - 1:
            h = mp.sxstage_iter(h)
    return jnp.mean((h - y) ** 2)


def checked_step(loss, params, batch, mesh, **settings):
    """A 2-rank Std1F1B step of `loss`, its loss and gradients checked against the unsplit ones."""
    step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=S.Std1F1B(microbatches=4), **settings)
    value, grads = step(params, batch)
    want_value, want_grads = jax.value_and_grad(loss)(params, batch)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    return step


def layers_of(key, n: int = 2, d: int = 8) -> list:
    return [
        {"w": jax.random.normal(k, (d, d)) / 3, "b": jnp.full((d,), 0.1)} for k in jax.random.split(key, n)
    ]


@pytest.fixture(scope="module")
def mesh():
    return mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])


@pytest.mark.parametrize("name", ["tanh", "gelu_tanh", "sigmoid", "relu"])
def test_a_step_with_residuals_left_out_equals_the_unsplit_gradient(mesh, name):
    act = ACTIVATIONS[name]
    params = layers_of(jax.random.key(2))
    batch = (jax.random.normal(jax.random.key(3), (8, 8)), jnp.zeros((8, 8)))

    def loss(p, b):
        return mlp_loss(p, b, act)

    step = checked_step(loss, params, batch, mesh)
    forward = step.plan_for(params, batch).cells[(0, "F")]
    outputs = jax.make_jaxpr(forward.fn)(*forward.in_specs).jaxpr.outvars
    probe, sources = probe_of(lambda w, b, x: act(x @ w + b))
    jax.make_jaxpr(probe)(params[0]["w"], params[0]["b"], batch[0][:2])
    produced = sum(src is None for src in sources[0])
    # the stage's output, the microbatch of x it slices, and what its vjp makes less the left-out
    assert len(outputs) == 1 + 1 + produced - LEFT_OUT[name], (name, outputs)


def looped_loss(params, batch):
    """Each stage runs its layer twice in a `lax.scan` and scales by a cosine: under a checkpoint
    policy, the vjp's residuals come out of a `closed_call`."""
    x, y = batch
    h = x
    for k, p in enumerate(params):
        h, _ = jax.lax.scan(lambda c, _, p=p: (jnp.tanh(c @ p["w"] + p["b"]), None), h, None, length=2)
        h = h * jnp.cos(jnp.arange(h.shape[-1], dtype=h.dtype))
        if k < len(params) - 1:
            h = mp.sxstage_iter(h)
    return jnp.mean((h - y) ** 2)


@pytest.mark.parametrize("remat", [False, "dots_saveable", "nothing_saveable"])
def test_a_step_over_loops_and_checkpoint_policies_equals_the_unsplit_gradient(mesh, remat):
    params = layers_of(jax.random.key(4))
    batch = (jax.random.normal(jax.random.key(5), (8, 8)), jnp.ones((8, 8)))
    checked_step(looped_loss, params, batch, mesh, remat=remat)
