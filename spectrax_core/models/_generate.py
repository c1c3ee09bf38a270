"""Generation with a KV cache: ragged prompts, sampling, stop tokens, per-sequence budgets.

`generate` is the unsplit reference a pipelined generator is checked against,
and runs the same decode step a pipeline cuts: `lm_step(lm, cache, tokens,
positions)`, with one position per sequence. Ragged prompts
come left-padded (`left_pad`) and are moved to the front of their rows
(`right_padded`): each sequence's tokens sit at positions `0, 1, ...` from its
own first token, exactly as the prompt decoded alone, its new tokens follow
its own last one, and the slots after a short prompt are never seen (a query
at position p sees only positions <= p; the next token overwrites them).

`lm_embed`, `lm_blocks` (the blocks with a left-padding mask over a shared
cache index) and `lm_sample_head` are the left-padded form of one step, kept
for callers that decode a shared-index cache themselves (`lm_generate_step`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from .._apply import apply
from ._lm import TransformerLM, _check_tokens, init_cache, lm_embed, lm_head
from ._sample import GenState, Sampler, gen_state, next_tokens


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[Array, Array]:
    """Token lists of different lengths → `(tokens (batch, longest), lengths (batch,))`, padded on the left."""
    lengths = [len(p) for p in prompts]
    if not prompts or min(lengths) < 1:
        raise ValueError(f"left_pad: every prompt needs at least one token, received lengths {lengths}.")
    longest = max(lengths)
    tokens = np.full((len(prompts), longest), pad_id, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, longest - len(p) :] = np.asarray(p, np.int32)
    return jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32)


def check_generate(prompt: Array, lengths, max_new_tokens, max_len: int | None, name: str = "generate"):
    """Checked `(starts (batch,), new tokens T, max_len)` for a left-padded `prompt` `(batch, L)`.

    `starts[b] = L - lengths[b]` is where sequence `b`'s real tokens begin; the
    cache needs `L + T` positions, `T` the largest of `max_new_tokens`.
    """
    _check_tokens(name, prompt)
    batch, length = prompt.shape
    lengths = np.full((batch,), length) if lengths is None else np.asarray(lengths).reshape(-1)
    if lengths.shape != (batch,) or lengths.min() < 1 or lengths.max() > length:
        raise ValueError(
            f"{name}: lengths must give each of the {batch} prompts a length in 1..{length} (the padded "
            f"prompt length), received {lengths.tolist()}; build both with left_pad(prompts)."
        )
    steps = int(np.max(max_new_tokens))
    max_len = length + steps if max_len is None else int(max_len)
    if length + steps > max_len:
        raise ValueError(
            f"{name}: a prompt of {length} tokens plus {steps} new ones needs a cache of {length + steps} "
            f"positions, but max_len is {max_len}; raise max_len or shorten the prompt or max_new_tokens."
        )
    return (length - lengths).astype(np.int32), steps, max_len


def pad_mask(starts: Int[Array, " batch"], max_len: int) -> Array:
    """`(batch, 1, 1, max_len)`: True where a cache slot holds a real token (at or after `starts[b]`)."""
    return (jnp.arange(max_len)[None, :] >= starts[:, None])[:, None, None, :]


def lm_blocks(blocks, x: Array, cache, starts: Int[Array, " batch"]):
    """Run `blocks` over `x` continuing `cache`, with the left padding masked: `(x, new_cache)`."""
    max_len = jax.tree.leaves(cache)[0].shape[-3]
    return apply(blocks, x, mask=pad_mask(starts, max_len), cache=cache)


def lm_sample_head(
    lm: TransformerLM, x: Array, state: GenState, sampler: Sampler, pad_id: int
) -> tuple[Array, GenState]:
    """Head on the last position of `x` `(batch, length, d_model)`, then `next_tokens`."""
    logits = lm_head(lm, x[:, -1:])[:, 0]
    return next_tokens(logits, state, sampler, pad_id)


@functools.partial(jax.jit, static_argnames=("sampler", "pad_id"), donate_argnums=2)
def lm_generate_step(lm: TransformerLM, tokens: Array, cache, starts, state: GenState, sampler, pad_id):
    """One unsplit step: tokens `(batch, length)` (or `(batch,)`) → `(next tokens, cache, state)`."""
    tokens = tokens[:, None] if tokens.ndim == 1 else tokens
    x, cache = lm_blocks(lm.blocks, lm_embed(lm, tokens), cache, starts)
    token, state = lm_sample_head(lm, x, state, sampler, pad_id)
    return token, cache, state


def lm_step(lm: TransformerLM, cache, tokens: Array, positions: Array):
    """`(logits (batch, length, vocab), cache)`: the decode step with one position per sequence.

    `tokens` and `positions` are `(batch, length)` (a prompt at `0 .. length -
    1`, then one token at a time, each sequence at its own position); every
    token's keys and values are written at its position of `cache` (from
    `init_cache`), and a query at position p sees the entries at positions <= p.
    The blocks' stage markers (a `StagedStack`) cut it for a pipeline.
    """
    x, cache = apply(lm.blocks, lm_embed(lm, tokens), cache=cache, positions=positions)
    return lm_head(lm, x), cache


@functools.partial(jax.jit, static_argnames=("sampler", "pad_id"), donate_argnums=1)
def _generate_step(lm, cache, tokens, positions, at, state: GenState, sampler: Sampler, pad_id: int):
    """One step of `generate` (tokens and positions `(batch, length)`, or `(batch,)` for one token
    each): `lm_step`, each row's next token from its logits at `at[b]`, and its next position."""
    if tokens.ndim == 1:
        tokens, positions = tokens[:, None], positions[:, None]
    logits, cache = lm_step(lm, cache, tokens, positions)
    rows = jnp.take_along_axis(logits, at[:, None, None], axis=1)[:, 0]
    token, state = next_tokens(rows, state, sampler, pad_id)
    return token, cache, state, jnp.take_along_axis(positions, at[:, None], axis=1)[:, 0] + 1


