"""`spectrax_eager.sharding.mesh`: `spectrax-lib`'s module path `spectrax.sharding.mesh`, for sharding
helpers (`spx.sharding`'s)."""

from typing import Any

from .._pipeline.meshes import cpu_context, create_cpu_mesh, create_mesh, parse_mesh_from_string
from .._pipeline.mpmd import mpmd_name
from .._sharding.mesh import (
    DEFAULT_MESH_AXIS_DIMS,
    DEFAULT_MESH_AXIS_NAMES,
    calculate_host_mesh_shape,
    force_cpu,
    use_mesh,
)
from .._sharding.rules import current_mesh


def __getattr__(name: str) -> Any:
    if name == "SpxMesh":  # the mesh type of `create_mesh`, imported on first use
        return mpmd_name(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_MESH_AXIS_DIMS",
    "DEFAULT_MESH_AXIS_NAMES",
    "SpxMesh",  # noqa: F822 (module __getattr__)
    "calculate_host_mesh_shape",
    "cpu_context",
    "create_cpu_mesh",
    "create_mesh",
    "current_mesh",
    "force_cpu",
    "parse_mesh_from_string",
    "use_mesh",
]
