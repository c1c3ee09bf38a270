"""Mesh helpers of `spx.sharding`: creating and entering meshes, and making `PartitionSpec`s fit
a mesh and a shape. They work on plain jax meshes and on `spectrax_mpmd` meshes alike (an MPMD
mesh's pipeline axis places programs, so it never shards an array here).

`spectrax_mpmd` is imported on first use, so `import spectrax_eager` never needs the runtime.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._sharding_rules import as_jax_mesh, current_mesh

DEFAULT_MESH_AXIS_DIMS: tuple[int, ...] = (1, 1, -1, 1, 1, 1)
DEFAULT_MESH_AXIS_NAMES: tuple[str, ...] = ("pp", "dp", "fsdp", "ep", "tp", "sp")


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
    Mesh axes are of jax's default (Auto) type: `axis_types` may only say "auto".
    """
    import spectrax_mpmd

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
    return spectrax_mpmd.create_mesh(dims, axis_names, mpmd_axis=mpmd_axis, devices=devices)


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
    """Enter `mesh` (a jax `Mesh` or an `spx.create_mesh` mesh) for the block; yields it."""
    with jax.set_mesh(to_jax_mesh(mesh)):
        yield mesh


@contextlib.contextmanager
def force_cpu() -> Iterator[jax.Device]:
    """Run the block's computations on the first CPU device; yields it."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        yield cpu


@contextlib.contextmanager
def cpu_context() -> Iterator[Any]:
    """`force_cpu()` and a CPU mesh of the default axes entered together; yields the mesh."""
    with force_cpu():
        mesh = create_cpu_mesh()
        with use_mesh(mesh):
            yield mesh


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


def _spmd_sizes(mesh: Any) -> dict[str, int]:
    """Axis sizes usable for sharding an array: all but an MPMD mesh's pipeline axis."""
    pipeline = getattr(mesh, "mpmd_axis", None)
    jmesh = as_jax_mesh(mesh)
    if jmesh is None:
        raise ValueError("no mesh: pass mesh= or enter one (`with mesh:` / jax.set_mesh(mesh)).")
    return {name: size for name, size in dict(jmesh.shape).items() if name != pipeline}


def names_in_current_mesh(*names: str, mesh: Any = None) -> bool:
    """Whether every name is a sharding axis of `mesh` (default: the active mesh)."""
    sizes = _spmd_sizes(mesh)
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
    sizes = _spmd_sizes(mesh)
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    return math.prod(sizes.get(n, 1) for n in names if n is not None)


def _entry_names(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(n for n in entry if n)


def _entry(names: tuple[str, ...]) -> Any:
    return None if not names else names[0] if len(names) == 1 else names


def sanitize_partition_spec_for_mesh_and_shape(
    spec: Any, *, mesh: Any = None, shape: Sequence[int] | None = None
) -> PartitionSpec:
    """`spec` made valid for `mesh` and `shape`: unknown (or pipeline) axes dropped, a spec longer
    than the shape replicated, and an entry that does not divide its dimension unsharded."""
    spec = (
        PartitionSpec() if spec is None else spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec)
    )
    sizes = _spmd_sizes(mesh)
    entries = [tuple(n for n in _entry_names(e) if n in sizes) for e in spec]
    if shape is not None:
        if len(entries) > len(shape):
            return PartitionSpec()
        entries = [e if shape[i] % math.prod(sizes[n] for n in e) == 0 else () for i, e in enumerate(entries)]
    return PartitionSpec(*(_entry(e) for e in entries))


def spec_shape_mismatches(spec: PartitionSpec, mesh: Any, shape: Sequence[int]) -> tuple[str, ...]:
    """One message per dimension of `shape` that `spec` does not divide evenly on `mesh`."""
    out = []
    for i, entry in enumerate(spec):
        if i >= len(shape):
            out.append(f"spec entry {i} ({entry!r}) has no dimension in shape {tuple(shape)}")
            continue
        pieces = mesh_axis_product(mesh, entry)
        if shape[i] % pieces:
            out.append(f"dimension {i} of size {shape[i]} is not divisible by {entry!r} ({pieces} pieces)")
    return tuple(out)


