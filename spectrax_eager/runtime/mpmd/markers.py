"""`spx.runtime.mpmd.markers`: the stage markers, `sxstage_iter` (`spectrax_mpmd`'s, imported on
first use) and `sxstage_region`, and `stage_region_specs(jaxpr)`, the stage regions a traced
function opened (see `spx.runtime`)."""

from typing import Any

from ..._compat.paths import not_built
from ..._pipeline.entry_points import sxstage_region
from ..._pipeline.mpmd import mpmd_name
from ..._pipeline.regions import StageRegionSpec, stage_region_specs
from . import NOT_KEPT


def __getattr__(name: str) -> Any:
    if name == "sxstage_iter":  # the MPMD runtime's, imported on first use
        return mpmd_name(name)
    return not_built(__name__, NOT_KEPT)(name)


__all__ = ["StageRegionSpec", "stage_region_specs", "sxstage_iter", "sxstage_region"]  # noqa: F822
