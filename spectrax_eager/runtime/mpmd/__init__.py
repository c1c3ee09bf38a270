"""`spx.runtime.mpmd`: where the seed library keeps its MPMD marker helpers (`markers`)."""

from ..._pipeline.regions import StageRegionSpec, stage_region_specs

__all__ = ["StageRegionSpec", "stage_region_specs"]
