"""Execute a schedule table on a cost model (`Cost`, `StageCost`): `simulate`, `validate`.

Semantics: every rank runs its cells in table order, one at a
time; a cell starts when its rank is free and all its inputs exist. F of stage
s needs F of the stages it reads (`schedule.stage_inputs`: s−1 in a chain,
same microbatch); B/I of s needs its own F and the B/I of the stages that read
it (`schedule.gradient_inputs`: s+1 in a chain); W needs its own I. An input produced on another rank arrives `comm` later.
A fused cell waits for the inputs of both parts and costs the sum of its parts
unless `Cost.FB` is given.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ._actions import Action, ScheduleError, check_table
from ._memory import StageMemory, peak_bytes
from ._timeline import Cost, Event, StageCost, Timeline


@dataclass(frozen=True)
class _Flow:
    """Where each stage lives and which stages feed its forward and its backward."""

    rank_of: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]
    gradient_inputs: tuple[tuple[int, ...], ...]

    @property
    def is_chain(self) -> bool:
        n = len(self.inputs)
        return self.inputs == tuple(
            (s - 1,) if s else () for s in range(n)
        ) and self.gradient_inputs == tuple((s + 1,) if s < n - 1 else () for s in range(n))

    def needs(self, a: Action) -> list[tuple[tuple[str, int, int], int]]:
        """Inputs of `a` as (key, producing rank); key kinds: F done, G = input grad done, W done."""
        s, mb = a.stage, a.microbatch
        if a.kind == "F":
            return [(("F", p, mb), self.rank_of[p]) for p in self.inputs[s]]
        if a.kind == "W":
            return [(("G", s, mb), self.rank_of[s])]
        return [(("F", s, mb), self.rank_of[s])] + [
            (("G", c, mb), self.rank_of[c]) for c in self.gradient_inputs[s]
        ]


def _makes(a: Action) -> tuple[str, int, int]:
    return ("G" if a.kind in ("B", "I") else a.kind, a.stage, a.microbatch)


def simulate(
    schedule, n: int, cost: Cost | StageCost = Cost(), memory: StageMemory | None = None
) -> Timeline:
    """Run `schedule.actions(n)` on the cost model `cost` and return its `Timeline`.

    With `memory` (a `StageMemory`), the timeline's `peak_bytes` holds each
    rank's peak in bytes, the buffers following the host's issue order (see
    `peak_bytes`).

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
    flow = _Flow(
        tuple(schedule.rank_of(s, n) for s in range(n_stages)),
        schedule.stage_inputs(n),
        schedule.gradient_inputs(n),
    )
    if memory is not None and not flow.is_chain:
        raise ValueError(
            f"simulate: peak bytes (memory=) are modelled for a chain of stages, each reading the one "
            f"before; the stages of {type(schedule).__name__} form a graph (regions). Simulate it "
            "without memory=, or each region's chain on its own."
        )
    comm = float(cost.comm)
    done: dict[tuple[str, int, int], float] = {}
    waiting: dict[tuple[str, int, int], list[int]] = {}
    blocked_on: dict[int, tuple[str, int, int]] = {}
    pos = [0] * n
    free = [0.0] * n
    events: list[list[Event]] = [[] for _ in range(n)]
    todo = list(range(n))
    while todo:
        r = todo.pop()
        row = table[r]
        while pos[r] < len(row):
            cell = row[pos[r]]
            start = free[r]
            missing = None
            for a in cell.parts:
                for key, src in flow.needs(a):
                    t = done.get(key)
                    if t is None:
                        missing = key
                        break
                    start = max(start, t + comm if src != r else t)
                if missing is not None:
                    break
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                blocked_on[r] = missing
                break
            blocked_on.pop(r, None)
            end = start + cost.of(cell)
            for a in cell.parts:
                key = _makes(a)
                done[key] = end
                todo.extend(waiting.pop(key, ()))
            free[r] = end
            events[r].append(Event(r, cell, start, end))
            pos[r] += 1
    stuck = [r for r in range(n) if pos[r] < len(table[r])]
    if stuck:
        lines = "; ".join(
            f"rank {r} at cell {pos[r]} ({table[r][pos[r]]!r}) waits for {_describe(blocked_on[r])}"
            for r in stuck
        )
        raise ScheduleError(
            f"{type(schedule).__name__}: the table deadlocks on n={n} ranks: {lines}. "
            "Reorder the rows so every input is produced before it is needed."
        )
    timeline = _timeline(schedule, n, cost, events)
    return timeline if memory is None else replace(timeline, peak_bytes=peak_bytes(timeline, memory))


def _describe(key: tuple[str, int, int]) -> str:
    kind, s, mb = key
    what = {"F": "the forward", "G": "the input gradient", "W": "the weight gradient"}[kind]
    return f"{what} of stage {s}, microbatch {mb}"


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
