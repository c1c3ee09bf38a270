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
    if any(c is not None and c < 1 for c in policy.caps):
        raise ScheduleError(
            f"{owner_name}: memory caps must be at least 1 activation, received {policy.caps}."
        )
    state = _Ranks(owner, m, cost, policy)
    queue = [(0.0, r, r) for r in range(state.n) if state.left[r]]
    heapq.heapify(queue)
    order, stalls = state.n, 0
    while queue:
        t, _, r = heapq.heappop(queue)
        chosen, waits = state.pick(r, t)
        if chosen is None:
            stalls += 1
            others = [q[0] for q in queue]
            if not waits and not any(x > t for x in others) and stalls > 2 * len(queue) + 2:
                raise ScheduleError(
                    f"{owner_name}: the memory caps {policy.caps} leave rank {r} unable to proceed at "
                    f"t={t}; raise the cap (each rank needs at least its stage count + 1)."
                )
            later = [x for x in waits + others if x > t]
            order += 1
            heapq.heappush(queue, (min(later) if later else t, order, r))
            continue
        stalls = 0
        end = state.run(r, chosen, t)
        if state.left[r]:
            order += 1
            heapq.heappush(queue, (end, order, r))
    return Built(state.rows, max(state.finished.values(), default=0.0), tuple(state.peaks))


class _Ranks:
    """The state of a list-scheduling run: what each rank has run, holds and may run next."""

    def __init__(self, owner: tuple[int, ...], m: int, cost, policy: Policy):
        n, stages = len(policy.caps), len(owner)
        self.n, self.m, self.owner, self.cost, self.policy = n, m, owner, cost, policy
        self.flow, self.comm = Flow.chain(stages), float(cost.comm)
        self.held_stages = [
            sorted((s for s in range(stages) if owner[s] == r), reverse=True) for r in range(n)
        ]
        self.later_here = [
            sum(1 for t in range(s + 1, stages) if owner[t] == owner[s]) for s in range(stages)
        ]
        self.earlier_here = [sum(1 for t in range(s) if owner[t] == owner[s]) for s in range(stages)]
        self.back = "I" if policy.split else "B"
        self.next_f, self.next_b = [0] * stages, [0] * stages
        self.held: list[deque] = [deque() for _ in range(n)]
        self.live, self.reserved, self.peaks = [0] * n, [0] * n, [0] * n
        self.finished: dict[tuple, float] = {}
        self.rows: list[list[Action]] = [[] for _ in range(n)]
        self.left = [m * (3 if policy.split else 2) * len(self.held_stages[r]) for r in range(n)]

    def arrival(self, action: Action, r: int) -> float | None:
        """When everything `action` waits for is on rank r (None: not all of it is scheduled)."""
        at = 0.0
        for dep in self.flow._needs(action):
            if dep not in self.finished:
                return None
            at = max(at, self.finished[dep] + (self.comm if self.owner[dep[1]] != r else 0.0))
        return at

    def room(self, r: int, s: int) -> bool:
        """Whether the forward of stage s fits rank r's cap (a microbatch new to the rank needs
        room for its later stages here too; one already admitted uses its reservation)."""
        cap, live = self.policy.caps[r], self.live[r]
        if cap is None:
            return True
        if not self.policy.reserve_route:  # keep one slot free for the later stages' forwards
            return live < cap if self.earlier_here[s] else live + 1 + (self.later_here[s] > 0) <= cap
        return self.earlier_here[s] > 0 or live + self.reserved[r] + 1 + self.later_here[s] <= cap

    def pick(self, r: int, t: float) -> tuple[Action | None, list[float]]:
        """The cell rank r runs at time t (None: none is ready), and when waiting cells get ready."""
        waits: list[float] = []
        for kind in self.policy.order:
            if kind == "W":
                if self.held[r]:
                    return self.held[r][0], waits
                continue
            kind = self.back if kind == "B" else kind
            ready = []
            for s in self.held_stages[r]:
                mb = self.next_f[s] if kind == "F" else self.next_b[s]
                if mb >= self.m or (kind == "F" and not self.room(r, s)):
                    continue
                action = Action(kind, s, mb)
                at = self.arrival(action, r)
                if at is not None and at <= t:
                    ready.append(action)
                elif at is not None:
                    waits.append(at)
            if ready:
                oldest = min(ready, key=lambda a: (a.microbatch, -a.stage))
                return (oldest if self.policy.oldest_first else ready[0]), waits
        return None, waits

    def run(self, r: int, action: Action, t: float) -> float:
        """Record `action` on rank r from time t; returns its end."""
        end = t + self.cost.of(action)
        s, mb = action.stage, action.microbatch
        if action.kind == "F":
            self.next_f[s] += 1
            self.live[r] += 1
            self.peaks[r] = max(self.peaks[r], self.live[r])
            self.reserved[r] += self.later_here[s] if self.earlier_here[s] == 0 else -1
        elif action.kind == "W":
            self.held[r].popleft()
            self.live[r] -= 1
        else:
            self.next_b[s] += 1
            if action.kind == "I":
                self.held[r].append(Action("W", s, mb))
            else:
                self.live[r] -= 1
        self.finished[Flow.makes(action)] = end
        self.rows[r].append(action)
        self.left[r] -= 1
        return end
