"""A step's time on `units` shared compute units, the issuing thread among what shares them.

One list simulation of a schedule's table: the issuing thread issues every cell
in the host's issue order (`walk_table`), one after another, each for its issuing
seconds (its call and its share of the step's host copies); a rank runs its cells
in table order, a cell once issued and its inputs arrived (`comm` later from
another rank), for its work (`predict.worked`). Whatever runs at a moment shares
the `units`: each at full speed while they are no more than the units, else each
at `units / running` (processor sharing). On separate accelerators the units are
the rank count and the issuing thread runs on a core of its own: the plain
simulation with the issuing as a serial resource. Fake CPU devices share the
host's cores with the issuing thread (`shares_host`), and the units are the ranks
computing at once measured on a real plain Std1F1B step (`backend.ranks_at_once`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from spectrax_core.schedules import StageCost
from spectrax_core.schedules._flow import Flow
from spectrax_core.schedules._simulate import walk_table

_DONE = 1e-15  # seconds left below which a job counts as finished (float residue)


@dataclass
class _Run:
    """The simulation's state: each rank's cells `(issue index, cell, needs)`, the next one's
    place and its work left (None: not started), the finish time of each input made, the
    cells issued so far and the issuing seconds left on the current one."""

    rows: list
    pos: list
    left: list
    done: dict = field(default_factory=dict)
    issued: int = 0
    issuing: float = 0.0
    end: float = 0.0


def shared_makespan(
    schedule, n: int, cost: StageCost, units: float, issue_s: float, shares_host: bool
) -> float:
    """Seconds from the first issue to the last cell's end of `schedule` on `n` ranks whose cells
    take `cost` (their work), each issued for `issue_s` by one thread, on `units` compute units
    shared by the running cells and, with `shares_host`, the issuing thread (module docstring)."""
    order = walk_table(schedule, n, schedule.actions(n), schedule.flow(n))
    owner = tuple(schedule.rank_of(s, n) for s in range(schedule.num_stages(n)))
    rows: list = [[] for _ in range(n)]
    for i, (r, cell, needs) in enumerate(order):
        rows[r].append((i, cell, needs))
    run, t = _Run(rows, [0] * n, [None] * n, issuing=issue_s), 0.0
    while True:
        running, wake = _running(run, t, cost, owner, float(cost.comm))
        host = run.issued < len(order)
        if not running and not host and wake == math.inf:
            return max(run.end, t)  # `walk_table` proved that every cell runs
        share = len(running) + (1 if host and shares_host else 0)
        rate = min(1.0, units / share) if share else 1.0
        host_rate = rate if shares_host else 1.0
        steps = [run.left[r] / rate for r in running] + [wake - t]
        steps += [run.issuing / host_rate] if host else []
        dt = max(min(steps), 0.0)
        t += dt
        if host:
            run.issuing -= dt * host_rate
            if run.issuing <= _DONE:
                run.issued, run.issuing = run.issued + 1, issue_s
        _advance(run, running, dt * rate, t)


def _running(run: _Run, t: float, cost: StageCost, owner: tuple, comm: float) -> tuple[list, float]:
    """`(ranks whose cell runs at `t`, the next time an issued cell's input arrives)`; a rank
    whose next cell can start now starts it."""
    running, wake = [], math.inf
    for r, row in enumerate(run.rows):
        if run.pos[r] >= len(row):
            continue
        i, cell, needs = row[run.pos[r]]
        if run.left[r] is None:
            if i >= run.issued or not all(need in run.done for need in needs):
                continue
            ready = max((run.done[d] + (comm if owner[d[1]] != r else 0.0) for d in needs), default=0.0)
            if ready > t + _DONE:
                wake = min(wake, ready)
                continue
            run.left[r] = cost.of(cell)
        running.append(r)
    return running, wake


def _advance(run: _Run, running: list, work: float, t: float) -> None:
    """Each running rank's cell does `work` more; one that finishes at `t` makes its outputs."""
    for r in running:
        run.left[r] -= work
        if run.left[r] <= _DONE:
            _, cell, _ = run.rows[r][run.pos[r]]
            run.done.update((Flow.makes(a), t) for a in cell.parts)
            run.pos[r], run.left[r], run.end = run.pos[r] + 1, None, t

