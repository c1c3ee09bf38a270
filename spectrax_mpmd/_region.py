"""`sxstage_region`: a named branch of the model (a vision tower, a text tower) with its own
stage numbering and schedule.

A region is a JAX name scope (`jax.named_scope`), so every equation traced
inside it carries the region in its name stack and the splitter can tell which
branch it belongs to. Outside an MPMD trace that scope is all a region does:
the function runs unchanged under `jax.jit`, `jax.grad` or eagerly. While
`sxjit` / `sxvalue_and_grad` trace, a region also records its schedule with the
trace (`recording_regions`), and entering one name twice is an error.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator

import jax

from spectrax_core.schedules import GPipe, Region, RegionSchedule, ScheduleError

from .errors import MpmdError, StageSplitError

SCOPE_PREFIX = "sxstage_region:"
DEFAULT_REGION = "default"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_IN_SCOPE = re.compile(re.escape(SCOPE_PREFIX) + r"([A-Za-z_][A-Za-z0-9_\-]*)")
_recording: contextvars.ContextVar[dict | None] = contextvars.ContextVar("spectrax_regions", default=None)


class sxstage_region(contextlib.ContextDecorator):  # noqa: N801 - named like the other markers
    """Run the enclosed code (or the decorated function) as pipeline region `name`.

    Stage markers inside a region number its stages locally (V0, V1, ...); values
    that flow between regions become cross-region edges. `schedule` is the
    region's own schedule (default: the call's); every region runs the same
    number of microbatches. A no-op outside an MPMD trace.
    """

    def __init__(self, name: str, schedule=None):
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise StageSplitError(
                f"sxstage_region: name must be an identifier-like string (letters, digits, _ or -), "
                f"received {name!r}."
            )
        if name == DEFAULT_REGION:
            raise StageSplitError(
                f"sxstage_region: {DEFAULT_REGION!r} names the code outside every region; pick another name."
            )
        if schedule is not None and not hasattr(schedule, "actions"):
            raise StageSplitError(
                f"sxstage_region({name!r}): schedule must be a schedule object (e.g. GPipe(microbatches=4)) "
                f"or None for the call's, received {schedule!r}."
            )
        self.name, self.schedule = name, schedule
        self._scopes: list = []

    def __enter__(self):
        recorded = _recording.get()
        if recorded is not None:
            if self.name in recorded:
                raise StageSplitError(
                    f"sxstage_region({self.name!r}) is entered twice in one traced function; each region "
                    "is one block of code. Give the second block its own name."
                )
            recorded[self.name] = self.schedule
        scope = jax.named_scope(SCOPE_PREFIX + self.name)
        scope.__enter__()
        self._scopes.append(scope)
        return self

    def __exit__(self, *exc):
        return self._scopes.pop().__exit__(*exc)

    def __repr__(self) -> str:
        return f"sxstage_region({self.name!r}, schedule={self.schedule!r})"


@contextlib.contextmanager
def recording_regions() -> Iterator[dict]:
    """While tracing for the MPMD runtime: collect `{region name: schedule}` of the regions entered."""
    recorded: dict = {}
    token = _recording.set(recorded)
    try:
        yield recorded
    finally:
        _recording.reset(token)


def region_of(name_stack: str) -> str:
    """The innermost region named in an equation's name stack (`a/sxstage_region:vision/b`);
    `DEFAULT_REGION` when none. Nested regions are an error."""
    found = list(dict.fromkeys(_IN_SCOPE.findall(name_stack)))
    if len(found) > 1:
        raise StageSplitError(
            f"sxstage_region({found[1]!r}) is opened inside sxstage_region({found[0]!r}); regions do not "
            "nest. Close the outer region first, or make the inner one part of it."
        )
    return found[0] if found else DEFAULT_REGION


def region_schedule(graph, recorded: dict, schedule, n: int, region_ranks, owner: str) -> RegionSchedule:
    """The merged schedule of `graph`'s regions on `n` ranks.

    Each region runs its own schedule (`sxstage_region(schedule=)`, else the call's;
    GPipe over one microbatch when neither is given, for a plain forward). Ranks:
    `region_ranks[name]` when given; otherwise each region gets `stages / virtual
    stages` ranks of its own, in the order the regions' first stages run.
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
            ranks[name] = tuple(range(start, start + len(owned) // v))
            start += len(owned) // v
        if start != n:
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
