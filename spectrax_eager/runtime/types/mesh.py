"""`spx.runtime.types.mesh`: `MpMdMesh(jax_mesh, mpmd_axis_name)`, the runtime's mesh
(`spectrax_mpmd`'s, imported on first use)."""

from typing import Any

from ..._compat.paths import not_built
from ..._pipeline.mpmd import mpmd_mesh_class
from . import NOT_KEPT


def __getattr__(name: str) -> Any:
    if name == "MpMdMesh":
        return mpmd_mesh_class()
    return not_built(__name__, NOT_KEPT)(name)


__all__ = ["MpMdMesh"]  # noqa: F822 (module __getattr__)
