"""Merge a traced function's regions into one schedule: each region's own schedule on its ranks.

The trace-time half of regions (`sxstage_region`, recording each region's
schedule) is `spectrax_mpmd._trace.region`; this pass places the regions on
ranks and builds the `RegionSchedule` the plan runs.
"""

from __future__ import annotations

from spectrax_core.schedules import GPipe, Region, RegionSchedule, ScheduleError

from .._trace.region import DEFAULT_REGION
from ..errors import MpmdError, StageSplitError


def region_schedule(graph, recorded: dict, schedule, n: int, region_ranks, owner: str) -> RegionSchedule:
    """The merged schedule of `graph`'s regions on `n` ranks.

    Each region runs its own schedule (`sxstage_region(schedule=)`, else the call's;
    GPipe over one microbatch when neither is given, for a plain forward). Ranks:
    `region_ranks[name]` when given; otherwise each region gets `stages / virtual
    stages` consecutive ranks, in the order the regions' first stages run, each region
    starting on the rank after the previous region's last; when the regions need more
    ranks than the mesh has, the count wraps around to rank 0 (regions then share ranks).
    """
    stages: dict[str, list[int]] = {}
    for s, (region, _) in sorted(enumerate(graph.stage_regions), key=lambda x: x[1][1]):
        stages.setdefault(region, []).append(s)
    stages = {name: stages[name] for name in sorted(stages, key=lambda name: min(stages[name]))}
    schedules = {}
    for name in stages:
        if name != DEFAULT_REGION and name not in recorded:
            raise StageSplitError(
                f"{owner}: region {name!r} was traced inside a function JAX had already compiled, so its "
                "schedule is unknown; open sxstage_region in the traced function itself, not inside a "
                "jax.jit-compiled helper."
            )
        chosen = recorded.get(name) or schedule
        schedules[name] = chosen if chosen is not None else GPipe(microbatches=1)
    ranks = _region_ranks(stages, schedules, n, region_ranks, owner)
    regions = tuple(Region(name, schedules[name], ranks[name], tuple(stages[name])) for name in stages)
    edges = tuple(dict.fromkeys((e.src, e.dst) for e in graph.edges))
    gradient_edges = tuple(dict.fromkeys((e.src, e.dst) for e in graph.edges if e.differentiable))
    try:
        merged = RegionSchedule(regions, edges, gradient_edges)
        merged.validate(n)
    except ScheduleError as err:
        raise MpmdError(f"{owner}: {err}") from None
    return merged


def _region_ranks(stages: dict, schedules: dict, n: int, region_ranks, owner: str) -> dict:
    if region_ranks is None:
        ranks, start = {}, 0
        for name, owned in stages.items():
            v = schedules[name].virtual_stages
            if len(owned) % v:
                raise MpmdError(
                    f"{owner}: region {name!r} has {len(owned)} stage(s), which {schedules[name]!r} cannot "
                    f"spread over whole ranks ({v} virtual stages per rank); add or remove markers in it."
                )
            if len(owned) // v > n:
                raise MpmdError(
                    f"{owner}: region {name!r} needs {len(owned) // v} pipeline ranks (one per "
                    f"{v} of its {len(owned)} stage(s)) but the mesh has {n}; remove markers in it or "
                    "use a mesh with more pipeline ranks."
                )
            ranks[name] = tuple((start + k) % n for k in range(len(owned) // v))
            start += len(owned) // v
        if start < n:
            need = ", ".join(f"{name}: {len(r)}" for name, r in ranks.items())
            raise MpmdError(
                f"{owner}: the regions need {start} pipeline ranks ({need}) but the mesh has {n}; give "
                "each region its own ranks with region_ranks={name: (rank, ...)} (ranks may be shared), "
                "or change the regions' markers or the mesh."
            )
        return ranks
    if not isinstance(region_ranks, dict):
        raise MpmdError(
            f"{owner}: region_ranks must be a dict {{region name: (rank, ...)}}, got {region_ranks!r}."
        )
    unknown = sorted(set(region_ranks) - set(stages))
    missing = [name for name in stages if name not in region_ranks]
    if unknown or missing:
        raise MpmdError(
            f"{owner}: region_ranks names {sorted(region_ranks)} but the function's regions are "
            f"{list(stages)} ({DEFAULT_REGION!r} is the code outside every region); give exactly those."
        )
    ranks = {}
    for name in stages:
        given = tuple(region_ranks[name]) if isinstance(region_ranks[name], (tuple, list)) else ()
        if not given or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n for r in given):
            raise MpmdError(
                f"{owner}: region_ranks[{name!r}] must be a non-empty tuple of pipeline ranks in 0..{n - 1}, "
                f"got {region_ranks[name]!r}."
            )
        if len(set(given)) != len(given):
            raise MpmdError(f"{owner}: region_ranks[{name!r}] lists a rank twice: {given}.")
        ranks[name] = given
    unused = sorted(set(range(n)) - {r for given in ranks.values() for r in given})
    if unused:
        raise MpmdError(
            f"{owner}: pipeline rank(s) {unused} hold no region's stage; give them to a region in "
            "region_ranks, or use a mesh with fewer pipeline ranks."
        )
    return ranks
