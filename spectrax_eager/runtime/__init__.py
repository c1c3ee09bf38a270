"""`spx.runtime`: the pipeline runtime's user-facing names in one place.

The schedule classes and the entry points (`sxjit`, `sxcall`, `sxgrad`,
`sxvalue_and_grad`, `sxvalue_and_grad_and_apply`, `sxstage_region`) are `spx`'s;
the stage marker `sxstage_iter` and the mesh type `MpmdMesh` (also built as
`MpMdMesh(jax_mesh, mpmd_axis_name)`) come from `spectrax_mpmd`, imported on first use.
`dualpipev_tasks` lists one rank's DualPipeV actions; `StagesArray` (in `types` too) holds
one array per pipeline rank; `stage_region_specs(jaxpr)` lists the stage regions a traced
function opened.
"""

from __future__ import annotations

from typing import Any

from spectrax_core.schedules import Action, FusedAction, Schedule

from .._compat import schedules as _schedules
from .._compat.schedules import *  # the schedule classes and dualpipev_tasks
from .._compat.stages_array import StagesArray, abstract_stages_array
from .._pipeline.entry_points import (
    sxgrad,
    sxjit,
    sxstage_region,
    sxvalue_and_grad,
    sxvalue_and_grad_and_apply,
)
from .._pipeline.mpmd import mpmd as _runtime_module  # `mpmd` here names the subpackage
from .._pipeline.mpmd import mpmd_mesh_class
from .._pipeline.regions import StageRegionSpec, stage_region_specs
from .._pipeline.sxcall import sxcall

#: The fused forward+backward cell of a schedule table (`FusedAction` here).
FusedTask = FusedAction

MPMD_NAMES = ("sxstage_iter", "MpmdMesh", "MpMdMesh")


def __getattr__(name: str) -> Any:
    if name == "MpMdMesh":
        return mpmd_mesh_class()
    if name in MPMD_NAMES:
        return getattr(_runtime_module(), name)
    raise AttributeError(f"module 'spectrax_eager.runtime' has no attribute {name!r}")


__all__ = [
    "Action",
    "FusedAction",
    "FusedTask",
    "MpMdMesh",
    "MpmdMesh",
    "Schedule",
    "StageRegionSpec",
    "StagesArray",
    "abstract_stages_array",
    "stage_region_specs",
    "sxcall",
    "sxgrad",
    "sxjit",
    "sxstage_iter",
    "sxstage_region",
    "sxvalue_and_grad",
    "sxvalue_and_grad_and_apply",
    *_schedules.__all__,
]
