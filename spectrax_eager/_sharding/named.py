"""`NamedSharding`s made to fit a mesh and a shape, and arrays and pytrees placed by them: the
spec helpers of `spx.sharding`."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .mesh import get_current_stage_mesh, get_incontext_mesh, mesh_axis_product, spmd_sizes, to_jax_mesh
from .rules import current_mesh


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
    sizes = spmd_sizes(mesh)
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
