"""The step's loss is the whole batch's loss: losses whose value depends on how a batch is cut
(padded and packed token means, fixed normalisers, batch-computed scale factors) against
`jax.value_and_grad` of the unsplit function, and `microbatch_weight_fn`'s weighted mean
against the microbatches computed one by one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_mpmd as mp
from spectrax_core.schedules import Std1F1B, ZeroBubbleH1

M = 4
SCHEDULES = {"Std1F1B": Std1F1B(microbatches=M), "ZeroBubbleH1": ZeroBubbleH1(microbatches=M)}


@pytest.fixture(scope="module")
def mesh():
    return mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])


def _inputs():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"a": jax.random.normal(k[0], (8, 8)) * 0.3, "b": jax.random.normal(k[1], (8, 4)) * 0.3}
    x, y = jax.random.normal(k[2], (16, 8)), jax.random.normal(k[3], (16, 4))
    return params, x, y


# microbatches of 4 rows with 4, 1, 0 and 2 real rows (one microbatch all padding)
MASK = jnp.asarray([1.0] * 4 + [1.0, 0, 0, 0] + [0.0] * 4 + [1.0, 1.0, 0, 0])
SEGMENTS = jnp.asarray([[1, 1, 2, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]] * 4, jnp.int32)


def _errors(p, x, y):
    h = jnp.tanh(x @ p["a"])
    h = mp.sxstage_iter(h)
    return ((h @ p["b"]) - y) ** 2  # [batch, 4]


LOSSES = {
    # the padded token mean, guarded against an empty batch
    "padded_mean": lambda p, x, y, m: jnp.sum(_errors(p, x, y).mean(-1) * m) / jnp.maximum(jnp.sum(m), 1.0),
    # packed sequences (`m` holds segment ids): per-token terms, tokens of segment 0 are padding
    "packed_tokens": lambda p, x, y, m: jnp.sum(_errors(p, x, y) * (m > 0)) / jnp.sum(m > 0),
    # a scaled padded mean, written with a multiplication by the inverse count
    "scaled_inverse": lambda p, x, y, m: (
        0.5 * (jnp.sum(_errors(p, x, y).sum(-1) * m) * (1.0 / jnp.sum(m + 1.0)))
    ),
    # a fixed normaliser: the same on a microbatch and on the whole batch
    "fixed_normaliser": lambda p, x, y, m: jnp.sum(_errors(p, x, y)) / 100.0,
    # the plain mean (a sum over a count of the shape)
    "mean": lambda p, x, y, m: jnp.mean(_errors(p, x, y)),
    # a padded mean plus a parameter regulariser
    "padded_mean_plus_l2": lambda p, x, y, m: (
        jnp.sum(_errors(p, x, y).mean(-1) * m) / jnp.maximum(jnp.sum(m), 1.0) + 0.01 * jnp.sum(p["a"] ** 2)
    ),
}


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", LOSSES)
def test_whole_batch_loss_and_gradients(mesh, name, schedule):
    """Each loss's pipelined value and gradients equal the unsplit function's."""
    loss = LOSSES[name]
    params, x, y = _inputs()
    step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=SCHEDULES[schedule])
    mask = SEGMENTS if name == "packed_tokens" else MASK
    value, grads = step(params, x, y, mask)
    want_value, want_grads = jax.value_and_grad(loss)(params, x, y, mask)
    _close(value, want_value)
    jax.tree.map(_close, grads, want_grads)


def test_batch_factors_cost_no_transfer(mesh):
    """A padded mean runs the same cells and transfers as a plain mean of the masked rows: the
    count is computed on the loss rank from the batch leaves it holds there."""
    params, x, y = _inputs()

    def counts(loss):
        plan = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=SCHEDULES["Std1F1B"]).plan_for(
            params, x, y, MASK
        )
        return len(plan.steps), len(plan.input_keys)

    assert counts(LOSSES["padded_mean"]) == counts(lambda p, x, y, m: jnp.mean(_errors(p, x, y).mean(-1) * m))


def _l2_plus_token_mean(p, x, y, m):
    return LOSSES["padded_mean_plus_l2"](p, x, y, m)


def _normalised_by_batch_statistic(p, x, y, m):
    err = _errors(p, x, y)
    return jnp.mean(err / jnp.sum(m))


def test_batch_dependent_losses_are_refused(mesh):
    """A loss that scales per-row values by a batch statistic before summing them is refused,
    naming the operation and the fixes."""
    params, x, y = _inputs()
    step = mp.sxvalue_and_grad(_normalised_by_batch_statistic, mesh=mesh, schedule=SCHEDULES["Std1F1B"])
    with pytest.raises(mp.MpmdError, match="batch statistic.*microbatch_weight_fn"):
        step(params, x, y, MASK)


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_a_declared_reduction_combines_the_microbatch_losses(mesh, reduce):
    """`reduce="mean"`/`"sum"` is the user's statement: the mean or sum of the microbatch losses,
    for any loss (here one that is refused without it)."""
    params, x, y = _inputs()
    loss = _normalised_by_batch_statistic
    step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=SCHEDULES["Std1F1B"], reduce=reduce)
    value, grads = step(params, x, y, MASK)

    def combined(p):
        parts = [loss(p, x[s], y[s], MASK[s]) for s in (slice(i * 4, (i + 1) * 4) for i in range(M))]
        total = sum(parts)
        return total / M if reduce == "mean" else total

    want_value, want_grads = jax.value_and_grad(combined)(params)
    _close(value, want_value)
    jax.tree.map(_close, grads, want_grads)


def _per_microbatch(loss, weight, params, x, y, mask):
    """`sum(w_i * loss_i) / sum(w_i)` and its gradients, the microbatches computed one by one."""

    def total(p):
        parts = [slice(i * 4, (i + 1) * 4) for i in range(M)]
        w = jnp.stack([weight(p, x[s], y[s], mask[s]) for s in parts]).astype(jnp.float32)
        values = jnp.stack([loss(p, x[s], y[s], mask[s]) for s in parts])
        return jnp.sum(w * values) / jnp.sum(w)

    return jax.value_and_grad(total)(params)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_microbatch_weight_fn(mesh, schedule):
    """User weights give the weighted mean of the microbatch losses; with the count of real rows
    as the weight, a loss with a regulariser after the token mean is the unsplit loss."""
    params, x, y = _inputs()
    mask = MASK.at[8].set(1.0)  # every microbatch has a real row

    def weight(p, x, y, m):
        return jnp.sum(m)

    step = mp.sxvalue_and_grad(
        _l2_plus_token_mean, mesh=mesh, schedule=SCHEDULES[schedule], microbatch_weight_fn=weight
    )
    value, grads = step(params, x, y, mask)
    want_value, want_grads = _per_microbatch(_l2_plus_token_mean, weight, params, x, y, mask)
    _close(value, want_value)
    jax.tree.map(_close, grads, want_grads)
    unsplit_value, unsplit_grads = jax.value_and_grad(_l2_plus_token_mean)(params, x, y, mask)
    _close(value, unsplit_value)
    jax.tree.map(_close, grads, unsplit_grads)


def test_equal_weights_accept_the_microbatch_mean(mesh):
    """`microbatch_weight_fn=lambda *a: 1.0` is the plain mean over microbatches."""
    params, x, y = _inputs()
    step = mp.sxgrad(
        _normalised_by_batch_statistic,
        mesh=mesh,
        schedule=SCHEDULES["Std1F1B"],
        microbatch_weight_fn=lambda *args: 1.0,
    )
    mask = MASK + 1.0
    grads = step(params, x, y, mask)
    _, want = _per_microbatch(_normalised_by_batch_statistic, lambda *a: 1.0, params, x, y, mask)
    jax.tree.map(_close, grads, want)


def test_weight_fn_errors(mesh):
    params, x, y = _inputs()
    with pytest.raises(mp.MpmdError, match="reduce='sum'"):
        mp.sxvalue_and_grad(
            LOSSES["mean"],
            mesh=mesh,
            schedule=SCHEDULES["Std1F1B"],
            reduce="sum",
            microbatch_weight_fn=lambda *a: 1.0,
        )
    reads_params = mp.sxvalue_and_grad(
        LOSSES["mean"],
        mesh=mesh,
        schedule=SCHEDULES["Std1F1B"],
        microbatch_weight_fn=lambda p, *a: p["a"].sum(),
    )
    with pytest.raises(mp.MpmdError, match="parameters"):
        reads_params(params, x, y, MASK)
    not_scalar = mp.sxvalue_and_grad(
        LOSSES["mean"], mesh=mesh, schedule=SCHEDULES["Std1F1B"], microbatch_weight_fn=lambda p, x, y, m: m
    )
    with pytest.raises(mp.MpmdError, match="scalar"):
        not_scalar(params, x, y, MASK)
