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


# --- the train step written by hand inside sxjit ----------------------------------------------


def test_a_hand_written_train_step_with_metrics_traced_once():
    """`sxvalue_and_grad` called inside `sxjit`, then optax, clipping and metrics: one plan."""
    tx = clipped_adam(0.05)
    mesh, schedule = pipeline_mesh(4), make_schedule("ZeroBubbleH1", 4)
    grad_step = mp.sxvalue_and_grad(hetero_loss, mesh=mesh, schedule=schedule)

    def train_step(params, opt_state, batch):
        loss, grads = grad_step(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "head_max": jnp.max(grads["head"])}
        return optax.apply_updates(params, updates), opt_state, metrics

    def reference_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(hetero_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "head_max": jnp.max(grads["head"])}
        return optax.apply_updates(params, updates), opt_state, metrics

    step = mp.sxjit(train_step, mesh=mesh, donate_argnums=(0, 1))
    params = hetero_params(jax.random.key(4), 4)
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    rp, rs = params, tx.init(params)
    for batch in batches(3):
        p, s, metrics = step(p, s, batch)
        rp, rs, ref_metrics = jax.jit(reference_step)(rp, rs, batch)
        assert_close(metrics, ref_metrics)
    assert_close((p, s), (rp, rs))
    assert len(step.cache) == 1


def test_treduce_inside_sxjit_is_the_pipeline():
    tx = optax.adam(1e-2)
    schedule = make_schedule("Std1F1B", 4)

    def train_step(params, opt_state, xs):
        def loss_of(p):
            def body(mb):
                return hetero_loss(p, mb), jnp.argmax(p["embed"]["table"][mb[0]].sum(-1), -1)

            return mp.treduce(body, xs, schedule, operation=(mp.Mean, mp.Concat))

        (loss, picks), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, picks, optax.apply_updates(params, updates), opt_state

    params = hetero_params(jax.random.key(4), 4)
    tokens, labels = batches(1)[0]
    xs = (tokens.reshape(4, 4, *tokens.shape[1:]), labels.reshape(4, 4))
    step = mp.sxjit(train_step, mesh=pipeline_mesh(4))
    got = step(params, tx.init(params), xs)
    want = jax.jit(train_step)(params, tx.init(params), xs)  # outside sxjit: a plain loop
    assert got[1].shape == (16,)
    assert_close(got, want)
    loss, grads = jax.value_and_grad(hetero_loss)(params, (tokens, labels))
    assert_close(got[0], loss)


def test_treduce_reductions_without_differentiation():
    schedule = make_schedule("GPipe", 4)

    def evaluate(params, xs):
        def body(mb):
            value = hetero_loss(params, mb)
            return value, {"max": value, "each": value[None]}

        return mp.treduce(body, xs, schedule, operation=(mp.Add, {"max": mp.Max, "each": mp.Concat}))

    params = hetero_params(jax.random.key(4), 4)
    tokens, labels = batches(1)[0]
    xs = (tokens.reshape(4, 4, *tokens.shape[1:]), labels.reshape(4, 4))
    got = mp.sxjit(evaluate, mesh=pipeline_mesh(4))(params, xs)
    each = jnp.stack(
        [hetero_loss(params, (tokens[4 * i : 4 * i + 4], labels[4 * i : 4 * i + 4])) for i in range(4)]
    )
    assert_close(got, (jnp.sum(each), {"max": jnp.max(each), "each": each}))


def test_train_step_errors_name_the_rule():
    mesh, schedule = pipeline_mesh(4), make_schedule("Std1F1B", 4)
    grad_step = mp.sxvalue_and_grad(hetero_loss, mesh=mesh, schedule=schedule)
    params = hetero_params(jax.random.key(4), 4)
    batch = batches(1)[0]

    def twice(params, batch):
        return grad_step(params, batch)[0] + grad_step(params, batch)[0]

    with pytest.raises(mp.MpmdError, match="calls a pipelined step 2 time"):
        mp.sxjit(twice, mesh=mesh)(params, batch)

    def computed(params, batch):
        return grad_step(jax.tree.map(lambda x: 2 * x, params), batch)[0]

    with pytest.raises(mp.MpmdError, match="reads a value computed inside the function"):
        mp.sxjit(computed, mesh=mesh)(params, batch)
    xs = jax.tree.map(lambda x: x.reshape(8, 2, *x.shape[1:]), batch)
    with pytest.raises(mp.MpmdError, match="8 microbatches on axis 0 but schedule.microbatches=4"):
        mp.sxjit(lambda p, xs: mp.treduce(lambda mb: hetero_loss(p, mb), xs, schedule), mesh=mesh)(params, xs)
    with pytest.raises(mp.TraceContextError):
        jax.jit(lambda p, b: grad_step(p, b)[0])(params, batch)


