"""Show a simulated `Timeline`: a per-rank text grid and Chrome-trace JSON (Perfetto)."""

from __future__ import annotations

import json
import math
import os

from ._timeline import Timeline

IDLE = "."
CONTINUED = "-"


def render_grid(timeline: Timeline, step: float | None = None, show_stage: bool | None = None) -> str:
    """One line per rank, one column per `step` cost units (default: the shortest cell).

    A cell is labelled in its first column by its kind as it ran (`Event.label`: `F3`, `B3`,
    `I3`, `W3`, fused `F3&B1`, a measured loss cell `FB3`);
    the further columns of a longer cell show `-`, idle columns `.`. With
    `show_stage` (default: when a rank holds several stages, or the stages are
    named) labels carry the stage too: its number (`5F3`) or its name (`V1F3`
    in a region pipeline). Raises `ValueError` if `step` is too coarse to give
    every cell its own column.
    """
    if not isinstance(timeline, Timeline):
        raise TypeError(
            f"render_grid: expected a Timeline (from simulate), received "
            f"{type(timeline).__name__}; call render_grid(simulate(schedule, n))."
        )
    durations = [e.end - e.start for row in timeline.events for e in row if e.end > e.start]
    if step is None:
        step = min(durations, default=1.0)
    if not step > 0:
        raise ValueError(f"render_grid: step must be > 0, received {step!r}.")
    if show_stage is None:
        show_stage = bool(timeline.stage_labels) or any(
            len({a.stage for e in row for a in e.cell.parts}) > 1 for row in timeline.events
        )
    names = timeline.stage_labels
    columns = math.ceil(round(timeline.makespan / step, 9))
    labels = [[IDLE] * columns for _ in range(timeline.n)]
    for r, row in enumerate(timeline.events):
        for e in row:
            first, last = round(e.start / step), round(e.end / step)
            if labels[r][first] != IDLE:
                raise ValueError(
                    f"render_grid: step={step} is too coarse: rank {r}'s cell {e.cell!r} at "
                    f"t={e.start} shares a column with the cell before it; pass a smaller step."
                )
            for c in range(first, max(last, first + 1)):
                labels[r][c] = e.label(names, show_stage) if c == first else CONTINUED
    width = max([len(x) for row in labels for x in row], default=1)
    name = f"rank {timeline.n - 1}"
    lines = [
        f"{f'rank {r}':<{len(name)}} | " + " ".join(x.ljust(width) for x in row).rstrip()
        for r, row in enumerate(labels)
    ]
    return "\n".join(lines)


def chrome_trace(timeline: Timeline, us_per_unit: float = 1000.0) -> dict:
    """The timeline as a Chrome-trace dict (open the saved JSON in Perfetto / chrome://tracing).

    One thread per rank; one complete event (`"ph": "X"`) per cell, named by stage, kind as it
    ran and microbatch (`Event.label`: `2F5`, a measured loss cell `3FB5`, or `V1F5` when the
    stages are named), its kind as category, with the stage(s) and microbatch(es) in `args`. One
    cost unit lasts `us_per_unit` microseconds on the trace's clock.
    """
    if not isinstance(timeline, Timeline):
        raise TypeError(
            f"chrome_trace: expected a Timeline (from simulate), received {type(timeline).__name__}."
        )
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": timeline.schedule_name}}
    ]
    for r in range(timeline.n):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
    for row in timeline.events:
        for e in row:
            parts = e.cell.parts
            events.append(
                {
                    "name": e.label(timeline.stage_labels),
                    "cat": e.kind,
                    "ph": "X",
                    "pid": 0,
                    "tid": e.rank,
                    "ts": e.start * us_per_unit,
                    "dur": (e.end - e.start) * us_per_unit,
                    "args": {
                        "actions": [repr(a) for a in parts],
                        "stage": [a.stage for a in parts],
                        "microbatch": [a.microbatch for a in parts],
                    },
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_chrome_trace(timeline: Timeline, path: str | os.PathLike, us_per_unit: float = 1000.0):
    """Write `chrome_trace(timeline)` as JSON to `path` and return the path."""
    with open(path, "w") as f:
        json.dump(chrome_trace(timeline, us_per_unit), f)
    return path
