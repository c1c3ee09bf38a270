"""Making meshes: `spx.create_mesh` and the forms built on it. A mesh made here is a
`spectrax_mpmd` mesh (with or without a pipeline axis), so this is where the facade first
imports the MPMD runtime for a program that only builds a mesh."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.experimental import mesh_utils

from .._sharding.mesh import DEFAULT_MESH_AXIS_DIMS, DEFAULT_MESH_AXIS_NAMES, force_cpu, use_mesh


def create_mesh(
    axis_dims: Sequence[int] = DEFAULT_MESH_AXIS_DIMS,
    axis_names: Sequence[str] = DEFAULT_MESH_AXIS_NAMES,
    *,
    mpmd_axis: str | None = None,
    devices: Sequence[jax.Device] | None = None,
    dcn_mesh_dims: Sequence[int] | None = None,
    should_sort_granules_by_key: bool = True,
    allow_split_physical_axes: bool = True,
    backend: str | None = None,
    use_jax: bool = False,
    axis_types: Any = None,
) -> Any:
    """`spectrax_mpmd.create_mesh` with the default six axes (`-1` takes the remaining devices).

    Devices are `devices` (default: those of `backend`) in order; with `dcn_mesh_dims` (the
    slices or hosts along each axis, one `-1` allowed) they are arranged by
    `jax.experimental.mesh_utils.create_hybrid_device_mesh` (`should_sort_granules_by_key`,
    `allow_split_physical_axes` as there). `use_jax` is accepted (the order is already jax's).
    Mesh axes are of jax's default (Auto) type: `axis_types` may only say "auto". The mesh is an
    `SpxMesh`: with a pipeline axis, `with mesh:` names it to the facade and leaves JAX's context
    mesh unset, so JAX code in the block runs on the arrays of any rank (`spx_mesh.py`).
    """
    import spectrax_mpmd

    from .spx_mesh import SpxMesh

    kinds = axis_types if isinstance(axis_types, list | tuple) else (axis_types,)
    if any(k is not None and str(getattr(k, "name", k)).lower() != "auto" for k in kinds):
        raise ValueError(f"create_mesh: axis_types={axis_types!r}; the meshes here have Auto axes only.")
    devices = list(jax.devices(backend) if devices is None else devices)
    dims = _filled(tuple(axis_dims), len(devices), "axis_dims")
    if dcn_mesh_dims is not None:
        dcn = _filled(
            tuple(dcn_mesh_dims),
            math.prod(dims) // math.prod(d for d in dcn_mesh_dims if d != -1)
            if -1 in dcn_mesh_dims
            else math.prod(dcn_mesh_dims),
            "dcn_mesh_dims",
        )
        if len(dcn) != len(dims) or any(d % c for d, c in zip(dims, dcn)):
            raise ValueError(f"create_mesh: dcn_mesh_dims {dcn} must divide axis_dims {dims} axis by axis.")
        grid = mesh_utils.create_hybrid_device_mesh(
            tuple(d // c for d, c in zip(dims, dcn)),
            dcn,
            devices,
            should_sort_granules_by_key=should_sort_granules_by_key,
            allow_split_physical_axes=allow_split_physical_axes,
        )
        devices = list(grid.flat)
    return SpxMesh.of(spectrax_mpmd.create_mesh(dims, axis_names, mpmd_axis=mpmd_axis, devices=devices))


def _filled(dims: tuple[int, ...], total: int, name: str) -> tuple[int, ...]:
    """`dims` with its one `-1` (if any) set so that the product is `total`."""
    known = math.prod(d for d in dims if d != -1)
    if list(dims).count(-1) > 1 or (-1 in dims and total % known):
        raise ValueError(f"create_mesh: {name} {dims} cannot be filled to {total} devices.")
    return tuple(total // known if d == -1 else d for d in dims)


def create_cpu_mesh(
    axis_dims: Sequence[int] = DEFAULT_MESH_AXIS_DIMS, axis_names: Sequence[str] = DEFAULT_MESH_AXIS_NAMES
) -> Any:
    """`create_mesh` over the CPU devices (with `--xla_force_host_platform_device_count=N`)."""
    return create_mesh(axis_dims, axis_names, devices=jax.devices("cpu"))


def parse_mesh_from_string(axis_dims: str, names: Sequence[str]) -> Any:
    """A mesh from `"dp:2,tp:4"` (named, each of `names` once) or `"2,4"` (by position)."""
    parts = [p.strip() for p in axis_dims.split(",") if p.strip()]
    names = tuple(names)
    if all(":" in p for p in parts):
        sizes = {}
        for p in parts:
            name, size = (s.strip() for s in p.split(":", 1))
            if name not in names or name in sizes:
                raise ValueError(
                    f"parse_mesh_from_string: {name!r} is unknown or repeated; expected each of {names} once."
                )
            sizes[name] = int(size)
        if set(sizes) != set(names):
            raise ValueError(f"parse_mesh_from_string: {axis_dims!r} does not size every axis of {names}.")
        dims = tuple(sizes[n] for n in names)
    else:
        dims = tuple(int(p) for p in parts)
        if len(dims) != len(names):
            raise ValueError(
                f"parse_mesh_from_string: {len(dims)} sizes in {axis_dims!r} for {len(names)} names {names}."
            )
    return create_mesh(dims, names)


@contextlib.contextmanager
def cpu_context() -> Iterator[Any]:
    """`force_cpu()` and a CPU mesh of the default axes entered together; yields the mesh."""
    with force_cpu():
        mesh = create_cpu_mesh()
        with use_mesh(mesh):
            yield mesh
