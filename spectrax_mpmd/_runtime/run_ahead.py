"""Bounded run-ahead: at most `limit` cells of a rank issued ahead of its oldest unfinished one.

JAX dispatch is asynchronous, so one host thread can issue a rank's cells far ahead
of the device. On an accelerator the runtime allocates a program's outputs when it is
enqueued, and frees its inputs only when it has run: a host far ahead holds the
outputs of every queued cell together with the inputs they have not yet consumed,
more than the plan's peak. With a limit, before issuing a rank's next cell the plan's
step function (`straight`) waits for that rank's oldest outstanding cell once `limit`
are outstanding (waiting on the cell's outputs that no later program has consumed: its
outputs are ready together). `limit=1` issues a
cell only after the previous one of its rank has run; the bytes beyond the plan's
peak are then nil, and `limit=k` adds at most what `k - 1` cells of the rank hold
(`spectrax_mpmd._planner.memory.run_ahead_bytes`).

The bound applies to a plan run by one process: a multi-process plan's steps are
the process's share, which the schedule's action spans do not index, so it runs
unbounded, as before.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from .._comm import is_transfer


class Gates(NamedTuple):
    """Per plan step: the rank whose cell starts there (-1: none) and the rank whose cell it ends
    (-1: none); a cell is one schedule action's steps, transfers aside."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    ranks: int


def gates(plan) -> Gates:
    """The issued steps where each action's cell starts and where its last program runs (a fused
    program running several cells of a rank counts as one)."""
    issued = plan.issued_of or range(len(plan.steps))
    starts, ends = [-1] * len(plan.hot_steps), [-1] * len(plan.hot_steps)
    for rank, _, first, end in plan.action_steps:
        programs = [k for k in range(first, end) if not is_transfer(plan.steps[k].fn)]
        if programs:
            starts[issued[programs[0]]] = rank
            ends[issued[programs[-1]]] = rank
    ranks = 1 + max((rank for rank, *_ in plan.action_steps), default=-1)
    return Gates(tuple(starts), tuple(ends), ranks)


def wait_for(outputs) -> None:
    """Wait for a cell through its outputs still held (one donated to a later program is gone;
    the cell's other outputs are ready with it)."""
    for x in outputs:
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.block_until_ready()
            return
