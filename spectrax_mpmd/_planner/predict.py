"""A candidate's predicted step: its table simulated with its measured cells on the compute units
the backend measured, the issuing thread among them (`spectrax_mpmd._planner.shared`); the
thread issues one call per run of a rank's cells the plan fuses (`issued_calls`).

Each cell runs for its work (`worked`: its measured time alone less its issuing,
which the issuing thread does ahead of the devices), once issued; one thread
issues every compiled call and host copy of the step; ranks and, on fake CPU
devices, the issuing thread share the measured compute units; then the
optimizer's update runs as the step's validation says. `limit` names the largest
of three lower bounds of that time, what sets it: the table on a device per rank
(`schedule`), the issuing alone (`host thread`), the work over the units
(`shared devices`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spectrax_core import schedules as S
from spectrax_core.schedules import StageCost, Timeline

from .._env import configured_fuse_cells, configured_run_ahead
from .backend import BackendCost, cell_work
from .issued import issued_calls
from .memory import run_ahead_bytes
from .optimizer import with_sync_copy
from .shared import shared_makespan

LIMITS = ("schedule", "host thread", "shared devices")


@dataclass(frozen=True)
class Predicted:
    """Peak device bytes per rank, predicted seconds per step, the simulated timeline, which
    lower bound sets the seconds (one of `LIMITS`), the seconds the update adds after the
    schedule's last cell in the simulation, and the table simulated on a device per rank, update
    included (the `schedule` bound)."""

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
    fused = issued_calls(schedule, n, configured_fuse_cells())

    def predict(memory, cost, copies: int = 0) -> Predicted:
        work = worked(cost, backend.call_issue_s)
        timeline = S.simulate(schedule, n, work, memory=memory)
        updated = S.with_update(timeline, update_s, validation=validation)
        update = updated.makespan - timeline.makespan
        cells = sum(cost.of(e.cell) > 0 for row in timeline.events for e in row)
        calls = min(cells, fused) + n  # a run of one rank's cells fused is one call
        issuing = calls * backend.call_issue_s + copies * backend.copy_issue_s
        per_cell = issuing / max(sum(map(len, timeline.events)), 1)
        units, shares = backend.parallelism, backend.shares_host
        seconds = shared_makespan(schedule, n, work, units, per_cell, shares) + update
        bounds = (updated.makespan, issuing, (sum(timeline.busy) + sum(update_s)) / units)
        limit = LIMITS[max(range(3), key=lambda j: bounds[j])]
        peaks = with_sync_copy(timeline.peak_bytes, memory, validation != "none")
        if bound is not None:
            peaks = tuple(p + e for p, e in zip(peaks, run_ahead_bytes(memory, schedule, n, bound)))
        return Predicted(peaks, seconds, timeline, limit, update, updated.makespan)

    return predict


def worked(cost: StageCost, issue_s: float) -> StageCost:
    """`cost` with each cell's work in place of its time alone: less `issue_s`, the issuing of
    its call, and at least 0 (`cell_work`; a cell that costs nothing stays at 0)."""
    return replace(cost, **{k: tuple(cell_work((t,), issue_s) for t in getattr(cost, k)) for k in "FBIW"})
