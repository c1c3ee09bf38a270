"""The zero-bubble V schedules (Qi et al. 2024): ZB-V, V-Half and V-Min.

Rank r holds logical stages r and 2n−1−r (the V of DualPipeV), so rank 0 both
starts and ends every microbatch. The backward is split into I and W, and the
three differ only in how many `(stage, microbatch)` activations a rank may hold
(their memory knob, `activation_limit`; an activation of one of the V's stages is
half a rank's layers): ZB-V as many as 1F1B (2n), V-Half about half
(2·⌊(n+2)/2⌋), V-Min about a third (2·⌊(n+4)/3⌋). Each table is the best (least
makespan at unit costs) within the limit of two constructions:

* list scheduling (`_greedy`), with a few pick orders;
* the building block: one microbatch's cells (F down the V, I back up, each W after
  its I) placed one after another, each at the first time its input is ready whose
  slot modulo 6 is still free on its rank, and the block repeated every 6 cells (a
  rank runs 6 cells per microbatch, so the steady state has no bubble). Every cell
  waits at most 5 cells, so each activation lives about as long as its microbatch
  takes to turn around: V-Min's memory, with V-Min's bubble (about 4n cells per rank,
  the published (2p/3)(T_F + T_B + T_W)).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from ._actions import Action, ScheduleError
from ._base import Schedule, check_count
from ._greedy import Policy, list_schedule
from ._timeline import Cost
from ._user import UserSchedule

_ORDERS = (("BWF", False), ("BFW", False), ("FBW", False), ("BFW", True), ("FBW", True))


class _V(Schedule):
    """Shared layout and construction of the zero-bubble V schedules."""

    activation_limit: int | None
    layout = "v"
    splits_backward = True

    def __post_init__(self):
        super().__post_init__()
        if self.activation_limit is not None:
            check_count(type(self).__name__, "activation_limit", self.activation_limit, 3)

    @abc.abstractmethod
    def default_limit(self, n: int) -> int:
        """The schedule's own memory knob on `n` ranks."""

    def limit(self, n: int) -> int:
        """Most `(stage, microbatch)` activations a rank may hold on `n` ranks."""
        return self.default_limit(n) if self.activation_limit is None else self.activation_limit

    def _rows(self, n):
        owner = tuple(s if s < n else 2 * n - 1 - s for s in range(2 * n))
        best, best_span = None, None
        for order, reserve in _ORDERS:
            policy = Policy((self.limit(n),) * n, split=True, order=order, reserve_route=reserve)
            try:
                rows, span, _ = list_schedule(owner, self.microbatches, Cost(), policy, type(self).__name__)
            except ScheduleError:
                continue
            if best_span is None or span < best_span:
                best, best_span = rows, span
        block = UserSchedule(_block_rows(n, self.microbatches))
        if block.peak_activations(n) <= self.limit(n) and (best is None or block.total_steps(n) < best_span):
            best = [list(row) for row in block.actions(n)]
        if best is None:
            raise ScheduleError(
                f"{type(self).__name__}: activation_limit={self.limit(n)} is too small to run on {n} ranks; "
                "allow at least 3 activations per rank."
            )
        return best


def _block_rows(n: int, m: int) -> list[list[Action]]:
    """The V's building block on `n` ranks repeated for `m` microbatches (see the module docstring)."""
    free = [set(range(6)) for _ in range(n)]
    at: dict[tuple[str, int], int] = {}

    def place(kind: str, s: int, ready: int) -> int:
        rank = s if s < n else 2 * n - 1 - s
        t = next(t for t in range(ready, ready + 6) if t % 6 in free[rank])
        free[rank].remove(t % 6)
        at[(kind, s)] = t
        return t + 1

    ready = 0
    for s in range(2 * n):
        ready = place("F", s, ready)
    for s in reversed(range(2 * n)):
        ready = place("I", s, ready)
    for s in range(2 * n):
        place("W", s, at[("I", s)] + 1)
    cells = sorted(
        (s if s < n else 2 * n - 1 - s, t + 6 * k, Action(kind, s, k))
        for k in range(m)
        for (kind, s), t in at.items()
    )
    rows: list[list[Action]] = [[] for _ in range(n)]
    for rank, _, action in cells:
        rows[rank].append(action)
    return rows


@dataclass(frozen=True)
class ZBV(_V):
    """ZB-V: the V layout with 1F1B's memory (2n half-rank activations per rank).

    At T_F = T_I = T_W the makespan is 6m + n − 1 chunk cells: the only idle is
    the fill of the V (n − 1 cells), none in the steady state.
    """

    microbatches: int
    activation_limit: int | None = None
    virtual_stages: int = field(default=2, init=False)

    def default_limit(self, n):
        return 2 * n


@dataclass(frozen=True)
class VHalf(_V):
    """V-Half: about half of 1F1B's activation memory, 2·⌊(n+2)/2⌋ half-rank activations per
    rank, with a bubble at most about half of 1F1B's."""

    microbatches: int
    activation_limit: int | None = None
    virtual_stages: int = field(default=2, init=False)

    def default_limit(self, n):
        return 2 * ((n + 2) // 2)


@dataclass(frozen=True)
class VMin(_V):
    """V-Min: about a third of 1F1B's activation memory, 2·⌊(n+4)/3⌋ half-rank activations per
    rank, for a bubble of about 4n cells per rank at T_F = T_I = T_W (the published
    (2p/3)(T_F + T_B + T_W); two thirds of 1F1B's)."""

    microbatches: int
    activation_limit: int | None = None
    virtual_stages: int = field(default=2, init=False)

    def default_limit(self, n):
        return 2 * ((n + 4) // 3)
