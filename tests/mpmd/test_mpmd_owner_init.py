"""Parameters and Adam state made on their ranks (`mp.init_on_owners`), trained, checkpointed and
restored into another layout, with every device's live bytes within its rank's predicted peak.

A residual-MLP LM whose parameters and Adam state together are several times what any rank's
predicted peak allows one device: each rank makes only its own leaves (the values of the
unsplit `jax.jit(init)(key)`, bit for bit; within one rounding step of `init(key)` run op by
op), trains as the unsplit step does (rtol 1e-5), and a restore
into a 2-rank layout reads in batches, its host staging bounded by the largest array.
"""

import functools
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from planner_cases import residual_lm_loss
from test_mpmd_owner_programs import ULPS, ulps

import spectrax_core as sc
import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_core.losses import softmax_cross_entropy
from spectrax_core.models import TransformerLM
from spectrax_mpmd._checkpoint.hosts import host_batches

VOCAB, D, LENGTH, BATCH, M, BLOCKS, HIDDEN = 32, 128, 8, 16, 4, 8, 512
TX = optax.adam(1e-3)
MESH = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])
MESH2 = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[4:6])
STEPS = 3
HOST_SLACK = 256 << 10  # orbax's own bookkeeping of a restore (measured: under 0.2 MiB)


def init(key):
    keys = jax.random.split(key, 2 * BLOCKS + 2)
    blocks = [
        {
            "w1": jax.random.normal(keys[2 * k], (D, HIDDEN)) / D**0.5,
            "w2": jax.random.truncated_normal(keys[2 * k + 1], -2.0, 2.0, (HIDDEN, D)) / (4 * HIDDEN**0.5),
        }
        for k in range(BLOCKS)
    ]
    embed = jax.random.normal(keys[-2], (VOCAB, D))
    head = (jax.random.uniform(keys[-1], (D, VOCAB)) - 0.5) / D**0.5
    return {"embed": embed, "blocks": blocks, "head": head}


def lm_loss(n_stages: int):
    return residual_lm_loss(mp.stage_sizes(BLOCKS, n_stages))


def batch():
    k1, k2 = jax.random.split(jax.random.key(7))
    shape = (BATCH, LENGTH)
    return jax.random.randint(k1, shape, 0, VOCAB), jax.random.randint(k2, shape, 0, VOCAB)


def build(n_stages):
    return lm_loss(n_stages), (jax.jit(init)(jax.random.key(0)), *batch())


@functools.cache
def unsplit_losses(steps: int) -> list[float]:
    """The losses of `steps` steps of the model initialised and trained on one device."""
    params, tokens, targets = build(1)[1]
    state, out = TX.init(params), []
    for _ in range(steps):
        loss, grads = jax.value_and_grad(lm_loss(1))(params, tokens, targets)
        updates, state = TX.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        out.append(float(loss))
    return out


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def live_bytes(before: set) -> dict:
    """Bytes per device of the live arrays made since `before` (the ids of those alive then), each
    buffer once (an array's per-device views share its buffers)."""
    buffers: dict = {}
    for x in jax.live_arrays():
        if id(x) in before or x.is_deleted():
            continue
        for shard in x.addressable_shards:
            buffers[shard.device, shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    out: dict = {}
    for (device, _), size in buffers.items():
        out[device] = out.get(device, 0) + size
    return out


@pytest.fixture(scope="module")
def planned():
    """The planner's predicted peak per rank (Adam's state included) and its one-plan step."""
    advice = mp.advise(
        build, mesh=MESH, schedules=(S.Std1F1B,), microbatches=(M,), virtual_stages=(1,), rounds=1, tx=TX,
        search=False,
    )  # fmt: skip
    return advice.best.peak_bytes, advice.step()


@pytest.fixture(scope="module")
def trained(planned, tmp_path_factory):
    """Owner-rank init, a few steps and a checkpoint; the highest live bytes per rank at each point."""
    peaks, step = planned
    kept = jax.live_arrays()  # held, so that their ids stay theirs
    before = {id(x) for x in kept}
    tokens, targets = batch()
    seen = []
    params, state = mp.init_on_owners(step, init, jax.random.key(0), tokens, targets, tx=TX)
    seen.append(("init", live_bytes(before)))
    made = (jax.tree.map(np.asarray, params), nbytes(params) + nbytes(state))
    losses = []
    for _ in range(STEPS):
        loss, params, state = step(params, state, tokens, targets)
        losses.append(float(loss))
        seen.append(("step", live_bytes(before)))
    directory = tmp_path_factory.mktemp("owner_init")
    mp.save_checkpoint(directory, STEPS, params=params, opt_state=state)
    seen.append(("save", live_bytes(before)))
    return peaks, seen, made, losses, directory


def test_each_rank_holds_no_more_than_its_predicted_peak(trained):
    peaks, seen, (_, whole), *_ = trained
    # the whole state is 4x a device's share of it, and more than any rank's predicted peak allows
    shares = seen[0][1].values()
    assert len(shares) == 4 and whole >= 3.5 * max(shares) and whole > 1.8 * max(peaks), (whole, peaks)
    for where, live in seen:
        assert set(live) <= set(MESH.devices.flat), (where, live)
        for device, held in live.items():
            rank = MESH.device_rank[device]
            assert held <= 1.1 * peaks[rank], (where, rank, held, peaks)
            assert held < whole / 2, (where, rank, held, whole)


def test_the_values_are_those_of_the_jitted_unsplit_init(trained):
    _, _, (made, _), *_ = trained
    want = jax.jit(init)(jax.random.key(0))  # on one device
    assert jax.tree.structure(made) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(want)):
        assert ulps(a, b) <= ULPS  # 0 at XLA's default optimisation (test_mpmd_owner_programs)


