"""The one program every stage runs, for a prompt (prefill) or a single new token.

`stage_step` is the unsplit generation step (`spectrax_core.models`:
`lm_embed`, `lm_blocks`, `lm_sample_head`) restricted to one stage: the first
stage embeds, every stage runs its blocks over its own KV cache (donated, so it
is updated in place on its rank), the last stage samples. Nothing else is
computed, so a pipelined step does the unsplit step's arithmetic.
"""

from __future__ import annotations

import functools

import jax

from spectrax_core.models import lm_blocks, lm_embed, lm_sample_head


@functools.partial(
    jax.jit, static_argnames=("first", "last", "sampler", "pad_id"), donate_argnames=("cache", "state")
)
def stage_step(view, x, cache, starts, state, *, first: bool, last: bool, sampler=None, pad_id: int = 0):
    """`(out, cache, state)`: the residual stream for the next stage, or the sampled tokens when `last`."""
    if first:
        x = lm_embed(view, x[:, None] if x.ndim == 1 else x)
    x, cache = lm_blocks(view.blocks, x, cache, starts)
    if not last:
        return x, cache, state
    token, state = lm_sample_head(view, x, state, sampler, pad_id)
    return token, cache, state
