"""Issuing a generation as a wavefront of sequence groups.

The batch is split into `g` groups, each with its own KV caches on every
stage's rank, its own padding starts and its own sampling state (on the last
stage's rank). One round issues every group's next token through every stage
in the order of `issue_order`: cell `(group i, stage s)` goes by `i + s`, so
while rank r runs group i, rank r-1 already has group i+1. Calls are
asynchronous: the host only queues cells, each rank runs its queue in order,
and a group's next round waits on device for its own token only. Only the new
tokens' residual stream (and each sampled token, back to the first stage)
crosses ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from spectrax_core.models import GenState

from .programs import stage_step
from .stages import StageLayout


@dataclass
class Group:
    """One group's live values: its input on stage 0, caches and starts per stage, state, tokens so far."""

    x: jax.Array
    caches: list
    starts: list
    state: GenState
    tokens: list


def issue_order(n_groups: int, n_stages: int) -> tuple[tuple[int, int], ...]:
    """The `(group, stage)` cells of one round, by wavefront slot `group + stage` (stage order within one)."""
    cells = [(i, s) for i in range(n_groups) for s in range(n_stages)]
    return tuple(sorted(cells, key=lambda c: (c[0] + c[1], c[1])))


def place_groups(views, layout: StageLayout, prompts, starts, states, max_len: int) -> list[Group]:
    """Put every group's prompt, starts, state and empty caches on the ranks that use them (one copy each)."""
    n_stages, last = len(views), len(views) - 1
    values, targets = [], []
    for prompt, start, state in zip(prompts, starts, states):
        values += [prompt, state] + [start] * n_stages
        targets += [layout.sharding(0), layout.sharding(last)] + [layout.sharding(s) for s in range(n_stages)]
    placed = jax.device_put(values, targets)
    width, groups = 2 + n_stages, []
    for i, prompt in enumerate(prompts):
        mine = placed[i * width : (i + 1) * width]
        caches = [_empty_cache(v, prompt.shape[0], max_len, layout.sharding(s)) for s, v in enumerate(views)]
        groups.append(Group(x=mine[0], caches=caches, starts=list(mine[2:]), state=mine[1], tokens=[]))
    return groups


def _empty_cache(view, batch: int, max_len: int, sharding):
    shapes = jax.eval_shape(lambda: view.blocks.init_cache(batch, max_len))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=sharding), shapes)


def run_wavefront(
    views, layout: StageLayout, groups: list[Group], steps: int, sampler, pad_id: int, record=None
) -> np.ndarray:
    """Issue `steps` rounds; the tokens `(batch, steps)` in group order.

    With `record` (a list), each cell is waited for and `(rank, stage, group,
    round, start_s, end_s)` appended: a measured timeline, not the fast path.
    """
    n_stages, ranks = len(views), layout.ranks
    order = issue_order(len(groups), n_stages)
    moves = [s > 0 and ranks[s] != ranks[s - 1] for s in range(n_stages)]
    back = ranks[-1] != ranks[0]
    first_sharding, last = layout.sharding(0), n_stages - 1
    tail = {"sampler": sampler, "pad_id": pad_id}  # only the last stage samples: others compile once
    for t in range(steps):
        for i, s in order:
            g, begin = groups[i], time.perf_counter()
            x = jax.device_put(g.x, layout.sharding(s)) if moves[s] else g.x
            out, g.caches[s], state = stage_step(
                views[s], x, g.caches[s], g.starts[s], g.state if s == last else None,
                first=s == 0, last=s == last, **(tail if s == last else {}),
            )  # fmt: skip
            if record is not None:
                jax.block_until_ready(out)
                record.append((ranks[s], s, i, t, begin, time.perf_counter()))
            if s < last:
                g.x = out
                continue
            g.state = state
            g.tokens.append(out)
            g.x = jax.device_put(out, first_sharding) if back else out
    return np.concatenate([np.stack(jax.device_get(g.tokens), axis=1) for g in groups], axis=0)
