"""`PipelineDecoder.step` refuses tokens that do not fit in the cache instead of clamping the write.

The decoder counts the positions of each cache it made or returned; a cache it
has not seen (built by the core's `init_cache`, or copied) is read once. Each
refusal comes where `positions written + new tokens > max_len` says, computed
here by hand, and leaves the cache usable.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpmd_cases import pipeline_mesh

import spectrax_mpmd as mp
from spectrax_core.models import TransformerLM, init_cache

MAX_LEN, BATCH = 6, 2


@functools.cache
def decoder() -> mp.PipelineDecoder:
    lm = TransformerLM.init(jax.random.key(0), vocab_size=16, d_model=16, n_layers=4, n_heads=2, d_ff=32)
    return mp.PipelineDecoder(lm, mesh=pipeline_mesh(2))


def tokens(length: int):
    return jnp.ones((BATCH, length), jnp.int32)


@pytest.mark.parametrize("lengths", [(4, 1, 1, 1), (6, 1), (3, 3, 1), (7,), (2, 5)])
def test_a_step_past_max_len_is_refused_where_the_lengths_say(lengths):
    dec = decoder()
    cache, written = dec.init_cache(BATCH, MAX_LEN), 0
    for length in lengths:
        if written + length > MAX_LEN:
            with pytest.raises(mp.MpmdError, match=rf"holds {written} positions.*max_len is {MAX_LEN}"):
                dec.step(tokens(length), cache)
            break
        _, cache = dec.step(tokens(length), cache)
        written += length
    else:
        pytest.fail(f"{lengths} fit in {MAX_LEN} positions; every case here overflows")
    np.testing.assert_array_equal(np.asarray(cache[0].index), written)  # the refused cache is intact
    if written < MAX_LEN:
        _, cache = dec.step(tokens(MAX_LEN - written), cache)  # and still takes what fits


def test_a_cache_the_decoder_has_not_seen_is_read_once():
    dec = decoder()
    _, cache = dec.step(tokens(4), init_cache(dec.lm, BATCH, MAX_LEN))
    copied = jax.tree.map(jnp.copy, cache)  # new arrays: the decoder reads their index (4)
    with pytest.raises(mp.MpmdError, match=r"holds 4 positions and 3 more tokens need 7"):
        dec.step(tokens(3), copied)
    _, full = dec.step(tokens(2), copied)
    with pytest.raises(mp.MpmdError, match=r"holds 6 positions"):
        dec.step(tokens(1), full)