def get_corrected_named_sharding(
    shape: Sequence[int], partition_spec: PartitionSpec, raise_mesh_error: bool = True
) -> NamedSharding:
    """A `NamedSharding` on the active mesh with `partition_spec` sanitized for `shape`; with no
    mesh, an error (or, with `raise_mesh_error=False`, a one-device mesh)."""
    mesh = current_mesh()
    if mesh is None:
        if raise_mesh_error:
            get_incontext_mesh()
        mesh = Mesh(np.array(jax.devices()[:1]), ("_",))
    return NamedSharding(
        mesh, sanitize_partition_spec_for_mesh_and_shape(partition_spec, mesh=mesh, shape=shape)
    )


def named_sharding_for_shape(
    source_sharding: NamedSharding, shape: Sequence[int], spec: PartitionSpec, *, context: str
) -> NamedSharding:
    """`spec` on `source_sharding`'s mesh, refusing a spec that does not divide `shape`."""
    bad = spec_shape_mismatches(spec, source_sharding.mesh, shape)
    if bad:
        raise ValueError(f"{context}: {spec} does not fit shape {tuple(shape)}: {'; '.join(bad)}.")
    return NamedSharding(source_sharding.mesh, spec)


def named_sharding_for_value(value: Any, spec: PartitionSpec, *, context: str) -> NamedSharding | None:
    """`spec` on the mesh `value` is placed on; None when `value` has no `NamedSharding`."""
    sharding = getattr(value, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    return named_sharding_for_shape(sharding, value.shape, spec, context=context)


def place(x: Any, sharding: Any) -> Any:
    """A sharding constraint under a trace, `jax.device_put` on a concrete array."""
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)


def with_named_sharding(value: Any, spec: PartitionSpec, *, context: str) -> Any:
    """`value` placed by `spec` on its own mesh (unchanged when it has none)."""
    target = named_sharding_for_value(value, spec, context=context)
    return value if target is None else place(value, target)


def reshape_with_named_shardings(
    value: Any, shape: Sequence[int], *, in_sharding: NamedSharding, out_sharding: NamedSharding
) -> Any:
    """`value.reshape(shape)` with the layouts before and after stated."""
    return place(place(value, in_sharding).reshape(tuple(shape)), out_sharding)


def transpose_with_named_shardings(
    value: Any, permutation: Sequence[int], *, in_sharding: NamedSharding, out_sharding: NamedSharding
) -> Any:
    """`value.transpose(permutation)` with the layouts before and after stated."""
    return place(place(value, in_sharding).transpose(tuple(permutation)), out_sharding)


def place_setup_leaf_with_sharding(
    leaf: Any,
    sharding: jax.sharding.Sharding,
    *,
    path: str = "",
    label: str = "placement",
    diagnostics: dict[str, int] | None = None,
    donate: bool = False,
) -> Any:
    """`jax.device_put(leaf, sharding)` for set-up values; a failure names `label` and `path`,
    and `diagnostics["placed"]` counts the arrays placed. Non-arrays are returned as they are."""
    if not isinstance(leaf, jax.Array | np.ndarray):
        return leaf
    try:
        out = jax.device_put(leaf, sharding, donate=donate)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"{label}: cannot place {path or 'a leaf'} of shape {tuple(leaf.shape)} on {sharding}: {err}"
        ) from err
    if diagnostics is not None:
        diagnostics["placed"] = diagnostics.get("placed", 0) + 1
    return out


