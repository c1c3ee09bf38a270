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

from ..._comm import transfer
from .programs import flat_step
from .stages import StageLayout


@dataclass
class Group:
    """One group's live values: its input on stage 0, caches and starts per stage, state, tokens so far.

    Caches and state are flat lists of arrays; `trees` holds their structures
    (one cache structure per stage, then the state's).
    """

    x: jax.Array
    caches: list
    starts: list
    state: list
    tokens: list
    trees: tuple


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
    size = prompts[0].shape[0]  # every group has the same size: one cache shape per stage
    shapes = [jax.tree.flatten(jax.eval_shape(lambda v=v: v.blocks.init_cache(size, max_len))) for v in views]
    width, groups = 2 + n_stages, []
    for i in range(len(prompts)):
        mine = placed[i * width : (i + 1) * width]
        caches = [
            [jnp.zeros(a.shape, a.dtype, device=layout.sharding(s)) for a in leaves]
            for s, (leaves, _) in enumerate(shapes)
        ]
        state, state_def = jax.tree.flatten(mine[1])
        trees = (*(tree for _, tree in shapes), state_def)
        groups.append(Group(mine[0], caches, list(mine[2:]), state, [], trees))
    return groups


def _mover(src, dst):
    """`x -> x on dst`: JAX's C++ per-device copy between one-device ranks (where the layout cannot
    differ), else `jax.device_put` (which also re-lays out an output the stage left sharded)."""
    if len(src.device_set) == 1 and len(dst.device_set) == 1:
        copy = transfer([src], [dst])
        return lambda x: copy(x)[0]
    return lambda x: jax.device_put(x, dst)


def run_wavefront(
    views, layout: StageLayout, groups: list[Group], steps: int, sampler, pad_id: int, record=None
) -> np.ndarray:
    """Issue `steps` rounds; the tokens `(batch, steps)` in group order.

    With `record` (a list), each cell is waited for and `(rank, stage, group,
    round, start, received, end)` appended (seconds; `received` is when its
    input reached the rank): a measured timeline, not the fast path.
    """
    n_stages, ranks, last = len(views), layout.ranks, len(views) - 1
    flat, trees = [jax.tree.flatten(v) for v in views], groups[0].trees
    no_state, none_def = [], jax.tree.structure(None)
    calls = [
        dict(trees=(flat[s][1], trees[s], trees[-1] if s == last else none_def), first=s == 0, last=s == last)
        for s in range(n_stages)
    ]
    calls[last].update(sampler=sampler, pad_id=pad_id)  # only the last stage samples: others compile once
    moves = [_mover(layout.sharding(s - 1), layout.sharding(s)) if s and ranks[s] != ranks[s - 1] else None
             for s in range(n_stages)]  # fmt: skip
    back = _mover(layout.sharding(last), layout.sharding(0)) if ranks[last] != ranks[0] else None
    order = issue_order(len(groups), n_stages)
    for t in range(steps):
        for i, s in order:
            g, begin = groups[i], time.perf_counter()
            x = g.x if moves[s] is None else moves[s](g.x)
            if record is not None:
                jax.block_until_ready(x)
                received = time.perf_counter()
            out, g.caches[s], state = flat_step(
                flat[s][0], x, g.caches[s], g.starts[s], g.state if s == last else no_state, **calls[s]
            )
            if record is not None:
                jax.block_until_ready(out)
                record.append((ranks[s], s, i, t, begin, received, time.perf_counter()))
            if s < last:
                g.x = out
                continue
            g.state = state
            g.tokens.append(out)
            g.x = out if back is None else back(out)
    return np.concatenate([np.stack(jax.device_get(g.tokens), axis=1) for g in groups], axis=0)
