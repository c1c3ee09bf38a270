"""MPMD meshes: a `jax.sharding.Mesh` with one axis naming the pipeline ranks."""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._comm import check_joined
from .errors import MeshError

DEFAULT_AXIS_NAMES = ("pp", "dp", "fsdp", "ep", "tp", "sp")


class MpmdMesh:
    """A device mesh whose `mpmd_axis` (if any) enumerates pipeline ranks.

    Each rank runs its own programs on `submesh(rank)`: the devices of that
    rank's slice, with the pipeline axis dropped. Ranks may own submeshes of
    different sizes and axes (`create_rank_mesh`, `mesh_of_ranks`); such a mesh
    has no single rectangular `jax_mesh`.
    """

    def __init__(self, jax_mesh: Mesh | None, mpmd_axis: str | None = None, _submeshes: Sequence[Mesh] = ()):
        self._grid, self.mpmd_axis, self._submeshes = jax_mesh, mpmd_axis, tuple(_submeshes)
        self._entered: list = []  # open `with mesh:` contexts
        if mpmd_axis is not None and not self._submeshes:  # built as `MpmdMesh(jax_mesh, "pp")`
            if mpmd_axis not in jax_mesh.axis_names:
                raise MeshError(
                    f"mesh: axis {mpmd_axis!r} not in the mesh axes {tuple(jax_mesh.axis_names)}."
                )
            self._submeshes = _slice_submeshes(jax_mesh, mpmd_axis)

    @property
    def jax_mesh(self) -> Mesh:
        """The whole mesh as one `jax.sharding.Mesh` (pipeline axis included); ranks of different
        shapes have none."""
        if self._grid is None:
            raise MeshError(
                f"mesh: its pipeline ranks own submeshes of different shapes {self.rank_shapes}, so it "
                "has no single rectangular jax mesh; use mesh.submesh(rank) (or mesh.unstack()) for a "
                "rank's own mesh."
            )
        return self._grid

    @property
    def uniform(self) -> bool:
        """Whether every rank's submesh has the same axes and shape (a rectangular `jax_mesh`)."""
        return self._grid is not None

    @property
    def rank_sizes(self) -> tuple[int, ...]:
        """Devices per pipeline rank (all equal on a rectangular mesh)."""
        return tuple(self.submesh(r).size for r in range(self.mpmd_dim))

    @property
    def rank_shapes(self) -> tuple[dict[str, int], ...]:
        """Each pipeline rank's submesh axes and sizes."""
        return tuple(dict(self.submesh(r).shape) for r in range(self.mpmd_dim))

    def __enter__(self) -> "MpmdMesh":
        """`with mesh:` is `with jax.set_mesh(mesh.jax_mesh):` (the whole mesh, MPMD axis included)."""
        ctx = jax.set_mesh(self.jax_mesh)
        ctx.__enter__()
        self._entered.append(ctx)
        return self

    def __exit__(self, *exc) -> None:
        self._entered.pop().__exit__(*exc)

    @property
    def is_mpmd(self) -> bool:
        return self.mpmd_axis is not None

    @property
    def mpmd_dim(self) -> int:
        """Number of pipeline ranks (1 when the mesh has no MPMD axis)."""
        return len(self._submeshes) if self.is_mpmd else 1

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The pipeline axis, then every axis some rank's submesh has."""
        if self.uniform:
            return tuple(self.jax_mesh.axis_names)
        return (self.mpmd_axis, *self.spmd_axis_names)

    @property
    def shape(self) -> dict[str, int]:
        """Axis sizes of `jax_mesh` (ranks of different shapes: see `rank_shapes`)."""
        return dict(self.jax_mesh.shape)

    @property
    def devices(self) -> np.ndarray:
        """`jax_mesh.devices`; with ranks of different shapes, every device in rank order (1-D)."""
        if self.uniform:
            return self.jax_mesh.devices
        return np.asarray([d for sub in self._submeshes for d in sub.devices.flat], dtype=object)

    def submesh(self, rank: int) -> Mesh:
        """The mesh of pipeline rank `rank` (the MPMD axis dropped)."""
        if not 0 <= rank < self.mpmd_dim:
            raise MeshError(f"submesh: rank must be in [0, {self.mpmd_dim}), got {rank}.")
        return self._submeshes[rank]

    @functools.cached_property
    def device_rank(self) -> dict:
        """`device -> pipeline rank` of every device of the mesh."""
        return {d: r for r in range(self.mpmd_dim) for d in self.submesh(r).devices.flat}

    def rank_of(self, placed) -> int | None:
        """The pipeline rank holding `placed` (an array or a sharding); see `rank_holding`."""
        return rank_holding(self.device_rank, placed)

    @property
    def mpmd_axis_name(self) -> str | None:
        """The pipeline axis' name (`mpmd_axis`)."""
        return self.mpmd_axis

    @property
    def spmd_axis_names(self) -> tuple[str, ...]:
        """The axis names other than the pipeline axis: what the ranks' submeshes have."""
        if self.uniform:
            return tuple(n for n in self.jax_mesh.axis_names if n != self.mpmd_axis)
        return tuple(dict.fromkeys(n for sub in self._submeshes for n in sub.axis_names))

    @property
    def mpmd_mesh(self) -> MpmdMesh:
        """The mesh itself (it is its own MPMD view)."""
        return self

    def unstack(self) -> list[Mesh]:
        """Every rank's submesh, in rank order."""
        return [self.submesh(r) for r in range(self.mpmd_dim)]

    def sub_sharding(self, rank: int, spec: PartitionSpec | Sequence | None = None) -> NamedSharding:
        """A `NamedSharding` of `spec` (default: replicated) on rank `rank`'s submesh; the spec
        may not name the pipeline axis (each submesh has none)."""
        spec = PartitionSpec() if spec is None else spec
        spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec)
        named = {n for entry in spec for n in (entry if isinstance(entry, tuple) else (entry,))}
        if self.mpmd_axis is not None and self.mpmd_axis in named:
            raise MeshError(
                f"sub_sharding: {spec} names the pipeline axis {self.mpmd_axis!r}, which a rank's "
                f"submesh does not have; use the axes {self.spmd_axis_names}."
            )
        return NamedSharding(self.submesh(rank), spec)

    def __repr__(self) -> str:
        if not self.uniform:
            return f"MpmdMesh(ranks={list(self.rank_shapes)}; mpmd_axis={self.mpmd_axis!r})"
        dims = ", ".join(f"{k}={v}" for k, v in self.shape.items())
        return f"MpmdMesh({dims}; mpmd_axis={self.mpmd_axis!r})"


