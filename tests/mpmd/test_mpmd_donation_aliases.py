"""One array passed twice to a donating call: refused before any device work, naming both leaves.

The call consumes a donated array, so it cannot read it again through another leaf: an
optimizer state holding the parameter arrays themselves, a batch that is a parameter, one tree
in two donated arguments. Nothing is deleted by the refusal; a copy, or `donate=False`, runs.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from mpmd_cases import assert_close

import spectrax_mpmd as mp
from spectrax_core.schedules import Std1F1B

MESH = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])
SCHEDULE = Std1F1B(microbatches=2)


def loss_fn(p, x, y):
    h = mp.sxstage_iter(jnp.tanh(x @ p["w0"]))
    return jnp.mean((h @ p["w1"] - y) ** 2)


def toward_init(rate: float) -> optax.GradientTransformation:
    """Decay toward the initial weights; its state holds the parameter arrays themselves."""

    def update(g, anchor, params):
        return jax.tree.map(lambda g, p, a: g + rate * (p - a), g, params, anchor), anchor

    return optax.GradientTransformation(lambda params: params, update)


TX = optax.chain(toward_init(0.1), optax.sgd(0.1))


def init():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w0": jax.random.normal(k[0], (8, 8)) * 0.3, "w1": jax.random.normal(k[1], (8, 4)) * 0.3}
    return params, jax.random.normal(k[2], (8, 8)), jax.random.normal(k[3], (8, 4))


def unsplit(params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = TX.update(grads, state, params)
    return loss, optax.apply_updates(params, updates), state


def alive(tree) -> bool:
    return not any(leaf.is_deleted() for leaf in jax.tree.leaves(tree))


def test_a_state_holding_the_parameters_is_refused_naming_both_leaves():
    params, x, y = init()
    step = mp.sxvalue_and_grad_and_apply(loss_fn, TX, mesh=MESH, schedule=SCHEDULE)
    with pytest.raises(mp.MpmdError) as raised:
        step(params, TX.init(params), x, y)
    message = str(raised.value)
    assert "argument 1[0]['w0'] is the same array as argument 0['w0']" in message
    assert "donate=False" in message and "jax.tree.map(jnp.copy, opt_state)" in message
    assert alive(params) and alive((x, y))
    want = unsplit(params, TX.init(params), x, y)
    copied = jax.tree.map(jnp.copy, params)
    assert_close(step(copied, jax.tree.map(jnp.copy, TX.init(copied)), x, y), want)


def test_without_donation_the_shared_arrays_are_read_and_kept():
    params, x, y = init()
    step = mp.sxvalue_and_grad_and_apply(loss_fn, TX, mesh=MESH, schedule=SCHEDULE, donate=False)
    got = step(params, TX.init(params), x, y)
    assert_close(got, unsplit(params, TX.init(params), x, y))
    assert alive(params)


def test_a_batch_that_is_a_donated_parameter_is_refused_and_kept():
    params, _, y = init()
    tx = optax.sgd(0.1)
    step = mp.sxvalue_and_grad_and_apply(loss_fn, tx, mesh=MESH, schedule=SCHEDULE)
    x = params["w0"]  # (8, 8): a batch of 8 rows
    with pytest.raises(mp.MpmdError, match=r"argument 2 is the same array as argument 0\['w0'\]"):
        step(params, tx.init(params), x, y)
    assert alive(params) and alive(x)


def test_one_tree_in_two_donated_arguments_of_sxjit_is_refused():
    params, x, y = init()
    grads_of = mp.sxvalue_and_grad(loss_fn, mesh=MESH, schedule=SCHEDULE)

    def step(p, anchor, x, y):
        loss, g = grads_of(p, x, y)
        return loss, jax.tree.map(lambda p, g, a: p - 0.1 * g - 0.01 * (p - a), p, g, anchor)

    jitted = mp.sxjit(step, mesh=MESH, donate_argnums=(0, 1))
    with pytest.raises(mp.MpmdError, match=r"argument 1 \('anchor'\)\['w0'\] is the same array as"):
        jitted(params, params, x, y)
    assert alive(params)


def test_a_runner_without_a_pipeline_axis_refuses_a_state_holding_the_parameters():
    """The one SPMD program donates too: refused before placement, naming both leaves."""

    def apply_fn(params, x):
        return jnp.tanh(x @ params["w0"]) @ params["w1"]

    params, x, y = init()
    step = mp.runner(
        mesh=mp.create_mesh((1, 2, -1, 1, 1, 1)),
        loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
        apply_fn=apply_fn,
        microbatches=2,
        tx=TX,
    )
    with pytest.raises(mp.MpmdError, match=r"opt_state\[0\]\['w0'\] is the same array as params\['w0'\]"):
        step.update(params, TX.init(params), x, y)
    assert alive((params, x, y))
