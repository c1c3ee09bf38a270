"""`spx.runtime.types`: the mesh and array types of the pipeline runtime.

`MpMdMesh(jax_mesh, mpmd_axis_name)` builds the runtime's mesh (`spectrax_mpmd.MpmdMesh`,
imported on first use); `StagesArray` holds one array per pipeline rank.
"""

from __future__ import annotations

from typing import Any

from ..._compat.paths import not_built
from ..._compat.stages_array import StagesArray, abstract_stages_array
from ..._pipeline.mpmd import mpmd, mpmd_mesh_class

_MPMD_NAMES = ("MpMdMesh", "MpmdMesh")


#: What to use for `spectrax-lib`'s names of this path not kept here.
NOT_KEPT = (
    "stages are cut by spx.run (a `blocks` ModuleList, a PipelineSequential, assign_stage), and a mesh "
    "from spx.create_mesh(..., mpmd_axis=...) is its own MPMD view"
)


def __getattr__(name: str) -> Any:
    if name == "MpMdMesh":
        return mpmd_mesh_class()
    if name in _MPMD_NAMES:
        return getattr(mpmd(), name)
    return not_built(__name__, NOT_KEPT)(name)


__all__ = ["MpMdMesh", "MpmdMesh", "StagesArray", "abstract_stages_array"]  # noqa: F822 (module __getattr__)
