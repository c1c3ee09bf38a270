"""Checks shared by the entry points: the mesh, the schedule, and the schedule a trace runs."""

from __future__ import annotations

from collections.abc import Callable

from .._mesh import MpmdMesh, as_mpmd_mesh
from .._plan.regions import region_schedule
from .._trace.region import DEFAULT_REGION
from ..errors import MpmdError

WITHOUT_SCHEDULE = (
    "schedule= may be omitted only when every stage sits in an sxstage_region with its own "
    "schedule (sxstage_region(name, schedule=...)); "
)


def check_mesh(name: str, mesh) -> MpmdMesh:
    mesh = as_mpmd_mesh(mesh)
    if not mesh.is_mpmd:
        raise MpmdError(
            f"{name}: the mesh has no pipeline axis; build it with "
            "create_mesh(..., mpmd_axis='pp') (or pass a jax Mesh with a 'pp' axis)."
        )
    return mesh


def check_weight_fn(name: str, weight_fn, reduce: str | None):
    """`microbatch_weight_fn`: None or a callable, which replaces the reduction."""
    if weight_fn is None:
        return None
    if not callable(weight_fn):
        raise MpmdError(
            f"{name}: microbatch_weight_fn must be a function with the loss function's signature "
            f"returning one microbatch's weight, got {type(weight_fn).__name__}."
        )
    if reduce is not None:
        raise MpmdError(
            f"{name}: microbatch_weight_fn gives the weighted mean sum(w_i * loss_i) / sum(w_i); it "
            f"does not combine with reduce={reduce!r}. Drop one of them."
        )
    return weight_fn


def check_reduce(name: str, reduce) -> None:
    if reduce not in (None, "mean", "sum"):
        raise MpmdError(
            f"{name}: reduce must be None (the whole batch's loss, proven exact or refused), 'mean' "
            f"(the mean of the microbatch losses) or 'sum' (their sum), got {reduce!r}."
        )


def check_schedule(name: str, schedule, n: int) -> tuple[int, MpmdError | None]:
    """The schedule's virtual stages, and the error its table gives on all `n` ranks: raised at
    the first call unless the function has regions (each region's schedule is then checked
    on its own ranks)."""
    if schedule is None:
        return 1, None
    if not hasattr(schedule, "actions"):
        raise MpmdError(
            f"{name}: schedule must be a schedule object (e.g. Std1F1B(microbatches=8)), got {schedule!r}."
        )
    try:
        schedule.validate(n)
    except ValueError as err:
        return schedule.virtual_stages, MpmdError(
            f"{name}: schedule {schedule!r} is not valid for {n} pipeline ranks: {err}"
        )
    return schedule.virtual_stages, None


def pipeline_schedule(function, graph, regions: dict):
    """The schedule a traced function runs: the call's, or its regions' merged into one.

    Called twice: before the split with no graph (the trace opened no region, so the
    call's schedule must be valid on every rank) and after it."""
    if graph is not None and graph.has_regions:
        outside = any(region == DEFAULT_REGION for region, _ in graph.stage_regions)
        if function.schedule is None and outside and getattr(function, "microbatched", True):
            raise MpmdError(
                f"{function.name}: {WITHOUT_SCHEDULE}some stages run outside every region; wrap that code "
                "in a region too, or pass schedule= (the schedule of the code outside the regions)."
            )
        return region_schedule(
            graph, regions, function.schedule, function.mesh.mpmd_dim, function.region_ranks, function.name
        )
    if graph is None and regions:
        return None
    if function.region_ranks is not None:
        raise MpmdError(
            f"{function.name}: region_ranks places sxstage_regions, but the function opens none; "
            "drop region_ranks or wrap each branch in `with sxstage_region(name):`."
        )
    if function.schedule_error is not None:
        raise function.schedule_error
    return function.schedule


def microbatches(name: str, schedule, regions: Callable[[], dict]) -> int:
    """How many microbatches a call splits its batch into: its schedule's or, with `schedule=`
    omitted, its regions' (`regions()` gives the `sxstage_region`s the function opens, read
    from its trace; every region must name a schedule, all with the same microbatches)."""
    if schedule is not None:
        return schedule.microbatches
    regions = regions()
    unnamed = sorted(name for name, schedule in regions.items() if schedule is None)
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
