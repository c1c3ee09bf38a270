"""A timing model of the generation wavefront, for utilisation figures from measured cell costs.

Each rank runs its cells in the order the host issues them (`issue_order`,
round after round); a cell starts when its rank is free and its input is
there: the previous stage's cell for the same group and round, or, on the
first stage, the last stage's cell of the previous round (the sampled token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .wavefront import issue_order


@dataclass(frozen=True)
class WavefrontTimes:
    """`makespan`, `busy[r]` per rank and `utilisation` = Σ busy / (ranks · makespan)."""

    makespan: float
    busy: tuple[float, ...]

    @property
    def utilisation(self) -> float:
        return sum(self.busy) / (len(self.busy) * self.makespan)


def simulate_wavefront(
    cost: Sequence[float], groups: int, rounds: int, ranks: Sequence[int] | None = None, comm: float = 0.0
) -> WavefrontTimes:
    """Run `rounds` of `groups` through stages costing `cost[s]` each (stage s on `ranks[s]`, default s).

    `comm` is the time an activation or token takes to reach another rank.
    """
    n_stages = len(cost)
    ranks = tuple(range(n_stages)) if ranks is None else tuple(ranks)
    free = dict.fromkeys(ranks, 0.0)
    busy = dict.fromkeys(ranks, 0.0)
    ready = [0.0] * groups  # when each group's input reaches its next stage
    order = issue_order(groups, n_stages)
    for _ in range(rounds):
        for i, s in order:
            r = ranks[s]
            start = max(free[r], ready[i])
            free[r] = start + cost[s]
            busy[r] += cost[s]
            nxt = ranks[(s + 1) % n_stages]
            ready[i] = free[r] + (comm if nxt != r else 0.0)
    return WavefrontTimes(makespan=max(free.values()), busy=tuple(busy[r] for r in sorted(busy)))
