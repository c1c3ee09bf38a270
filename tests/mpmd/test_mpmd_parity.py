"""`check_parity` compares a built step with its unsplit reference leaf by leaf: small distances for
an exact step, the planted difference for a wrong reference, the caller's arrays left alive."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import spectrax_mpmd as mp
from spectrax_core.schedules import Std1F1B

SCHEDULE = Std1F1B(microbatches=4)


@functools.cache
def mesh():
    return mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])


def inputs():
    k = jax.random.split(jax.random.key(0), 4)
    p = {"a": jax.random.normal(k[0], (8, 8)) * 0.3, "b": jax.random.normal(k[1], (8, 4)) * 0.3}
    return p, jax.random.normal(k[2], (16, 8)), jax.random.normal(k[3], (16, 4))


def loss(p, x, y):
    h = mp.sxstage_iter(jnp.tanh(x @ p["a"]))
    return jnp.mean((h @ p["b"] - y) ** 2)


def test_an_exact_step_is_within_float32_rounding_of_its_reference():
    report = mp.check_parity(mp.sxvalue_and_grad(loss, mesh=mesh(), schedule=SCHEDULE), *inputs())
    assert [r.path for r in report.rows] == ["", "['a']", "['b']"]
    assert [r.group for r in report.rows] == ["loss", "grads", "grads"]
    assert report.ok(1e-5) and "worst" in str(report)


def test_a_reference_that_differs_is_reported_leaf_by_leaf():
    step = mp.sxvalue_and_grad(loss, mesh=mesh(), schedule=SCHEDULE)
    doubled = jax.value_and_grad(lambda p, x, y: 2 * loss(p, x, y))
    report = mp.check_parity(step, *inputs(), reference=doubled)
    assert not report.ok() and all(r.rel_l2 == pytest.approx(0.5, rel=1e-4) for r in report.rows)


def test_the_one_plan_step_compares_parameters_and_optimizer_state_and_consumes_nothing():
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
    step = mp.sxvalue_and_grad_and_apply(loss, tx, mesh=mesh(), schedule=SCHEDULE)
    p, x, y = inputs()
    state = tx.init(p)
    report = mp.check_parity(step, p, state, x, y)
    groups = {r.group for r in report.rows}
    assert groups == {"loss", "params", "opt_state"} and report.ok(1e-5)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves((p, state)))


def test_aux_stacked_per_microbatch_is_listed_not_compared():
    step = mp.sxvalue_and_grad(
        lambda p, x, y: (loss(p, x, y), x.sum()), mesh=mesh(), schedule=SCHEDULE, has_aux=True
    )
    report = mp.check_parity(step, *inputs())
    aux = [r for r in report.rows if r.group == "aux"]
    assert len(aux) == 1 and aux[0].rel_l2 is None and "stacked per microbatch" in str(report)


def test_another_callable_needs_a_reference():
    with pytest.raises(mp.MpmdError, match="reference="):
        mp.check_parity(lambda p, x, y: loss(p, x, y), *inputs())
