"""The core LM trains through the pipeline exactly as on one device.

A tied-embedding TransformerLM on 4 ranks (embed | block 0 | block 1 | norm,
tied head and loss): the embedding table is read by the first and the last
stage, so its gradient is the sum of both uses. A 20-step AdamW loop with
global-norm clipping (`StagedOptimizer`) tracks the single-device optax loop.
"""

import jax
import numpy as np
import optax
import pytest
from mpmd_cases import assert_close, lm_batch, make_schedule, pipeline_mesh, pipelined_lm_loss, tiny_lm

import spectrax_mpmd as mp

STEPS, LR, CLIP = 20, 3e-3, 0.5
loss_fn = pipelined_lm_loss((0, 1, 1, 0))


@pytest.fixture(scope="module")
def tied():
    mesh = pipeline_mesh(4)
    lm = tiny_lm(jax.random.key(11), n_layers=2, tie_embeddings=True)
    step = mp.sxvalue_and_grad(loss_fn, mesh=mesh, schedule=make_schedule("Std1F1B", 4))
    batches = [lm_batch(k, 8) for k in jax.random.split(jax.random.key(12), STEPS)]
    first = (*step(lm, batches[0]), *jax.jit(jax.value_and_grad(loss_fn))(lm, batches[0]))
    return mesh, lm, step, batches, first


def test_tied_lm_gradients_match_the_reference(tied):
    mesh, lm, step, batches, (loss, grads, ref_loss, ref_grads) = tied
    assert lm.head is None
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    plan = step.plan_for(lm, batches[0])
    readers = {r for _, (kind, a, r) in plan.input_keys if kind == "param" and a == 0}
    assert readers == {0, 3}, "the tied table is sent to the embedding stage and the head stage"
    assert grads.embed.table.sharding.device_set == set(mesh.submesh(0).devices.flat)


def test_staged_global_norm_is_the_global_norm(tied):
    _, lm, _, _, (_, grads, _, ref_grads) = tied
    opt = mp.StagedOptimizer(optax.sgd(0.1), max_grad_norm=CLIP)
    np.testing.assert_allclose(opt.global_norm(grads), optax.tree.norm(ref_grads), rtol=1e-5)
    assert len(opt.init(lm, grads).groups) == 3  # ranks 0, 1, 2 own parameters; rank 3 reads only


@pytest.mark.parametrize("max_norm", [CLIP, None], ids=["clipped", "unclipped"])
def test_one_update_is_the_unsplit_update(tied, max_norm):
    """One step of `StagedOptimizer` (the norm read inside each rank's update program) against
    `clip_by_global_norm` + adamw on the unsplit gradients, on one device."""
    _, lm, _, _, (_, grads, _, ref_grads) = tied
    tx = optax.adamw(LR, weight_decay=0.1)
    ref_tx = tx if max_norm is None else optax.chain(optax.clip_by_global_norm(max_norm), tx)
    assert max_norm is None or float(optax.tree.norm(ref_grads)) > max_norm, "the clip must be active"
    updates, _ = ref_tx.update(ref_grads, ref_tx.init(lm), lm)
    opt = mp.StagedOptimizer(tx, max_grad_norm=max_norm)
    params, _ = opt.update(grads, opt.init(lm, grads), lm)
    assert_close(params, optax.apply_updates(lm, updates))


@pytest.mark.slow
def test_twenty_adamw_steps_track_the_single_device_loop(tied):
    _, lm, step, batches, _ = tied
    tx = optax.adamw(LR, weight_decay=0.1)
    reference_tx = optax.chain(optax.clip_by_global_norm(CLIP), tx)

    @jax.jit
    def reference_step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = reference_tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, optax.tree.norm(grads)

    opt = mp.StagedOptimizer(tx, max_grad_norm=CLIP)
    params, ref_params = lm, lm
    ref_state = reference_tx.init(lm)
    state = None
    losses, ref_losses, clipped = [], [], 0
    for batch in batches:
        loss, grads = step(params, batch)
        state = opt.init(params, grads) if state is None else state
        params, state = opt.update(grads, state, params)
        ref_params, ref_state, ref_loss, ref_norm = reference_step(ref_params, ref_state, batch)
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
        clipped += float(ref_norm) > CLIP
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert_close(params, ref_params, rtol=1e-4, atol=1e-5)
    assert clipped >= 5, "the clip must be active for the test to check it"
    assert losses[-1] < losses[0] - 0.05, "the loop must actually train"