def generate(
    lm: TransformerLM,
    prompt: Array,
    max_new_tokens,
    *,
    lengths=None,
    sampler: Sampler = Sampler(),
    keys=None,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    max_len: int | None = None,
) -> Array:
    """New tokens `(batch, T)` after the left-padded `prompt` `(batch, L)`, on one device.

    `max_new_tokens`: an int or one per sequence (`T` is the largest).
    `lengths`: each prompt's real length (default: all `L`; see `left_pad`).
    `keys`: one PRNG key per sequence (see `gen_state`). A sequence finishes
    after a stop token or its budget; its later positions hold `pad_id`.
    """
    starts, steps, max_len = check_generate(prompt, lengths, max_new_tokens, max_len)
    state = gen_state(prompt.shape[0], max_new_tokens, keys, stop_tokens)
    tokens, lengths = right_padded(prompt, starts)
    cache = init_cache(lm, prompt.shape[0], max_len)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    step = functools.partial(_generate_step, sampler=sampler, pad_id=pad_id)
    token, cache, state, pos = step(lm, cache, tokens, positions, lengths - 1, state)
    out, first = [token], jnp.zeros_like(lengths)
    for _ in range(steps - 1):
        token, cache, state, pos = step(lm, cache, token, pos, first, state)
        out.append(token)
    return jnp.stack(out, axis=1)


def right_padded(prompt: Array, starts) -> tuple[Array, Array]:
    """The left-padded `prompt` with each row's real tokens moved to the front, padded on the right
    to the longest: `(tokens, lengths)`."""
    tokens, starts = np.asarray(prompt, np.int32), np.asarray(starts)
    lengths = tokens.shape[1] - starts
    out = np.zeros((tokens.shape[0], int(lengths.max())), np.int32)
    for b, s in enumerate(starts):
        out[b, : lengths[b]] = tokens[b, s:]
    return jnp.asarray(out), jnp.asarray(lengths, jnp.int32)