def default_device() -> jax.Device:
    """Where a value with no placement of its own goes: JAX's default device (`jax.default_device`,
    the `jax_default_device` setting, a device or a platform name) when one is set, else this
    process's first device."""
    chosen = jax.config.jax_default_device
    if isinstance(chosen, str):
        return jax.local_devices(backend=chosen)[0]
    return chosen if chosen is not None else jax.local_devices()[0]


def rank_holding(device_rank: dict, placed) -> int | None:
    """The pipeline rank holding `placed` (an array or a sharding) under `device_rank` (`device ->
    rank`): the one rank all its devices belong to; None when it spans several ranks, lies
    outside the mesh or is not placed. Every "which rank holds this leaf" question about a
    placed value is answered here."""
    sharding = getattr(placed, "sharding", placed)
    ranks = {device_rank.get(d) for d in getattr(sharding, "device_set", ())}
    return ranks.pop() if len(ranks) == 1 else None


def _slice_submeshes(mesh: Mesh, axis: str) -> tuple[Mesh, ...]:
    names = tuple(mesh.axis_names)
    pos = names.index(axis)
    rest = names[:pos] + names[pos + 1 :]
    devs = np.moveaxis(mesh.devices, pos, 0)
    return tuple(Mesh(devs[r], rest) for r in range(devs.shape[0]))


def as_mpmd_mesh(mesh: Mesh | MpmdMesh, mpmd_axis: str | None = "pp") -> MpmdMesh:
    """Wrap a plain `jax.sharding.Mesh` (pipeline axis `mpmd_axis`) or return an `MpmdMesh` as is."""
    if isinstance(mesh, MpmdMesh):
        return mesh
    if isinstance(mesh, Mesh):
        if mpmd_axis is not None and mpmd_axis not in mesh.axis_names:
            raise MeshError(
                f"mesh: axis {mpmd_axis!r} not in the mesh axes {tuple(mesh.axis_names)}; "
                f"build the mesh with a {mpmd_axis!r} axis (e.g. create_mesh(..., mpmd_axis={mpmd_axis!r}))."
            )
        subs = _slice_submeshes(mesh, mpmd_axis) if mpmd_axis else ()
        return MpmdMesh(mesh, mpmd_axis, subs)
    raise MeshError(f"mesh: expected an MpmdMesh or jax.sharding.Mesh, got {type(mesh).__name__}.")


