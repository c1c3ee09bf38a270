"""Execute a schedule table on a cost model (`Cost`, `StageCost`): `simulate`, `validate`.

Semantics: every rank runs its cells in table order, one at a time; a cell starts
when its rank is free and all it waits for has finished (the rule of `Flow`, over
`schedule.flow(n)`: F of stage s needs F of the stages it reads, s−1 in a chain; B/I of s
its own F and the B/I of the stages whose gradient it reads, s+1 in a chain; W its own I).
An input produced on another rank arrives `comm` later. A fused cell waits for the inputs
of both parts and costs the sum of its parts unless `Cost.FB` is given. Cells are timed in
`issue_order`, so every input is timed before the cells that read it.
"""

from __future__ import annotations

from dataclasses import replace

from ._actions import Cell, check_table
from ._flow import DeadlockError, Dependency, Flow, walk
from ._memory import StageMemory, peak_bytes
from ._timeline import Cost, Event, StageCost, Timeline


def simulate(
    schedule, n: int, cost: Cost | StageCost = Cost(), memory: StageMemory | None = None
) -> Timeline:
    """Run `schedule.actions(n)` on the cost model `cost` and return its `Timeline`.

    With `memory` (a `StageMemory`), the timeline's `peak_bytes` holds each
    rank's peak in device bytes and `peak_host_bytes` in host bytes, the buffers
    following the host's issue order (see `peak_bytes`).

    Raises `ScheduleError` (a `ValueError`) when the table is malformed (see
    `check_table`) or deadlocks (every unfinished rank waits on an input that
    no rank will produce); the message lists what each stuck rank waits for.
    """
    if not isinstance(cost, (Cost, StageCost)):
        raise TypeError(f"simulate: cost must be a Cost or a StageCost, received {type(cost).__name__}.")
    table = schedule.actions(n)
    check_table(schedule, n, table)
    n_stages = schedule.num_stages(n)
    if isinstance(cost, StageCost) and cost.stages != n_stages:
        raise ValueError(
            f"simulate: the StageCost has {cost.stages} stages but {type(schedule).__name__} on {n} ranks "
            f"has {n_stages}; give one duration per stage."
        )
    flow = schedule.flow(n)
    if memory is not None and not flow.is_chain:
        raise ValueError(
            f"simulate: peak bytes (memory=) are modelled for a chain of stages, each reading the one "
            f"before; the stages of {type(schedule).__name__} form a graph (regions). Simulate it "
            "without memory=, or each region's chain on its own."
        )
    owner = tuple(schedule.rank_of(s, n) for s in range(n_stages))
    comm = float(cost.comm)
    finished: dict[Dependency, float] = {}
    free = [0.0] * n
    events: list[list[Event]] = [[] for _ in range(n)]
    for r, cell, needs in walk_table(schedule, n, table, flow):
        start = free[r]
        for need in needs:
            t = finished[need]
            start = max(start, t + comm if owner[need[1]] != r else t)  # need: (kind, stage, mb)
        end = start + cost.of(cell)
        finished.update((Flow.makes(a), end) for a in cell.parts)
        free[r] = end
        events[r].append(Event(r, cell, start, end))
    timeline = _timeline(schedule, n, cost, events)
    if memory is None:
        return timeline
    device, host = peak_bytes(timeline, memory), peak_bytes(timeline, memory, kind="host")
    return replace(timeline, peak_bytes=device, peak_host_bytes=host)


def walk_table(schedule, n: int, table, flow: Flow) -> list[tuple[int, Cell, tuple]]:
    """`walk` over `table`, `schedule`'s table on `n` ranks, and its `flow`; a table that stalls
    raises `DeadlockError` naming the schedule and what each stuck rank waits for."""
    try:
        return walk(table, flow)
    except DeadlockError as err:
        raise DeadlockError(
            f"{type(schedule).__name__}: the table deadlocks on n={n} ranks: "
            f"{'; '.join(map(str, err.stuck))}. Reorder the rows so every input is produced before "
            "it is needed.",
            err.stuck,
        ) from None


def _timeline(schedule, n, cost, events) -> Timeline:
    makespan = max((row[-1].end for row in events if row), default=0.0)
    busy = tuple(sum(e.end - e.start for e in row) for row in events)
    idle = tuple(makespan - b for b in busy)
    bubble = sum(idle) / (n * makespan) if makespan > 0 else 0.0
    peaks = tuple(_peak_live(row) for row in events)
    return Timeline(
        schedule_name=type(schedule).__name__,
        n=n,
        cost=cost,
        events=tuple(tuple(row) for row in events),
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_fraction=bubble,
        peak_activations=peaks,
        stage_labels=schedule.stage_labels(n),
    )


def _peak_live(row: list[Event]) -> int:
    born: dict[tuple[int, int], float] = {}
    freed: dict[tuple[int, int], float] = {}
    for e in row:
        for a in e.cell.parts:
            key = (a.stage, a.microbatch)
            if a.kind == "F":
                born[key] = e.start
            elif a.kind in ("B", "W"):
                freed[key] = e.end
    # at equal times a release (-1) sorts before an allocation (+1)
    marks = sorted([(t, 1) for t in born.values()] + [(t, -1) for t in freed.values()])
    live = peak = 0
    for _, delta in marks:
        live += delta
        peak = max(peak, live)
    return peak


def validate(schedule, n: int) -> None:
    """Raise `ScheduleError` unless `schedule`'s table for `n` ranks is well formed and runs.

    Checks the structural rules of `check_table` and executes the table (at
    default costs) to prove it has no deadlock.
    """
    simulate(schedule, n)
