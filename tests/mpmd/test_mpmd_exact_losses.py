"""Every loss is the unsplit value or refused: losses as users write them, against one
`jax.value_and_grad` of the same function on the whole batch (2 ranks, m = 4), on two schedules;
losses that couple the rows of a batch, or apply a nonlinear function to a mean, are refused before
any device work, naming the operation and the user's source line."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mpmd_cases import lm_batch, tiny_lm

import spectrax_mpmd as mp
from spectrax_core import apply
from spectrax_core.losses import softmax_cross_entropy
from spectrax_core.schedules import Std1F1B, ZeroBubbleH1

M, B, D, V = 4, 16, 8, 6
SCHEDULES = {"Std1F1B": Std1F1B(microbatches=M), "ZeroBubbleH1": ZeroBubbleH1(microbatches=M)}
# microbatches of 4 rows with 0, 1, 4 and 3 real rows
MASK = jnp.asarray([0.0] * 4 + [1.0, 0, 0, 0] + [1.0] * 4 + [1.0, 1.0, 1.0, 0])


@functools.cache
def mesh():
    return mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])


def inputs(dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 4)
    p = {"a": jax.random.normal(k[0], (D, D)) * 0.4, "b": jax.random.normal(k[1], (D, V)) * 0.4}
    x, y = jax.random.normal(k[2], (B, D)), jax.random.randint(k[3], (B,), 0, V)
    return jax.tree.map(lambda a: a.astype(dtype), p), x.astype(dtype), y, MASK


def stages(p, x):
    """Two stages; stage 0 also emits a row-mean auxiliary term that travels to the loss."""
    h = jnp.tanh(x @ p["a"])
    h, aux = mp.sxstage_iter((h, jnp.mean(h**2)))
    return h @ p["b"], aux


def ce(logits, y):
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[:, None], -1)[:, 0]


def chunked(lg, y, m):  # a scan over chunks of the feature axis accumulating (sum, count)
    def body(c, t):
        return (c[0] + jnp.sum(t * m), c[1] + jnp.sum(m)), None

    (s, n), _ = lax.scan(body, (0.0, 0.0), jnp.swapaxes(lg, 0, 1))
    return s / jnp.maximum(n, 1.0)


def guarded(v, m):  # no division by zero on a batch without real rows
    s, n = jnp.sum(v * m), jnp.sum(m)
    return lax.cond(n > 0, lambda: s / n, lambda: 0.0 * s)


EXACT = {
    "mean_of_two_means": lambda p, x, y, m: (lambda o: (jnp.mean(o**2) + jnp.mean(jnp.abs(o))) / 2)(
        stages(p, x)[0]
    ),
    "scaled_sum_of_means": lambda p, x, y, m: (lambda o: 2.0 * (jnp.mean(ce(o, y)) + 0.01 * jnp.mean(o**2)))(
        stages(p, x)[0]
    ),
    "divided_by_accumulation_steps": lambda p, x, y, m: jnp.mean(ce(stages(p, x)[0], y)) / 8,
    "bare_sum": lambda p, x, y, m: jnp.sum(ce(stages(p, x)[0], y)),
    "token_mean_plus_l2": lambda p, x, y, m: (
        jnp.sum(ce(stages(p, x)[0], y) * m) / jnp.maximum(jnp.sum(m), 1.0) + 1e-2 * jnp.sum(p["a"] ** 2)
    ),
    "term_from_stage_0": lambda p, x, y, m: (lambda o, aux: jnp.mean(ce(o, y)) + 0.1 * aux)(*stages(p, x)),
    "weighted_average": lambda p, x, y, m: jnp.average(ce(stages(p, x)[0], y), weights=m + 0.5),
    "feature_mean_then_sum": lambda p, x, y, m: jnp.sum(jnp.mean(stages(p, x)[0] ** 2, axis=0)),
    "chunked_in_scan": lambda p, x, y, m: chunked(stages(p, x)[0], y, m),
    "guarded_by_cond": lambda p, x, y, m: guarded(ce(stages(p, x)[0], y), m),
    "behind_jit": lambda p, x, y, m: jax.jit(lambda v, m: jnp.sum(v * m) / jnp.sum(m))(
        ce(stages(p, x)[0], y), m
    ),
}


def _close(got, want, rtol=1e-5):
    np.testing.assert_allclose(
        np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=1e-6
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", EXACT)
def test_losses_as_users_write_them_are_the_unsplit_loss(name, schedule):
    loss, args = EXACT[name], inputs()
    value, grads = mp.sxvalue_and_grad(loss, mesh=mesh(), schedule=SCHEDULES[schedule])(*args)
    want_value, want_grads = jax.value_and_grad(loss)(*args)
    _close(value, want_value)
    jax.tree.map(_close, grads, want_grads)


def test_a_float16_mean_is_summed_in_float32_and_cast_once():
    """Each microbatch emits its partial sum in float32: no overflow of a float16 sum, and the
    loss is the unsplit float16 mean."""

    def loss(p, x, y, m):
        return jnp.mean((stages(p, x)[0] * 60.0) ** 2)  # each microbatch's sum passes float16's range

    args = inputs(jnp.float16)
    value, grads = mp.sxvalue_and_grad(loss, mesh=mesh(), schedule=SCHEDULES["Std1F1B"])(*args)
    want_value, want_grads = jax.value_and_grad(loss)(*args)
    assert value.dtype == jnp.float16 and np.isfinite(float(value))
    _close(value, want_value, rtol=1e-3)
    jax.tree.map(lambda a, b: _close(a, b, rtol=2e-2), grads, want_grads)


def contrastive(p, x, y, m):
    z = stages(p, x)[0]
    return jnp.mean(jax.nn.logsumexp(z @ z.T, -1))


@jax.custom_vjp
def fused_mean(v, m):
    return jnp.sum(v * m) / jnp.maximum(jnp.sum(m), 1.0)


fused_mean.defvjp(
    lambda v, m: (fused_mean(v, m), (v, m)), lambda r, g: (g * r[1] / jnp.maximum(jnp.sum(r[1]), 1.0), None)
)

REFUSED = {
    "sqrt_of_mean": (lambda p, x, y, m: 0.5 * jnp.sqrt(jnp.mean(stages(p, x)[0] ** 2)), "sqrt"),
    "square_of_mean": (lambda p, x, y, m: 0.5 * jnp.mean(stages(p, x)[0]) ** 2, "integer_pow"),
    "in_batch_contrastive": (contrastive, "dot_general"),
    "batch_statistics": (
        lambda p, x, y, m: (lambda o: jnp.mean((o - o.mean(0)) ** 2))(stages(p, x)[0]),
        "sub",
    ),
    "max_over_batch": (lambda p, x, y, m: jnp.max(ce(stages(p, x)[0], y)), "reduce_max"),
    "division_inside_custom_vjp": (lambda p, x, y, m: fused_mean(ce(stages(p, x)[0], y), m), "custom_vjp"),
    "nanmean": (lambda p, x, y, m: jnp.nanmean(jnp.where(m > 0, ce(stages(p, x)[0], y), jnp.nan)), "div"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_losses_the_proof_does_not_cover_are_refused_naming_the_operation(name):
    loss, primitive = REFUSED[name]
    step = mp.sxvalue_and_grad(loss, mesh=mesh(), schedule=SCHEDULES["Std1F1B"])
    with pytest.raises(mp.MpmdError, match=rf"`{primitive}\w*` at .*test_mpmd_exact_losses.py:\d+") as e:
        step(*inputs())
    assert "microbatch_weight_fn" in str(e.value) and "reduce='mean'" in str(e.value)


def test_refused_before_any_program_is_compiled():
    step = mp.sxvalue_and_grad(REFUSED["sqrt_of_mean"][0], mesh=mesh(), schedule=SCHEDULES["Std1F1B"])
    with pytest.raises(mp.MpmdError):
        step(*inputs())
    assert step.compiler.stats.compiled == 0 and step.compiler.stats.lowered == 0


def test_a_constant_indexed_by_the_batch_size_is_not_a_per_row_value():
    table = jnp.arange(B, dtype=jnp.float32)

    def loss(p, x, y, m):
        return jnp.sum(ce(stages(p, x)[0], y) * table[: x.shape[0]])

    with pytest.raises(mp.MpmdError, match="loss cannot be proven"):
        mp.sxvalue_and_grad(loss, mesh=mesh(), schedule=SCHEDULES["Std1F1B"])(*inputs())


def z_loss_average(logits, targets):
    """`(cross-entropy + 0.01 * z-loss) / 2`: a scaled sum of two means over the tokens."""
    z = jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
    return (softmax_cross_entropy(logits, targets) + 0.01 * z) / 2


@pytest.mark.parametrize("kind", ["pipeline", "no_pipeline_axis"])
def test_run_on_both_kinds_of_mesh_returns_the_unsplit_loss(kind):
    lm = tiny_lm(jax.random.key(0), n_layers=2, tie_embeddings=False)
    tokens, targets = lm_batch(jax.random.key(1), 8)
    want = jax.value_and_grad(lambda model: z_loss_average(apply(model, tokens), targets))(lm)
    if kind == "pipeline":
        settings = {
            "mesh": mp.create_mesh((2, 1, -1, 1, 1, 1), mpmd_axis="pp"),
            "schedule": Std1F1B(microbatches=M),
        }
    else:
        settings = {"mesh": mp.create_mesh((1, 2, -1, 1, 1, 1)), "microbatches": M}
    got = mp.run(lm, inputs=tokens, targets=targets, loss_fn=z_loss_average, **settings)
    jax.tree.map(_close, got, want)