def test_a_two_region_model():
    from test_mpmd_regions import VISION, batch, mesh, tower_params, towers_loss

    from spectrax_core import schedules as S

    text = ("text", S.Std1F1B(4), 2)
    loss = towers_loss((VISION,), text)
    params = tower_params(jax.random.PRNGKey(0), (VISION,), 2)
    data = [batch((VISION,), jax.random.PRNGKey(k)) for k in range(3)]
    tx = clipped_adam(0.1)
    step = mp.sxvalue_and_grad_and_apply(loss, tx, mesh=mesh(4), schedule=S.Std1F1B(4))

    def unsplit(p, s, args):
        value, g = jax.value_and_grad(loss)(p, *args)
        updates, s = tx.update(g, s, p)
        return value, optax.apply_updates(p, updates), s

    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    rp, rs = params, tx.init(params)
    for args in data:
        value, p, s = step(p, s, *args)
        ref, rp, rs = jax.jit(unsplit)(rp, rs, args)
        assert_close(value, ref)
    assert_close((p, s), (rp, rs))


# --- clipping and non-finite skips: synchronous and validated after the fact ------------------


def _scaled_loss(params, batch, factor):
    return hetero_loss(params, batch) * factor


FACTORS = [jnp.float32(f) for f in (1.0, 4.0, 1.0, jnp.inf, 0.5)]


def _guarded_reference(tx, max_norm, params):
    """Unsplit steps through `optax.clip_by_global_norm` then `tx`, a non-finite step dropped."""
    chain = optax.chain(optax.clip_by_global_norm(max_norm), tx)

    @jax.jit
    def step(p, s, batch, factor):
        loss, g = jax.value_and_grad(_scaled_loss)(p, batch, factor)
        finite = jnp.isfinite(optax.tree.norm(g))
        updates, new_s = chain.update(g, s, p)
        new = (optax.apply_updates(p, updates), new_s)
        return loss, *jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, (p, s))

    p, s, losses = params, chain.init(params), []
    for batch, factor in zip(batches(), FACTORS):
        loss, p, s = step(p, s, batch, factor)
        losses.append(loss)
    return losses, p, s[1]


@pytest.mark.parametrize("validation", ["sync", "post"])
def test_clipping_and_skips_match_the_unsplit_update(validation):
    tx = optax.adam(1e-2)
    params = hetero_params(jax.random.key(4), 4)
    max_norm = 1.5 * gradient_norm(4)  # triggers at the step scaled by 4 only
    step = mp.sxvalue_and_grad_and_apply(
        _scaled_loss,
        tx,
        mesh=pipeline_mesh(4),
        schedule=make_schedule("ZeroBubbleH1", 4),
        batch_argnums=1,
        max_grad_norm=max_norm,
        skip_nonfinite=True,
        validation=validation,
    )
    got = pipelined(step, tx, params, batches(), FACTORS)
    want = _guarded_reference(tx, max_norm, params)
    for a, b in zip(got[0], want[0]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)
    assert_close(got[1], want[1])
    assert_close(got[2], want[2])
    entry = step.last_entry
    leaves = jax.tree.leaves((params, tx.init(params), batches(1)[0], FACTORS[0]))
    assert all(shape == () for shape in _epilogue_moves(entry.plan, entry.place(step.placer, leaves)))


def _update_positions(plan) -> dict:
    """Per rank, the positions of the plan's steps that belong to no schedule action and run a
    compiled cell there (the gradient reduction's and the update's)."""
    inside = {k for *_, first, end in plan.action_steps for k in range(first, end)}
    start = min(first for *_, first, _ in plan.action_steps)  # before it: the accumulators' setup
    out: dict = {}
    for k, step in enumerate(plan.steps):
        shardings = getattr(step.fn, "output_shardings", None)
        if k < start or k in inside or not shardings:
            continue
        rank = plan.device_rank[next(iter(shardings[0].device_set))]
        out.setdefault(rank, []).append(k)
    return out


def test_each_rank_updates_right_after_its_own_last_backward():
    """Without a global condition, every rank's update is issued as soon as its last backward
    action is: before the actions of other ranks that end later (1F1B: rank 0 ends last)."""
    tx = optax.adam(1e-2)
    params = hetero_params(jax.random.key(4), 4)
    step = mp.sxvalue_and_grad_and_apply(
        hetero_loss, tx, mesh=pipeline_mesh(4), schedule=make_schedule("Std1F1B", 4), donate=False
    )
    p, s = step(params, tx.init(params), batches(1)[0])[1:]
    plan = step.last_entry.plan
    # the last action issuing a step (the last stage's loss cell runs its backward in its F)
    last_end = {
        rank: max(end for r, _, first, end in plan.action_steps if r == rank and end > first)
        for rank in range(4)
    }
    updates = _update_positions(plan)
    assert sorted(updates) == [0, 1, 2, 3]
    for rank, positions in updates.items():
        assert min(positions) == last_end[rank], (rank, positions, last_end)
    assert max(updates[3]) < last_end[0]
    assert_close((p, s), reference(hetero_loss, tx, params, batches(1))[1:])
