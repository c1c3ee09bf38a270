"""Schedules with one stage per rank: GPipe, Std1F1B, Eager1F1B, ZeroBubbleH1.

Stage r lives on rank r. Any m ≥ 1 works: with fewer microbatches than ranks
the warm-up is capped at m and the schedule degrades towards GPipe.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ._actions import Action
from ._base import Schedule


def _one_f_one_b(rank: int, m: int, warmup: int, forward_first: bool) -> list[Action]:
    """`warmup` forwards, then pairs of one F and one B, then the remaining Bs."""
    row = [Action("F", rank, j) for j in range(warmup)]
    for k in range(m - warmup):
        pair = [Action("F", rank, warmup + k), Action("B", rank, k)]
        row.extend(pair if forward_first else pair[::-1])
    row.extend(Action("B", rank, k) for k in range(m - warmup, m))
    return row


@dataclass(frozen=True)
class GPipe(Schedule):
    """GPipe (Huang et al. 2019): every forward, then every backward.

    Bubble (n−1)(T_F+T_B) per rank; peak activations m on every rank.
    """

    microbatches: int
    virtual_stages: int = field(default=1, init=False)

    def _rows(self, n):
        m = self.microbatches
        return [
            [Action("F", r, j) for j in range(m)] + [Action("B", r, j) for j in range(m)] for r in range(n)
        ]


@dataclass(frozen=True)
class Std1F1B(Schedule):
    """1F1B / PipeDream-flush (Narayanan et al. 2021).

    Rank r runs a warm-up of min(n−r−1, m) forwards, then alternates one
    forward and one backward, then drains the backwards: at most n
    microbatches are in flight on rank 0. Bubble (n−1)(T_F+T_B) per rank.
    """

    microbatches: int
    virtual_stages: int = field(default=1, init=False)

    def _rows(self, n):
        m = self.microbatches
        return [_one_f_one_b(r, m, min(n - r - 1, m), forward_first=True) for r in range(n)]


@dataclass(frozen=True)
class Eager1F1B(Schedule):
    """1F1B with a longer warm-up, min(2(n−r)−1, m) forwards on rank r.

    The extra forwards are queued ahead of the first backward so that
    activation transfers overlap compute when transfers are slow; the steady
    state then alternates one backward and one forward. Peak activations
    2n−1 on rank 0 (for m ≥ 2n−1).
    """

    microbatches: int
    virtual_stages: int = field(default=1, init=False)

    def _rows(self, n):
        m = self.microbatches
        return [_one_f_one_b(r, m, min(2 * (n - r) - 1, m), forward_first=False) for r in range(n)]


@dataclass(frozen=True)
class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al., ICLR 2024): 1F1B with the backward split into I and W.

    I (input gradient) stays on the critical path in 1F1B position; rank r
    holds back its r most recent Ws and runs each one later, so the Ws of the
    later ranks fill the cool-down bubble. Every rank then keeps at most n
    activations live (n − r in flight plus r awaiting W), 1F1B's peak.
    Bubble (n−1)(T_F+T_I−T_W) per rank.
    """

    microbatches: int
    virtual_stages: int = field(default=1, init=False)
    splits_backward = True

    def _rows(self, n):
        return [_zb_h1_row(r, n, self.microbatches) for r in range(n)]


def _zb_h1_row(rank: int, n: int, m: int) -> list[Action]:
    """1F1B order with B split into I then W, the last `rank` Ws held back."""
    warmup = min(n - rank - 1, m)
    row = [Action("F", rank, j) for j in range(warmup)]
    held: deque[int] = deque()
    for k in range(m):
        if k < m - warmup:
            row.append(Action("F", rank, warmup + k))
        row.append(Action("I", rank, k))
        held.append(k)
        if len(held) > rank:
            row.append(Action("W", rank, held.popleft()))
    row.extend(Action("W", rank, k) for k in held)
    return row
