"""A candidate's predicted step: the schedule simulated with its measured cells, and the two
limits the backend sets on top of it (`spectrax_mpmd._planner.backend`).

The simulation runs each rank's cells in table order on a device of its own, each
cell for its work (`worked`: its measured time alone less its issuing, which the
issuing thread does ahead of the devices), then the optimizer's update as the
step's validation says. Two measured limits bound it from below: one thread
issues every compiled call and host copy of the step (`host thread`), and ranks
that share compute (fake CPU devices on a few cores) run their cells' total work
no faster than the measured ranks-at-once allow (`shared devices`). The
prediction is the largest of the three, named in `limit`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spectrax_core import schedules as S
from spectrax_core.schedules import StageCost, Timeline

from .._env import configured_run_ahead
from .backend import BackendCost, cell_work
from .memory import run_ahead_bytes
from .optimizer import with_sync_copy

LIMITS = ("schedule", "host thread", "shared devices")


@dataclass(frozen=True)
class Predicted:
    """Peak device bytes per rank, predicted seconds per step, the simulated timeline, which
    limit set the seconds (one of `LIMITS`), the seconds the update adds after the schedule's
    last cell in the simulation, and the simulated step alone (the `schedule` limit)."""

    peaks: tuple[int, ...]
    seconds: float
    timeline: Timeline
    limit: str
    update_s: float
    schedule_s: float


def predictor(schedule, n: int, update_s, validation: str, backend: BackendCost):
    """`predict(memory, cost, copies=0) -> Predicted` for `schedule` on `n` ranks, `copies` the
    host copies per step: the update runs as `validation` says
    (`spectrax_core.schedules.with_update`); gated, a rank holds its reduced gradients until
    the verdict (`with_sync_copy`); with a run-ahead bound (the default on an accelerator) its
    queued cells' bytes are added (`run_ahead_bytes`)."""
    bound = configured_run_ahead()

    def predict(memory, cost, copies: int = 0) -> Predicted:
        timeline = S.simulate(schedule, n, worked(cost, backend.call_issue_s), memory=memory)
        updated = S.with_update(timeline, update_s, validation=validation)
        calls = sum(cost.of(e.cell) > 0 for row in timeline.events for e in row) + n
        bounds = (
            updated.makespan,
            calls * backend.call_issue_s + copies * backend.copy_issue_s,
            (sum(timeline.busy) + sum(update_s)) / backend.parallelism,
        )
        k = max(range(3), key=lambda j: bounds[j])
        peaks = with_sync_copy(timeline.peak_bytes, memory, validation != "none")
        if bound is not None:
            peaks = tuple(p + e for p, e in zip(peaks, run_ahead_bytes(memory, schedule, n, bound)))
        update = updated.makespan - timeline.makespan
        return Predicted(peaks, bounds[k], timeline, LIMITS[k], update, updated.makespan)

    return predict


def worked(cost: StageCost, issue_s: float) -> StageCost:
    """`cost` with each cell's work in place of its time alone: less `issue_s`, the issuing of
    its call, and at least 0 (`cell_work`; a cell that costs nothing stays at 0)."""
    return replace(cost, **{k: tuple(cell_work((t,), issue_s) for t in getattr(cost, k)) for k in "FBIW"})
