"""`stage_region_specs(jaxpr)`: the stage regions a traced function opened (see `spx.runtime`)."""

from ..._pipeline.regions import StageRegionSpec, stage_region_specs

__all__ = ["StageRegionSpec", "stage_region_specs"]
