"""DualPipe and DualPipeV: DeepSeek's bidirectional schedule and its cut-in-half V.

DualPipeV: rank r holds logical stage r (local chunk 0, on the way down) and
stage 2n−1−r (chunk 1, on the way back), so rank 0 holds both the input stage
and the loss stage. The steady state runs fused `F&B` cells (a forward of one
chunk overlapped with a backward of the other); the warm-up and the tail split
some backwards into I and W so weight gradients fill the bubbles.

DualPipe: the model's n stages run twice, as two pipelines in opposite
directions: half the microbatches enter at rank 0 (logical stages 0..n−1, stage
s on rank s) and half at rank n−1 (logical stages n..2n−1, a copy of model stage
s on rank n−1−s). Each rank holds two copies of stage parameters and the copies'
gradients are summed. Ranks r and n−1−r run the DualPipeV order of half-rank
min(r, n−1−r) on n/2 half-ranks, mirrored: each chunk of DualPipeV is one
direction here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ._actions import Action, FusedAction, ScheduleError
from ._base import Schedule


class _RankWriter:
    """Appends one rank's cells, numbering microbatches per (chunk, kind) in order."""

    def __init__(self, stages: tuple[int, int], offsets: tuple[int, int] = (0, 0)):
        self.stages, self.offsets = stages, offsets
        self.next = {(c, k): 0 for c in (0, 1) for k in ("F", "B")}
        self.held: deque[Action] = deque()
        self.row: list = []

    def _take(self, chunk: int, kind: str) -> int:
        mb = self.next[(chunk, kind)]
        self.next[(chunk, kind)] = mb + 1
        return self.offsets[chunk] + mb

    def f(self, chunk: int) -> Action:
        return Action("F", self.stages[chunk], self._take(chunk, "F"))

    def b(self, chunk: int, split: bool = False) -> Action:
        mb = self._take(chunk, "B")
        if split:
            self.held.append(Action("W", self.stages[chunk], mb))
            return Action("I", self.stages[chunk], mb)
        return Action("B", self.stages[chunk], mb)

    def add(self, *cells) -> None:
        self.row.extend(cells)

    def add_weight(self) -> None:
        self.row.append(self.held.popleft())


def _dualpipe_v_row(rank: int, n: int, m: int, writer: _RankWriter | None = None) -> list:
    """DeepSeek's eight phases for `rank` of `n` (half-)ranks and `m` microbatches per chunk."""
    w = writer if writer is not None else _RankWriter((rank, 2 * n - 1 - rank))
    down = n - rank - 1  # ranks below this one on the way down
    # 1. fill: chunk-0 forwards until the V's far end can turn around
    for _ in range(2 * down):
        w.add(w.f(0))
    # 2. forwards of both chunks
    for _ in range(rank + 1):
        w.add(w.f(0), w.f(1))
    # 3. first chunk-1 backwards, split, their Ws at once
    for _ in range(down):
        w.add(w.b(1, split=True))
        w.add_weight()
        w.add(w.f(1))
    # 4. steady state: F0&B1, F1&B0 (the turning rank runs its first pair unfused)
    for i in range(m - 2 * n + rank + 1):
        if i == 0 and rank == n - 1:
            w.add(w.f(0), w.b(1))
        else:
            w.add(FusedAction((w.f(0), w.b(1))))
        w.add(FusedAction((w.f(1), w.b(0))))
    # 5. chunk-0 forwards done: B1, F1&B0
    for _ in range(down):
        w.add(w.b(1))
        w.add(FusedAction((w.f(1), w.b(0))))
    # 6. drain B1/B0; from the middle on the backwards are split and Ws held
    half = (rank + 1) // 2
    for i in range(rank + 1):
        w.add(w.b(1, split=i > half or (i == half and rank % 2 == 1)))
        w.add(w.b(0, split=i >= half))
    # 7. W then split B0, 8. the remaining Ws
    for _ in range(down):
        w.add_weight()
        w.add(w.b(0, split=True))
    while w.held:
        w.add_weight()
    return w.row


@dataclass(frozen=True)
class DualPipeV(Schedule):
    """DualPipeV (DeepSeek, 2025): V-shaped layout, fused F&B cells, split I/W tail.

    Needs m ≥ 2n. Bubble (n−1)(T_F&B + T_B − 3T_W) per rank (DeepSeek's
    (PP/2−1)(…) with PP = 2n stages); peak activations 2n+1 on rank 0
    ((stage, microbatch) pairs, a stage being half a rank's layers).
    """

    microbatches: int
    virtual_stages: int = field(default=2, init=False)
    layout = "v"
    splits_backward = True

    def _check_n(self, n):
        if self.microbatches < 2 * n:
            raise ScheduleError(
                f"DualPipeV: needs microbatches >= 2 * n (n = {n} ranks) so the V fills "
                f"before its steady state; received microbatches={self.microbatches}. "
                f"The smallest valid microbatches is {2 * n}."
            )

    def _rows(self, n):
        return [_dualpipe_v_row(r, n, self.microbatches) for r in range(n)]


@dataclass(frozen=True)
class DualPipe(Schedule):
    """DualPipe (DeepSeek, 2025): two pipelines in opposite directions over two copies of the
    model's n stages, fused F&B cells, split I/W tail.

    Needs an even n and an even m ≥ 2n; microbatches 0..m/2−1 enter at rank 0 (logical
    stages 0..n−1), m/2..m−1 at rank n−1 (stages n..2n−1, `model_stage(s) = s − n`).
    Bubble (n/2−1)(T_F&B + T_B − 3T_W) per rank, DeepSeek's (PP/2−1)(…) with PP = n;
    peak activations n+1 = PP+1 on every rank, each a whole model stage's.
    """

    microbatches: int
    virtual_stages: int = field(default=2, init=False)
    layout = "v"
    splits_backward = True

    def _check_n(self, n):
        m = self.microbatches
        if n % 2:
            raise ScheduleError(
                f"DualPipe: needs an even number of ranks (the two directions meet in the middle); "
                f"received n={n}. Use DualPipeV for an odd n."
            )
        if m % 2 or m < 2 * n:
            raise ScheduleError(
                f"DualPipe: needs an even microbatches >= 2 * n (n = {n} ranks; half the microbatches "
                f"enter from each end); received microbatches={m}. The smallest valid microbatches is "
                f"{2 * n}."
            )

    def model_stage(self, stage, n):
        return stage % n

    def microbatches_of(self, stage, n):
        half = self.microbatches // 2
        return range(0, half) if stage < n else range(half, self.microbatches)

    def stage_inputs(self, n):
        return tuple((s - 1,) if s % n else () for s in range(2 * n))

    def gradient_inputs(self, n):
        return tuple((s + 1,) if (s + 1) % n else () for s in range(2 * n))

    def _rows(self, n):
        half, m = n // 2, self.microbatches // 2
        rows = []
        for r in range(n):
            down, up = (r, 0), (2 * n - 1 - r, m)  # (logical stage, first microbatch) of each direction
            first, second = (down, up) if r < half else (up, down)
            writer = _RankWriter((first[0], second[0]), (first[1], second[1]))
            rows.append(_dualpipe_v_row(min(r, n - 1 - r), half, m, writer))
        return rows
