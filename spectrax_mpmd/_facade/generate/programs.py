"""The one program every stage runs, for a prompt (prefill) or a single new token.

`stage_step` is the unsplit generation step (`spectrax_core.models`:
`lm_embed`, `lm_blocks`, `lm_sample_head`) restricted to one stage: the first
stage embeds, every stage runs its blocks over its own KV cache (donated, so it
is updated in place on its rank), the last stage samples. Nothing else is
computed, so a pipelined step does the unsplit step's arithmetic.

`flat_step` is the compiled form the issue loop calls: the view, cache and
state go in and out as flat lists of arrays (their tree structures are static
arguments), so a call does no Python pytree work on the model's classes. The
last stage also returns whether every sequence of its group has finished, a
scalar apart from the (donated) state, which the host may read later.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

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
    """`stage_step` over flat leaf lists; `trees` = the view's, cache's and state's tree structures.

    Returns `(out, cache leaves, state leaves, finished)`, `finished` None but on the last stage.
    """
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
    finished = jnp.all(state.done) if last else None
    return out, jax.tree.leaves(cache), jax.tree.leaves(state), finished


def lm_cells(views, trees: tuple, sampler, pad_id: int) -> list:
    """The wavefront's cells (see `wavefront.run_wavefront`) of a staged LM: `flat_step` over each
    stage's view; `trees` = the groups' cache structure per stage, then their state's."""
    last, none_def = len(views) - 1, jax.tree.structure(None)
    flat = [jax.tree.flatten(v) for v in views]

    def cell(s: int):
        call = dict(
            trees=(flat[s][1], trees[s], trees[-1] if s == last else none_def), first=s == 0, last=s == last
        )
        if s == last:
            call.update(sampler=sampler, pad_id=pad_id)  # only the last stage samples: others compile once

        def run(g, x, t):
            out, g.caches[s], state, finished = flat_step(
                flat[s][0], x, g.caches[s], g.starts[s], g.state if s == last else [], **call
            )
            if s == last:
                g.state = state
            return out, finished

        return run

    return [cell(s) for s in range(len(views))]


def input_specs(views, size: int, length: int, max_len: int) -> tuple[list, list]:
    """Each stage's input `ShapeDtypeStruct` in a decode round and in the prefill round (index with
    `t == 0`): a group of `size` sequences, a prompt of `length` tokens, caches of `max_len`."""
    starts = jax.ShapeDtypeStruct((size,), jnp.int32)
    out = []
    for x in (jax.ShapeDtypeStruct((size,), jnp.int32), jax.ShapeDtypeStruct((size, length), jnp.int32)):
        row = [x]
        for s, view in enumerate(views[:-1]):
            cache = jax.eval_shape(lambda v=view: v.blocks.init_cache(size, max_len))
            step = functools.partial(stage_step, first=s == 0, last=False)
            row.append(jax.eval_shape(step, view, row[-1], cache, starts, None)[0])
        out.append(row)
    return out[0], out[1]
