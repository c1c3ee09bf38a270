"""Program identity: stage programs share an executable only when they are the same program.

Each case builds pipelines whose middle stages have the same structure and
differ only in something a printed summary of the jaxpr does not show — a
constant inside a nested `jax.jit` helper, the closure of a `custom_jvp` or
`custom_vjp` rule, a top-level constant built from a static argument — and
places several of them on one rank (DualPipeV's V, an interleaved loop).
Loss and every gradient leaf must equal `jax.value_and_grad` of the unsplit
function.
"""

from __future__ import annotations

import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpmd_cases import assert_close, pipeline_mesh

import spectrax_mpmd as mp
from spectrax_core import schedules as S

D, BATCH = 8, 8
CONSTANTS = (0.5, -1.5, 2.0, -0.25)


def nested_jit_block(c: float):
    const = jnp.full((D,), c)
    return jax.jit(lambda h: jnp.tanh(h + const))


def custom_jvp_block(c: float):
    @jax.custom_jvp
    def scaled(x):
        return jnp.tanh(x)

    scaled.defjvp(lambda primals, tangents: (jnp.tanh(primals[0]), tangents[0] * c))
    return scaled


def custom_vjp_block(c: float):
    @jax.custom_vjp
    def scaled(x):
        return jnp.tanh(x)

    scaled.defvjp(lambda x: (jnp.tanh(x), None), lambda _, g: (g * c,))
    return scaled


BLOCK_FAMILIES = {
    "nested_jit": nested_jit_block,
    "custom_jvp": custom_jvp_block,
    "custom_vjp": custom_vjp_block,
}


def chain_loss(blocks):
    """Stage 0: `x @ p[0]`; stage k (1..len(blocks)): `blocks[k-1](h @ p[k])`; last: MSE head."""

    def loss(p, x, y):
        h = mp.sxstage_iter(x @ p[0])
        for k, block in enumerate(blocks, start=1):
            h = mp.sxstage_iter(block(h @ p[k]))
        return jnp.mean((h @ p[-1] - y) ** 2)

    return loss


def static_constant_loss(p, x, y, constants):
    """Like `chain_loss`, with each middle stage adding a top-level constant built from a static value."""
    h = mp.sxstage_iter(x @ p[0])
    for k, c in enumerate(constants, start=1):
        h = mp.sxstage_iter(jnp.tanh(h @ p[k] + np.full((D,), c, np.float32)))
    return jnp.mean((h @ p[-1] - y) ** 2)


def data(n_params: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), n_params + 2)
    params = [jax.random.normal(keys[k], (D, D)) * 0.5 for k in range(n_params)]
    return params, jax.random.normal(keys[-2], (BATCH, D)), jax.random.normal(keys[-1], (BATCH, D))


# DualPipeV on 2 ranks: 4 stages, stages 1 and 2 on rank 1. InterleavedH1 on 2 ranks x 3:
# 6 stages, stages 2 and 4 on rank 0, stages 1 and 3 on rank 1.
LAYOUTS = {
    "DualPipeV": (S.DualPipeV(microbatches=4), 2),
    "InterleavedH1": (S.InterleavedH1(microbatches=4, virtual_stages=3), 4),
}


@functools.lru_cache(maxsize=None)
def mesh2():
    return pipeline_mesh(2)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", sorted(BLOCK_FAMILIES))
def test_same_structure_different_closure_is_a_different_program(family, layout):
    schedule, n_blocks = LAYOUTS[layout]
    blocks = [BLOCK_FAMILIES[family](c) for c in CONSTANTS[:n_blocks]]
    loss = chain_loss(blocks)
    params, x, y = data(n_blocks + 2)
    step = mp.sxvalue_and_grad(loss, mesh=mesh2(), schedule=schedule)
    got_loss, got_grads = step(params, x, y)
    ref_loss, ref_grads = jax.value_and_grad(loss)(params, x, y)
    assert_close(got_loss, ref_loss)
    assert_close(got_grads, ref_grads)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_top_level_constants_from_a_static_argument(layout):
    schedule, n_blocks = LAYOUTS[layout]
    params, x, y = data(n_blocks + 2)
    step = mp.sxvalue_and_grad(static_constant_loss, mesh=mesh2(), schedule=schedule, static_argnums=3)
    for shift in (0.0, 1.0, 0.0, -2.0):  # a changed value retraces; a repeated one is a cache hit
        gc.collect()
        constants = tuple(c + shift for c in CONSTANTS[:n_blocks])
        got = step(params, x, y, constants)
        ref = jax.value_and_grad(static_constant_loss)(params, x, y, constants)
        assert_close(got, ref)


