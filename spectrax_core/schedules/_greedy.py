"""Build a table by list scheduling: simulate the ranks and let each pick its next cell.

The construction of the zero-bubble family (Qi et al. 2024) and of the searched
schedule. Each rank, whenever it is free, runs the first of these that can start now:

1. a backward (I, or B when the backward is not split) whose input gradient has
   arrived, of its latest stage first (the one more ranks wait on);
2. a forward whose input has arrived, of its latest stage first, if the rank's
   memory cap allows it (below);
3. its oldest held weight-gradient cell W;

and otherwise waits for the next input. Forwards and backwards of a stage run in
microbatch order. The cap counts live `(stage, microbatch)` activations (from the
start of F to the end of B or W, as `simulate` does) and reserves room for the
later stages a microbatch will still pass on the same rank (the way back of a V), so
a cap of at least `stages held + 1` never deadlocks. The cells' durations come
from the cost model the table is built for; `simulate` of the table on that model
replays the same times.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from ._actions import Action, ScheduleError
from ._flow import Flow
from ._timeline import Cost, StageCost


@dataclass(frozen=True)
class Policy:
    """How the ranks pick: `caps[r]` live activations at most on rank r (None: no cap); `split`
    runs backwards as I then W (else one B); `order` the kinds tried in turn (`"BFW"`:
    backward, forward, held W; B stands for I when split); `oldest_first` picks among ready
    cells of one kind the oldest microbatch (else the latest stage); `reserve_route` admits a
    microbatch only with room for all its stages on the rank (else one slot is kept free for
    the later stages' forwards)."""

    caps: tuple[int | None, ...]
    split: bool = True
    order: str = "BFW"
    oldest_first: bool = False
    reserve_route: bool = True


class Built(NamedTuple):
    """A built table: one row per rank, its makespan and each rank's peak live activations on
    the cost model it was built for (what `simulate` reports for it)."""

    rows: list[list[Action]]
    makespan: float
    peaks: tuple[int, ...]


def list_schedule(
    owner: tuple[int, ...], m: int, cost: Cost | StageCost, policy: Policy, owner_name: str = "schedule"
) -> Built:
    """One row of actions per rank for a chain of `len(owner)` stages, stage s on rank
    `owner[s]`, `m` microbatches, timed on `cost` (see the module docstring); and the
    makespan, which `simulate` of the table on `cost` reproduces."""
    n = len(policy.caps)
    if any(c is not None and c < 1 for c in policy.caps):
        raise ScheduleError(
            f"{owner_name}: memory caps must be at least 1 activation, received {policy.caps}."
        )
    stages = len(owner)
    flow = Flow.chain(stages)
    comm = float(cost.comm)
    held_stages = [sorted((s for s in range(stages) if owner[s] == r), reverse=True) for r in range(n)]
    later_here = [sum(1 for t in range(s + 1, stages) if owner[t] == owner[s]) for s in range(stages)]
    earlier_here = [sum(1 for t in range(s) if owner[t] == owner[s]) for s in range(stages)]
    back = "I" if policy.split else "B"
    next_f, next_b = [0] * stages, [0] * stages
    held: list[deque] = [deque() for _ in range(n)]
    live, reserved, peaks = [0] * n, [0] * n, [0] * n
    finished: dict[tuple, float] = {}
    rows: list[list[Action]] = [[] for _ in range(n)]
    left = [sum(m * (3 if policy.split else 2) for _ in held_stages[r]) for r in range(n)]
    queue = [(0.0, 0, r) for r in range(n) if left[r]]
    heapq.heapify(queue)
    order, stalls = n, 0

    def arrival(action: Action, r: int) -> float | None:
        at = 0.0
        for dep in flow._needs(action):
            if dep not in finished:
                return None
            at = max(at, finished[dep] + (comm if owner[dep[1]] != r else 0.0))
        return at

    def room(r: int, s: int) -> bool:
        """Whether the forward of stage s fits rank r's cap (a microbatch new to the rank needs
        room for its later stages here too; one already admitted uses its reservation)."""
        cap = policy.caps[r]
        if cap is None:
            return True
        if not policy.reserve_route:  # keep one slot free for the later stages' forwards
            return live[r] < cap if earlier_here[s] else live[r] + 1 + (later_here[s] > 0) <= cap
        return earlier_here[s] > 0 or live[r] + reserved[r] + 1 + later_here[s] <= cap

    while queue:
        t, _, r = heapq.heappop(queue)
        waits: list[float] = []
        chosen = None
        for kind in policy.order:
            if kind == "W":
                if held[r]:
                    chosen = held[r].popleft()
                    break
                continue
            kind = back if kind == "B" else kind
            ready = []
            for s in held_stages[r]:
                mb = next_f[s] if kind == "F" else next_b[s]
                if mb >= m or (kind == "F" and not room(r, s)):
                    continue
                action = Action(kind, s, mb)
                at = arrival(action, r)
                if at is not None and at <= t:
                    ready.append(action)
                elif at is not None:
                    waits.append(at)
            if ready:
                chosen = (
                    min(ready, key=lambda a: (a.microbatch, -a.stage)) if policy.oldest_first else ready[0]
                )
                break
        if chosen is None:
            stalls += 1
            others = [q[0] for q in queue]
            if not waits and not any(x > t for x in others) and stalls > 2 * len(queue) + 2:
                raise ScheduleError(
                    f"{owner_name}: the memory caps {policy.caps} leave rank {r} unable to proceed at "
                    f"t={t}; raise the cap (each rank needs at least its stage count + 1)."
                )
            later = [x for x in waits + others if x > t]
            wake = min(later) if later else t
            order += 1
            heapq.heappush(queue, (wake, order, r))
            continue
        stalls = 0
        end = t + cost.of(chosen)
        s, mb = chosen.stage, chosen.microbatch
        if chosen.kind == "F":
            next_f[s] += 1
            live[r] += 1
            peaks[r] = max(peaks[r], live[r])
            reserved[r] += later_here[s] if earlier_here[s] == 0 else -1
            finished[("F", s, mb)] = end
        elif chosen.kind == "W":
            live[r] -= 1
            finished[("W", s, mb)] = end
        else:
            next_b[s] += 1
            finished[("G", s, mb)] = end
            if chosen.kind == "I":
                held[r].append(Action("W", s, mb))
            else:
                live[r] -= 1
        rows[r].append(chosen)
        left[r] -= 1
        if left[r]:
            order += 1
            heapq.heappush(queue, (end, order, r))
    return Built(rows, max(finished.values(), default=0.0), tuple(peaks))
