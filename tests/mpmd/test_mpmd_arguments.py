"""The four kinds of argument of a training step: parameters, batch, broadcast, static.

Broadcast arguments (a mask, a temperature, a PRNG key) reach every microbatch
unchanged — a key folded with the microbatch index — and are checked against
the unsplit function, or, for keys, against a one-device `lax.scan` over the
microbatches that folds the same way. Batch leaves must share one leading
size: a mismatch is an error, never a silent slice.
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


@functools.lru_cache(maxsize=None)
def mesh2():
    return pipeline_mesh(2)


def schedule():
    return S.Std1F1B(microbatches=M)


def data(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 4)
    params = [jax.random.normal(k[0], (D, D)) * 0.4, jax.random.normal(k[1], (D, D)) * 0.4]
    return params, jax.random.normal(k[2], (BATCH, D)), jax.random.normal(k[3], (BATCH, D))


def masked_loss(p, x, y, mask):
    h = mp.sxstage_iter(jnp.tanh(x @ p[0]) * mask)
    return jnp.mean((h @ p[1] - y) ** 2)


def tempered_loss(p, x, y, temperature):
    h = mp.sxstage_iter(jnp.tanh(x @ p[0] / temperature))
    return jnp.mean((h @ p[1] - y) ** 2)


def options_loss(p, x, y, options):
    h = mp.sxstage_iter(jnp.tanh(x @ p[0] / options["temperature"]) * options["mask"])
    return jnp.mean((h @ p[1] - y) ** 2) * options["weight"]


# --- broadcast arguments ------------------------------------------------------------------


@pytest.mark.parametrize("width", [D, M], ids=["divisible-by-m", "equal-to-m"])
def test_broadcast_mask(width):
    p, x, y = data()
    x, p = x[:, :width], [p[0][:width, :width], p[1][:width, :width]]
    y = y[:, :width]
    mask = jnp.arange(width) % 2 == 0
    step = mp.sxvalue_and_grad(masked_loss, mesh=mesh2(), schedule=schedule(), batch_argnums=(1, 2))
    assert_close(step(p, x, y, mask), jax.value_and_grad(masked_loss)(p, x, y, mask))


@pytest.mark.parametrize(
    "temperature",
    [2.0, np.float32(2.0), jnp.float32(2.0), jnp.asarray(2.0)],
    ids=["python", "numpy", "jax", "weak"],
)
def test_broadcast_scalar(temperature):
    p, x, y = data(1)
    step = mp.sxvalue_and_grad(tempered_loss, mesh=mesh2(), schedule=schedule(), batch_argnums=(1, 2))
    assert_close(step(p, x, y, temperature), jax.value_and_grad(tempered_loss)(p, x, y, temperature))


def test_broadcast_pytree_argument():
    p, x, y = data(2)
    options = {"temperature": 1.5, "mask": jnp.arange(D) % 3 != 0, "weight": jnp.float32(0.5)}
    step = mp.sxvalue_and_grad(options_loss, mesh=mesh2(), schedule=schedule(), batch_argnums=(1, 2))
    assert_close(step(p, x, y, options), jax.value_and_grad(options_loss)(p, x, y, options))


def test_broadcast_values_change_between_calls():
    p, x, y = data(3)
    step = mp.sxvalue_and_grad(tempered_loss, mesh=mesh2(), schedule=schedule(), batch_argnums=(1, 2))
    for t in (0.5, 2.0, 0.5, np.float32(3.0)):
        assert_close(step(p, x, y, t), jax.value_and_grad(tempered_loss)(p, x, y, t))
    assert len(step.cache) == 2  # a Python float and a numpy float32 are different signatures


# --- batch leaves must agree ---------------------------------------------------------------


@pytest.mark.parametrize("width", [D, M], ids=["divisible-by-m", "equal-to-m"])
def test_mismatched_leading_axis_is_an_error(width):
    p, x, y = data()
    step = mp.sxvalue_and_grad(masked_loss, mesh=mesh2(), schedule=schedule())
    pattern = rf"argument 1 \('x'\) has {BATCH} and argument 3 \('mask'\) has {width}.*batch_argnums="
    with pytest.raises(mp.MpmdError, match=pattern):
        step(p, x, y, jnp.ones(width))
    assert step.cache == {}


def test_scalar_batch_leaf_suggests_batch_argnums():
    p, x, y = data()
    step = mp.sxvalue_and_grad(tempered_loss, mesh=mesh2(), schedule=schedule())
    with pytest.raises(
        mp.MpmdError, match=r"argument 3 \('temperature'\) is a batch argument but has shape \(\)"
    ):
        step(p, x, y, 2.0)


def test_argument_kinds_do_not_overlap():
    p, x, y = data()
    step = mp.sxvalue_and_grad(tempered_loss, mesh=mesh2(), schedule=schedule(), batch_argnums=(0, 1))
    with pytest.raises(mp.MpmdError, match=r"batch_argnums=\(0, 1\) includes \[0\].*one kind"):
        step(p, x, y, 2.0)


def test_non_array_argument_names_static_argnums():
    p, x, y = data()

    def loss(p, x, y, activation):
        return tempered_loss(p, x, y, 1.0) if activation == "tanh" else 0.0

    step = mp.sxvalue_and_grad(loss, mesh=mesh2(), schedule=schedule())
    with pytest.raises(mp.MpmdError, match=r"argument 3 \('activation'\) is a str.*static_argnums"):
        step(p, x, y, "tanh")


# --- static arguments -----------------------------------------------------------------------


def activation_loss(p, x, y, activation):
    act = {"tanh": jnp.tanh, "relu": jax.nn.relu, "gelu": jax.nn.gelu}[activation]
    h = mp.sxstage_iter(act(x @ p[0]))
    return jnp.mean((h @ p[1] - y) ** 2)


def test_static_argument_of_a_training_step():
    p, x, y = data(4)
    step = mp.sxvalue_and_grad(activation_loss, mesh=mesh2(), schedule=schedule(), static_argnums=3)
    for name in ("tanh", "relu", "tanh"):
        assert_close(step(p, x, y, name), jax.value_and_grad(activation_loss)(p, x, y, name))
    assert len(step.cache) == 2


# --- reduce ---------------------------------------------------------------------------------


def sum_loss(p, x, y):
    h = mp.sxstage_iter(jnp.tanh(x @ p[0]))
    return jnp.sum((h @ p[1] - y) ** 2)


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64")
def test_reduce_sum():
    """In float64: a sum loss's gradients have elements of about 0.002 summed from terms of about 6,
    where float32's summation order alone (microbatch by microbatch against one whole-batch dot)
    moves them by about 1e-6, as far as either float32 result lies from the float64 one."""
    jax.config.update("jax_enable_x64", True)
    try:
        p, x, y = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), data(5))
        step = mp.sxvalue_and_grad(sum_loss, mesh=mesh2(), schedule=schedule(), reduce="sum")
        value, grads = step(p, x, y)
        assert value.dtype == jnp.float64
        assert_close((value, grads), jax.value_and_grad(sum_loss)(p, x, y))
        grads_only = mp.sxgrad(sum_loss, mesh=mesh2(), schedule=S.ZeroBubbleH1(microbatches=M), reduce="sum")
        assert_close(grads_only(p, x, y), jax.grad(sum_loss)(p, x, y))
    finally:
        jax.config.update("jax_enable_x64", False)


def test_reduce_must_be_none_mean_or_sum():
    with pytest.raises(mp.MpmdError, match=r"reduce must be None.*'mean'.*or 'sum'.*got 'max'"):
        mp.sxvalue_and_grad(sum_loss, mesh=mesh2(), schedule=schedule(), reduce="max")


# --- PRNG keys --------------------------------------------------------------------------------


def dropout_loss(p, x, key):
    """Dropout on stage 0; returns the keep mask as aux so masks can be compared bitwise."""
    h = jnp.tanh(x @ p[0])
    keep = jax.random.bernoulli(key, 0.5, h.shape)
    h = mp.sxstage_iter(jnp.where(keep, 2.0 * h, 0.0))
    return jnp.mean((h @ p[1]) ** 2), keep


def scan_reference(fn, p, x, key, *, fold: bool):
    """Loss, grads and per-microbatch aux of `fn` over `M` microbatches in one `lax.scan`."""

    def run(p, x, key):
        xs = x.reshape(M, -1, *x.shape[1:])

        def body(carry, inputs):
            i, xb = inputs
            k = jax.random.fold_in(key, i) if fold else key
            (loss, aux), grads = jax.value_and_grad(fn, has_aux=True)(p, xb, k)
            return jax.tree.map(jnp.add, carry, (loss, grads)), aux

        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, p))
        (loss, grads), aux = jax.lax.scan(body, zero, (jnp.arange(M), xs))
        return loss / M, jax.tree.map(lambda g: g / M, grads), aux

    return jax.jit(run)(p, x, key)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "legacy-uint32"])
@pytest.mark.parametrize("sched", ["Std1F1B", "ZeroBubbleH1"])
def test_broadcast_key_is_folded_per_microbatch(make_key, sched):
    p, x, _ = data(6)
    key = make_key(11)
    step = mp.sxvalue_and_grad(
        dropout_loss, mesh=mesh2(), schedule=getattr(S, sched)(microbatches=M), has_aux=True, batch_argnums=1
    )
    (loss, keep), grads = step(p, x, key)
    ref_loss, ref_grads, ref_keep = scan_reference(dropout_loss, p, x, key, fold=True)
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(ref_keep))
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    assert not all(np.array_equal(keep[0], keep[i]) for i in range(1, M))


def test_keys_inside_a_broadcast_pytree_are_folded_and_other_leaves_are_not():
    def loss(p, x, extras):
        (value, keep), scale = dropout_loss(p, x, extras["key"]), extras["scale"]
        return value * scale, keep

    p, x, _ = data(7)
    extras = {"key": jax.random.key(3), "scale": jnp.float32(0.5)}
    step = mp.sxvalue_and_grad(loss, mesh=mesh2(), schedule=schedule(), has_aux=True, batch_argnums=1)
    (value, keep), grads = step(p, x, extras)
    ref_loss, ref_grads, ref_keep = scan_reference(loss, p, x, extras, fold=False)  # folded below
    folded = scan_reference(
        lambda p, x, k: loss(p, x, {"key": k, "scale": extras["scale"]}), p, x, extras["key"], fold=True
    )
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(folded[2]))
    assert_close(value, folded[0])
    assert_close(grads, folded[1])
    assert not np.array_equal(np.asarray(keep), np.asarray(ref_keep))


def per_example_dropout_loss(p, x, keys):
    h = jnp.tanh(x @ p[0])
    keep = jax.vmap(lambda k, row: jax.random.bernoulli(k, 0.5, row.shape))(keys, h)
    h = mp.sxstage_iter(jnp.where(keep, 2.0 * h, 0.0))
    return jnp.mean((h @ p[1]) ** 2)


def test_keys_as_a_batch_leaf_are_split_not_folded():
    p, x, _ = data(8)
    keys = jax.random.split(jax.random.key(5), BATCH)
    step = mp.sxvalue_and_grad(per_example_dropout_loss, mesh=mesh2(), schedule=schedule())
    assert_close(step(p, x, keys), jax.value_and_grad(per_example_dropout_loss)(p, x, keys))


def test_closed_over_key_is_a_constant_for_every_microbatch_under_reduce_mean():
    """By default the step refuses such a draw (`test_mpmd_constant_keys.py`); `reduce="mean"`
    asks for the mean of the microbatch losses, each drawing with the key as it is."""
    p, x, _ = data(9)
    key = jax.random.key(13)

    def closed(p, x):
        return dropout_loss(p, x, key)

    step = mp.sxvalue_and_grad(closed, mesh=mesh2(), schedule=schedule(), has_aux=True, reduce="mean")
    (loss, keep), grads = step(p, x)
    ref_loss, ref_grads, ref_keep = scan_reference(
        lambda p, x, k: dropout_loss(p, x, k), p, x, key, fold=False
    )
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(ref_keep))
    assert all(np.array_equal(keep[0], keep[i]) for i in range(1, M))
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
