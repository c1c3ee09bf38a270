"""`sxvalue_and_grad` / `sxgrad` options: aux outputs, several argnums, unused and skip-connected
parameters, and fresh argument values on every call."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpmd_cases import assert_close, make_schedule, pipeline_mesh, unaligned_copy

import spectrax_mpmd as mp

M = 4  # microbatches


def _params():
    k = jax.random.split(jax.random.key(21), 4)
    return {
        "w0": jax.random.normal(k[0], (6, 7)) * 0.4,
        "w1": jax.random.normal(k[1], (7, 5)) * 0.4,
        "unused": jnp.ones((3,)),
    }


def _batch():
    k1, k2 = jax.random.split(jax.random.key(22))
    return jax.random.normal(k1, (16, 6)), jax.random.normal(k2, (16, 5))


def loss_with_aux(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w0"])
    first_aux = jnp.mean(h, axis=0)  # computed in stage 0
    h = mp.sxstage_iter(h)
    err = h @ p["w1"] - y
    loss = jnp.mean(err**2)
    return loss, {"h_mean": first_aux, "err_max": jnp.max(jnp.abs(err)), "rows": jnp.int32(x.shape[0])}


def plain_loss(p, batch):
    return loss_with_aux(p, batch)[0]


@pytest.fixture(scope="module")
def mesh2():
    return pipeline_mesh(2)


@pytest.fixture(scope="module")
def aux_step(mesh2):
    step = mp.sxvalue_and_grad(loss_with_aux, mesh=mesh2, schedule=make_schedule("Std1F1B", M), has_aux=True)
    return step, step(_params(), _batch())


def test_has_aux_returns_loss_aux_and_exact_grads(aux_step):
    _, ((loss, aux), grads) = aux_step
    (ref_loss, _), ref_grads = jax.value_and_grad(loss_with_aux, has_aux=True)(_params(), _batch())
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    np.testing.assert_array_equal(grads["unused"], np.zeros(3))


def test_aux_is_stacked_over_microbatches(aux_step):
    _, ((_, aux), _) = aux_step
    x, y = _batch()
    size = x.shape[0] // M
    micro = [(x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]) for i in range(M)]
    per_micro = [loss_with_aux(_params(), b)[1] for b in micro]
    expected = jax.tree.map(lambda *xs: jnp.stack(xs), *per_micro)
    assert aux["h_mean"].shape == (M, 7) and aux["rows"].dtype == jnp.int32
    assert_close(aux, expected)


def test_sxgrad_returns_grads_and_aux(mesh2):
    schedule = make_schedule("GPipe", M)
    grads = mp.sxgrad(plain_loss, mesh=mesh2, schedule=schedule)(_params(), _batch())
    assert_close(grads, jax.grad(plain_loss)(_params(), _batch()))
    grads2, aux = mp.sxgrad(loss_with_aux, mesh=mesh2, schedule=schedule, has_aux=True)(_params(), _batch())
    assert_close(grads2, grads)
    assert aux["err_max"].shape == (M,)


def test_several_argnums_give_a_tuple_of_grads(mesh2):
    def loss(first, second, batch):
        return plain_loss({**first, **second}, batch)

    p = _params()
    first, second = {"w0": p["w0"]}, {"w1": p["w1"], "unused": p["unused"]}
    step = mp.sxvalue_and_grad(loss, argnums=(0, 1), mesh=mesh2, schedule=make_schedule("Std1F1B", M))
    value, grads = step(first, second, _batch())
    ref_value, ref_grads = jax.value_and_grad(loss, argnums=(0, 1))(first, second, _batch())
    assert isinstance(grads, tuple) and len(grads) == 2
    assert_close(value, ref_value)
    assert_close(grads, ref_grads)


def test_new_parameter_values_give_new_results(aux_step):
    step, ((loss, _), _) = aux_step
    scaled = jax.tree.map(lambda w: w * 0.5, _params())
    (loss2, _), grads2 = step(scaled, _batch())
    (ref_loss, _), ref_grads = jax.value_and_grad(loss_with_aux, has_aux=True)(scaled, _batch())
    assert not np.isclose(loss, loss2)
    assert_close(loss2, ref_loss)
    assert_close(grads2, ref_grads)


def test_numpy_parameters_changed_in_place_are_placed_again(mesh2):
    step = mp.sxvalue_and_grad(plain_loss, mesh=mesh2, schedule=make_schedule("GPipe", M))
    params = jax.tree.map(unaligned_copy, _params())
    before = float(step(params, _batch())[0])
    params["w1"] *= 0.5
    after = float(step(params, _batch())[0])
    np.testing.assert_allclose(before, plain_loss(_params(), _batch()), rtol=1e-5)
    np.testing.assert_allclose(after, plain_loss(jax.tree.map(np.asarray, params), _batch()), rtol=1e-5)


def test_skip_connection_across_stages():
    """A value made in stage 0 and read again in stage 2 travels there; its gradient comes back summed."""
    mesh = pipeline_mesh(4)
    k = jax.random.split(jax.random.key(23), 4)
    params = [jax.random.normal(k[i], (6, 6)) * 0.4 for i in range(4)]

    def loss(p, batch):
        x, y = batch
        h0 = x @ p[0]
        a = mp.sxstage_iter(jnp.tanh(h0))
        b = mp.sxstage_iter(jnp.tanh(a @ p[1]))
        c = mp.sxstage_iter(jnp.tanh(b @ p[2]) + h0)
        return jnp.mean((c @ p[3] - y) ** 2)

    batch = (_batch()[0], jax.random.normal(k[3], (16, 6)))
    step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=make_schedule("Std1F1B", M))
    value, grads = step(params, batch)
    ref_value, ref_grads = jax.value_and_grad(loss)(params, batch)
    assert_close(value, ref_value)
    assert_close(grads, ref_grads)
    edges = {(e.src, e.dst) for e in step.last_graph.edges}
    assert (0, 2) in edges


def test_building_and_running_a_step_warns_nothing(mesh2):
    """No DeprecationWarning (JAX turns today's deprecations into tomorrow's errors)."""
    step = mp.sxvalue_and_grad(plain_loss, mesh=mesh2, schedule=make_schedule("Eager1F1B", M))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        value, grads = step(_params(), _batch())
    assert_close(grads, jax.grad(plain_loss)(_params(), _batch()))


@jax.jit
def _jitted_block(w, h):
    """A jitted helper that ends its own stage: called twice, inlined twice."""
    return mp.sxstage_iter(jnp.tanh(h @ w))


def loss_with_markers_in_helpers(p, batch):
    x, y = batch
    h = _jitted_block(p["a"], x)  # stage 0 ends inside a jax.jit helper
    h = jax.checkpoint(lambda h: mp.sxstage_iter(jnp.sin(h @ p["b"])))(
        h
    )  # stage 1 ends inside a remat region
    h = _jitted_block(p["c"], h)  # stage 2 ends inside the same helper again
    return jnp.mean((h @ p["d"] - y) ** 2)


def test_markers_inside_jit_helpers_and_checkpoint_regions_are_found():
    k = jax.random.split(jax.random.key(23), 4)
    params = {
        "a": jax.random.normal(k[0], (6, 8)) * 0.4,
        "b": jax.random.normal(k[1], (8, 8)) * 0.4,
        "c": jax.random.normal(k[2], (8, 4)) * 0.4,
        "d": jax.random.normal(k[3], (4, 5)) * 0.4,
    }
    batch = _batch()
    step = mp.sxvalue_and_grad(
        loss_with_markers_in_helpers, mesh=pipeline_mesh(4), schedule=make_schedule("Std1F1B", M, 1)
    )
    loss, grads = step(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(loss_with_markers_in_helpers)(params, batch)
    assert len(step.last_graph.stages) == 4
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


def test_bfloat16_parameters_accumulate_in_float32_and_return_bfloat16():
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), {"w0": _params()["w0"], "w1": _params()["w1"]})
    x, y = _batch()
    batch = (x.astype(jnp.bfloat16), y.astype(jnp.bfloat16))

    def loss(p, b):
        return jnp.mean((mp.sxstage_iter(jnp.tanh(b[0] @ p["w0"])) @ p["w1"] - b[1]) ** 2)

    step = mp.sxvalue_and_grad(loss, mesh=pipeline_mesh(2), schedule=make_schedule("Std1F1B", M, 1))
    value, grads = step(params, batch)
    backward = step.plan_for(params, batch).cells[(0, "B")]
    acc_dtypes = {spec.dtype for spec in backward.in_specs[-1:]}
    assert acc_dtypes == {jnp.dtype(jnp.float32)}
    assert value.dtype == jnp.bfloat16
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
    ref_value, ref_grads = jax.value_and_grad(loss)(params, batch)
    for a, b in zip(jax.tree.leaves((value, grads)), jax.tree.leaves((ref_value, ref_grads))):
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=2e-2, atol=2e-2)
