"""Pipelined generation with a user's own decode step (`StepDecoder`): plain-JAX attention with
learned positions and one mixture-of-experts layer (`decode_model`), cut at its markers.

Every result is compared with each prompt decoded alone and unsplit (`decode_model.alone`).
"""

from __future__ import annotations

import functools

import decode_model as M
import jax
import numpy as np
import pytest
from mpmd_cases import pipeline_mesh

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_core.models import Sampler, left_pad

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]
SEEDED = dict(sampler=Sampler(0.9, top_k=5), keys=jax.random.split(jax.random.key(3), 4), stop_tokens=[3])


@functools.cache
def params():
    return M.init_params(jax.random.key(0))


@functools.cache
def decoder(n: int):
    return mp.StepDecoder(M.decode_step(n), params(), M.init_cache, mesh=pipeline_mesh(n))


def alone(budgets, prompts=PROMPTS, **options):
    keys = options.pop("keys", [None] * len(prompts))
    budgets = np.broadcast_to(budgets, (len(prompts),))
    return [M.alone(params(), p, int(b), key=k, **options) for p, b, k in zip(prompts, budgets, keys)]


def padded(rows, steps, pad_id=0):
    return [r + [pad_id] * (steps - len(r)) for r in rows]


@pytest.mark.parametrize("n, groups", [(2, 2), (4, 1), (4, 4)])
def test_greedy_ragged_prompts_equal_each_prompt_alone(n, groups):
    out = decoder(n).generate(PROMPTS, 6, groups=groups)
    np.testing.assert_array_equal(np.asarray(out), alone(6))


@pytest.mark.parametrize("n", [2, 4])
def test_seeded_sampling_with_stops_and_budgets_equals_each_prompt_alone(n):
    budgets = [6, 3, 5, 2]
    out = decoder(n).generate(PROMPTS, budgets, groups=2, **SEEDED)
    np.testing.assert_array_equal(np.asarray(out), padded(alone(budgets, **SEEDED), 6))


@pytest.mark.slow
@pytest.mark.parametrize("n, seeded", [(2, False), (4, True)])
def test_continuous_batching_over_a_queue_equals_each_prompt_alone(n, seeded):
    rng = np.random.default_rng(n)
    prompts = [rng.integers(1, M.VOCAB, size=k).tolist() for k in rng.integers(1, 6, size=12)]  # 3x batch
    budgets = rng.integers(1, 6, size=12)
    options = {}
    if seeded:
        options = dict(
            sampler=Sampler(0.9, top_k=5), keys=jax.random.split(jax.random.key(5), 12), stop_tokens=[3]
        )
    out = decoder(n).serve(prompts, budgets, batch=4, groups=2, **options)
    np.testing.assert_array_equal(np.asarray(out), padded(alone(budgets, prompts, **options), 5))


def test_virtual_stages_put_two_stages_on_each_rank():
    schedule = S.InterleavedH1(microbatches=2)
    dec = mp.StepDecoder(M.decode_step(4), params(), M.init_cache, mesh=pipeline_mesh(2), schedule=schedule)
    assert dec._layout.ranks == (0, 1, 0, 1)
    np.testing.assert_array_equal(np.asarray(dec.generate(PROMPTS, 4, groups=2)), alone(4))


def test_left_padded_prompts_are_accepted():
    tokens, lengths = left_pad(PROMPTS)
    out = decoder(2).generate(tokens, 6, lengths=lengths, groups=2)
    np.testing.assert_array_equal(np.asarray(out), alone(6))


def test_each_stage_owns_its_cache_and_reads_only_its_params():
    split = decoder(4).split(1, 1, 8)
    assert split.owned == ((0, 1), (2, 3), (4, 5), (6, 7))  # cache leaves: layer 0's k, v, then layer 1's ...
    embed, pos = 0, M.LAYERS * 4 + 2  # flat leaves: embed first, then the layers, pos last
    assert embed in split.params[0] and embed in split.params[3] and pos in split.params[0]
    assert all(pos not in split.params[s] for s in (1, 2, 3))


def test_params_already_on_their_rank_are_used_without_a_copy():
    layout = decoder(2)._layout
    placed = jax.tree.map(lambda a: jax.device_put(a, layout.sharding(1)), params())
    dec = mp.StepDecoder(M.decode_step(2), placed, M.init_cache, mesh=pipeline_mesh(2))
    leaves = jax.tree.leaves(placed)
    index = dec.split(2, 1, 8).params[1]
    assert all(w is leaves[i] for w, i in zip(dec._places.weights(1, index), index))


def test_a_cache_leaf_crossing_stages_is_named():
    def step(params, cache, tokens, positions):
        x = params["embed"][tokens] + params["pos"][positions] + cache[0]["k"].sum()  # stage 0 reads it
        x = mp.sxstage_iter(x)
        x, first = M.attention(params["layers"][0], cache[0], x, positions)  # stage 1 writes it
        return x @ params["embed"].T, [first, *cache[1:]]

    cross = mp.StepDecoder(step, params(), M.init_cache, mesh=pipeline_mesh(2))
    with pytest.raises(mp.MpmdError, match=r"cache\[0\]\['k'\] is read in stage 0 but written in stage 1"):
        cross.generate(PROMPTS, 2)


def test_wrong_marker_count_and_short_cache_raise_early():
    with pytest.raises(mp.StageSplitError, match="need 4"):
        mp.StepDecoder(M.decode_step(2), params(), M.init_cache, mesh=pipeline_mesh(4)).generate(PROMPTS, 2)
    with pytest.raises(mp.MpmdError, match="max_len is 6"):
        decoder(2).generate(PROMPTS, 4, max_len=6)
    with pytest.raises(mp.MpmdError, match="groups=3"):
        decoder(2).generate(PROMPTS, 4, groups=3)
    with pytest.raises(mp.MpmdError, match="groups=3 divides"):
        decoder(2).serve(PROMPTS, 4, batch=4, groups=3)


def test_update_takes_new_values_without_recompiling():
    dec = decoder(2)
    dec.generate(PROMPTS, 6, groups=2)
    newer = jax.tree.map(lambda a: a * 1.5, params())
    compiles = []

    def count(event, duration, **_):
        compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        out = dec.update(newer).generate(PROMPTS, 6, groups=2)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
        dec.update(params())
    assert compiles == []
    np.testing.assert_array_equal(np.asarray(out), [M.alone(newer, p, 6) for p in PROMPTS])
    with pytest.raises(mp.MpmdError, match="update takes new values"):
        dec.update({**newer, "pos": newer["pos"][:4]})