def nested_constant_forward(x, k):
    c = np.full((4,), k, np.float32)
    return mp.sxstage_iter(jax.jit(lambda h: h + c)(x)) * 2


def top_constant_forward(x, k):
    return mp.sxstage_iter(x + np.full((4,), k, np.float32)) * 2


@pytest.mark.parametrize(
    "fn", [nested_constant_forward, top_constant_forward], ids=["nested_jit", "top_level"]
)
def test_sxjit_static_values_never_return_a_stale_result(fn):
    f = mp.sxjit(fn, mesh=mesh2(), static_argnums=1)
    x = jnp.arange(4.0)
    for k in [*range(1, 7), 3, 5, 1]:  # 6 distinct values, then repeats
        gc.collect()  # frees the previous trace's constants, so their ids could be reused
        np.testing.assert_array_equal(np.asarray(f(x, float(k))), np.asarray(fn(x, float(k))))


def test_static_values_are_keyed_with_their_type():
    f = mp.sxjit(lambda x, k: mp.sxstage_iter(x * 2) + k, mesh=mesh2(), static_argnums=1)
    x = jnp.ones(3, jnp.int32)
    assert f(x, 1).dtype == jnp.int32  # an int static keeps the int dtype
    assert f(x, 1.0).dtype == jnp.float32  # 1.0 == 1, but it is another trace


def homogeneous_loss(constants):
    """8 stages of `tanh(h @ p[k] + c_k)`; the MSE loss runs on the last."""

    def loss(p, x, y):
        h = x
        for k, c in enumerate(constants):
            h = jnp.tanh(h @ p[k] + c)
            if k < len(constants) - 1:
                h = mp.sxstage_iter(h)
        return jnp.mean((h - y) ** 2)

    return loss


def test_identical_stages_compile_once():
    """InterleavedH1 on 4 ranks x 2: stages s and s + 4 share rank s. On the middle ranks (1, 2) the
    two stages are identical programs, so each cell kind compiles once there. When the stages differ
    by a constant, their forwards are two programs; their backwards (which never read the constant:
    they use the saved tanh output) are still one."""
    mesh, schedule = pipeline_mesh(4), S.InterleavedH1(microbatches=4, virtual_stages=2)
    params, x, y = data(8, seed=1)
    steps = {}
    for name, constants in {"same": (0.1,) * 8, "distinct": tuple(0.1 * k for k in range(8))}.items():
        step = mp.sxvalue_and_grad(homogeneous_loss(constants), mesh=mesh, schedule=schedule)
        assert_close(step(params, x, y), jax.value_and_grad(homogeneous_loss(constants))(params, x, y))
        steps[name] = step

    def programs(step, s, kind):
        cells = step.plan_for(params, x, y).cells
        keys = step.compiler.program_key(cells[(s, kind)]), step.compiler.program_key(cells[(s + 4, kind)])
        executables = (
            step.compiler.compile_spec(cells[(s, kind)]),
            step.compiler.compile_spec(cells[(s + 4, kind)]),
        )
        step.compiler.forget_lowerings()
        return keys, executables

    for s in (1, 2):
        for kind in ("F", "B"):
            (k1, k2), (e1, e2) = programs(steps["same"], s, kind)
            assert k1 == k2 and e1 is e2
        (k1, k2), _ = programs(steps["distinct"], s, "F")
        assert k1 != k2
        (k1, k2), (e1, e2) = programs(steps["distinct"], s, "B")
        assert k1 == k2 and e1 is e2
    assert len(steps["distinct"].compiler.cache) - len(steps["same"].compiler.cache) == 2
