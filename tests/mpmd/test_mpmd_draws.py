"""A program's random draws hashed together: JAX's bits, element for element, in fewer hashes.

`draws.hash_together` hashes the draws of one wave by one threefry call. Each draw's value is
checked against JAX's public `jax.random.bits` / `jax.random.split` (vmapped over batched
keys) for a class of draws: 8, 16 and 32 bits, keys batched over 0 to 2 axes, scalar, odd,
empty and 3-d shapes, splits. The merged path must be the one taken (one threefry hash, no
`random_bits` left); draws JAX counts differently (another key implementation, the
partitionable flag off) and draws above the size cap take the fallback, with the same values.
An owner-rank init program holds one hash per wave, and its values are `jax.jit(init)`'s.
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spectrax_mpmd._trace import draws
from spectrax_mpmd._trace.rows import rows_program

BITS = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}
CASES = [  # (kind, key batch, draw shape, bit width)
    ("bits", (), (7,), 32),
    ("bits", (4,), (3, 5), 32),
    ("bits", (2, 3), (2, 2), 8),
    ("bits", (), (), 16),
    ("bits", (3,), (2, 3, 4), 16),
    ("bits", (), (0,), 32),
    ("split", (), (3,), None),
    ("split", (2,), (2, 2), None),
]


def batched(fn, batch: tuple):
    """`fn` of one key, vmapped over `batch`'s axes of a key array."""
    for _ in batch:
        fn = jax.vmap(fn)
    return fn


def public(kind: str, keys, shape: tuple, width):
    """The draw by JAX's public API, one key at a time."""
    if kind == "bits":
        return batched(lambda k: jax.random.bits(k, shape, BITS[width]), keys.shape)(keys)
    return batched(lambda k: jax.random.split(k, shape), keys.shape)(keys)


def case_draws(key, cases=CASES) -> list:
    keys = jax.random.split(key, len(cases))
    out = []
    for k, (kind, batch, shape, width) in zip(keys, cases):
        ks = jax.random.split(k, batch) if batch else k
        name = "random_bits" if kind == "bits" else "random_split"
        params = {"shape": shape} | ({"bit_width": width} if kind == "bits" else {})
        out.append(
            draws.Draw(
                name, ks, params, lambda kind=kind, ks=ks, shape=shape, w=width: public(kind, ks, shape, w)
            )
        )
    return out


def data(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def both(key, cases=CASES):
    found = case_draws(key, cases)
    return [data(d.bind()) for d in found], [data(x) for x in draws.hash_together(found)]


def assert_same(pairs) -> None:
    want, got = pairs
    for w, g in zip(want, got):
        assert w.shape == g.shape and w.dtype == g.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def count(fn, name: str, *args) -> int:
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr

    def walk(j) -> int:
        return sum(
            (e.primitive.name == name) + sum(walk(p.jaxpr) for p in e.params.values() if hasattr(p, "jaxpr"))
            for e in j.eqns
        )

    return walk(jaxpr)


def test_draws_hashed_together_are_jaxs_bits_element_for_element():
    key = jax.random.key(3)
    assert_same(jax.jit(both)(key))
    merged = lambda k: draws.hash_together(case_draws(k))
    assert count(merged, "threefry2x32", key) == 1
    assert count(merged, "random_bits", key) == 1  # the empty draw, bound as JAX writes it


def test_a_hash_call_takes_at_most_the_cap_and_a_larger_draw_is_bound_alone(monkeypatch):
    cases = [
        ("bits", (), (40,), 32),
        ("bits", (), (30,), 32),
        ("bits", (), (100,), 32),
        ("bits", (2,), (10,), 8),
    ]
    monkeypatch.setattr(draws, "MAX_ELEMENTS", 64)
    key = jax.random.key(5)
    assert_same(jax.jit(lambda k: both(k, cases))(key))
    merged = lambda k: draws.hash_together(case_draws(k, cases))
    # 40 alone (40 + 30 > 64), 100 above the cap alone, 30 + 20 together: one hash of two
    assert count(merged, "threefry2x32", key) == 1
    assert count(merged, "random_bits", key) == 2


@pytest.mark.parametrize("counted_otherwise", ["rbg keys", "partitionable off"])
def test_draws_jax_counts_otherwise_are_bound_as_jax_writes_them(counted_otherwise):
    key = jax.random.key(7, impl="rbg") if counted_otherwise == "rbg keys" else jax.random.key(7)
    cases = CASES[:5] if counted_otherwise == "rbg keys" else CASES
    with jax.threefry_partitionable(counted_otherwise == "rbg keys"):
        assert_same(jax.jit(lambda k: both(k, cases))(key))
        merged = lambda k: draws.hash_together(case_draws(k, cases))
        assert count(merged, "threefry2x32", key) == 0


def test_every_equation_runs_after_what_it_reads_and_each_wave_hashes_its_draws_together():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 30)
        reads = [sorted(rng.sample(range(i), rng.randint(0, min(i, 3)))) for i in range(n)]
        is_draw = [rng.random() < 0.4 for _ in range(n)]
        order = draws.waves(reads, is_draw)
        done: set = set()
        for plain, drawn in order:
            for i in plain:
                assert not is_draw[i] and set(reads[i]) <= done
                done.add(i)
            assert all(is_draw[i] and set(reads[i]) <= done for i in drawn)
            done.update(drawn)
        assert done == set(range(n))
    # split -> split -> two draws of the second keys, one draw of the first: three waves
    chain = draws.waves([[], [0], [1], [1], [0]], [True, True, True, True, True])
    assert [drawn for _, drawn in chain] == [[0], [1, 4], [2, 3]]


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


def test_an_owner_init_program_hashes_each_wave_once_with_the_jitted_values():
    key = jax.random.key(11)
    closed = jax.make_jaxpr(many_draws)(key)
    fn, offsets = rows_program(closed, range(len(closed.jaxpr.outvars)))
    starts = np.asarray(offsets, np.int32)
    assert count(fn, "random_bits", starts, key) == 0
    # the key's split bound alone; then its keys' five draws (two of them splits) hashed
    # together, and the three draws of those splits' keys together
    assert count(fn, "threefry2x32", starts, key) == 2
    assert count(many_draws, "random_bits", key) >= 5  # the unmerged init: one hash per draw
    want = jax.tree.leaves(jax.jit(many_draws)(key))
    got = jax.jit(fn)(starts, key)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
