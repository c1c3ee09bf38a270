"""Loop-layout schedules: rank r holds stages r, r+n, …, r+(v−1)n.

InterleavedH1 (Megatron interleaved 1F1B), Interleaved1F1BPlusOne and KimiK2
(one more warm-up forward so each steady forward is independent of the
backward paired with it; KimiK2 runs each pair as one fused cell), and
InterleavedGPipe (GPipe over the v·n logical stages).

The 1F1B variants walk microbatches in rounds of n: within a round every
chunk runs forward over the round's microbatches, chunk by chunk, so a
microbatch leaving rank n−1 re-enters rank 0 just as rank 0 needs it. That
needs m ≥ n; when n does not divide m the last round is shorter (a valid
grouping, with a small extra bubble).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ._actions import Action, FusedAction, ScheduleError
from ._base import Schedule, check_count


def _round_sizes(n: int, m: int) -> list[int]:
    """Rounds of n microbatches; the first round also takes the m mod n left over.

    A round of s ≥ n microbatches keeps the loop full (a microbatch leaving rank
    n−1 re-enters rank 0 no earlier than rank 0 needs it). Putting the longer
    round first lets the warm-up cover it, so no backward overtakes its forward.
    """
    return [n + m % n] + [n] * (m // n - 1)


def _round_order(n: int, m: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """(local chunk, microbatch) visiting order of one rank, round by round."""
    order = []
    first = 0
    for size in _round_sizes(n, m):
        chunks = range(v - 1, -1, -1) if backward else range(v)
        for c in chunks:
            order.extend((c, first + j) for j in range(size))
        first += size
    return order


def _interleaved_1f1b_row(rank: int, n: int, m: int, v: int, extra: int, fuse: bool) -> list:
    """Warm-up 2(n−r−1) + (v−1)·(first round) + `extra` forwards, 1F1B pairs, cool-down."""
    fwd = [Action("F", c * n + rank, mb) for c, mb in _round_order(n, m, v, False)]
    bwd = [Action("B", c * n + rank, mb) for c, mb in _round_order(n, m, v, True)]
    total = m * v
    first_round = _round_sizes(n, m)[0]
    warmup = min(2 * (n - rank - 1) + (v - 1) * first_round + extra, total)
    row: list = list(fwd[:warmup])
    for k in range(total - warmup):
        f, b = fwd[warmup + k], bwd[k]
        row.extend([FusedAction((f, b))] if fuse else [f, b])
    row.extend(bwd[total - warmup :])
    return row


class _Loop(Schedule):
    """Shared checks of the loop-layout schedules: v ≥ 2, and m ≥ n if `needs_full_rounds`."""

    layout = "loop"
    needs_full_rounds = True

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        check_count(name, "virtual_stages", self.virtual_stages, 2)

    def _check_n(self, n):
        if self.needs_full_rounds and self.microbatches < n:
            raise ScheduleError(
                f"{type(self).__name__}: interleaving walks microbatches in rounds of n = {n} "
                f"(one per rank), so it needs microbatches >= n; received "
                f"microbatches={self.microbatches}. The smallest valid microbatches is {n} "
                "(or use Std1F1B / InterleavedGPipe for fewer microbatches)."
            )


@dataclass(frozen=True)
class _Interleaved1F1B(_Loop):
    """Interleaved 1F1B rows (`_interleaved_1f1b_row`): `extra` more warm-up forwards per rank,
    and each steady F/B pair one fused cell when `fuse`."""

    microbatches: int
    virtual_stages: int = 2
    extra: ClassVar[int] = 0
    fuse: ClassVar[bool] = False

    def _rows(self, n):
        m, v = self.microbatches, self.virtual_stages
        return [_interleaved_1f1b_row(r, n, m, v, self.extra, self.fuse) for r in range(n)]


@dataclass(frozen=True)
class InterleavedH1(_Interleaved1F1B):
    """Megatron interleaved 1F1B (Narayanan et al. 2021) with v chunks per rank.

    Bubble (n−1)(T_F+T_B) per rank in chunk costs, i.e. 1/v of 1F1B's.
    Needs m ≥ n.
    """


@dataclass(frozen=True)
class Interleaved1F1BPlusOne(_Interleaved1F1B):
    """Interleaved 1F1B with one more warm-up forward per rank.

    In the steady state the forward issued next to a backward is then never of
    the backward's microbatch, so the two are independent and may overlap (for
    example a transfer of one with the compute of the other). Needs m ≥ n.
    """

    extra = 1


@dataclass(frozen=True)
class KimiK2(_Interleaved1F1B):
    """Interleaved 1F1B plus one, with each steady F/B pair fused into one `F&B` cell.

    The order of the Kimi K2 training report: an extra warm-up microbatch makes
    every steady forward independent of its paired backward, so each pair runs
    as one overlapped cell. Needs m ≥ n.
    """

    extra, fuse = 1, True


@dataclass(frozen=True)
class InterleavedGPipe(_Loop):
    """GPipe over the v·n logical stages of the loop layout.

    Each rank runs every forward of its first chunk, then of the next, …, then
    the backwards chunk by chunk in reverse. Any m ≥ 1 works; bubble
    (n−1)(T_F+T_B) per rank in chunk costs when m ≥ n; peak activations m·v.
    """

    microbatches: int
    virtual_stages: int = 2
    needs_full_rounds = False

    def _rows(self, n):
        m, v = self.microbatches, self.virtual_stages
        rows = []
        for r in range(n):
            row = [Action("F", c * n + r, mb) for c in range(v) for mb in range(m)]
            row += [Action("B", c * n + r, mb) for c in range(v - 1, -1, -1) for mb in range(m)]
            rows.append(row)
        return rows
