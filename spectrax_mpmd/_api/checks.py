"""What a traced function's settings come to once its trace is known: how many microbatches it
splits into, and the schedule it runs."""

from __future__ import annotations

from collections.abc import Callable

from .._plan.regions import region_schedule
from .._settings import StepSettings
from .._trace.region import DEFAULT_REGION
from ..errors import MpmdError

WITHOUT_SCHEDULE = (
    "schedule= may be omitted only when every stage sits in an sxstage_region with its own "
    "schedule (sxstage_region(name, schedule=...)); "
)


def pipeline_schedule(settings: StepSettings, schedule_error: MpmdError | None, graph, regions: dict):
    """The schedule a traced function with `settings` runs: theirs, or its regions' merged into
    one. `schedule_error` is `settings.schedule_error()`, raised when no region replaces it.

    Called twice: before the split with no graph (the trace opened no region, so the
    call's schedule must be valid on every rank) and after it."""
    name = settings.name
    if graph is not None and graph.has_regions:
        outside = any(region == DEFAULT_REGION for region, _ in graph.stage_regions)
        if settings.schedule is None and outside and settings.microbatched:
            raise MpmdError(
                f"{name}: {WITHOUT_SCHEDULE}some stages run outside every region; wrap that code "
                "in a region too, or pass schedule= (the schedule of the code outside the regions)."
            )
        n = settings.pipeline_mesh.mpmd_dim
        return region_schedule(graph, regions, settings.schedule, n, settings.region_ranks, name)
    if graph is None and regions:
        return None
    if settings.region_ranks is not None:
        raise MpmdError(
            f"{name}: region_ranks places sxstage_regions, but the function opens none; "
            "drop region_ranks or wrap each branch in `with sxstage_region(name):`."
        )
    if schedule_error is not None:
        raise schedule_error
    return settings.schedule


def microbatches(settings: StepSettings, regions: Callable[[], dict]) -> int:
    """How many microbatches a call splits its batch into: its schedule's or, with `schedule=`
    omitted, its regions' (`regions()` gives the `sxstage_region`s the function opens, read
    from its trace; every region must name a schedule, all with the same microbatches)."""
    name = settings.name
    if settings.schedule is not None:
        return settings.schedule.microbatches
    regions = regions()
    unnamed = sorted(region for region, schedule in regions.items() if schedule is None)
    if not regions or unnamed:
        where = f"region(s) {unnamed} name none" if unnamed else "the function opens no region"
        raise MpmdError(f"{name}: {WITHOUT_SCHEDULE}{where}. Pass schedule=, e.g. Std1F1B(microbatches=8).")
    counts = {schedule.microbatches for schedule in regions.values()}
    if len(counts) != 1:
        raise MpmdError(
            f"{name}: the regions' schedules split the batch into {sorted(counts)} microbatches; "
            "every region runs the same number, so give each region's schedule the same microbatches=."
        )
    return counts.pop()
