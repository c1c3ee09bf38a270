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

from .rows import RowState, next_rows
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


def _serve_cell(weights, x, cache, state, control, *, plan: StepSplit, s: int, index, sampler, pad_id):
    """`(out, cache, state)` of stage `s` in continuous batching (`serve`): one token per row.

    Stage 0's input is `(sampled, feed, positions)`: a row reads `feed` where it
    is >= 0 (a prompt token), else the token it sampled; later stages read
    `(bundle, positions)`. The last stage's `control` = `(ids, emit, fresh)`:
    each row's prompt, whether its token this round is a new one, and whether
    it is that prompt's first (its sampling state restarts); `state` =
    `(rows, keys, budgets)` with every prompt's key and budget.
    """
    if s == 0:
        sampled, feed, positions = x
        tokens, bundle = jnp.where(feed >= 0, feed, sampled)[:, None], None
    else:
        (values, positions), tokens = x, None
        bundle = dict(zip(plan.carried[s - 1], values))
    owned = plan.owned[s]
    out, new, logits = run_stage(
        plan, s, dict(zip(index, weights)), dict(zip(owned, cache)), tokens, positions[:, None], bundle
    )
    cache = [new[c] for c in owned]
    if s < plan.n_stages - 1:
        return (tuple(out[k] for k in plan.carried[s]), positions), cache, state
    (rows, keys, budgets), (ids, emit, fresh) = state, control
    rows = RowState(
        step=jnp.where(fresh, 0, rows.step),
        done=rows.done & ~fresh,
        keys=keys[ids],
        max_new=budgets[ids],
        stop=rows.stop,
    )
    token, after = next_rows(logits[:, 0], rows, sampler, pad_id)
    step, done = jnp.where(emit, after.step, rows.step), jnp.where(emit, after.done, rows.done)
    rows = RowState(step, done, rows.keys, rows.max_new, rows.stop)
    return jnp.where(emit, token, pad_id), cache, (rows, keys, budgets)


def serve_program(plan: StepSplit, s: int, index: tuple, sampler, pad_id: int) -> Callable:
    """The compiled continuous-batching cell of stage `s` (see `_serve_cell`)."""
    fn = functools.partial(_serve_cell, plan=plan, s=s, index=index, sampler=sampler, pad_id=pad_id)
    return jax.jit(fn, donate_argnums=(2, 3))


def stage_program(plan: StepSplit, s: int, index: tuple, prefill: bool, sampler, pad_id: int) -> Callable:
    """The compiled cell of stage `s`; `index`: the flat param indices of the weights it is given."""
    fn = functools.partial(
        _cell, plan=plan, s=s, index=index, prefill=prefill, sampler=sampler, pad_id=pad_id
    )
    return jax.jit(fn, donate_argnums=(2, 4))


def step_cell(s: int, n_stages: int, prefill: Callable, decode: Callable, weights: list) -> Callable:
    """The wavefront's cell of stage `s` (see `wavefront.run_wavefront`): `prefill` in round 0,
    `decode` after."""
    last = s == n_stages - 1

    def run(g, x, t: int):
        program = prefill if t == 0 else decode
        out, g.caches[s], g.starts[s], state, finished = program(
            weights, x, g.caches[s], g.starts[s], g.state if last else None
        )
        if last:
            g.state = state
        return out, finished

    return run
