"""`jax.lax.with_sharding_constraint(x, P("dp"))` inside a pipelined function: a bare PartitionSpec
names the axes of the stage's own submesh, inside any context mesh or none.

Every rank's submesh of a `create_mesh` mesh has the same axes, so the function is traced with
that abstract mesh as JAX's context mesh and each stage program resolves the spec on its own
submesh. Ranks of different shapes have no such mesh: a bare spec is refused naming the working
form, `NamedSharding(mesh.submesh(k), P(...))`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spectrax_mpmd as mp
from spectrax_core.schedules import Std1F1B

MESH = mp.create_mesh((2, 2, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])  # 2 ranks x dp=2
OTHER = jax.sharding.Mesh(np.asarray(jax.devices()[4:8]).reshape(2, 2), ("x", "y"))
CONTEXTS = {
    "none": lambda: jax.set_mesh(None),
    "with mesh": lambda: MESH,
    "jax.set_mesh(mesh)": lambda: jax.set_mesh(MESH.jax_mesh),
    "jax.set_mesh(another mesh)": lambda: jax.set_mesh(OTHER),
}


def loss_with(constrain):
    def loss_fn(p, x, y):
        h = constrain(jnp.tanh(x @ p["w0"]), P("dp"))  # stage 0
        h = mp.sxstage_iter(h)
        h = constrain(jnp.tanh(h @ p["w1"]), P("dp", None))  # stage 1, on the other rank's devices
        return jnp.mean((h @ p["w2"] - y) ** 2)

    return loss_fn


constrained = loss_with(jax.lax.with_sharding_constraint)
plain = loss_with(lambda x, _: x)


def inputs():
    k = jax.random.split(jax.random.key(0), 5)
    p = {name: jax.random.normal(k[i], (8, 8)) * 0.3 for i, name in enumerate(("w0", "w1", "w2"))}
    return p, jax.random.normal(k[3], (8, 8)), jax.random.normal(k[4], (8, 8))


def close(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


@pytest.mark.parametrize("context", CONTEXTS)
def test_a_bare_spec_in_each_stage_resolves_on_its_submesh(context):
    p, x, y = inputs()
    with CONTEXTS[context]():
        step = mp.sxvalue_and_grad(constrained, mesh=MESH, schedule=Std1F1B(microbatches=2))
        got = step(p, x, y)
        forward = mp.sxjit(constrained, mesh=MESH)(p, x, y)
    close(got, jax.value_and_grad(plain)(p, x, y))
    close(forward, plain(p, x, y))


def test_the_constraint_is_in_each_stage_program():
    p, x, y = inputs()
    step = mp.sxvalue_and_grad(constrained, mesh=MESH, schedule=Std1F1B(microbatches=2))
    plan = step.plan_for(p, x, y)
    found = set()
    for (stage, kind), spec in plan.cells.items():
        with jax.set_mesh(MESH.submesh(stage)):
            shardings = tuple(s.sharding for s in spec.in_specs)
            text = jax.jit(spec.fn, in_shardings=shardings).lower(*spec.in_specs).as_text()
        if "sharding_constraint" in text:
            assert '[{"dp"}' in text, (stage, kind)
            found.add(stage)
    assert found == {0, 1}


def test_the_one_plan_step_takes_a_bare_spec():
    p, x, y = inputs()
    tx = optax.sgd(0.1)
    loss, grads = jax.value_and_grad(plain)(p, x, y)
    want = (loss, optax.apply_updates(p, tx.update(grads, tx.init(p), p)[0]))
    step = mp.sxvalue_and_grad_and_apply(constrained, tx, mesh=MESH, schedule=Std1F1B(microbatches=2))
    with MESH:
        got, new, _ = step(jax.tree.map(jnp.copy, p), tx.init(p), x, y)
    close((got, new), want)


def test_ranks_of_different_shapes_refuse_a_bare_spec_naming_the_working_form():
    mesh = mp.create_rank_mesh([{"dp": 1}, {"dp": 2}], devices=jax.devices()[:3])
    p, x, y = inputs()

    def named(h, spec):  # the rank's own submesh: stage s runs on rank s here
        rank = 0 if spec == P("dp") else 1
        return jax.lax.with_sharding_constraint(h, NamedSharding(mesh.submesh(rank), spec))

    step = mp.sxvalue_and_grad(constrained, mesh=mesh, schedule=Std1F1B(microbatches=2))
    with pytest.raises(mp.MpmdError, match=r"NamedSharding\(mesh\.submesh\(k\), P\(\.\.\.\)\)"):
        step(p, x, y)
    working = mp.sxvalue_and_grad(loss_with(named), mesh=mesh, schedule=Std1F1B(microbatches=2))
    close(working(p, x, y), jax.value_and_grad(plain)(p, x, y))
