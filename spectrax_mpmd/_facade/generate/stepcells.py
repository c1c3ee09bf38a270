"""The program each stage of a user's decode step runs: one prefill or one decode cell of a group.

A cell of stage `s` takes the stage's weights, its input (the prompt or last
round's tokens on stage 0, the bundle of the stage before on the others), its
own cache leaves (donated: updated in place on its rank) and its own copy of
the group's next positions `pos` `(batch,)`. Prefill runs the step over the
prompt chunk at positions `0 .. length - 1` (a shorter prompt is padded on the
right: its padding slots lie after its last real token, so no query sees them
before a decode step overwrites them) and sets `pos` to the prompt lengths;
decode runs one token per sequence at `pos` and advances it. The last stage
takes each sequence's logits at its last real position and samples
(`rows.next_rows`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from .rows import next_rows
from .traced import StepSplit, run_stage


def _cell(weights, x, cache, pos, state, *, plan: StepSplit, s: int, index, prefill: bool, sampler, pad_id):
    """`(out, cache, pos, state, finished)` of stage `s` for one group (see the module docstring)."""
    last = s == plan.n_stages - 1
    if s == 0:
        tokens, bundle = (x if prefill else x[:, None]), None
    else:
        tokens, bundle = None, dict(zip(plan.carried[s - 1], x))
    if prefill:
        length = plan.graph.in_avals[plan.slots.tokens].shape[1]
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (pos.shape[0], length))
    else:
        positions = pos[:, None]
    owned = plan.owned[s]
    out, new, logits = run_stage(
        plan, s, dict(zip(index, weights)), dict(zip(owned, cache)), tokens, positions, bundle
    )
    cache = [new[c] for c in owned]
    next_pos = pos if prefill else pos + 1
    if not last:
        return tuple(out[k] for k in plan.carried[s]), cache, next_pos, state, None
    at = next_pos - 1 if prefill else jnp.zeros_like(pos)  # each row's last real position in the chunk
    rows = jnp.take_along_axis(logits, at[:, None, None], axis=1)[:, 0]
    token, state = next_rows(rows, state, sampler, pad_id)
    return token, cache, next_pos, state, jnp.all(state.done)


def stage_program(plan: StepSplit, s: int, index: tuple, prefill: bool, sampler, pad_id: int) -> Callable:
    """The compiled cell of stage `s`; `index`: the flat param indices of the weights it is given."""
    fn = functools.partial(
        _cell, plan=plan, s=s, index=index, prefill=prefill, sampler=sampler, pad_id=pad_id
    )
    return jax.jit(fn, donate_argnums=(2, 4))
