"""A `cond` whose predicate is a constant, in the code after the pipelined backward.

JAX writes `lax.cond(True, ...)` with a literal index, and `optax.MultiSteps` (gradient
accumulation, with its default `should_skip_update_fn=None`) holds such a cond. Split
by ownership over the ranks whose values it reads, each share runs with the constant
(owned by nobody): the steps equal the unsplit ones on one device.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.extend.core import Literal
from mpmd_cases import assert_close

import spectrax_mpmd as mp
from spectrax_mpmd._trace.ownership import Program
from spectrax_core.schedules import Std1F1B

D, STEPS = 8, 4
MESH = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])
SCHEDULE = Std1F1B(microbatches=4)


def init():
    k = jax.random.split(jax.random.key(3), 5)
    params = {"w0": jax.random.normal(k[0], (6, D)) * 0.4, "w1": jax.random.normal(k[1], (D, 3)) * 0.4}
    batches = [
        tuple(jax.random.normal(jax.random.fold_in(key, i), s) for key, s in ((k[2], (8, 6)), (k[3], (8, 3))))
        for i in range(STEPS)
    ]
    return params, batches


def loss_fn(p, x, y):
    h = mp.sxstage_iter(jnp.tanh(x @ p["w0"]))  # w0 on rank 0, w1 on rank 1
    return jnp.mean((h @ p["w1"] - y) ** 2)


def steps(step, params, state, batches) -> list:
    """Every step's results, each step fed the parameters and state the last returned."""
    out = []
    for x, y in batches:
        result = step(params, state, x, y)
        params, state = result[1], result[2]
        out.append(jax.tree.map(jnp.copy, result))  # kept apart from the buffers the next step consumes
    return out


def unsplit(update):
    """`update` after `jax.value_and_grad` of the whole loss, on one device."""
    return jax.jit(lambda p, s, x, y: update(*jax.value_and_grad(loss_fn)(p, x, y), s, p))


def multisteps():
    return optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)


def optax_update(tx):
    def update(loss, grads, state, params):
        updates, state = tx.update(grads, state, params)
        return loss, optax.apply_updates(params, updates), state

    return update


def test_multisteps_holds_a_literal_predicate():
    params, batches = init()
    tx = multisteps()
    update = optax_update(tx)
    closed = jax.make_jaxpr(lambda p, s, g: update(0.0, g, s, p))(params, tx.init(params), params)
    program = Program.of(closed)  # calls inlined, as the ownership split sees it
    conds = [e for e in program.eqns if e.primitive.name == "cond"]
    assert conds and all(isinstance(e.invars[0], Literal) for e in conds)


def test_multisteps_in_the_one_plan_step_equals_the_unsplit_steps():
    params, batches = init()
    tx = multisteps()
    step = mp.sxvalue_and_grad_and_apply(loss_fn, tx, mesh=MESH, schedule=SCHEDULE, donate=False)
    want = steps(unsplit(optax_update(tx)), params, tx.init(params), batches)
    assert_close(steps(step, params, tx.init(params), batches), want)
    assert not jnp.allclose(want[0][1]["w0"], want[1][1]["w0"])  # the second step applied the update


def test_multisteps_in_a_hand_written_step_equals_the_unsplit_steps():
    params, batches = init()
    tx = multisteps()
    grads_of = mp.sxvalue_and_grad(loss_fn, mesh=MESH, schedule=SCHEDULE)
    update = optax_update(tx)
    step = mp.sxjit(lambda p, s, x, y: update(*grads_of(p, x, y), s, p), mesh=MESH, donate_argnums=(0, 1))
    want = steps(unsplit(update), params, tx.init(params), batches)
    assert_close(steps(step, jax.tree.map(jnp.copy, params), tx.init(params), batches), want)


def scale_by_cond(loss, grads, state, params):
    """Both ranks' gradients and an unowned counter through one cond with a literal index."""
    g0, g1, count = jax.lax.cond(
        True,
        lambda a, b, c: (a * 2.0, b * 3.0, c + 1),
        lambda a, b, c: (a, b, c),
        grads["w0"],
        grads["w1"],
        state,
    )
    return loss, {"w0": params["w0"] - 0.1 * g0, "w1": params["w1"] - 0.1 * g1}, count


def switch_by_constant(loss, grads, state, params):
    """The same through a three-way switch whose index is a constant expression (JAX clamps the
    index: a value computed from literals, owned by nobody)."""
    branches = [
        lambda a, b, c: (a, b, c),
        lambda a, b, c: (a * 2.0, b * 3.0, c + 1),
        lambda a, b, c: (a + 1.0, b, c - 1),
    ]
    g0, g1, count = jax.lax.switch(1, branches, grads["w0"], grads["w1"], state)
    return loss, {"w0": params["w0"] - 0.1 * g0, "w1": params["w1"] - 0.1 * g1}, count


@pytest.mark.parametrize("update", [scale_by_cond, switch_by_constant], ids=lambda f: f.__name__)
def test_a_constant_predicate_over_two_ranks_values(update):
    params, batches = init()
    grads_of = mp.sxvalue_and_grad(loss_fn, mesh=MESH, schedule=SCHEDULE)
    step = mp.sxjit(lambda p, s, x, y: update(*grads_of(p, x, y), s, p), mesh=MESH)
    want = steps(unsplit(update), params, jnp.int32(0), batches)
    got = steps(step, params, jnp.int32(0), batches)
    assert_close(got, want)
    assert int(got[-1][2]) == STEPS
