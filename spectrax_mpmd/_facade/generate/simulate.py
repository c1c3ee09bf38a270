"""A timing model of the generation wavefront, for utilisation figures from measured cell costs.

Each rank runs its cells in the order the host issues them (`issue_order`,
round after round); a cell starts when its rank is free and its input is
there: the previous stage's cell for the same group and round, or, on the
first stage, the last stage's cell of the previous round (the sampled token).

Two utilisation figures: over the whole run (fill and drain included), and
in steady state, the window in which every rank has work: from the latest
first start of a rank to the earliest last end (every rank is between its
first and last cell), busy time inside it over ranks x its length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .wavefront import issue_order


@dataclass(frozen=True)
class WavefrontTimes:
    """`cells[r]`: rank r's `(start, end)` in run order; `makespan`, `busy[r]`, `utilisation` = Σ busy /
    (ranks · makespan), and `steady` the utilisation inside the window where every rank has work."""

    cells: tuple[tuple[tuple[float, float], ...], ...]

    @property
    def makespan(self) -> float:
        return max(row[-1][1] for row in self.cells)

    @property
    def busy(self) -> tuple[float, ...]:
        return tuple(sum(end - start for start, end in row) for row in self.cells)

    @property
    def utilisation(self) -> float:
        return sum(self.busy) / (len(self.cells) * self.makespan)

    @property
    def window(self) -> tuple[float, float]:
        """The steady state: from the latest first start of a rank to the earliest last end."""
        return max(row[0][0] for row in self.cells), min(row[-1][1] for row in self.cells)

    @property
    def steady(self) -> float:
        lo, hi = self.window
        if hi <= lo:
            return 0.0
        inside = sum(max(0.0, min(end, hi) - max(start, lo)) for row in self.cells for start, end in row)
        return inside / (len(self.cells) * (hi - lo))


def simulate_wavefront(
    cost: Sequence[float], groups: int, rounds: int, ranks: Sequence[int] | None = None, comm: float = 0.0
) -> WavefrontTimes:
    """Run `rounds` of `groups` through stages costing `cost[s]` each (stage s on `ranks[s]`, default s).

    `comm` is the time an activation or token takes to reach another rank.
    """
    n_stages = len(cost)
    ranks = tuple(range(n_stages)) if ranks is None else tuple(ranks)
    free = dict.fromkeys(ranks, 0.0)
    cells: dict[int, list] = {r: [] for r in ranks}
    ready = [0.0] * groups  # when each group's input reaches its next stage
    order = issue_order(groups, n_stages)
    for _ in range(rounds):
        for i, s in order:
            r = ranks[s]
            start = max(free[r], ready[i])
            free[r] = start + cost[s]
            cells[r].append((start, free[r]))
            nxt = ranks[(s + 1) % n_stages]
            ready[i] = free[r] + (comm if nxt != r else 0.0)
    return WavefrontTimes(tuple(tuple(cells[r]) for r in sorted(cells)))
