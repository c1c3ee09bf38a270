"""Meshes as `spx.sharding` sees them: the default axes, the active mesh, entering one, axis
sizes (an MPMD mesh's pipeline axis places programs, so it never shards an array here), and a
stage's submesh. They work on plain jax meshes and on `spectrax_mpmd` meshes alike."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from .rules import as_jax_mesh, current_mesh

DEFAULT_MESH_AXIS_DIMS: tuple[int, ...] = (1, 1, -1, 1, 1, 1)
DEFAULT_MESH_AXIS_NAMES: tuple[str, ...] = ("pp", "dp", "fsdp", "ep", "tp", "sp")


def calculate_host_mesh_shape(
    global_mesh_shape: Sequence[int], total_devices: int | None = None, num_processes: int | None = None
) -> tuple[int, ...]:
    """The part of `global_mesh_shape` one process holds: processes split the leading axes first."""
    total_devices = jax.local_device_count() if total_devices is None else total_devices
    num_processes = jax.process_count() if num_processes is None else num_processes
    if math.prod(global_mesh_shape) != total_devices * num_processes:
        raise ValueError(
            f"calculate_host_mesh_shape: the mesh {tuple(global_mesh_shape)} has "
            f"{math.prod(global_mesh_shape)} devices, but {num_processes} processes x {total_devices} "
            "devices are available."
        )
    left, out = num_processes, []
    for dim in global_mesh_shape:
        share = math.gcd(dim, left)
        out.append(dim // share)
        left //= share
    if left != 1:
        raise ValueError(
            f"calculate_host_mesh_shape: {num_processes} processes do not tile {global_mesh_shape}."
        )
    return tuple(out)


@contextlib.contextmanager
def use_mesh(mesh: Any) -> Iterator[Any]:
    """Enter `mesh` (a jax `Mesh` or an `spx.create_mesh` mesh) for the block, as `with mesh:`
    does (a pipeline mesh enters itself); yields it."""
    with mesh if getattr(mesh, "is_mpmd", False) else jax.set_mesh(to_jax_mesh(mesh)):
        yield mesh


@contextlib.contextmanager
def force_cpu() -> Iterator[jax.Device]:
    """Run the block's computations on the first CPU device; yields it."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        yield cpu


def to_jax_mesh(mesh: Any) -> Mesh | None:
    """The `jax.sharding.Mesh` of `mesh` (an MPMD mesh's `jax_mesh`); None stays None."""
    return None if mesh is None else getattr(mesh, "jax_mesh", mesh)


def get_incontext_mesh(raise_error: bool = True) -> Mesh | None:
    """The active mesh; with none, an error (or None when `raise_error=False`)."""
    mesh = current_mesh()
    if mesh is None and raise_error:
        raise ValueError(
            "no mesh is active; enter one with `with mesh:` (spx.create_mesh) or jax.set_mesh(mesh)."
        )
    return mesh


def spmd_sizes(mesh: Any) -> dict[str, int]:
    """Axis sizes usable for sharding an array: all but an MPMD mesh's pipeline axis."""
    pipeline = getattr(mesh, "mpmd_axis", None)
    jmesh = as_jax_mesh(mesh)
    if jmesh is None:
        raise ValueError("no mesh: pass mesh= or enter one (`with mesh:` / jax.set_mesh(mesh)).")
    return {name: size for name, size in dict(jmesh.shape).items() if name != pipeline}


def names_in_current_mesh(*names: str, mesh: Any = None) -> bool:
    """Whether every name is a sharding axis of `mesh` (default: the active mesh)."""
    sizes = spmd_sizes(mesh)
    return all(name in sizes for name in names)


def mesh_axis_product(mesh: Any, axis_entry: Any) -> int:
    """How many pieces a spec entry (None, a name, or a tuple of names) cuts an axis into on `mesh`."""
    if axis_entry is None:
        return 1
    sizes = dict(as_jax_mesh(mesh).shape)
    names = (axis_entry,) if isinstance(axis_entry, str) else tuple(axis_entry)
    return math.prod(sizes[n] for n in names if n is not None)


def get_axes_size_in_mesh(axis_names: Any, mesh: Any = None) -> int:
    """The product of the sizes of `axis_names` in `mesh` (an MPMD pipeline axis counts 1)."""
    if axis_names is None:
        return 1
    sizes = spmd_sizes(mesh)
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    return math.prod(sizes.get(n, 1) for n in names if n is not None)


def _stage_of(stage: Any, metadata: Any) -> int | None:
    """The stage index from `stage=` (an int or `(current, total)`) or a Variable's metadata."""
    if stage is None and metadata:
        stage = metadata.get("stage")
    return stage[0] if isinstance(stage, tuple) else stage


def get_current_stage_mesh(
    mesh: Any = None,
    *,
    arr: Any = None,
    stage: Any = None,
    stage_mesh: Any = None,
    metadata: Any = None,
    raise_error: bool = False,
) -> Mesh | None:
    """The mesh a stage's arrays live on: `stage_mesh` when given; on an MPMD mesh, the submesh
    of `stage` (an int or `(current, total)`, else the `"stage"` of `metadata`, else the mesh
    `arr` is placed on); a plain mesh itself. `mesh=None` uses the active mesh. An MPMD stage
    that cannot be told gives None (an error with `raise_error`)."""
    if stage_mesh is not None:
        return to_jax_mesh(stage_mesh)
    mesh = current_mesh() if mesh is None else mesh
    if not getattr(mesh, "is_mpmd", False):
        return to_jax_mesh(mesh)
    index = _stage_of(stage, metadata)
    if index is not None:
        return mesh.submesh(index)
    placed = getattr(getattr(arr, "sharding", None), "mesh", None)
    if isinstance(placed, Mesh) and mesh.mpmd_axis not in placed.axis_names:
        return placed
    if raise_error:
        raise ValueError(
            "get_current_stage_mesh: the mesh is an MPMD mesh and no stage is known; pass stage= "
            "(or stage_mesh=, or metadata with a 'stage')."
        )
    return None
