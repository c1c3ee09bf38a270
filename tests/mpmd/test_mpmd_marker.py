"""`sxstage_iter` is the identity outside the runtime; `sxjit` runs a cut forward, keyed on static values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from mpmd_cases import ATOL, RTOL, assert_close, make_schedule, pipeline_mesh, unaligned_copy

import spectrax_mpmd as mp

# --- the marker -------------------------------------------------------------------------------


def _through(x):
    return mp.sxstage_iter(x)


def test_marker_is_the_identity_on_a_pytree():
    tree = {"a": jnp.arange(3.0), "b": (jnp.ones((2, 2)), jnp.int32(4))}
    out = mp.sxstage_iter(tree, sharding={"a": P(), "b": (None, None)})
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)
    assert mp.sxstage_iter({}) == {}


def test_marker_under_jit_grad_vmap_and_scan():
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    np.testing.assert_array_equal(jax.jit(_through)(x), x)
    f = lambda v: jnp.sum(jnp.sin(mp.sxstage_iter(v * 2.0)))
    np.testing.assert_allclose(jax.grad(f)(x), 2.0 * jnp.cos(2.0 * x), rtol=RTOL)
    np.testing.assert_array_equal(jax.vmap(_through)(x), x)
    carry, ys = jax.lax.scan(lambda c, r: (mp.sxstage_iter(c + r), mp.sxstage_iter(r * c)), jnp.zeros(3), x)
    np.testing.assert_allclose(carry, x.sum(0), rtol=RTOL)
    np.testing.assert_allclose(ys, jnp.stack([jnp.zeros(3), x[0] * x[1]]), rtol=RTOL)
    np.testing.assert_allclose(jax.jacfwd(f)(x), jax.grad(f)(x), rtol=RTOL)


def test_marker_is_a_primitive_in_the_jaxpr_with_its_parameters():
    jaxpr = jax.make_jaxpr(lambda x: mp.sxstage_iter(x, stage=0, sharding=P("fsdp")))(jnp.ones(4))
    (eqn,) = jaxpr.jaxpr.eqns
    assert eqn.primitive.name == "sxstage_iter"
    assert eqn.params["stage"] == 0 and eqn.params["sharding"] == (P("fsdp"),)


# --- sxjit ------------------------------------------------------------------------------------


def forward(p, x, act="tanh"):
    h = x @ p["w1"]
    h = mp.sxstage_iter(jnp.tanh(h) if act == "tanh" else jax.nn.relu(h))
    return {"out": h @ p["w2"], "norm": jnp.sum(h * h)}


def _params(scale=1.0):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (5, 6)) * scale, "w2": jax.random.normal(k2, (6, 3))}


X = np.linspace(-1.0, 1.0, 20, dtype=np.float32).reshape(4, 5)


@pytest.fixture(scope="module")
def mesh2():
    return pipeline_mesh(2)


@pytest.fixture(scope="module")
def jitted(mesh2):
    return mp.sxjit(forward, mesh=mesh2, static_argnums=2)


def test_sxjit_matches_the_plain_function_and_runs_stage_s_on_rank_s(jitted, mesh2):
    out = jitted(_params(), X, "tanh")
    assert_close(out, forward(_params(), X, "tanh"))
    assert [(r, tuple(a), c) for r, a, c in jitted.dispatch_log] == [
        (0, ("F", 0, 0), "F"),
        (1, ("F", 1, 0), "F"),
    ]
    assert out["out"].sharding.device_set == set(mesh2.submesh(1).devices.flat)


def test_static_argument_values_are_part_of_the_cache_key(jitted):
    params = _params()
    relu = jitted(params, X, "relu")
    tanh = jitted(params, X, "tanh")
    assert_close(relu, forward(params, X, "relu"))
    assert_close(tanh, forward(params, X, "tanh"))
    assert not np.allclose(relu["out"], tanh["out"], rtol=RTOL, atol=ATOL)
    assert_close(jitted(params, X, "relu"), relu)


def test_new_values_with_the_same_shapes_give_new_results(jitted):
    first = jitted(_params(1.0), X, "tanh")
    second = jitted(_params(0.5), X, "tanh")
    assert_close(second, forward(_params(0.5), X, "tanh"))
    assert not np.allclose(first["out"], second["out"], rtol=RTOL, atol=ATOL)
    assert_close(jitted(_params(1.0), X * 2, "tanh"), forward(_params(1.0), X * 2, "tanh"))


def test_arguments_on_any_device_or_in_numpy_are_accepted(jitted):
    expected = forward(_params(), X, "tanh")
    elsewhere = jax.device_put(_params(), jax.devices()[5])
    assert_close(jitted(elsewhere, jax.device_put(X, jax.devices()[7]), "tanh"), expected)
    as_numpy = jax.tree.map(np.asarray, _params())
    assert_close(jitted(as_numpy, X, "tanh"), expected)


def test_numpy_arguments_changed_in_place_are_placed_again(jitted):
    """A numpy array is mutable: the same object with new contents must not reuse a stale placement."""
    params = jax.tree.map(unaligned_copy, _params())
    before = jax.tree.map(np.array, jitted(params, X, "tanh"))  # read out before the mutation
    params["w1"] *= 0.5
    after = jitted(params, X, "tanh")
    assert_close(before, forward(_params(1.0), X, "tanh"))
    assert_close(after, forward(_params(0.5), X, "tanh"))


def test_sxjit_with_a_loop_schedule_places_stages_on_their_ranks(mesh2):
    schedule = make_schedule("InterleavedH1", 2, 2)

    def four_stages(p, x):
        h = x @ p["w1"]
        for _ in range(3):
            h = mp.sxstage_iter(jnp.tanh(h))
        return h @ p["w2"]

    f = mp.sxjit(four_stages, mesh=mesh2, schedule=schedule)
    out = f(_params(), X)
    assert_close(out, four_stages(_params(), X))
    assert [(r, a[1]) for r, a, _ in f.dispatch_log] == [(schedule.rank_of(s, 2), s) for s in range(4)]
    assert out.sharding.device_set == set(mesh2.submesh(1).devices.flat)  # stage 3 is on rank 1
