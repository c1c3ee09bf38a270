"""The facade's way to the MPMD runtime: `spectrax_mpmd`, imported on first use.

`import spectrax_eager` never imports `spectrax_mpmd`; only `_pipeline` does, inside the
functions that pipeline (or make an MPMD mesh). Code elsewhere in the facade that needs the
runtime (an `spx.jit` on an MPMD mesh, the names `spx` takes from it) asks here.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

#: `spx` names that are `spectrax_mpmd`'s own objects, resolved on first access.
MPMD_NAMES = (
    "sxstage_iter",
    "gather",
    "stage_sizes",
    "MpmdMesh",
)


def mpmd() -> ModuleType:
    """The `spectrax_mpmd` module (imported now if it was not)."""
    import spectrax_mpmd

    return spectrax_mpmd


def mpmd_name(name: str) -> Any:
    """`spectrax_mpmd`'s object for the `spx` name `name` (a name of `MPMD_NAMES`), or `SpxMesh`,
    the mesh type of `spx.create_mesh` (a `spectrax_mpmd.MpmdMesh`)."""
    if name == "SpxMesh":
        return spx_mesh_class()
    return getattr(mpmd(), name)


def spx_mesh_class() -> type:
    """`SpxMesh`, the mesh type of `spx.create_mesh` (imported now if it was not)."""
    from .spx_mesh import SpxMesh

    return SpxMesh


def mpmd_mesh_class() -> type:
    """`MpMdMesh`: the runtime's mesh built as `MpMdMesh(jax_mesh, mpmd_axis_name)`."""
    from .spx_mesh import MpMdMesh

    return MpMdMesh
