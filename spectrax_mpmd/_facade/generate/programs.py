"""The one program every stage runs, for a prompt (prefill) or a single new token.

`stage_step` is the unsplit generation step (`spectrax_core.models`:
`lm_embed`, `lm_blocks`, `lm_sample_head`) restricted to one stage: the first
stage embeds, every stage runs its blocks over its own KV cache (donated, so it
is updated in place on its rank), the last stage samples. Nothing else is
computed, so a pipelined step does the unsplit step's arithmetic.

`flat_step` is the compiled form the issue loop calls: the view, cache and
state go in and out as flat lists of arrays (their tree structures are static
arguments), so a call does no Python pytree work on the model's classes.
"""

from __future__ import annotations

import functools

import jax

from spectrax_core.models import lm_blocks, lm_embed, lm_sample_head


def stage_step(view, x, cache, starts, state, *, first: bool, last: bool, sampler=None, pad_id: int = 0):
    """`(out, cache, state)`: the residual stream for the next stage, or the sampled tokens when `last`."""
    if first:
        x = lm_embed(view, x[:, None] if x.ndim == 1 else x)
    x, cache = lm_blocks(view.blocks, x, cache, starts)
    if not last:
        return x, cache, state
    token, state = lm_sample_head(view, x, state, sampler, pad_id)
    return token, cache, state


@functools.partial(
    jax.jit,
    static_argnames=("trees", "first", "last", "sampler", "pad_id"),
    donate_argnames=("cache", "state"),
)
def flat_step(
    view, x, cache, starts, state, *, trees, first: bool, last: bool, sampler=None, pad_id: int = 0
):
    """`stage_step` over flat leaf lists; `trees` = the view's, cache's and state's tree structures."""
    view_def, cache_def, state_def = trees
    out, cache, state = stage_step(
        jax.tree.unflatten(view_def, view),
        x,
        jax.tree.unflatten(cache_def, cache),
        starts,
        jax.tree.unflatten(state_def, state),
        first=first,
        last=last,
        sampler=sampler,
        pad_id=pad_id,
    )
    return out, jax.tree.leaves(cache), jax.tree.leaves(state)
