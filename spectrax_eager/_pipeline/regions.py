"""`stage_region_specs`: the stage regions a traced function opened, read back from its jaxpr.

A region (`spx.sxstage_region(name)`) is a JAX name scope, so every equation traced inside it
carries the region's name; `spectrax_mpmd.regions_in` lists them.
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
    import spectrax_mpmd as mp

    return [StageRegionSpec(name) for name in mp.regions_in(jaxpr)]
