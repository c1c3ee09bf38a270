"""A generated test of the promise: every loss is the unsplit value or refused.

Loss functions are drawn from a grammar — means, sums, masked and weighted means,
scalings, sums of terms, constants, parameter regularisers, loops and branches,
nonlinear functions of means, losses that couple the rows of a batch — wrapped in
`jax.jit`, `jax.checkpoint` or `jax.custom_vjp`, in float32, bfloat16 or float16, and
run pipelined (2 ranks, m = 4) on one of two schedules. Each must equal one
`jax.value_and_grad` of the same function on the whole batch, or be refused with an
`MpmdError`; a draw the grammar builds as a linear combination of sums must not be
refused."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import spectrax_mpmd as mp
from spectrax_core.schedules import Std1F1B, ZeroBubbleH1

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

M, B, D, V = 4, 16, 8, 6
SCHEDULES = (Std1F1B(microbatches=M), ZeroBubbleH1(microbatches=M))
MASK = jnp.asarray([0.0] * 4 + [1.0, 0, 0, 0] + [1.0] * 4 + [1.0, 1.0, 1.0, 0])
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 5e-3}


@functools.cache
def mesh():
    return mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])


def ce(o, y):
    return jax.nn.logsumexp(o, -1) - jnp.take_along_axis(o, y[:, None], -1)[:, 0]


def chunked(o, y, m):
    def body(c, col):
        return (c[0] + jnp.sum(col * m), c[1] + jnp.sum(m)), None

    (s, n), _ = lax.scan(body, (0.0, 0.0), jnp.swapaxes(o, 0, 1))
    return s / jnp.maximum(n, 1.0)


def guarded(o, y, m):
    s, n = jnp.sum(ce(o, y) * m), jnp.sum(m)
    return lax.cond(n > 0, lambda: s / n, lambda: 0.0 * s)


# term name -> (f(o, y, m, p), additive in the rows: True, or False when it couples rows)
TERMS = {
    "mse": (lambda o, y, m, p: jnp.mean(o**2), True),
    "mae": (lambda o, y, m, p: jnp.mean(jnp.abs(o)), True),
    "scaled_sum": (lambda o, y, m, p: 0.01 * jnp.sum(o), True),
    "token_mean": (lambda o, y, m, p: jnp.sum(ce(o, y) * m) / jnp.maximum(jnp.sum(m), 1.0), True),
    "weighted": (lambda o, y, m, p: jnp.average(ce(o, y), weights=m + 0.5), True),
    "feature_mean": (lambda o, y, m, p: jnp.sum(jnp.mean(o**2, axis=0)), True),
    "chunked_scan": (lambda o, y, m, p: chunked(o, y, m), True),
    "cond_guard": (lambda o, y, m, p: guarded(o, y, m), True),
    "l2": (lambda o, y, m, p: 0.01 * jnp.sum(p["b"].astype(jnp.float32) ** 2), True),
    "constant": (lambda o, y, m, p: jnp.float32(0.25), True),
    "contrastive": (lambda o, y, m, p: jnp.mean(jax.nn.logsumexp(o @ o.T, -1)), False),
    "batch_norm": (lambda o, y, m, p: jnp.mean((o - o.mean(0)) ** 2), False),
    "max": (lambda o, y, m, p: jnp.max(ce(o, y)), False),
}
ROW_FREE = {"l2", "constant"}
OUTER = {
    "none": lambda v: v,
    "scale": lambda v: 2.5 * v,
    "divide": lambda v: v / 8.0,
    "sqrt": lambda v: jnp.sqrt(v + 1.0),
    "square": lambda v: v**2,
    "exp": lambda v: jnp.exp(v / 10.0),
}
LINEAR_OUTER = {"none", "scale", "divide"}


def fenced(kind: str, tail):
    """`tail(o, y, m, p)` wrapped as the draw says."""
    if kind == "jit":
        return jax.jit(tail)
    if kind == "checkpoint":
        return jax.checkpoint(tail)
    if kind == "custom_vjp":  # a hand-written backward (the analysis reads its primal)
        f = jax.custom_vjp(tail)

        def backward(a, g):
            go, gp = jax.grad(tail, argnums=(0, 3))(*a)
            return jax.tree.map(lambda t: t * g, go), None, None, jax.tree.map(lambda t: t * g, gp)

        f.defvjp(lambda *a: (tail(*a), a), backward)
        return f
    return tail


@st.composite
def losses(draw):
    names = draw(st.lists(st.sampled_from(sorted(TERMS)), min_size=1, max_size=3))
    weights = draw(st.lists(st.sampled_from([0.5, 1.0, 3.0]), min_size=len(names), max_size=len(names)))
    outer = draw(st.sampled_from(sorted(OUTER)))
    fence = draw(st.sampled_from(["none", "none", "jit", "checkpoint", "custom_vjp"]))
    dtype = draw(st.sampled_from(sorted(TOLERANCE)))
    schedule = draw(st.integers(0, 1))

    def tail(o, y, m, p):
        total = sum(w * TERMS[n][0](o.astype(jnp.float32), y, m, p) for n, w in zip(names, weights))
        return OUTER[outer](total).astype(o.dtype)

    fenced_tail = fenced(fence, tail)

    def loss(p, x, y, m):
        h = mp.sxstage_iter(jnp.tanh(x @ p["a"]))
        return fenced_tail(h @ p["b"], y, m, p)

    batch_free = all(n in ROW_FREE for n in names)
    linear = all(TERMS[n][1] for n in names) and (outer in LINEAR_OUTER or batch_free)
    provable = linear and fence in ("none", "jit")
    return loss, dtype, schedule, provable, (names, weights, outer, fence)


def inputs(dtype):
    k = jax.random.split(jax.random.key(0), 4)
    p = {"a": jax.random.normal(k[0], (D, D)) * 0.4, "b": jax.random.normal(k[1], (D, V)) * 0.4}
    x, y = jax.random.normal(k[2], (B, D)), jax.random.randint(k[3], (B,), 0, V)
    return jax.tree.map(lambda a: a.astype(dtype), p), x.astype(dtype), y, MASK


def relative(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))


@pytest.mark.slow
@hypothesis.settings(max_examples=40, deadline=None, derandomize=True, database=None)
@hypothesis.given(losses())
def test_every_drawn_loss_is_exact_or_refused(drawn):
    loss, dtype, schedule, provable, what = drawn
    args = inputs(jnp.dtype(dtype))
    step = mp.sxvalue_and_grad(loss, mesh=mesh(), schedule=SCHEDULES[schedule])
    try:
        value, grads = step(*args)
    except mp.MpmdError as e:
        assert not provable, f"{what} is a linear combination of sums but was refused: {e}"
        return
    want_value, want_grads = jax.value_and_grad(loss)(*args)
    worst = max(
        relative(a, b)
        for a, b in zip(jax.tree.leaves((value, grads)), jax.tree.leaves((want_value, want_grads)))
    )
    assert worst <= TOLERANCE[dtype], f"{what} in {dtype}: silently off by {worst:.3g}"
