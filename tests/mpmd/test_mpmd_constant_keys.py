"""Random draws over the batch's rows from a PRNG key that is a constant of the loss.

Per microbatch, such a key draws the same values for every microbatch, where the
unsplit function draws different values for each row of the whole batch: the
step refuses it by default, naming the draw and the fix (pass the key as an
argument, which is folded per microbatch). Draws without rows from a constant
key (the same on a microbatch and on the whole batch) and draws from key
arguments stay exact: checked against the unsplit function and the folding
`lax.scan` respectively.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpmd_cases import assert_close, pipeline_mesh

import spectrax_mpmd as mp
from spectrax_core import schedules as S

D, BATCH, M = 8, 16, 4
KEY = jax.random.key(13)
LEGACY_KEY = jax.random.PRNGKey(13)


@functools.cache
def mesh2():
    return pipeline_mesh(2)


def data(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 3)
    params = [jax.random.normal(k[0], (D, D)) * 0.4, jax.random.normal(k[1], (D, D)) * 0.4]
    return params, jax.random.normal(k[2], (BATCH, D))


def dropout(h, key):
    return jnp.where(jax.random.bernoulli(key, 0.5, h.shape), 2.0 * h, 0.0)


def two_stages(p, x, key, *, late: bool = False):
    h = jnp.tanh(x @ p[0])
    h = mp.sxstage_iter(h if late else dropout(h, key))
    out = h @ p[1]
    return jnp.mean((dropout(out, key) if late else out) ** 2)


def in_a_layer_scan(p, x, key):
    def layer(h, inputs):
        w, i = inputs
        return dropout(jnp.tanh(h @ w), jax.random.fold_in(key, i)), None

    h, _ = jax.lax.scan(layer, x, (jnp.stack(p[:1]), jnp.arange(1)))
    return jnp.mean((mp.sxstage_iter(h) @ p[1]) ** 2)


def per_row_keys(p, x, key):
    h = jnp.tanh(x @ p[0])
    keys = jax.random.split(key, h.shape[0])
    h = jax.vmap(lambda k, row: jnp.where(jax.random.bernoulli(k, 0.5, row.shape), row, 0.0))(keys, h)
    return jnp.mean((mp.sxstage_iter(h) @ p[1]) ** 2)


CONSTANT_KEYS = {
    "closed-over key": lambda p, x, step: two_stages(p, x, KEY),
    "closed-over legacy key": lambda p, x, step: two_stages(p, x, LEGACY_KEY),
    "key made inside": lambda p, x, step: two_stages(p, x, jax.random.key(0)),
    "split of a closed-over key": lambda p, x, step: two_stages(p, x, jax.random.split(KEY)[1]),
    "folded with an integer argument": lambda p, x, step: two_stages(p, x, jax.random.fold_in(KEY, step)),
    "in the last stage": lambda p, x, step: two_stages(p, x, KEY, late=True),
    "in a jitted helper": lambda p, x, step: jax.jit(two_stages)(p, x, KEY),
    "in a scan over layers": lambda p, x, step: in_a_layer_scan(p, x, KEY),
    "split into one key per row": lambda p, x, step: per_row_keys(p, x, KEY),
}


@pytest.mark.parametrize("case", sorted(CONSTANT_KEYS))
def test_a_draw_over_rows_from_a_constant_key_is_refused(case):
    p, x = data(1)
    step = mp.sxvalue_and_grad(
        CONSTANT_KEYS[case], mesh=mesh2(), schedule=S.Std1F1B(microbatches=M), batch_argnums=1
    )
    with pytest.raises(mp.MpmdError) as info:
        step(p, x, jnp.int32(3))
    text = str(info.value)
    assert "a PRNG key that is a constant of the function" in text, text
    assert "Pass the key as an argument" in text, text
    assert "test_mpmd_constant_keys.py:" in text, text  # the user's line of the draw


@pytest.mark.parametrize("case", ["closed-over key", "in a scan over layers"])
def test_reduce_mean_accepts_the_same_draws_for_every_microbatch(case):
    """With `reduce="mean"` the step is the mean of the microbatch losses, each the function on its
    microbatch with the key as it is: the loop over microbatches is the reference."""
    p, x = data(2)
    fn = CONSTANT_KEYS[case]
    step = mp.sxvalue_and_grad(
        fn, mesh=mesh2(), schedule=S.Std1F1B(microbatches=M), reduce="mean", batch_argnums=1
    )
    parts = [jax.value_and_grad(fn)(p, xb, jnp.int32(3)) for xb in x.reshape(M, -1, D)]
    reference = jax.tree.map(lambda *a: sum(a) / M, *parts)
    assert_close(step(p, x, jnp.int32(3)), reference)


def noisy(p, x, key):
    """Noise of one row's shape, drawn from the key and added to every row: no row draws."""
    h = jnp.tanh(x @ p[0] + jax.random.normal(key, (D,)))
    return jnp.mean((mp.sxstage_iter(h) @ p[1]) ** 2)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "legacy-uint32"])
def test_a_draw_without_rows_from_a_constant_key_equals_the_unsplit_function(make_key):
    p, x = data(3)
    key = make_key(5)

    def closed(p, x):
        return noisy(p, x, key)

    step = mp.sxvalue_and_grad(closed, mesh=mesh2(), schedule=S.Std1F1B(microbatches=M), batch_argnums=1)
    assert_close(step(p, x), jax.value_and_grad(closed)(p, x))


def folded_scan(fn, p, x, key):
    """`fn` over the microbatches in one `lax.scan`, microbatch `i` given `fold_in(key, i)`."""

    def run(p, x, key):
        def body(total, inputs):
            i, xb = inputs
            return jax.tree.map(
                jnp.add, total, jax.value_and_grad(fn)(p, xb, jax.random.fold_in(key, i))
            ), None

        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, p))
        total, _ = jax.lax.scan(body, zero, (jnp.arange(M), x.reshape(M, -1, D)))
        return jax.tree.map(lambda t: t / M, total)

    return jax.jit(run)(p, x, key)


@pytest.mark.parametrize(
    "fn",
    [
        two_stages,
        functools.partial(two_stages, late=True),
        in_a_layer_scan,
        per_row_keys,
        lambda p, x, key: two_stages(p, x, jax.random.fold_in(key, 7)),
    ],
    ids=["stage 0", "last stage", "scan over layers", "one key per row", "folded with a constant"],
)
def test_the_same_draws_from_a_key_argument_are_folded_per_microbatch(fn):
    p, x = data(4)
    step = mp.sxvalue_and_grad(fn, mesh=mesh2(), schedule=S.Std1F1B(microbatches=M), batch_argnums=1)
    loss, grads = step(p, x, KEY)
    ref_loss, ref_grads = folded_scan(fn, p, x, KEY)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    assert not np.isclose(float(loss), float(jax.value_and_grad(fn)(p, x, KEY)[0]), rtol=1e-5)
