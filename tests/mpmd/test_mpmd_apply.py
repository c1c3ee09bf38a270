"""The training step with its optimizer update (`sxvalue_and_grad_and_apply`).

Every run is compared after 5 steps with the same optax transformation applied
by `jax.value_and_grad` + `tx.update` + `optax.apply_updates` on the unsplit
function, on one device: the loss of every step, the parameters and the whole
optimizer state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from mpmd_cases import (
    ALL,
    assert_close,
    config_of,
    hetero_batch,
    hetero_loss,
    hetero_params,
    lm_batch,
    make_schedule,
    microbatches_for,
    pipeline_mesh,
    pipelined_lm_loss,
    tiny_lm,
)

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_core import sharding as core_sharding
from spectrax_mpmd._comm import is_transfer
from spectrax_mpmd._runtime.replay import replay

STEPS = 5


def reference(loss_fn, tx, params, batches, *extra):
    """Losses, parameters and optimizer state after `len(batches)` unsplit steps."""

    @jax.jit
    def step(p, s, batch, *extra):
        loss, g = jax.value_and_grad(loss_fn)(p, batch, *extra)
        updates, s = tx.update(g, s, p)
        return loss, optax.apply_updates(p, updates), s

    p, s, losses = params, tx.init(params), []
    for k, batch in enumerate(batches):
        loss, p, s = step(p, s, batch, *(e[k] for e in extra))
        losses.append(loss)
    return losses, p, s


def pipelined(step, tx, params, batches, *extra):
    p, s, losses = jax.tree.map(jnp.copy, params), tx.init(params), []
    for k, batch in enumerate(batches):
        loss, p, s = step(p, s, batch, *(e[k] for e in extra))
        losses.append(loss)
    return losses, p, s


def assert_same_run(got, want):
    for a, b in zip(got[0], want[0]):
        assert_close(a, b)
    assert_close(got[1], want[1])
    assert_close(got[2], want[2])


def batches(n=STEPS):
    return [hetero_batch(jax.random.key(100 + k)) for k in range(n)]


def clipped_adam(max_norm):
    return optax.chain(optax.clip_by_global_norm(max_norm), optax.adam(1e-2))


def gradient_norm(n_stages):
    params = hetero_params(jax.random.key(n_stages), n_stages)
    return float(optax.tree.norm(jax.grad(hetero_loss)(params, batches(1)[0])))


@functools.cache
def run_schedule(name: str, max_norm: float):
    n, v = config_of(name)
    schedule = make_schedule(name, microbatches_for(name, n), v)
    n_stages = n * schedule.virtual_stages
    params = hetero_params(jax.random.key(n_stages), n_stages)
    tx = clipped_adam(max_norm)
    step = mp.sxvalue_and_grad_and_apply(hetero_loss, tx, mesh=pipeline_mesh(n), schedule=schedule)
    return step, pipelined(step, tx, params, batches()), reference(hetero_loss, tx, params, batches())


@pytest.mark.parametrize("name", ALL)
def test_every_schedule_matches_the_unsplit_update_with_clipping_that_triggers(name):
    n, v = config_of(name)
    schedule = make_schedule(name, microbatches_for(name, n), v)
    max_norm = 0.5 * gradient_norm(n * schedule.virtual_stages)
    _, got, want = run_schedule(name, max_norm)
    assert_same_run(got, want)


def test_dualpipe_sums_both_copies_before_the_update():
    """DualPipe runs two copies of every stage on different ranks: each leaf's update reads the sum
    of its copies' gradients on its owner, and clipping sees the loss of both directions."""
    tx = clipped_adam(0.5 * gradient_norm(4))
    params = hetero_params(jax.random.key(4), 4)
    step = mp.sxvalue_and_grad_and_apply(hetero_loss, tx, mesh=pipeline_mesh(4), schedule=S.DualPipe(8))
    assert_same_run(pipelined(step, tx, params, batches()), reference(hetero_loss, tx, params, batches()))


def test_clipping_that_does_not_trigger():
    max_norm = 10 * gradient_norm(4)
    _, got, want = run_schedule("Std1F1B", max_norm)
    assert_same_run(got, want)


