"""ZB-H2 (Qi et al., ICLR 2024): zero bubble with one stage per rank.

Each rank runs enough warm-up forwards to stay busy until its first input
gradient arrives, then I before F before its held W: the ranks' busy spans form a
parallelogram with no idle inside. The warm-up needs up to 2n−1 live activations
(1F1B needs n). `latency` is the transfer time in forward-cell units the table is
built for (0, ½ or 1 slot, as in Shardy's variants): a longer round trip takes more
warm-up forwards, 2(n−1)·latency more activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ._actions import ScheduleError
from ._base import Schedule
from ._greedy import Policy, list_schedule
from ._timeline import Cost


@dataclass(frozen=True)
class ZeroBubbleH2(Schedule):
    """ZB-H2: 1F1B-shaped with split I/W and a warm-up of up to 2n−1 forwards.

    At T_F = T_I = T_W and `latency` equal to the transfer time, no rank is idle
    between its first and its last cell (the published zero bubble: the only idle
    is the n−1 cells of the pipeline's fill); peak 2n−1 + ⌈2(n−1)·latency⌉
    activations.
    """

    microbatches: int
    latency: float = 0.0
    virtual_stages: int = field(default=1, init=False)
    splits_backward = True

    def __post_init__(self):
        super().__post_init__()
        ok = not isinstance(self.latency, bool) and isinstance(self.latency, (int, float))
        if not ok or not 0 <= self.latency <= 4:
            raise ScheduleError(
                "ZeroBubbleH2: latency is the transfer time in forward-cell units, a number in 0..4 "
                f"(0, 0.5 and 1 are the usual variants), received {self.latency!r}."
            )

    def activation_cap(self, n: int) -> int:
        """Live activations a rank may hold: 2n−1 plus the forwards that cover the transfers."""
        return 2 * n - 1 + math.ceil(2 * (n - 1) * self.latency)

    def _rows(self, n):
        policy = Policy((self.activation_cap(n),) * n, split=True, order="BFW")
        cost = Cost(comm=self.latency)
        return list_schedule(tuple(range(n)), self.microbatches, cost, policy, "ZeroBubbleH2")[0]
