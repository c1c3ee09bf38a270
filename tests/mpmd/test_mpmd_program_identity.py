"""Program identity beyond the lowered text.

The StableHLO text of a cell does not show everything its executable depends
on: a typed PRNG key lowers as its raw key data, a weak scalar as a strong one.
Two cells that differ only there must still get executables of their own, in
every call order, and give what `jax.jit` gives (values, dtypes, weak types).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpmd_cases import assert_close, pipeline_mesh

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._compile import CellSpec, Compiler

ONE_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _spec(shape, dtype, weak_type=False):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=ONE_DEVICE, weak_type=weak_type)


def _assert_same_avals(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(map(jax.typeof, jax.tree.leaves(got)), map(jax.typeof, jax.tree.leaves(want))):
        assert (a.shape, a.dtype, a.weak_type) == (b.shape, b.dtype, b.weak_type)


# --- argument and result avals --------------------------------------------------------------


def test_cells_differing_only_in_avals_are_other_programs():
    """Each pair lowers to the same text; each must get its own executable."""
    key_type = jax.random.key(0).dtype
    pairs = {
        "weak scalar": (_spec((), jnp.float32, True), _spec((), jnp.float32)),
        "typed key": (_spec((), key_type), _spec((2,), jnp.uint32)),
    }
    for name, (first, second) in pairs.items():
        compiler = Compiler()
        cells = [CellSpec(lambda a: (a,), (spec,), (ONE_DEVICE,)) for spec in (first, second)]
        keys = [compiler.program_key(cell) for cell in cells]
        assert keys[0] != keys[1], name
        executables = [compiler.compile_spec(cell) for cell in cells]
        assert executables[0] is not executables[1], name
        assert len(compiler.cache) == 2, name


def key_dropout_loss(w, x, key):
    h = jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0) @ w
    return jnp.mean(mp.sxstage_iter(h) ** 2)


@pytest.mark.parametrize("typed_first", [True, False])
@pytest.mark.parametrize("api", ["sxjit", "sxvalue_and_grad"])
def test_typed_and_raw_keys_on_one_function(api, typed_first):
    mesh = pipeline_mesh(2)
    w, x = jnp.linspace(-1, 1, 16).reshape(4, 4), jnp.linspace(0.5, 2, 32).reshape(8, 4)
    typed = jax.random.key(3)
    keys = [typed, jax.random.key_data(typed)]
    if not typed_first:
        keys.reverse()
    if api == "sxjit":
        step, reference = mp.sxjit(key_dropout_loss, mesh=mesh), jax.jit(key_dropout_loss)
    else:
        step = mp.sxvalue_and_grad(
            key_dropout_loss, mesh=mesh, schedule=S.Std1F1B(microbatches=1), batch_argnums=(1,)
        )
        # one microbatch reads the key folded with its index 0
        reference = jax.value_and_grad(lambda w, x, key: key_dropout_loss(w, x, jax.random.fold_in(key, 0)))
    for key in keys:
        assert_close(step(w, x, key), reference(w, x, key))


@pytest.mark.parametrize("strong_first", [True, False])
def test_weak_and_strong_scalars_keep_the_weak_type_jax_jit_gives(strong_first):
    def f(a, b):
        return mp.sxstage_iter(a * 2) + b, a

    g = mp.sxjit(f, mesh=pipeline_mesh(2))
    calls = [(jnp.float32(1.5), 2.0), (1.5, jnp.float32(2.0)), (1.5, 2.0), (jnp.float32(1.5), jnp.float32(2.0))]
    if not strong_first:
        calls.reverse()
    for args in calls:
        got, want = g(*args), jax.jit(f)(*args)
        _assert_same_avals(got, want)
        assert_close(got, want)
        bf16 = jnp.ones(2, jnp.bfloat16)
        assert (bf16 * got[0]).dtype == (bf16 * want[0]).dtype


def test_a_typed_key_result_stays_typed():
    """A cell returning a key: typed and raw inputs give typed and raw results, in both orders."""

    def f(key):
        return jax.random.split(mp.sxstage_iter(key))

    g = mp.sxjit(f, mesh=pipeline_mesh(2))
    typed = jax.random.key(5)
    for key in (jax.random.key_data(typed), typed, jax.random.key_data(typed)):
        got, want = g(key), jax.jit(f)(key)
        _assert_same_avals(got, want)
        unwrap = jax.random.key_data if jnp.issubdtype(want.dtype, jax.dtypes.prng_key) else np.asarray
        np.testing.assert_array_equal(np.asarray(unwrap(got)), np.asarray(unwrap(want)))
