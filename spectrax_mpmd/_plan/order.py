"""The issue order of one step: every rank's actions merged into one dependency-respecting sequence."""

from __future__ import annotations

from typing import Any

from spectrax_core.schedules import DeadlockError, issue_order

from .._trace.graph import StageGraph
from ..errors import StageSplitError


class ScheduleStallError(StageSplitError, DeadlockError):
    """The stage graph's dependencies stall the schedule's table (no rank can proceed)."""


def order_actions(schedule, n: int, graph: StageGraph) -> list[tuple[int, Any]]:
    """Merge the per-rank action lists into one issue order that respects data dependencies.

    Round-robin over ranks, one action at a time, keeping each rank's own order;
    an action waits until everything it reads (`graph.flow()`) has been issued.
    """
    try:
        return issue_order(schedule.actions(n), graph.flow())
    except DeadlockError as err:
        stuck = {s.rank: str(s.cell) for s in err.stuck}
        raise ScheduleStallError(
            f"schedule {schedule!r} cannot run this pipeline: no rank can proceed "
            f"(next actions {stuck}); the stage graph's dependencies conflict with the table.",
            err.stuck,
        ) from None
