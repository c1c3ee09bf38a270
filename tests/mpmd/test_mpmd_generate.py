"""`PipelineDecoder.generate`: a wavefront of sequence groups across 2 and 4 ranks.

Every pipelined result is compared with the unsplit reference on one device
(`spectrax_core.models.generate`, whose greedy tokens are `greedy_decode`'s
and whose ragged prompts give each prompt's unpadded tokens: tests/core). The
weights test trains with the pipelined optimizer step and compares with the
reference run on the gathered, unsplit parameters after each update.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpmd_cases import pipeline_mesh

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_core.losses import softmax_cross_entropy
from spectrax_core.models import (
    Sampler,
    TransformerLM,
    generate,
    greedy_decode,
    init_cache,
    left_pad,
    lm_step,
)
from spectrax_mpmd._facade.generate.simulate import simulate_wavefront
from spectrax_mpmd._facade.generate.wavefront import issue_order

BATCH, STEPS = 4, 4


@functools.cache
def lm():
    return TransformerLM.init(jax.random.key(0), vocab_size=16, d_model=16, n_layers=4, n_heads=2, d_ff=32)


@functools.cache
def decoder(n: int, one_device_ranks: bool = False) -> mp.PipelineDecoder:
    """`n` ranks over all 8 devices, or (`one_device_ranks`) over one device each."""
    mesh = mp.create_mesh((n, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:n])
    return mp.PipelineDecoder(lm(), mesh=mesh if one_device_ranks else pipeline_mesh(n))


def prompt(length: int = 5):
    return jax.random.randint(jax.random.key(1), (BATCH, length), 0, 16)


@pytest.mark.parametrize(
    "n, groups, one_device_ranks", [(2, 1, 0), (2, 2, 0), (4, 4, 0), (4, 2, 0), (4, 4, 1)]
)
def test_greedy_wavefront_gives_the_unsplit_tokens(n, groups, one_device_ranks):
    got = decoder(n, bool(one_device_ranks)).generate(prompt(), STEPS, groups=groups)
    np.testing.assert_array_equal(got, greedy_decode(lm(), prompt(), STEPS))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("sampler", [Sampler(1.0), Sampler(0.8, top_k=4, top_p=0.9)])
def test_seeded_sampling_with_stops_and_budgets_gives_the_unsplit_tokens(n, sampler):
    kw = dict(sampler=sampler, keys=jax.random.split(jax.random.key(7), BATCH), stop_tokens=[3, 5], pad_id=15)
    budgets = [STEPS, 2, 1, STEPS]
    got = decoder(n).generate(prompt(), budgets, groups=2, **kw)
    want = generate(lm(), prompt(), budgets, **kw)
    np.testing.assert_array_equal(got, want)
    assert np.all(np.asarray(got)[2, 1:] == 15)  # a budget of one token: the rest is padding


@pytest.mark.parametrize("n, groups", [(2, 2), (4, 4)])
def test_ragged_prompts_prefill_through_the_wavefront(n, groups):
    tokens, lengths = left_pad([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [3]])
    got = decoder(n).generate(tokens, STEPS, lengths=lengths, groups=groups)
    np.testing.assert_array_equal(got, generate(lm(), tokens, STEPS, lengths=lengths))


def test_each_rank_runs_its_stage_for_the_groups_in_wavefront_order():
    record = []
    decoder(4).generate(prompt(), 2, groups=4, record=record)
    assert len(record) == 2 * 4 * 4  # rounds x groups x stages
    for rank in range(4):
        mine = [(t, i) for r, s, i, t, *_ in record if r == rank]
        assert mine == [(t, i) for t in range(2) for i in range(4)], rank
    slots = [i + s for i, s in issue_order(4, 4)]
    assert slots == sorted(slots)  # group i+1 enters stage s as group i enters stage s+1


def test_bad_group_counts_and_lengths_are_refused_early():
    with pytest.raises(mp.MpmdError, match=r"groups=3 must be a positive int dividing the batch of 4"):
        decoder(2).generate(prompt(), STEPS, groups=3)
    with pytest.raises(ValueError, match=r"a prompt of 5 tokens plus 4 new ones.*max_len is 6"):
        decoder(2).generate(prompt(), STEPS, max_len=6)
    other = TransformerLM.init(jax.random.key(0), vocab_size=16, d_model=8, n_layers=4, n_heads=2, d_ff=32)
    with pytest.raises(mp.MpmdError, match=r"differ from the decoder's model"):
        mp.PipelineDecoder(lm(), mesh=pipeline_mesh(2)).update(other)


def test_decoder_follows_the_training_step_without_copies_or_recompiles():
    mesh, schedule = pipeline_mesh(2), S.GPipe(microbatches=2)
    step = mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, schedule=schedule, tx=optax.sgd(0.5))
    data = jax.random.randint(jax.random.key(2), (BATCH, 6), 0, 16)
    params = mp.stage_blocks(jax.tree.map(jnp.copy, lm()), 2)  # the step consumes what it is given
    state = optax.sgd(0.5).init(params)
    _, params, state = step.update(params, state, data[:, :-1], data[:, 1:])
    dec = mp.PipelineDecoder(params, mesh=mesh, schedule=schedule)
    got = dec.generate(prompt(), STEPS, groups=2)
    for view in dec.views:  # every leaf is the training step's own array, where it left it
        owned = {id(x) for x in jax.tree.leaves(params)}
        assert all(id(x) in owned for x in jax.tree.leaves(view))
    np.testing.assert_array_equal(got, greedy_decode(mp.unstage_blocks(mp.gather(params)), prompt(), STEPS))

    compiles = []

    def count(event, duration, **_):
        compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None

    _, params, state = step.update(params, state, data[:, :-1], data[:, 1:])
    want = greedy_decode(mp.unstage_blocks(mp.gather(params)), prompt(), STEPS)
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        got = dec.update(params).generate(prompt(), STEPS, groups=2)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiles == []
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(want, greedy_decode(lm(), prompt(), STEPS))  # the update changed the tokens


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 8])
def test_simulated_wavefront_keeps_every_rank_busy_once_groups_reach_ranks(n, groups):
    rounds = 16  # equal costs: a round lasts max(g, n) cells; fill and drain add min(g, n) - 1
    got = simulate_wavefront([1.0] * n, groups, rounds)
    expected = rounds * groups / (rounds * max(groups, n) + min(groups, n) - 1)
    assert got.utilisation == pytest.approx(expected)
    assert got.busy == (rounds * groups,) * n
    assert got.steady == pytest.approx(min(groups, n) / n)  # every rank busy once g >= n, g/n of it below


def test_the_lm_step_runs_through_step_decoder_with_its_own_positions_and_a_queue():
    """`PipelineDecoder` is `StepDecoder` over `lm_step`: ragged prompts without left padding and a
    queue served 2 rows at a time each give the prompt's tokens generated alone, unsplit."""
    staged = mp.stage_blocks(lm(), 2)
    dec = mp.StepDecoder(lm_step, staged, lambda b, n: init_cache(staged, b, n), mesh=pipeline_mesh(2))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [3], [9, 8], [2, 2, 2]]
    alone = [generate(lm(), jnp.asarray([p]), STEPS, max_len=9)[0] for p in prompts]
    np.testing.assert_array_equal(dec.generate(prompts[:4], STEPS, groups=2, max_len=9), alone[:4])
    np.testing.assert_array_equal(dec.serve(prompts, STEPS, batch=2, max_len=9), alone)
