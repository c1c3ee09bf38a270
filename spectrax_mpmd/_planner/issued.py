"""How many compiled calls one thread issues for a schedule's step, with consecutive cells of one
rank fused into one program as the plan fuses them (`spectrax_mpmd._plan.fusion`).

In the issue order (`spectrax_core.schedules.issue_order`), a cell joins the run of the cell
issued just before it when both are on the same rank and that cell sent nothing to another rank
(a value moving between two stages of one rank is no step); a run holds at most `limit` cells,
and its ends leave out cells whose program (their rank, kinds and stages) also runs alone.
"""

from __future__ import annotations

from spectrax_core.schedules import issue_order

from .._plan.fusion import trimmed


def _sends_away(schedule, n: int, cell) -> bool:
    """Whether `cell` makes a value another rank reads: a forward's output for the next stage, a
    backward's (or I's) input cotangent for the stage before."""
    stages = schedule.virtual_stages * n
    for part in cell.parts:
        if part.kind == "F":
            other = part.stage + 1 if part.stage + 1 < stages else None
        elif part.kind in ("B", "I"):
            other = part.stage - 1 if part.stage > 0 else None
        else:
            other = None
        if other is not None and schedule.rank_of(other, n) != schedule.rank_of(part.stage, n):
            return True
    return False


def issued_calls(schedule, n: int, limit: int) -> int:
    """The compiled calls issued for the schedule's cells on `n` ranks, runs of at most `limit`
    cells fused, less the cells at a run's ends whose program also runs alone (`trimmed`)."""
    order = issue_order(schedule.actions(n), schedule.flow(n))
    spans, start = [], 0
    for k in range(1, len(order) + 1):
        joins = (
            k < len(order)
            and order[k][0] == order[k - 1][0]
            and not _sends_away(schedule, n, order[k - 1][1])
            and k - start < limit
        )
        if not joins:
            if k - start > 1:
                spans.append((start, k))
            start = k
    programs = [(rank, tuple((part.kind, part.stage) for part in cell.parts)) for rank, cell in order]
    spans = trimmed(spans, programs)
    return len(order) - sum(end - first - 1 for first, end in spans)
