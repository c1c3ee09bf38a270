"""Trace safety and cache keys: no call under a JAX transformation, no stale plan after a
configuration change, weak types kept, fresh gradients every call, no state left by a failure."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpmd_cases import assert_close, pipeline_mesh

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._trace import context as _context

D, BATCH, M = 4, 8, 4


@functools.lru_cache(maxsize=None)
def mesh2():
    return pipeline_mesh(2)


def two_stage_loss(p, x):
    return jnp.mean(mp.sxstage_iter(jnp.tanh(x @ p["w"])) @ p["v"])


def data():
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k[0], (D, D)) * 0.5, "v": jax.random.normal(k[1], (D, 1)) * 0.5}
    return params, jax.random.normal(k[2], (BATCH, D))


def forward(x):
    return mp.sxstage_iter(jnp.tanh(x * 2.0)) + 1.0


# --- calls under a transformation ---------------------------------------------------------


def _transformations(call):
    """Ways of calling `call()` (which closes over concrete arrays) under an active transformation."""
    return {
        "jit": lambda: jax.jit(lambda z: call() + z)(1.0),
        "grad": lambda: jax.grad(lambda z: jnp.sum(call()) * z)(1.0),
        "vmap": lambda: jax.vmap(lambda z: call() * z)(jnp.ones(2)),
        "scan": lambda: jax.lax.scan(lambda c, _: (c + jnp.sum(call()), None), 0.0, None, length=2),
        "checkpoint": lambda: jax.checkpoint(lambda z: jnp.sum(call()) * z)(1.0),
        "eval_shape": lambda: jax.eval_shape(lambda z: call() + z, 1.0),
    }


TRANSFORMS = sorted(_transformations(lambda: 0.0))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_step_under_a_transformation_is_refused_before_any_cache(transform):
    params, x = data()
    step = mp.sxvalue_and_grad(two_stage_loss, mesh=mesh2(), schedule=S.Std1F1B(microbatches=M))
    with pytest.raises(
        mp.TraceContextError, match=r"sxvalue_and_grad was called inside a JAX transformation"
    ):
        _transformations(lambda: step(params, x)[0])[transform]()
    assert step.cache == {} and step.placer.cache == {} and step.compiler.cache == {}
    assert_close(step(params, x), jax.value_and_grad(two_stage_loss)(params, x))
    assert_close(
        step({k: v + 0 for k, v in params.items()}, x + 0), jax.value_and_grad(two_stage_loss)(params, x)
    )


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_sxjit_under_a_transformation_is_refused_before_any_cache(transform):
    f = mp.sxjit(forward, mesh=mesh2())
    x = jnp.arange(3.0)
    with pytest.raises(mp.TraceContextError, match=r"sxjit was called inside a JAX transformation"):
        _transformations(lambda: f(x))[transform]()
    assert f.cache == {} and f.placer.cache == {} and f.compiler.cache == {}
    np.testing.assert_allclose(f(x), forward(x), rtol=1e-6)


JAXPR_TRACES = ("jit", "scan", "checkpoint", "eval_shape")


def test_public_trace_probe_agrees_with_jax_on_jaxpr_traces():
    seen: list = []

    def probe():
        seen.append((_context.public_active_trace(), _context.active_trace()))
        return jnp.float32(0.0)

    for transform in JAXPR_TRACES:
        seen.clear()
        _transformations(probe)[transform]()
        assert seen and all(pair == (True, True) for pair in seen), transform
    assert (_context.public_active_trace(), _context.active_trace()) == (False, False)


@pytest.mark.parametrize("transform", JAXPR_TRACES)
def test_public_trace_probe_refuses_the_same_calls(monkeypatch, transform):
    monkeypatch.setattr(_context, "_trace_state_clean", None)
    f = mp.sxjit(forward, mesh=mesh2())
    x = jnp.arange(3.0)
    with pytest.raises(mp.TraceContextError):
        _transformations(lambda: f(x))[transform]()
    assert f.cache == {}
    np.testing.assert_allclose(f(x), forward(x), rtol=1e-6)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_public_trace_probe_under_grad_or_vmap_computes_concretely(monkeypatch, transform):
    """Without JAX's private trace state, grad / vmap over closed-over arrays run the call on concrete
    values: the result is right and no tracer reaches any cache."""
    monkeypatch.setattr(_context, "_trace_state_clean", None)
    f = mp.sxjit(forward, mesh=mesh2())
    x = jnp.arange(3.0)
    _transformations(lambda: f(x))[transform]()
    cached = [
        *jax.tree.leaves(list(f.placer.cache.values())),
        *f.cache[next(iter(f.cache))].plan.const_slots.values(),
    ]
    assert not any(isinstance(v, jax.core.Tracer) for v in cached)
    np.testing.assert_allclose(f(x), forward(x), rtol=1e-6)


# --- a failed call leaves nothing behind ----------------------------------------------------


def test_a_failed_trace_leaves_no_state():
    params, x = data()

    def loss(p, x, mode):
        if mode == "bad":
            raise RuntimeError("bad mode")
        return two_stage_loss(p, x)

    step = mp.sxvalue_and_grad(loss, mesh=mesh2(), schedule=S.Std1F1B(microbatches=M), static_argnums=2)
    with pytest.raises(RuntimeError, match="bad mode"):
        step(params, x, "bad")
    assert step.cache == {}
    assert_close(step(params, x, "good"), jax.value_and_grad(two_stage_loss)(params, x))


def test_a_refused_call_leaves_no_state():
    """A deleted array is refused before anything is built (first call) or run (later calls)."""
    params, x = data()
    step = mp.sxvalue_and_grad(two_stage_loss, mesh=mesh2(), schedule=S.Std1F1B(microbatches=M))
    gone = x + 0
    gone.delete()
    with pytest.raises(mp.MpmdError, match="deleted"):
        step(params, gone)
    assert step.cache == {}
    assert_close(step(params, x), jax.value_and_grad(two_stage_loss)(params, x))
    with pytest.raises(mp.MpmdError, match="deleted"):
        step(params, gone)
    assert len(step.cache) == 1
    assert_close(step(params, x), jax.value_and_grad(two_stage_loss)(params, x))


# --- gradients of unused leaves survive donation ---------------------------------------------


def test_donating_gradients_with_an_unused_leaf():
    params, x = data()
    params = {**params, "frozen": jnp.ones(3)}
    step = mp.sxvalue_and_grad(two_stage_loss, mesh=mesh2(), schedule=S.Std1F1B(microbatches=M))
    update = jax.jit(lambda a, g: a - 0.1 * g, donate_argnums=(1,))
    reference = dict(params)
    for _ in range(5):
        _, grads = step(params, x)
        np.testing.assert_array_equal(np.asarray(grads["frozen"]), np.zeros(3))
        params = {k: update(params[k], grads[k]) for k in params}
        ref_grads = jax.grad(two_stage_loss)(reference, x)
        reference = {
            k: reference[k] - 0.1 * ref_grads[k] if k in ref_grads else reference[k] for k in reference
        }
        assert all(g.is_deleted() for g in grads.values())
    assert_close(params, reference)


# --- configuration and weak types key the plan -------------------------------------------------


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64")
def test_x64_toggled_between_calls():
    def f(x):
        return mp.sxstage_iter(x.astype(jnp.float_)) + jnp.arange(4)

    g = mp.sxjit(f, mesh=mesh2())
    x = np.ones(4, np.float32)
    assert g(x).dtype == jnp.float32
    jax.config.update("jax_enable_x64", True)
    try:
        assert g(x).dtype == jnp.float64
        np.testing.assert_array_equal(g(x), f(x))
    finally:
        jax.config.update("jax_enable_x64", False)
    assert g(x).dtype == jnp.float32
    assert len(g.cache) == 2


def test_x64_toggled_between_training_steps():
    def loss(p, x):
        return two_stage_loss(p, x) + jnp.sum(jnp.arange(3.0)) * 0.0

    params, x = data()
    step = mp.sxvalue_and_grad(loss, mesh=mesh2(), schedule=S.Std1F1B(microbatches=M))
    assert step(params, x)[0].dtype == jnp.float32
    jax.config.update("jax_enable_x64", True)
    try:
        value, grads = step(params, x)
        ref_value, ref_grads = jax.value_and_grad(loss)(params, x)
        assert value.dtype == ref_value.dtype == jnp.float64
        assert_close((value, grads), (ref_value, ref_grads))
    finally:
        jax.config.update("jax_enable_x64", False)


def test_rank_promotion_and_matmul_precision_key_the_plan():
    def add(a, b):
        return mp.sxstage_iter(a + b)[0] * 1

    g = mp.sxjit(add, mesh=mesh2())
    a, b = jnp.ones((3, 1)), jnp.ones(3)
    assert g(a, b).shape == (3,)
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="rank_promotion"):
            g(a, b)
    assert g(a, b).shape == (3,)

    h = mp.sxjit(lambda x: mp.sxstage_iter(x @ x) @ x, mesh=mesh2())
    x = jnp.eye(3) * 0.5
    h(x)
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(h(x), x @ x @ x, rtol=1e-6)
    assert len(h.cache) == 2


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64")
def test_public_config_key_gives_the_same_plans(monkeypatch):
    """JAX's private trace context and the public fallback (every jax.config value) both see a
    configuration change, and the runtime gives the same results with either."""
    keys = {}
    for name, fn in {"private": _context.config_key, "public": _context.public_config_key}.items():
        before = fn()
        with jax.numpy_rank_promotion("raise"):
            promotion = fn()
        with jax.default_matmul_precision("highest"):
            precision = fn()
        keys[name] = (before != promotion, before != precision, before == fn())
    assert keys["private"] == keys["public"] == (True, True, True)

    results = {}
    for name in ("private", "public"):
        if name == "public":
            monkeypatch.setattr(_context, "_trace_context", None)
        g = mp.sxjit(lambda x: mp.sxstage_iter(x.astype(jnp.float_)) * 2, mesh=mesh2())
        x = np.arange(3, dtype=np.float32)
        out32 = g(x)
        jax.config.update("jax_enable_x64", True)
        try:
            out64 = g(x)
        finally:
            jax.config.update("jax_enable_x64", False)
        results[name] = (out32.dtype, out64.dtype, np.asarray(out64))
    assert results["private"][:2] == results["public"][:2] == (jnp.float32, jnp.float64)
    np.testing.assert_array_equal(results["private"][2], results["public"][2])


@pytest.mark.parametrize(
    "x, scalar",
    [
        (jnp.ones(4, jnp.bfloat16), 2.0),
        (jnp.ones(4, jnp.float16), 2.0),
        (jnp.ones(4, jnp.int8), 3),
        (jnp.ones(4, jnp.bfloat16), jnp.asarray(2.0)),  # a weakly typed JAX scalar
    ],
    ids=["bf16-float", "f16-float", "int8-int", "bf16-weak-array"],
)
def test_python_scalars_stay_weakly_typed(x, scalar):
    def f(x, s):
        return mp.sxstage_iter(x * s) + 1

    g = mp.sxjit(f, mesh=mesh2())
    out = g(x, scalar)
    assert out.dtype == jax.jit(f)(x, scalar).dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(jax.jit(f)(x, scalar), np.float32))
    assert g(x, np.float32(2.0)).dtype == jnp.promote_types(x.dtype, jnp.float32)  # a strong scalar promotes


def test_weak_broadcast_scalar_keeps_bf16_gradients():
    def loss(p, x, scale):
        return jnp.mean(mp.sxstage_iter(jnp.tanh(x @ p["w"] * scale)) @ p["v"]).astype(jnp.float32)

    params, x = data()
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    x = x.astype(jnp.bfloat16)
    step = mp.sxvalue_and_grad(loss, mesh=mesh2(), schedule=S.Std1F1B(microbatches=M), batch_argnums=1)
    _, grads = step(params, x, 0.5)
    ref = jax.grad(loss)(params, x, 0.5)
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
    assert_close(
        jax.tree.map(lambda a: a.astype(jnp.float32), grads),
        jax.tree.map(lambda a: a.astype(jnp.float32), ref),
        rtol=2e-2,
        atol=2e-2,
    )


# --- error messages --------------------------------------------------------------------------


def test_marker_sharding_that_does_not_match_the_value():
    def loss(p, x):
        h, _ = mp.sxstage_iter((x @ p["w"], x), sharding={"a": None})
        return jnp.mean(h @ p["v"])

    params, x = data()
    step = mp.sxvalue_and_grad(loss, mesh=mesh2(), schedule=S.Std1F1B(microbatches=M))
    pattern = (
        r"sxstage_iter: sharding= must be one PartitionSpec.*structure of the marked value.*\{'a': None\}"
    )
    with pytest.raises(mp.MarkerError, match=pattern):
        step(params, x)
    with pytest.raises(mp.MarkerError, match=r"sxstage_iter\(stage=0\): sharding="):
        mp.sxstage_iter((x, x), stage=0, sharding=[None])
