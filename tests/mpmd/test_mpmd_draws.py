"""Random draws hashed without a loop: JAX's bits, element for element.

`draws.draw` computes a draw's threefry hash written out. Its value is checked against JAX's
public `jax.random.bits` / `jax.random.split` (vmapped over batched keys) for a class of
draws: 8, 16 and 32 bits, keys batched over 0 to 2 axes, scalar, odd, empty and 3-d shapes,
splits. Draws JAX counts otherwise (another key implementation, the partitionable flag off)
are not `hashable`. An owner-rank init program holds no JAX draw and no loop, and its values
are `jax.jit(init)`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spectrax_mpmd._trace import draws
from spectrax_mpmd._trace.jaxpr import contains_primitive
from spectrax_mpmd._trace.rows import rows_program

BITS = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}
CASES = [  # (draw, key batch, draw shape, bit width)
    ("random_bits", (), (7,), 32),
    ("random_bits", (4,), (3, 5), 32),
    ("random_bits", (2, 3), (2, 2), 8),
    ("random_bits", (), (), 16),
    ("random_bits", (3,), (2, 3, 4), 16),
    ("random_bits", (), (0,), 32),
    ("random_split", (), (3,), None),
    ("random_split", (2,), (2, 2), None),
]


def public(name: str, keys, shape: tuple, width):
    """The draw by JAX's public API, one key at a time."""
    if name == "random_bits":
        fn = lambda k: jax.random.bits(k, shape, BITS[width])
    else:
        fn = lambda k: jax.random.split(k, shape)
    for _ in keys.shape:
        fn = jax.vmap(fn)
    return fn(keys)


def params(name: str, shape: tuple, width) -> dict:
    return {"shape": shape} | ({"bit_width": width} if name == "random_bits" else {})


def data(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_draw_hashed_without_a_loop_is_jaxs_bits_element_for_element(case):
    name, batch, shape, width = case

    def both(key):
        keys = jax.random.split(key, batch) if batch else key
        assert draws.hashable(name, keys, params(name, shape, width))
        return data(public(name, keys, shape, width)), data(draws.draw(name, keys, params(name, shape, width)))

    want, got = jax.jit(both)(jax.random.key(3))
    assert want.shape == got.shape and want.dtype == got.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    lowered = jax.jit(lambda k: draws.draw(name, k, params(name, shape, width))).lower(jax.random.key(3))
    assert "while" not in lowered.as_text()


@pytest.mark.parametrize("counted_otherwise", ["rbg keys", "partitionable off", "64 bits"])
def test_draws_jax_counts_otherwise_are_left_to_jax(counted_otherwise):
    key = jax.random.key(7, impl="rbg") if counted_otherwise == "rbg keys" else jax.random.key(7)
    width = 64 if counted_otherwise == "64 bits" else 32
    with jax.threefry_partitionable(counted_otherwise != "partitionable off"):
        assert not draws.hashable("random_bits", key, {"shape": (3,), "bit_width": width})
        if counted_otherwise != "64 bits":
            assert not draws.hashable("random_split", key, {"shape": (2,)})


def many_draws(key):
    k = jax.random.split(key, 5)
    blocks = jax.vmap(lambda kk: jax.random.normal(kk, (6, 8)))(jax.random.split(k[0], 4))
    return {
        "blocks": blocks,
        "truncated": jax.random.truncated_normal(k[1], -2.0, 2.0, (8, 16)) * 0.02,
        "uniform": jax.random.uniform(k[2], (5, 3), minval=-0.1, maxval=0.1),
        "ids": jax.random.randint(k[3], (4, 8), 0, 100),
        "half": jax.random.normal(k[4], (9,), jnp.bfloat16),
    }


@pytest.mark.parametrize("partitionable", [True, False])
def test_an_owner_init_program_draws_the_jitted_values_without_a_loop_where_jax_counts_so(partitionable):
    key = jax.random.key(11)
    with jax.threefry_partitionable(partitionable):
        closed = jax.make_jaxpr(many_draws)(key)
        fn, offsets = rows_program(closed, range(len(closed.jaxpr.outvars)))
        starts = np.asarray(offsets, np.int32)
        program = jax.make_jaxpr(fn)(starts, key).jaxpr
        assert contains_primitive(closed.jaxpr, "random_bits")  # the init as written: JAX's draws
        left_to_jax = [contains_primitive(program, name) for name in draws.HASHED]
        assert left_to_jax == [not partitionable] * 2
        assert ("while" in jax.jit(fn).lower(starts, key).as_text()) == (not partitionable)
        want = jax.tree.leaves(jax.jit(many_draws)(key))
        got = jax.jit(fn)(starts, key)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
