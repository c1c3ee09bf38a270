"""A measured step as a `spectrax_core.schedules.Timeline`, so the simulator's renderers apply."""

from __future__ import annotations

from collections.abc import Sequence

from spectrax_core.schedules import Cost, Event, Timeline


def measured_timeline(
    spans: Sequence[tuple[int, object, float, float]], n: int, name: str, stage_labels: tuple[str, ...] = ()
) -> Timeline:
    """`(rank, action, start_s, end_s)` spans as a Timeline in microseconds."""
    rows: list[list[Event]] = [[] for _ in range(n)]
    for rank, action, start, end in spans:
        rows[rank].append(Event(rank, action, start * 1e6, end * 1e6))
    makespan = max((e.end for row in rows for e in row), default=0.0)
    busy = tuple(sum(e.end - e.start for e in row) for row in rows)
    idle = tuple(makespan - b for b in busy)
    return Timeline(
        schedule_name=f"{name} (measured)",
        n=n,
        cost=Cost(),
        events=tuple(tuple(row) for row in rows),
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_fraction=sum(idle) / (n * makespan) if makespan else 0.0,
        peak_activations=(0,) * n,
        stage_labels=stage_labels,
    )
