"""The pipeline names of `spx` in the forms written for `spectrax-lib`: the schedule classes'
arguments, `sxgrad` / `sxvalue_and_grad` / `sxvalue_and_grad_and_apply` of an `sxjit`ted loss,
`sxstage_region(fn)`, `sxjit(static_argnames=)`, and the keywords refused with a clear error.

References: the core's schedule tables, and `jax.value_and_grad` of the same loss on the
whole batch on one device (rtol 1e-5)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_eager as spx
import spectrax_mpmd as mp
from spectrax_core import schedules as core

RTOL, ATOL = 1e-5, 1e-6
N = 4  # pipeline ranks


@pytest.mark.parametrize(
    "seed_call, core_call",
    [
        (lambda: spx.GPipe(8, True), lambda: core.GPipe(8)),
        (lambda: spx.Std1F1B(8, lazy_bwd_batching=False), lambda: core.Std1F1B(8)),
        (lambda: spx.Eager1F1B(microbatches=8), lambda: core.Eager1F1B(8)),
        (lambda: spx.ZeroBubbleH1(8, True), lambda: core.ZeroBubbleH1(8)),
        (lambda: spx.DualPipeV(8, False, True), lambda: core.DualPipeV(8)),
        (lambda: spx.InterleavedH1(8, False, 3, "interleaved"), lambda: core.InterleavedH1(8, 3)),
        (lambda: spx.InterleavedGPipe(8, virtual_stages=2), lambda: core.InterleavedGPipe(8, 2)),
        (lambda: spx.Interleaved1F1BPlusOne(8, True, 2), lambda: core.Interleaved1F1BPlusOne(8, 2)),
        (lambda: spx.runtime.KimiK2(8, False, 2, "interleaved", 1, False), lambda: core.KimiK2(8, 2)),
    ],
)
def test_schedules_take_the_seed_arguments_and_build_the_core_table(seed_call, core_call):
    ours, reference = seed_call(), core_call()
    assert type(ours) is type(reference) and ours == reference  # one class per schedule name
    assert ours.actions(N) == reference.actions(N)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: spx.InterleavedH1(8, 2), ["lazy_bwd_batching", "virtual_stages="]),
        (lambda: spx.KimiK2(8, stage_layout="loop"), ["stage_layout='loop'", "'interleaved'"]),
        (lambda: spx.InterleavedGPipe(8, stage_layout="ring"), ["stage_layout must be one of"]),
        (lambda: spx.DualPipeV(8, zero_bubble=False), ["zero_bubble=False", "zero_bubble=True"]),
        (lambda: spx.KimiK2(8, extra_warmup=2), ["extra_warmup=2", "extra_warmup=1"]),
        (lambda: spx.KimiK2(8, split_backward=True), ["split_backward=True"]),
    ],
)
def test_schedule_arguments_asking_for_another_table_are_refused(call, words):
    with pytest.raises((TypeError, core.ScheduleError)) as info:
        call()
    assert all(w in str(info.value) for w in words), str(info.value)


# --- the entry points on an sxjitted loss ----------------------------------------------------------


def _loss(ws, x, y):
    h = x
    for i, w in enumerate(ws):
        h = jnp.tanh(h @ w)
        if i < len(ws) - 1:
            h = spx.sxstage_iter(h)
    return jnp.mean((h - y) ** 2)


def _reference(ws, x, y):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.mean((h - y) ** 2)


@functools.cache
def _setup():
    mesh = spx.create_mesh((N, 1, -1, 1, 1, 1), mpmd_axis="pp")
    ws = [jax.random.normal(jax.random.key(i), (8, 8)) * 0.3 for i in range(N)]
    x, y = jax.random.normal(jax.random.key(9), (8, 8)), jnp.ones((8, 8))
    jitted = spx.sxjit(_loss, mesh=mesh, schedule=spx.Std1F1B(4), batch_argnums=(1, 2))
    return jitted, ws, x, y


def _close(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=RTOL, atol=ATOL)


def test_sxgrad_and_sxvalue_and_grad_of_an_sxjitted_loss():
    jitted, ws, x, y = _setup()
    loss_ref, (g_ws, g_x) = jax.value_and_grad(_reference, argnums=(0, 1))(ws, x, y)
    grads = spx.sxgrad(jitted)(ws, x, y)  # one entry per position, also for an int
    assert isinstance(grads, tuple) and len(grads) == 1
    _close(grads[0], g_ws)
    loss, grads = spx.sxvalue_and_grad(jitted, argnums=(0,))(ws, x, y)
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=RTOL)
    _close(grads, (g_ws,))


def test_sxvalue_and_grad_and_apply_calls_apply_fn_per_rank():
    jitted, ws, x, y = _setup()
    lr, seen = 0.1, []

    def apply_fn(rank, *, grad_accums, state):
        seen.append((rank, sorted(grad_accums)))
        leaves, tree = jax.tree.flatten(state["new_params_buf"].get(rank - 1, state["params"]))
        for i, g in grad_accums.items():
            leaves[i] = leaves[i] - lr * jax.device_put(g, leaves[i].sharding)
        state["new_params_buf"][rank] = jax.tree.unflatten(tree, leaves)
        state["new_opt_state_buf"][rank] = state["opt_state"] + 1

    step = spx.sxvalue_and_grad_and_apply(jitted, argnums=0)
    loss, new_ws, count = step(ws, x, y, apply_fn=apply_fn, opt_state=0)
    loss_ref, g_ws = jax.value_and_grad(_reference)(ws, x, y)
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=RTOL)
    _close(new_ws, [w - lr * g for w, g in zip(ws, g_ws)])
    assert count == 1 and seen == [(r, [r]) for r in range(N)]  # leaf r (ws[r]) lives on rank r
    with pytest.raises(mp.MpmdError, match="new_params_buf"):
        step(ws, x, y, apply_fn=lambda rank, grad_accums, state: None, opt_state=0)


def test_the_forms_built_from_a_loss_are_spectrax_mpmds():
    jitted, ws, x, y = _setup()
    with pytest.raises(TypeError, match="sxjit"):
        spx.sxgrad(_loss)  # neither sxjitted nor given mesh=
    with pytest.raises(TypeError, match="mesh="):
        spx.sxvalue_and_grad(jitted, has_aux=True)
    step = spx.sxvalue_and_grad(_loss, mesh=jitted.mesh, schedule=spx.Std1F1B(4), batch_argnums=(1, 2))
    loss, g = step(ws, x, y)
    _close((loss, g), jax.value_and_grad(_reference)(ws, x, y))


def test_sxjit_static_argnames_and_refused_shardings():
    jitted, ws, x, y = _setup()

    def scaled(ws, x, scale):
        return _loss(ws, x, jnp.zeros_like(x)) * scale

    fn = spx.sxjit(scaled, mesh=jitted.mesh, static_argnames="scale")
    assert fn.static_argnums == (2,)
    np.testing.assert_allclose(
        float(fn(ws, x, 3.0)), 3.0 * float(_reference(ws, x, jnp.zeros_like(x))), rtol=RTOL
    )
    with pytest.raises(mp.MpmdError, match="in_shardings"):
        spx.sxjit(scaled, mesh=jitted.mesh, in_shardings=())


def test_sxstage_region_of_a_function_and_refused_arguments():
    def vision(x):
        return x * 2

    wrapped = spx.sxstage_region(vision, schedule=spx.GPipe(4))
    assert float(wrapped(jnp.ones(()))) == 2.0
    with pytest.raises(mp.StageSplitError, match="name the region"):
        spx.sxstage_region()
    with pytest.raises(mp.StageSplitError, match="batch_argnums"):
        spx.sxstage_region("text", batch_argnums=(0,))
    assert spx.sxstage_region("text").name == "text"


def test_run_and_sxcall_refuse_fusion_and_legacy_options():
    model = spx.nn.PipelineSequential(spx.nn.Linear(4, 4, rngs=spx.Rngs(0)))
    mesh, _, x, _ = _setup()[0].mesh, None, jnp.ones((4, 4)), None
    with pytest.raises(mp.MpmdError, match="fuse_1f1b=True"):
        spx.run(model, inputs=x, mesh=mesh, fuse_1f1b=True)
    for key, value in (("chunks", 2), ("transport", "ppermute"), ("donate_activations", True)):
        with pytest.raises(mp.MpmdError, match=key):
            spx.sxcall(model, (x, x), mesh=mesh, schedule=spx.GPipe(4), **{key: value})
