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

from spectrax_core.schedules import Schedule

from ..errors import StageSplitError
from .jaxpr import name_stack, sub_jaxprs

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
        if schedule is not None and not isinstance(schedule, Schedule):
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


def regions_in(jaxpr) -> tuple[str, ...]:
    """The `sxstage_region`s `jaxpr` (a `Jaxpr` or `ClosedJaxpr`, e.g. `jax.make_jaxpr(fn)(...)`)
    was traced in, each once, in the order its equations first enter them (nested jaxprs, loop
    bodies and calls, included)."""
    names: dict[str, None] = {}

    def walk(j) -> None:
        for eqn in getattr(j, "jaxpr", j).eqns:
            region = region_of(name_stack(eqn))
            if region != DEFAULT_REGION:
                names.setdefault(region)
            for sub in sub_jaxprs(eqn):
                walk(sub)

    walk(jaxpr)
    return tuple(names)
