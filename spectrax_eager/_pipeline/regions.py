"""`stage_region_specs`: the stage regions a traced function opened, read back from its jaxpr.

A region (`spx.sxstage_region(name)`) is a JAX name scope, so every equation traced inside it
carries the region's name; this lists those names in the order the jaxpr first reaches them,
nested jaxprs (loop bodies, calls) included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StageRegionSpec:
    """One stage region of a jaxpr: its `name` (the schedule is the call's, not the jaxpr's)."""

    name: str


def stage_region_specs(jaxpr: Any) -> list[StageRegionSpec]:
    """The regions `jaxpr` (a `Jaxpr` or `ClosedJaxpr`, e.g. `jax.make_jaxpr(fn)(...)`) was traced
    in, each once, in the order its equations first enter them."""
    from spectrax_mpmd._trace.jaxpr import name_stack, sub_jaxprs
    from spectrax_mpmd._trace.region import DEFAULT_REGION, region_of

    names: dict[str, None] = {}

    def walk(j: Any) -> None:
        for eqn in getattr(j, "jaxpr", j).eqns:
            region = region_of(name_stack(eqn))
            if region != DEFAULT_REGION:
                names.setdefault(region)
            for sub in sub_jaxprs(eqn):
                walk(sub)

    walk(jaxpr)
    return [StageRegionSpec(n) for n in names]