def place_setup_tree_with_shardings(
    tree: Any, shardings: Any, *, label: str = "placement", donate: bool = False
) -> Any:
    """`place_setup_leaf_with_sharding` over a pytree and a matching pytree of shardings (each
    leaf's error names its path in the tree)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x, s: place_setup_leaf_with_sharding(x, s, path=_path_str(kp), label=label, donate=donate),
        tree,
        shardings,
    )


def _path_str(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def match_partition_rules(
    rules: Sequence[tuple[str, PartitionSpec]], tree: Any, min_size: int | None = None, strict: bool = True
) -> Any:
    """A pytree of `PartitionSpec` like `tree`: each leaf takes the spec of the first `(regex, spec)`
    rule whose regex is found in its `/`-joined path. Non-arrays, scalars and (with `min_size`)
    small arrays are replicated; with `strict`, an array no rule matches is an error."""
    compiled = [(re.compile(pattern), spec) for pattern, spec in rules]

    def leaf_spec(path: tuple, leaf: Any) -> PartitionSpec:
        shape = getattr(leaf, "shape", None)
        if shape is None or len(shape) == 0 or (min_size is not None and math.prod(shape) < min_size):
            return PartitionSpec()
        name = _path_str(path)
        for pattern, spec in compiled:
            if pattern.search(name):
                spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec)
                return PartitionSpec(*tuple(spec)[: len(shape)])
        if strict:
            raise ValueError(f"match_partition_rules: no rule matches {name!r} (shape {tuple(shape)}).")
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(leaf_spec, tree)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def make_shard_and_gather_fns(partition_specs: Any, mesh: Any = None) -> tuple[Any, Any]:
    """Two pytrees like `partition_specs`: functions placing an array by its spec (fitted to the
    array's shape), and functions gathering it whole onto the same mesh."""
    jmesh = to_jax_mesh(mesh) or get_incontext_mesh()

    def shard_fn(spec: PartitionSpec):
        return lambda x: jax.device_put(
            x,
            NamedSharding(
                jmesh, sanitize_partition_spec_for_mesh_and_shape(spec, mesh=mesh or jmesh, shape=x.shape)
            ),
        )

    def gather_fn(spec: PartitionSpec):
        return lambda x: jax.device_put(x, NamedSharding(jmesh, PartitionSpec()))

    shard = jax.tree.map(shard_fn, partition_specs, is_leaf=_is_spec)
    gather = jax.tree.map(gather_fn, partition_specs, is_leaf=_is_spec)
    return shard, gather


def extract_shardings(tree: Any, mesh: Any = None) -> Any:
    """A pytree like `tree` of each array's `NamedSharding` (rebound to `mesh` when given, its
    spec fitted to that mesh); None for leaves without one."""

    def one(x: Any) -> NamedSharding | None:
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            return None
        if mesh is None:
            return sharding
        spec = sanitize_partition_spec_for_mesh_and_shape(sharding.spec, mesh=mesh, shape=x.shape)
        return NamedSharding(to_jax_mesh(mesh), spec)

    return jax.tree.map(one, tree)


def extract_sharding_structure(
    pytree: Any, *, mesh: Any = None, stage: Any = None, stage_mesh: Any = None, metadata: Any = None
) -> Any:
    """`extract_shardings` onto the mesh of a stage (see `get_current_stage_mesh`): on an MPMD
    mesh, the shardings a stage's arrays have on its own submesh."""
    target = get_current_stage_mesh(mesh, stage=stage, stage_mesh=stage_mesh, metadata=metadata)
    return jax.tree.map(lambda _: None, pytree) if target is None else extract_shardings(pytree, target)


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


__all__ = [
    "DEFAULT_MESH_AXIS_DIMS",
    "DEFAULT_MESH_AXIS_NAMES",
    "calculate_host_mesh_shape",
    "cpu_context",
    "create_cpu_mesh",
    "create_mesh",
    "extract_sharding_structure",
    "extract_shardings",
    "force_cpu",
    "get_axes_size_in_mesh",
    "get_corrected_named_sharding",
    "get_current_stage_mesh",
    "get_incontext_mesh",
    "make_shard_and_gather_fns",
    "match_partition_rules",
    "mesh_axis_product",
    "named_sharding_for_shape",
    "named_sharding_for_value",
    "names_in_current_mesh",
    "parse_mesh_from_string",
    "place_setup_leaf_with_sharding",
    "place_setup_tree_with_shardings",
    "reshape_with_named_shardings",
    "sanitize_partition_spec_for_mesh_and_shape",
    "spec_shape_mismatches",
    "to_jax_mesh",
    "transpose_with_named_shardings",
    "use_mesh",
    "with_named_sharding",
]
