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
ALIASES = {"SpxMesh": "MpmdMesh"}  # seed name -> spectrax_mpmd name


def mpmd() -> ModuleType:
    """The `spectrax_mpmd` module (imported now if it was not)."""
    import spectrax_mpmd

    return spectrax_mpmd


def mpmd_name(name: str) -> Any:
    """`spectrax_mpmd`'s object for the `spx` name `name` (a name of `MPMD_NAMES` or `SpxMesh`)."""
    return getattr(mpmd(), ALIASES.get(name, name))


def mpmd_mesh_class() -> type:
    """`MpMdMesh`: the runtime's mesh built as `MpMdMesh(jax_mesh, mpmd_axis_name)`."""
    from spectrax_mpmd._mesh import MpMdMesh

    return MpMdMesh