def _epilogue_moves(plan, placed) -> list[tuple]:
    """The shapes of every array moved between ranks after the last schedule action."""
    start = max(end for *_, end in plan.action_steps)
    moved = []

    def call(k, fn, args):
        if k >= start and is_transfer(fn):
            moved.extend(np.shape(a) for a in args)
        return fn(*args)

    replay(plan, placed, call=call)
    return moved


def test_only_scalars_cross_ranks_in_a_clipped_update():
    step, _, _ = run_schedule("Std1F1B", 0.5 * gradient_norm(4))
    entry = step.last_entry
    params = hetero_params(jax.random.key(4), 4)
    leaves = jax.tree.leaves((params, clipped_adam(1.0).init(params), batches(1)[0]))
    placed = entry.place(step.placer, leaves)
    moved = _epilogue_moves(entry.plan, placed)
    assert moved and all(shape == () for shape in moved), moved


def test_non_finite_gradients_are_skipped_as_unsplit():
    def loss(params, batch, factor):
        return hetero_loss(params, batch) * factor

    factors = [jnp.float32(f) for f in (1.0, jnp.inf, 1.0, jnp.nan, 1.0)]
    tx = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=5)
    params = hetero_params(jax.random.key(4), 4)
    step = mp.sxvalue_and_grad_and_apply(
        loss, tx, mesh=pipeline_mesh(4), schedule=make_schedule("ZeroBubbleH1", 4), batch_argnums=1
    )
    got = pipelined(step, tx, params, batches(), factors)
    want = reference(loss, tx, params, batches(), factors)
    assert int(got[2].total_notfinite) == 2
    assert_close(got[1], want[1])
    assert_close(got[2], want[2])
    for a, b in zip(got[0], want[0]):
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))


def test_a_different_transformation_per_stage():
    labels = {"embed": "sgd", "blocks": "adam", "head": "adamw"}
    tx = optax.multi_transform(
        {"sgd": optax.sgd(0.1, momentum=0.9), "adam": optax.adam(1e-2), "adamw": optax.adamw(1e-2)},
        lambda params: {k: jax.tree.map(lambda _: labels[k], v) for k, v in params.items()},
    )
    params = hetero_params(jax.random.key(4), 4)
    step = mp.sxvalue_and_grad_and_apply(
        hetero_loss, tx, mesh=pipeline_mesh(4), schedule=make_schedule("Eager1F1B", 4)
    )
    assert_same_run(pipelined(step, tx, params, batches()), reference(hetero_loss, tx, params, batches()))


