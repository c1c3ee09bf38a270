"""A schedule searched for measured stage costs under a memory budget: `search`.

In the spirit of the zero-bubble authors' automatic scheduler: list scheduling
(`_greedy`) on the caller's costs, over a small grid of memory caps per rank,
pick orders and split or whole backwards, plus every named schedule of the same
stage cut; each candidate is simulated on the same costs and the one with the
shortest makespan whose peak fits the budget wins (ties: the smaller peak).
When nothing fits, smaller caps are tried, down to the least the cut runs with
(one live activation per rank; two on a V). A
named schedule that wins is returned as itself, a built table as a
`SearchedSchedule`, so the result is never slower than the best named schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._actions import ScheduleError
from ._base import Schedule, check_count
from ._dualpipe import DualPipeV
from ._flat import Eager1F1B, GPipe, Std1F1B, ZeroBubbleH1
from ._greedy import Policy, list_schedule
from ._interleaved import Interleaved1F1BPlusOne, InterleavedGPipe, InterleavedH1
from ._memory import StageMemory
from ._simulate import simulate
from ._timeline import Cost, StageCost
from ._user import UserSchedule
from ._zb_h2 import ZeroBubbleH2
from ._zero_bubble_v import ZBV, VHalf, VMin

_FLAT = (GPipe, Std1F1B, Eager1F1B, ZeroBubbleH1)
_V = (DualPipeV, ZBV, VHalf, VMin)
_LOOP = (InterleavedH1, InterleavedGPipe, Interleaved1F1BPlusOne)


@dataclass(frozen=True)
class SearchedSchedule(UserSchedule):
    """A table that `search` built (a `UserSchedule`: fixed rows, checked when made)."""


class BudgetError(ScheduleError):
    """`search` found no table within its memory budget: `smallest` is the table with the smallest
    peak it found and `peak` that peak (what a budget must at least allow)."""

    def __init__(self, message: str, smallest: Schedule, peak: float):
        super().__init__(message)
        self.smallest, self.peak = smallest, peak


def search(
    n: int,
    microbatches: int,
    cost: Cost | StageCost = Cost(),
    memory_budget: int | None = None,
    memory: StageMemory | None = None,
    virtual_stages: int = 1,
) -> Schedule:
    """The fastest table found for `n` ranks and `microbatches` on `cost` within `memory_budget`.

    The stage cut is one stage per rank (`virtual_stages=1`) or a V of two per rank
    (`virtual_stages=2`); a `StageCost` must give one duration per stage of that cut.
    `memory_budget` bounds each rank's peak: bytes when `memory` (a `StageMemory`) is
    given, else live `(stage, microbatch)` activations (`Timeline.peak_activations`);
    None: no bound. Raises `BudgetError` (a `ScheduleError`) when nothing fits, naming the
    smallest peak found (its `smallest` and `peak`).
    """
    check_count("search", "n (number of ranks)", n, 1)
    check_count("search", "microbatches", microbatches, 1)
    if virtual_stages not in (1, 2):
        raise ScheduleError(
            f"search: virtual_stages must be 1 (a stage per rank) or 2 (a V), received {virtual_stages!r}."
        )
    stages = n * virtual_stages
    if isinstance(cost, StageCost) and cost.stages != stages:
        raise ScheduleError(
            f"search: the StageCost has {cost.stages} stages but n={n} ranks x virtual_stages="
            f"{virtual_stages} cut the model into {stages}; give one duration per stage."
        )
    if memory_budget is not None and (isinstance(memory_budget, bool) or not memory_budget > 0):
        raise ScheduleError(
            f"search: memory_budget must be a positive number or None, received {memory_budget!r}."
        )
    found: list[tuple[float, float, int, Schedule]] = []
    for k, schedule in enumerate(_named(n, microbatches, virtual_stages, cost)):
        span, peak = _measure(schedule, n, cost, memory)
        found.append((span, peak, k, schedule))
    owner = (
        tuple(range(n))
        if virtual_stages == 1
        else tuple(s if s < n else 2 * n - 1 - s for s in range(stages))
    )
    policies = _policies(n, microbatches, virtual_stages, cost)
    found += _tables(owner, microbatches, cost, policies, memory_budget, memory, len(found))
    fitting = [f for f in found if memory_budget is None or f[1] <= memory_budget]
    if not fitting:  # the tables kept there name the smallest peak if none fits
        top, v = policies[0].caps[0] - 1, virtual_stages
        found += _below_grid(owner, n, microbatches, cost, top, v, memory_budget, memory, len(found))
        fitting = [f for f in found if f[1] <= memory_budget]
    if not fitting:
        _, peak, _, smallest = min(found, key=lambda f: f[1])
        raise BudgetError(
            f"search: no table fits memory_budget={memory_budget}; the smallest peak found is {peak} "
            f"({type(smallest).__name__}), with caps searched down to {_FLOOR[virtual_stages]} live "
            f"activation(s) per rank, the least this stage cut runs with. Raise the budget to at least "
            f"{peak}.",
            smallest,
            peak,
        )
    return min(fitting, key=lambda f: (f[0], f[1], f[2]))[3]


def _tables(
    owner: tuple, m: int, cost, policies: list, budget, memory, first: int, below: bool = False
) -> list[tuple]:
    """`(makespan, peak, order, SearchedSchedule)` of each table list scheduling builds with
    `policies`, fastest first (those that deadlock left out; without `memory`, those over
    `budget` too). `below` (caps below the grid, tried when nothing fits): every table is kept,
    up to the first that fits `budget` (the slower ones after it are not measured)."""
    n = len(policies[0].caps)
    built = []
    for policy in policies:
        try:
            built.append(list_schedule(owner, m, cost, policy, "search"))
        except ScheduleError:
            continue
    found = []
    for k, b in enumerate(sorted(built, key=lambda b: (b.makespan, max(b.peaks)))):
        if not below and memory is None and budget is not None and max(b.peaks) > budget:
            continue
        schedule = SearchedSchedule(tuple(map(tuple, b.rows)))
        span, peak = (b.makespan, max(b.peaks)) if memory is None else _measure(schedule, n, cost, memory)
        found.append((span, peak, first + k, schedule))
        if below and peak <= budget:
            break
    return found


# the least cap on live activations per rank a stage cut can run with: one stage per rank holds
# one microbatch at a time; a V holds its two stages' activations of a microbatch at once
_FLOOR = {1: 1, 2: 2}


def _below_grid(owner: tuple, n: int, m: int, cost, top: int, v: int, budget, memory, first: int) -> list:
    """Every table built at caps up to `top` (below the grid) when nothing in the grid fits: at
    the cap a budget in activations names (a table's peak is at most its cap), or, for a budget
    in bytes, at the floor and then, by bisection, at the largest cap whose tables fit (the
    fastest; peaks grow with the cap)."""
    made: list = []

    def fits_at(cap: int) -> bool:
        tables = _tables(owner, m, cost, _grid([cap], v, n), budget, memory, first + len(made), below=True)
        made.extend(tables)
        return any(peak <= budget for _, peak, _, _ in tables)

    if memory is None:
        fits_at(max(_FLOOR[v], min(top, int(budget))))
        return made
    low, high = _FLOOR[v], top
    if not fits_at(low):
        return made
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits_at(mid) else (low, mid - 1)
    return made


def _measure(schedule: Schedule, n: int, cost, memory) -> tuple[float, float]:
    t = simulate(schedule, n, cost, memory=memory)
    return t.makespan, max(t.peak_bytes if memory is not None else t.peak_activations)


def _named(n: int, m: int, v: int, cost) -> list[Schedule]:
    """Every named schedule valid on `n` ranks and `m` microbatches with the same stage cut."""
    if v == 1:
        latency = _slots(cost)
        made = [cls(microbatches=m) for cls in _FLAT] + [ZeroBubbleH2(microbatches=m)]
        made += [ZeroBubbleH2(microbatches=m, latency=x) for x in sorted({0.5, 1.0, latency}) if x > 0]
    else:
        made = [cls(microbatches=m) for cls in _V]
        made += [cls(microbatches=m, virtual_stages=2) for cls in _LOOP]
    out = []
    for schedule in made:
        try:
            schedule.actions(n)
        except ScheduleError:
            continue
        out.append(schedule)
    return out


def _slots(cost) -> float:
    """The transfer time in forward cells (the mean forward), rounded to a half, at most 4."""
    forward = cost.F if isinstance(cost, Cost) else sum(cost.F) / len(cost.F)
    return min(4.0, round(2 * cost.comm / forward) / 2) if forward > 0 else 0.0


def _policies(n: int, m: int, v: int, cost) -> list[Policy]:
    """The grid of list-scheduling variants tried first."""
    extra = math.ceil(2 * (n - 1) * _slots(cost))
    if v == 1:
        return _grid(sorted({n, (3 * n) // 2, 2 * n - 1, 2 * n - 1 + extra, m}), v, n)
    return _grid(sorted({2 * ((n + 4) // 3), n + 2, 2 * n, 2 * n + extra}), v, n)


def _grid(caps: list[int], v: int, n: int) -> list[Policy]:
    """Every pick order and backward form at each of `caps` (the same cap on every rank)."""
    if v == 1:
        grid = [(c, split, order, True) for c in caps for split in (True, False) for order in ("BFW", "FBW")]
    else:
        grid = [
            (c, True, order, reserve)
            for c in caps
            for order in ("BWF", "BFW", "FBW")
            for reserve in (False, True)
        ]
    return [
        Policy((c,) * n, split=split, order=order, reserve_route=reserve) for c, split, order, reserve in grid
    ]
