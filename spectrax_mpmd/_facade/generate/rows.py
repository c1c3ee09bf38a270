"""Sampling state with one step count per sequence, so a sequence may start in any round.

`spectrax_core.models.GenState` counts the steps of a whole batch; here each
row counts its own, so a slot that takes a new prompt mid-generation draws
token `t` of that prompt with `fold_in(keys[b], t)` exactly as the prompt
decoded alone would. Sampling itself is `spectrax_core.models.sample_tokens`,
row by row.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from spectrax_core.models import GenState, Sampler, sample_tokens


class RowState(NamedTuple):
    """Per sequence: tokens produced `step`, finished `done`, PRNG `keys`, budgets `max_new`; the
    stop tokens `stop`. A named tuple: a cell's call flattens it in JAX's C++ dispatch."""

    step: Array
    done: Array
    keys: Array
    max_new: Array
    stop: Array


def row_state(state: GenState) -> RowState:
    """`state` with its step count given to every row."""
    step = jnp.broadcast_to(state.step, state.done.shape)
    return RowState(step, state.done, state.keys, state.max_new, state.stop)


def rows_of(state: RowState, part) -> RowState:
    """The state of the rows `part` (an index or slice)."""
    return RowState(state.step[part], state.done[part], state.keys[part], state.max_new[part], state.stop)


def next_rows(logits: Array, state: RowState, sampler: Sampler, pad_id: int) -> tuple[Array, RowState]:
    """The next token of each row from its logits `(batch, vocab)` (`pad_id` once it is finished)."""
    one = lambda z, key, t: sample_tokens(z[None], key[None], t, sampler)[0]  # noqa: E731
    token = jnp.where(state.done, pad_id, jax.vmap(one)(logits, state.keys, state.step))
    stopped = jnp.any(token[:, None] == state.stop[None, :], axis=-1)
    done = state.done | stopped | (state.step + 1 >= state.max_new)
    return token, state._replace(step=state.step + 1, done=done)