def orthogonalized(steps: int = 5) -> optax.GradientTransformation:
    """A Muon-like update: each matrix's gradient replaced by a Newton–Schulz orthogonalisation,
    which needs the whole matrix."""

    def orthogonalize(g):
        if g.ndim != 2:
            return g
        x = g / (jnp.linalg.norm(g) + 1e-7)
        return jax.lax.fori_loop(0, steps, lambda _, x: 1.5 * x - 0.5 * (x @ x.T) @ x, x)

    def update(updates, state, params=None):
        return jax.tree.map(orthogonalize, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def test_a_per_matrix_update_runs_whole_on_each_owner():
    tx = optax.chain(orthogonalized(), optax.sgd(0.05, momentum=0.9))
    params = hetero_params(jax.random.key(4), 4)
    step = mp.sxvalue_and_grad_and_apply(
        hetero_loss, tx, mesh=pipeline_mesh(4), schedule=make_schedule("Std1F1B", 4)
    )
    assert_same_run(pipelined(step, tx, params, batches()), reference(hetero_loss, tx, params, batches()))
    entry = step.last_entry
    leaves = jax.tree.leaves((params, tx.init(params), batches(1)[0]))
    assert _epilogue_moves(entry.plan, entry.place(step.placer, leaves)) == []


def test_tied_and_sharded_parameters_keep_their_layout():
    """The core LM with tied embeddings (one leaf read by both ranks) on 2 ranks of fsdp=2 x tp=2:
    the update matches, and every parameter and moment comes back laid out as the parameter."""
    mesh = mp.create_mesh((2, 1, 2, 1, 2, 1), mpmd_axis="pp")
    lm = tiny_lm(jax.random.key(3), n_layers=2, tie_embeddings=True)
    loss_fn = pipelined_lm_loss((1, 1), sharding=P("fsdp"))
    tx = clipped_adam(0.1)
    data = [lm_batch(jax.random.key(k), 8) for k in range(3)]
    rules = core_sharding.Rules.default()
    step = mp.sxvalue_and_grad_and_apply(
        loss_fn, tx, mesh=mesh, schedule=make_schedule("Std1F1B", 2), rules=rules
    )
    got = pipelined(step, tx, lm, data)
    assert_same_run(got, reference(loss_fn, tx, lm, data))
    _, new_params, state = got
    mu = state[1][0].mu
    for p, m in zip(jax.tree.leaves(new_params), jax.tree.leaves(mu)):
        assert m.sharding == p.sharding, (m.sharding, p.sharding)


def test_aux_results_come_back_stacked_per_microbatch():
    def loss(params, batch):
        value = hetero_loss(params, batch)
        return value, {"double": 2 * value}

    tx = optax.sgd(0.1)
    params = hetero_params(jax.random.key(4), 4)
    step = mp.sxvalue_and_grad_and_apply(
        loss, tx, mesh=pipeline_mesh(4), schedule=make_schedule("GPipe", 4), has_aux=True
    )
    (value, aux), new_params, _ = step(jax.tree.map(jnp.copy, params), tx.init(params), batches(1)[0])
    ref_loss, ref_grads = jax.value_and_grad(lambda p, b: loss(p, b)[0])(params, batches(1)[0])
    assert_close(value, ref_loss)
    assert aux["double"].shape == (4,)
    assert_close(jnp.mean(aux["double"]), 2 * ref_loss)
    assert_close(new_params, jax.tree.map(lambda p, g: p - 0.1 * g, params, ref_grads))


def test_donation_consumes_the_arguments_unless_turned_off():
    tx = optax.adam(1e-2)
    params = hetero_params(jax.random.key(4), 4)
    kwargs = dict(mesh=pipeline_mesh(4), schedule=make_schedule("Std1F1B", 4))
    step = mp.sxvalue_and_grad_and_apply(hetero_loss, tx, **kwargs)
    _, p1, s1 = step(jax.tree.map(jnp.copy, params), tx.init(params), batches(1)[0])
    _, p2, s2 = step(p1, s1, batches(1)[0])
    assert all(x.is_deleted() for x in jax.tree.leaves((p1, s1)))
    keep = mp.sxvalue_and_grad_and_apply(hetero_loss, tx, donate=False, **kwargs)
    _, q1, t1 = keep(jax.tree.map(jnp.copy, params), tx.init(params), batches(1)[0])
    _, q2, _ = keep(q1, t1, batches(1)[0])
    assert not any(x.is_deleted() for x in jax.tree.leaves((q1, t1)))
    assert_close(q2, p2)


def test_bad_input_gets_a_clear_error():
    params = hetero_params(jax.random.key(4), 4)
    kwargs = dict(mesh=pipeline_mesh(4), schedule=make_schedule("Std1F1B", 4))
    step = mp.sxvalue_and_grad_and_apply(hetero_loss, optax.adam(1e-2), **kwargs)
    other = optax.sgd(0.1, momentum=0.9).init(params)
    with pytest.raises(mp.MpmdError, match=r"opt_state \(argument 1\) does not match tx.init\(params\)"):
        step(params, other, batches(1)[0])
    with pytest.raises(mp.MpmdError, match=r"step\(params, opt_state, \*batch\)"):
        step(params)
    with pytest.raises(mp.MpmdError, match="optax.GradientTransformation"):
        mp.sxvalue_and_grad_and_apply(hetero_loss, "adam", **kwargs)
    vector = mp.sxvalue_and_grad_and_apply(
        lambda p, b: jnp.full(3, hetero_loss(p, b)), optax.adam(1e-2), **kwargs
    )
    with pytest.raises(mp.MpmdError, match="floating-point scalar"):
        vector(params, optax.adam(1e-2).init(params), batches(1)[0])
