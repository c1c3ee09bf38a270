"""`StepDecoder` with a cache leaf the step only reads (an encoder's output, read by cross-attention)
and returns unchanged: every stage that reads it holds a copy, and the tokens equal the unsplit loop.

A leaf the step changes is still owned by one stage: read in one stage and written in another is
refused naming it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_mpmd as mp

V, D = 16, 8
PROMPTS = [[1, 2, 3], [4], [5, 6]]


@functools.cache
def params():
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "embed": jax.random.normal(k[0], (V, D)),
        "w0": jax.random.normal(k[1], (D, D)) / 3,
        "w1": jax.random.normal(k[2], (D, D)) / 3,
    }


def init_cache(batch, max_len):
    memory = jnp.broadcast_to(jnp.linspace(-0.5, 0.5, D), (batch, D))
    return {"h": jnp.zeros((batch, max_len, D)), "memory": memory}


def make_step(reads: tuple[int, ...], change_memory: bool = False):
    """A two-stage step reading `memory` in the stages `reads`; stage 1 writes `h` and attends over
    it causally. `change_memory`: stage 1 returns a new `memory` instead of the one given."""

    def step(params, cache, tokens, positions):
        memory = lambda: cache["memory"][:, None, :]  # noqa: E731  (read where it is used)
        x = params["embed"][tokens] + (memory() if 0 in reads else 0.0)
        x = mp.sxstage_iter(jnp.tanh(x @ params["w0"]))
        h = jax.vmap(lambda c, p, n: c.at[p].set(n))(cache["h"], positions, x)
        seen = jnp.arange(h.shape[1])[None, None, :] <= positions[:, :, None]
        x = x + jnp.einsum("blm,bmd->bld", seen, h) / (positions[:, :, None] + 1.0)
        x = jnp.tanh((x + (memory() if 1 in reads else 0.0)) @ params["w1"])
        new_memory = cache["memory"] * 1.5 if change_memory else cache["memory"]
        return x @ params["embed"].T, {"h": h, "memory": new_memory}

    return step


def unsplit(step, prompt, budget):
    """`budget` greedy tokens of one prompt, decoded by the step itself, unsplit."""
    n = len(prompt)
    cache = init_cache(1, n + budget)
    tokens, positions = jnp.asarray([prompt]), jnp.arange(n)[None]
    out = []
    for t in range(budget):
        logits, cache = step(params(), cache, tokens, positions)
        out.append(int(jnp.argmax(logits[0, -1])))
        tokens, positions = jnp.asarray([[out[-1]]]), jnp.asarray([[n + t]])
    return out


def mesh():
    return mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])


@pytest.mark.parametrize("reads, owned", [((0,), ((1,), (0,))), ((0, 1), ((1,), (0, 1))), ((), ((), (0,)))])
def test_a_leaf_returned_unchanged_is_held_by_each_stage_that_reads_it(reads, owned):
    step = make_step(reads)
    decoder = mp.StepDecoder(step, params(), init_cache, mesh=mesh())
    assert decoder.split(3, 1, 8).owned == owned  # cache leaves: 0 = h (written by stage 1), 1 = memory
    out = decoder.generate(PROMPTS, 4, groups=1)
    np.testing.assert_array_equal(np.asarray(out), [unsplit(step, p, 4) for p in PROMPTS])


def test_a_leaf_read_in_stage_0_and_changed_in_stage_1_is_refused():
    decoder = mp.StepDecoder(make_step((0,), change_memory=True), params(), init_cache, mesh=mesh())
    with pytest.raises(mp.MpmdError, match=r"cache\['memory'\] is read in stage 0 but written in stage 1"):
        decoder.generate(PROMPTS, 2)