def create_mesh(
    axis_dims: Sequence[int],
    axis_names: Sequence[str] = DEFAULT_AXIS_NAMES,
    *,
    mpmd_axis: str | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> MpmdMesh:
    """Build a mesh over `devices` (default: all); one entry of `axis_dims` may be -1 (the rest).

    With `mpmd_axis` set (e.g. `"pp"`), that axis enumerates pipeline ranks.
    """
    axis_dims, axis_names = tuple(int(d) for d in axis_dims), tuple(axis_names)
    if len(axis_dims) != len(axis_names):
        raise MeshError(
            f"create_mesh: axis_dims has {len(axis_dims)} entries but axis_names has "
            f"{len(axis_names)} ({axis_names}); give one size per axis name."
        )
    check_joined("create_mesh")
    devices = list(jax.devices() if devices is None else devices)
    if sum(d == -1 for d in axis_dims) > 1 or any(d == 0 or d < -1 for d in axis_dims):
        raise MeshError(
            f"create_mesh: axis_dims {axis_dims} must be positive, with at most one -1 "
            "(the remaining devices)."
        )
    known = math.prod(d for d in axis_dims if d != -1)
    if -1 in axis_dims:
        if len(devices) % known:
            raise MeshError(
                f"create_mesh: {len(devices)} devices are not divisible by the fixed axes' product {known}."
            )
        axis_dims = tuple(len(devices) // known if d == -1 else d for d in axis_dims)
    total = math.prod(axis_dims)
    if total > len(devices):
        raise MeshError(
            f"create_mesh: axis_dims {axis_dims} need {total} devices but only {len(devices)} are available."
        )
    if mpmd_axis is not None and mpmd_axis not in axis_names:
        raise MeshError(f"create_mesh: mpmd_axis {mpmd_axis!r} is not one of axis_names {axis_names}.")
    grid = np.asarray(devices[:total], dtype=object).reshape(axis_dims)
    return as_mpmd_mesh(Mesh(grid, axis_names), mpmd_axis)


def create_rank_mesh(
    rank_axes: Sequence[dict[str, int]],
    *,
    mpmd_axis: str = "pp",
    devices: Sequence[jax.Device] | None = None,
) -> MpmdMesh:
    """A mesh whose pipeline rank `r` owns a submesh of its own axes `rank_axes[r]` (`{name: size}`).

    The ranks take consecutive runs of `devices` (default: all), rank 0 first, and
    their sizes must add up to the number of devices, e.g. `[{"fsdp": 1}, {"fsdp": 1},
    {"fsdp": 2}, {"fsdp": 2, "tp": 2}]` over 8 devices.
    """
    check_joined("create_rank_mesh")
    devices = list(jax.devices() if devices is None else devices)
    shapes = [_rank_axes(r, axes, mpmd_axis) for r, axes in enumerate(rank_axes)]
    sizes = [math.prod(shape.values()) for shape in shapes]
    if sum(sizes) != len(devices):
        raise MeshError(
            f"create_rank_mesh: the ranks' sizes {tuple(sizes)} add up to {sum(sizes)} devices but "
            f"{len(devices)} are given; give as many devices as the ranks use (devices=jax.devices()"
            f"[:{sum(sizes)}]) or change the ranks' axis sizes."
        )
    starts = np.cumsum([0, *sizes])
    meshes = [
        Mesh(np.asarray(devices[a:b], dtype=object).reshape(tuple(shape.values())), tuple(shape))
        for shape, a, b in zip(shapes, starts[:-1], starts[1:])
    ]
    return mesh_of_ranks(meshes, mpmd_axis=mpmd_axis)


def _rank_axes(rank: int, axes, mpmd_axis: str) -> dict[str, int]:
    if not isinstance(axes, dict) or not axes or any(int(v) < 1 for v in axes.values()):
        raise MeshError(
            f"create_rank_mesh: rank_axes[{rank}] must be a non-empty dict of axis name -> positive "
            f"size (e.g. {{'fsdp': 2}}), got {axes!r}."
        )
    if mpmd_axis in axes:
        raise MeshError(
            f"create_rank_mesh: rank_axes[{rank}] names the pipeline axis {mpmd_axis!r}; a rank's "
            "submesh has only its own SPMD axes."
        )
    return {str(k): int(v) for k, v in axes.items()}


def mesh_of_ranks(meshes: Sequence[Mesh], *, mpmd_axis: str = "pp") -> MpmdMesh:
    """A mesh whose pipeline rank `r` runs its programs on `meshes[r]` (disjoint jax meshes, each
    of its own axes and shape). Equal shapes give the same mesh as `create_mesh` (a rectangular
    `jax_mesh` stacking them); different ones have no `jax_mesh`."""
    meshes = tuple(meshes)
    if not meshes or not all(isinstance(m, Mesh) for m in meshes):
        raise MeshError(
            "mesh_of_ranks: meshes must be a non-empty sequence of jax.sharding.Mesh, one per pipeline "
            f"rank; got {[type(m).__name__ for m in meshes]}."
        )
    seen: dict = {}
    for r, m in enumerate(meshes):
        if mpmd_axis in m.axis_names:
            raise MeshError(
                f"mesh_of_ranks: meshes[{r}] has the pipeline axis {mpmd_axis!r}; a rank's mesh has "
                "only its own SPMD axes."
            )
        for d in m.devices.flat:
            if d in seen:
                raise MeshError(
                    f"mesh_of_ranks: device {d} is in meshes[{seen[d]}] and meshes[{r}]; pipeline "
                    "ranks own disjoint devices: give each rank its own."
                )
            seen[d] = r
    first = meshes[0]
    if all(m.axis_names == first.axis_names and m.devices.shape == first.devices.shape for m in meshes):
        grid = Mesh(np.stack([m.devices for m in meshes]), (mpmd_axis, *first.axis_names))
        return MpmdMesh(grid, mpmd_axis, meshes)
    return MpmdMesh(None, mpmd_axis, meshes)
