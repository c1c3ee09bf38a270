"""The unsplit generation reference: sampling rules, per-sequence keys, stop tokens, ragged prompts.

Each property is checked against something computed another way: greedy
against `greedy_decode` (itself checked against a cacheless decode), a ragged
batch against each prompt decoded alone without padding, a sequence's sampled
tokens against the same sequence decoded in another batch, top-k / top-p
draws against the sets computed from the logits with numpy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spectrax_core import apply
from spectrax_core.models import (
    Sampler,
    TransformerLM,
    gen_state,
    generate,
    greedy_decode,
    init_cache,
    left_pad,
    lm_step,
    next_tokens,
    right_padded,
    sample_tokens,
)

PROMPTS = ([1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [3])


@functools.cache
def lm():
    return TransformerLM.init(jax.random.key(0), vocab_size=16, d_model=16, n_layers=2, n_heads=2, d_ff=32)


def test_greedy_generate_is_greedy_decode():
    prompt = jax.random.randint(jax.random.key(1), (4, 5), 0, 16)
    np.testing.assert_array_equal(generate(lm(), prompt, 5), greedy_decode(lm(), prompt, 5))


def test_a_ragged_batch_gives_each_prompt_its_unpadded_tokens():
    tokens, lengths = left_pad(PROMPTS, pad_id=7)
    got = generate(lm(), tokens, 4, lengths=lengths)
    for b, p in enumerate(PROMPTS):
        alone = greedy_decode(lm(), jnp.asarray([p], jnp.int32), 4)
        np.testing.assert_array_equal(got[b], alone[0], err_msg=f"prompt {b}")


@pytest.mark.parametrize("sampler", [Sampler(1.0), Sampler(0.7, top_k=3), Sampler(1.3, top_p=0.6)])
def test_a_sequence_samples_the_same_tokens_in_any_batch(sampler):
    prompt = jax.random.randint(jax.random.key(2), (4, 3), 0, 16)
    keys = jax.random.split(jax.random.key(5), 4)
    whole = generate(lm(), prompt, 5, sampler=sampler, keys=keys)
    pair = generate(lm(), prompt[2:], 5, sampler=sampler, keys=keys[2:])
    np.testing.assert_array_equal(whole[2:], pair)
    other = generate(lm(), prompt, 5, sampler=sampler, keys=jax.random.split(jax.random.key(6), 4))
    assert not np.array_equal(whole, other)  # the keys matter


def test_top_k_and_top_p_draw_only_from_their_sets():
    logits = jax.random.normal(jax.random.key(3), (64, 10)) * 3
    keys = jax.random.split(jax.random.key(4), 64)
    order = np.argsort(-np.asarray(logits), axis=-1)
    got_k = np.asarray(sample_tokens(logits, keys, jnp.int32(0), Sampler(1.0, top_k=3)))
    assert all(got_k[b] in order[b, :3] for b in range(64))
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    got_p = np.asarray(sample_tokens(logits, keys, jnp.int32(0), Sampler(1.0, top_p=0.5)))
    for b in range(64):
        ranked = probs[b, order[b]]
        keep = order[b, : int(np.searchsorted(np.cumsum(ranked), 0.5)) + 1]  # smallest set reaching 0.5
        assert got_p[b] in keep
    greedy = np.argmax(np.asarray(logits), axis=-1)
    np.testing.assert_array_equal(sample_tokens(logits, keys, jnp.int32(0), Sampler(1.0, top_k=1)), greedy)


def test_stop_tokens_and_budgets_end_sequences_with_pad():
    logits = jnp.zeros((3, 5)).at[:, 2].set(1.0)  # greedy picks 2 every time
    state = gen_state(3, [1, 4, 9])
    rows = []
    for _ in range(3):
        token, state = next_tokens(logits, state, Sampler(), pad_id=-1)
        rows.append(np.asarray(token))
    np.testing.assert_array_equal(np.stack(rows, 1), [[2, -1, -1], [2, 2, 2], [2, 2, 2]])
    state = gen_state(3, 9, stop_tokens=[2])
    token, state = next_tokens(logits, state, Sampler(), pad_id=-1)
    token, _ = next_tokens(logits, state, Sampler(), pad_id=-1)
    np.testing.assert_array_equal(token, [-1, -1, -1])  # the stop token was emitted, then padding


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=4, max_len=6), r"needs a cache of 9 positions, but max_len is 6"),
        (dict(max_new_tokens=0), r"max_new_tokens must be >= 1"),
        (dict(max_new_tokens=2, lengths=[5, 6]), r"lengths must give each of the 2 prompts a length in 1..5"),
        (dict(max_new_tokens=2, keys=jax.random.split(jax.random.key(0), 3)), r"one PRNG key per sequence"),
    ],
)
def test_bad_generation_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(lm(), jnp.ones((2, 5), jnp.int32), **kwargs)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampler_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match=r"Sampler: "):
        Sampler(**kwargs)


def test_the_decode_step_runs_each_row_at_its_own_position():
    """`lm_step`: rows at different positions give each row's logits decoded alone with a cache
    counting its own index (a prompt of its own length, then one token); bad positions are refused."""
    prompts = ([1, 2, 3, 4], [5, 6], [7, 8, 9])
    padded, lengths = left_pad(prompts)
    tokens, lengths = right_padded(padded, padded.shape[1] - np.asarray(lengths))  # at the front
    positions = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), tokens.shape)
    logits, cache = lm_step(lm(), init_cache(lm(), 3, 8), tokens, positions)
    nxt = jnp.asarray([[11], [12], [13]], jnp.int32)
    after, _ = lm_step(lm(), cache, nxt, lengths[:, None])
    for b, p in enumerate(prompts):
        alone = init_cache(lm(), 1, 8)
        want, alone = apply(lm(), jnp.asarray([p], jnp.int32), cache=alone)
        np.testing.assert_allclose(logits[b, : len(p)], want[0], rtol=1e-5, atol=1e-6)
        want, _ = apply(lm(), nxt[b : b + 1], cache=alone)
        np.testing.assert_allclose(after[b], want[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"positions= must be \(batch, length\) = \(3, 4\)"):
        lm_step(lm(), init_cache(lm(), 3, 8), tokens, positions[:, :2])