def test_it_trains_as_the_unsplit_step(trained):
    *_, losses, _ = trained
    np.testing.assert_allclose(losses, unsplit_losses(STEPS), rtol=1e-5)


def test_a_restore_into_another_layout_reads_each_array_onto_its_rank_within_the_host_bound(trained):
    *_, directory = trained
    step = mp.sxvalue_and_grad_and_apply(lm_loss(2), TX, mesh=MESH2, schedule=S.GPipe(microbatches=M))
    tokens, targets = batch()
    like, opt_like = mp.owner_layout(step, init, jax.random.key(0), tokens, targets, tx=TX)
    largest = max(x.size * x.dtype.itemsize for x in jax.tree.leaves((like, opt_like)))
    tracemalloc.start()
    try:
        restored = mp.restore_checkpoint(directory, like=like, opt_like=opt_like, host_bytes=0)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # on CPU a restored array may keep the host buffer it was read into (it is the device's memory
    # there); staged beyond those: one batch (at most the largest array) and orbax's bookkeeping
    whole = nbytes((like, opt_like))
    assert peak - held <= 2 * largest + HOST_SLACK < whole / 4, (peak, held, largest, whole)
    got = jax.tree.leaves((restored.params, restored.opt_state))
    assert [x.sharding for x in got] == [x.sharding for x in jax.tree.leaves((like, opt_like))]
    loss, *_ = step(restored.params, restored.opt_state, tokens, targets)
    np.testing.assert_allclose(float(loss), unsplit_losses(STEPS + 1)[-1], rtol=1e-5)


def lm_init(key):
    lm = TransformerLM.init(key, vocab_size=VOCAB, d_model=16, n_layers=4, n_heads=2, d_ff=32)
    return mp.stage_blocks(lm, 4)


def test_a_runner_step_gets_both_ready_for_its_update():
    tokens, targets = batch()
    step = mp.runner(mesh=MESH, loss_fn=softmax_cross_entropy, schedule=S.Std1F1B(microbatches=M), tx=TX)
    params, state = mp.init_on_owners(step, lm_init, jax.random.key(1), tokens, targets)
    whole = jax.jit(lm_init)(jax.random.key(1))
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((whole, TX.init(whole)))):
        assert ulps(a, b) <= ULPS
    whole = jax.tree.map(np.asarray, params)  # the reference starts from the same values
    ranks = {MESH.rank_of(x.sharding) for x in jax.tree.leaves(params)}
    assert ranks == {0, 1, 2, 3}
    loss, params, state = step.update(params, state, tokens, targets)
    assert len(step.runner.update_step.cache) == 1  # the plan built for the init is the step's
    want = softmax_cross_entropy(sc.apply(mp.unstage_blocks(whole), tokens), targets)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)


def test_a_gradient_step_gets_its_parameters_where_it_makes_their_gradients():
    tokens, targets = batch()
    grad = mp.sxvalue_and_grad(lm_loss(4), mesh=MESH, schedule=S.GPipe(microbatches=M))
    params = mp.init_on_owners(grad, init, jax.random.key(0), tokens, targets)
    want = grad.plan_for(params, tokens, targets).grad_shardings(len(jax.tree.leaves(params)))
    assert [x.sharding for x in jax.tree.leaves(params)] == [want[a] for a in range(len(want))]
    loss, _ = grad(params, tokens, targets)
    np.testing.assert_allclose(float(loss), unsplit_losses(1)[0], rtol=1e-5)


def test_a_whole_step_without_its_optimizer_is_refused(planned):
    _, step = planned
    with pytest.raises(mp.MpmdError, match="tx="):
        mp.init_on_owners(step, init, jax.random.key(0), *batch())


def _sizes(batches) -> list[int]:
    return [sum(x.size * x.dtype.itemsize for arrays in b.values() for x in arrays.values()) for b in batches]


def test_restore_batches_hold_at_most_the_bound_or_one_array():
    def spec(n):
        return jax.ShapeDtypeStruct((n,), jnp.float32)  # 4n bytes

    held = {"params": {"a": spec(10), "b": spec(30), "c": spec(5)}}
    held["opt_state"] = {"d": spec(20), "e": spec(1)}
    assert _sizes(host_batches(held, 0)) == [40, 120, 104]  # the largest array is the least bound
    assert _sizes(host_batches(held, 160)) == [160, 104]
    assert _sizes(host_batches(held, None)) == [264]
    with pytest.raises(mp.CheckpointError, match="host_bytes"):
        host_batches(held, -1)
