"""`spx.run` advances the model's `Rngs` streams on the pipeline and on the SPMD path: consecutive
calls draw different dropout masks, the values equal `spx.jit` (train) or an eager call (forward)
of each microbatch with the stream key folded by the microbatch index, and the counters after a
call equal those after one `spx.jit` step of the same stream."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_rngs_worker import Net  # the model the two-process job trains too

import spectrax_eager as spx

M = 2  # microbatches
X = jax.random.normal(jax.random.key(1), (8, 8))
Y = jax.random.normal(jax.random.key(2), (8, 8))


@functools.cache
def mesh_of(kind: str):
    if kind == "spmd":
        return spx.create_mesh((1, 2, -1, 1, 1, 1))
    return spx.create_mesh((2, 1, -1, 1, 1, 1), mpmd_axis="pp")


def mse(out, target):
    return jnp.mean((out - target) ** 2)


def counters(model) -> list[int]:
    return [int(var.value) for _, var in spx.iter_variables(model, spx.RngCount)]


def microbatch_copy(model, i: int):
    """An independent copy of `model` whose stream keys are folded with microbatch index `i`."""
    copy = spx.clone(model)
    for _, var in spx.iter_variables(copy, spx.RngKey):
        var.value = jax.random.fold_in(var.value, i)
    return copy


@spx.jit
def jit_step(model, x, y):
    return spx.value_and_grad(lambda m: mse(m(x), y))(model)


def reference_train(model):
    """The mean over microbatches of `spx.jit` steps, and the counters after one such step."""
    size = X.shape[0] // M
    results, after = [], None
    for i in range(M):
        copy = microbatch_copy(model, i)
        results.append(jit_step(copy, X[i * size : (i + 1) * size], Y[i * size : (i + 1) * size]))
        after = counters(copy)
    loss = sum(r[0] for r in results) / M
    grads = jax.tree.map(lambda *g: sum(g) / M, *(r[1] for r in results))
    return loss, grads, after


def reference_forward(model):
    """The eager outputs of each microbatch in batch order, and the counters after one call."""
    size = X.shape[0] // M
    outs, after = [], None
    for i in range(M):
        copy = microbatch_copy(model, i)
        outs.append(copy(X[i * size : (i + 1) * size]))
        after = counters(copy)
    return jnp.concatenate(outs), after


def assert_tree_close(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["pp2", "spmd"])
def test_training_steps_draw_fresh_masks_equal_to_spx_jit(kind):
    model, losses = Net(), []
    for step in range(3):
        ref_loss, ref_grads, ref_counters = reference_train(model)
        loss, grads = spx.run(model, inputs=X, targets=Y, mesh=mesh_of(kind), loss_fn=mse, microbatches=M)
        assert_tree_close(loss, ref_loss)
        assert_tree_close(grads, ref_grads)
        assert counters(model) == ref_counters
        assert int(model.drop.rngs.dropout.count.value) == 2 * (step + 1)  # two draws per forward
        losses.append(float(loss))
    assert len(set(losses)) == 3


@pytest.mark.parametrize("kind", ["pp2", "spmd"])
def test_forward_calls_draw_fresh_masks_equal_to_eager_calls(kind):
    model, outputs = Net(), []
    for _ in range(2):
        ref_out, ref_counters = reference_forward(model)
        out = spx.run(model, inputs=X, mesh=mesh_of(kind), mode="forward", microbatches=M)
        assert_tree_close(out, ref_out)
        assert counters(model) == ref_counters
        outputs.append(np.asarray(out))
    assert not np.allclose(outputs[0], outputs[1])


def test_user_aux_comes_back_unchanged_next_to_the_advanced_stream():
    model = Net()
    ref_loss, _, ref_counters = reference_train(model)
    (loss, aux), _ = spx.run(
        model, inputs=X, targets=Y, mesh=mesh_of("spmd"), microbatches=M, has_aux=True,
        loss_fn=lambda o, t: (mse(o, t), {"mean_out": jnp.mean(o)}),
    )
    assert_tree_close(loss, ref_loss)
    assert aux["mean_out"].shape == (M,)
    assert counters(model) == ref_counters


def test_eval_mode_draws_nothing_and_repeats():
    model = Net()
    model.eval()
    first = spx.run(model, inputs=X, mesh=mesh_of("pp2"), mode="forward", microbatches=M)
    second = spx.run(model, inputs=X, mesh=mesh_of("pp2"), mode="forward", microbatches=M)
    np.testing.assert_array_equal(first, second)
    assert int(model.drop.rngs.dropout.count.value) == 0
    np.testing.assert_allclose(first, model(X), rtol=1e-5, atol=1e-6)
