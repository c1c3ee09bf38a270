"""Issuing a generation as a wavefront of sequence groups.

The batch is split into `g` groups, each with its own KV caches on every
stage's rank, its own padding starts and its own sampling state (on the last
stage's rank). One round issues every group's next token through every stage
in the order of `issue_order`: cell `(group i, stage s)` goes by `i + s`, so
while rank r runs group i, rank r-1 already has group i+1. Calls are
asynchronous: the host only queues cells, each rank runs its queue in order,
and a group's next round waits on device for its own token only. Only the new
tokens' residual stream (and each sampled token, back to the first stage)
crosses ranks (`links`); each process issues only its own ranks' cells.

Early exit: a group stops being issued once none of its sequences can emit a
real token. Its budget (the largest `max_new_tokens` of its sequences) is known
on the host, so its cells end there on every process. With stop tokens, in one
process, the host also reads the last stage's "all finished" flag of round
t − 2 before issuing round t (a round late, so the read waits for nothing the
devices are still queuing) and stops the group there. The rounds after a stop
hold `pad_id`, as the unsplit reference gives. Within a group that still runs,
finished sequences are masked (their shapes stay), not skipped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from .stages import local_stages


@dataclass
class Group:
    """One group's live values: its input on stage 0, caches and next positions per stage (None on
    another process's stages), state, tokens so far, the rounds it runs (its budget, cut short when
    it has stopped) and its finished flags. Caches are flat lists of arrays."""

    x: jax.Array | None
    caches: list
    starts: list
    state: object
    rounds: int
    index: int = 0  # the group's place in the batch
    tokens: list = field(default_factory=list)
    finished: list = field(default_factory=list)


def issue_order(n_groups: int, n_stages: int) -> tuple[tuple[int, int], ...]:
    """The `(group, stage)` cells of one round, by wavefront slot `group + stage` (stage order within one)."""
    cells = [(i, s) for i in range(n_groups) for s in range(n_stages)]
    return tuple(sorted(cells, key=lambda c: (c[0] + c[1], c[1])))


def generate_tokens(
    cells, layout, groups, steps, pad_id, *, batch, links, specs, transfers, watch, record
) -> jax.Array:
    """`run_wavefront`'s tokens `(batch, steps)` on every process: across processes `transfers` brings
    them from the last stage's process."""
    tokens = run_wavefront(
        cells,
        layout,
        groups,
        steps,
        pad_id,
        links=links,
        specs=specs,
        transfers=transfers,
        watch=watch,
        record=record,
    )
    if transfers is None:
        return jnp.asarray(tokens)
    return transfers.finish(tokens, (batch, steps))


def _live(groups: list[Group], t: int, watch: bool) -> list[bool]:
    """Which groups run round t: within their rounds, which end at t when (`watch`) a group's
    sequences had all finished by round t − 2."""
    for g in groups:
        if watch and 2 <= t < g.rounds and bool(g.finished[t - 2]):
            g.rounds = t
    return [t < g.rounds for g in groups]


def run_wavefront(
    cells, layout, groups, steps, pad_id, *, links, specs, transfers=None, watch=False, record=None
) -> np.ndarray | None:
    """Issue up to `steps` rounds; this process's tokens `(batch, steps)` in group order (None when
    the last stage is another process's).

    `cells[s](group, x, t)` runs stage s of round t for a group on its input
    `x` and returns `(out, finished)` (it updates the group's own caches,
    starts and state; `finished` is the last stage's "all finished" flag).
    `links[s]` says how stage s's input arrives; `specs[t == 0][s]` its shape;
    `transfers` carries the cross-process ones. `watch`: read the finished
    flags (stop tokens, one process). With `record` (a list), each cell is
    waited for and `(rank, stage, group, round, start, received, end)`
    appended (seconds; `received` is when its input reached the rank): a
    measured timeline, not the fast path.
    """
    n_stages, ranks, last, me = len(cells), layout.ranks, len(cells) - 1, jax.process_index()
    mine = local_stages(layout, n_stages)
    n_groups = len(groups)
    order = issue_order(n_groups, n_stages)
    for t in range(steps):
        live = _live(groups, t, watch)
        if not any(live):
            break
        for i, s in order:
            if not live[i]:
                continue
            g, link = groups[i], links[s]
            if link.cross and (t or s):  # both sides at the consuming cell's place in the one issue order
                key = (n_groups, t, i, s)
                if link.src == me:
                    transfers.send(key, g.x)
                elif link.dst == me:
                    g.x = transfers.receive(key, specs[t == 0][s])
            if not mine[s]:
                continue
            begin = time.perf_counter()
            x = g.x if link.copy is None or (t == 0 and s == 0) else link.copy(g.x)
            if record is not None:
                jax.block_until_ready(x)
                received = time.perf_counter()
            g.x, finished = cells[s](g, x, t)
            if record is not None:
                jax.block_until_ready(g.x)
                record.append((ranks[s], s, i, t, begin, received, time.perf_counter()))
            if s == last:
                g.tokens.append(g.x)
                g.finished.append(finished)
    if not mine[last]:
        return None
    size = groups[0].tokens[0].shape[0]
    out = np.full((n_groups * size, steps), pad_id, np.int32)
    for i, g in enumerate(groups):
        made = np.stack(jax.device_get(g.tokens), axis=1)
        out[i * size : (i + 1) * size, : made.shape[1]] = made
    return out
