"""`spx.sharding`: logical sharding annotations, the rules that resolve them, and mesh helpers.

Layers and Variables carry logical axis names as metadata (`sharding=("embed",
"mlp")`, any names); nothing is resolved when they are built. Names become mesh
axes when a spec is needed, under the innermost
`with spx.sharding.logical_axis_rules([(name, mesh axes), ...]):` block and the
active mesh (`with mesh:` for an `spx.create_mesh` mesh, or `jax.set_mesh`):
a rule maps a name; a name with no rule that is a mesh axis is that axis; any
other name is unsharded — or, inside a rules block with a mesh active, an
error naming it (a typo). The rules start from the core's defaults
(`spectrax_core.sharding.Rules.default()`: `EMBED`, `MLP`, ...), which the
built-in layers use when given no `sharding=`.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

import spectrax_core as sc
from spectrax_core.sharding import (  # noqa: F401  (the core's tokens, importable from here too)
    BATCH,
    EMBED,
    EXPERT,
    HEAD,
    KV_HEAD,
    LENGTH,
    MLP,
    VOCAB,
    Rules,
)

from .._compat.partition_axis import PartitionAxis
from .._graph.module import Module, plan_of
from .._graph.state import state_of
from .._graph.variable import set_value
from .._pipeline.meshes import cpu_context, create_cpu_mesh, create_mesh, parse_mesh_from_string
from .._pipeline.mpmd import spx_mesh_class
from .._scope import ambient
from .._sharding.mesh import (
    DEFAULT_MESH_AXIS_DIMS,
    DEFAULT_MESH_AXIS_NAMES,
    calculate_host_mesh_shape,
    force_cpu,
    get_axes_size_in_mesh,
    get_current_stage_mesh,
    get_incontext_mesh,
    mesh_axis_product,
    names_in_current_mesh,
    to_jax_mesh,
    use_mesh,
)
from .._sharding.named import (
    extract_sharding_structure,
    extract_shardings,
    get_corrected_named_sharding,
    make_shard_and_gather_fns,
    match_partition_rules,
    named_sharding_for_shape,
    named_sharding_for_value,
    place,
    place_setup_leaf_with_sharding,
    place_setup_tree_with_shardings,
    reshape_with_named_shardings,
    sanitize_partition_spec_for_mesh_and_shape,
    spec_shape_mismatches,
    transpose_with_named_shardings,
    with_named_sharding,
)
from .._sharding.rules import (
    Sharding,
    annotation_axes,
    as_jax_mesh,
    current_axis_rules,
    current_manager,
    current_mesh,
    current_mode,
    current_rules,
    logical_axis_rules,
    resolve,
    rules_block,
)
from .._sharding.specs import (
    AttnKVSharding,
    AttnQSharding,
    ColumnWise,
    ExpertActivations,
    ExpertColumnWise,
    ExpertRowWise,
    HiddenStateSharding,
    LogicalAxes,
    LogitsSharding,
    Replicated,
    RowWise,
    fitted,
    lax_reshard,
    with_partitioning,
    with_sharding_constraint,
    with_sharding_constraint_by_name,
)

MeshAxes = str | Sequence[str] | None


def _var_axes(var: Any) -> tuple | None:
    axes = var.metadata.get("axes")
    return None if axes is None else annotation_axes("variable metadata", axes, var.ndim)


def get_partition_spec(
    x_or_axes: Any, *, rules: Rules | None = None, mode: str | None = None, mesh: Any = None
) -> Any:
    """The `PartitionSpec` of logical axes, or the specs of what an object holds.

    * a tuple of names (or a prebuilt name such as `ColumnWise`): its spec under the
      rules and mesh in force (or given);
    * an `spx.Module`: a dict `{collection: {dotted path: spec}}` of every variable (the
      seed library's shape: `for col, entries in specs.items(): for path, spec in
      entries.items()`), from its `axes` metadata (`PartitionSpec()` without), resolved
      with its shape;
    * a `jax.Array`: the spec of its current sharding;
    * any other pytree (core params): `spectrax_core.sharding.param_specs`.
    """
    mesh = as_jax_mesh(mesh)
    kw = {"rules": rules, "mode": mode, "mesh": mesh}
    if isinstance(x_or_axes, Module):
        plan = plan_of(x_or_axes)
        return state_of(plan, values=_module_specs(plan, kw)).to_dict()
    if isinstance(x_or_axes, jax.Array):
        sharding = x_or_axes.sharding
        return sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
    if isinstance(x_or_axes, Sharding):
        return resolve(x_or_axes.axes or (), **kw)
    if isinstance(x_or_axes, tuple | list) and all(a is None or isinstance(a, str) for a in x_or_axes):
        return resolve(annotation_axes("get_partition_spec", x_or_axes), **kw)
    return sc.sharding.param_specs(
        x_or_axes, current_rules() if rules is None else rules, current_mode() if mode is None else mode, mesh
    )


def _module_specs(plan: Any, kw: dict) -> list[PartitionSpec]:
    """The spec of each of a module plan's variables, in the plan's order."""
    specs = []
    for var in plan.vars:
        axes = _var_axes(var)
        specs.append(PartitionSpec() if axes is None else resolve(axes, shape=var.shape, **kw))
    return specs


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def get_named_sharding(
    x_or_axes: Any, mesh: Any = None, *, rules: Rules | None = None, mode: str | None = None
) -> Any:
    """`get_partition_spec` wrapped in `NamedSharding`s over `mesh` (default: the current mesh)."""
    mesh = as_jax_mesh(mesh)
    if mesh is None:
        raise ValueError(
            "get_named_sharding: no mesh; pass mesh= or call inside `with mesh:` (spx.create_mesh) "
            "or `jax.set_mesh(mesh)`."
        )
    specs = get_partition_spec(x_or_axes, rules=rules, mode=mode, mesh=mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def apply_logical_sharding(
    x: Any,
    partition_manager: PartitionManager | None = None,
    axes: Any = None,
    mode: str | None = None,
    dynamic_axes: Any = None,
    auto_correct: bool = True,
    *,
    mesh: Any = None,
    rules: Rules | None = None,
) -> Any:
    """Place `x` as its logical axes say, on the current (or given) mesh.

    * an array with `axes`: traced, a sharding constraint; concrete, `jax.device_put`
      to its `NamedSharding`; returned unchanged when no mesh is set;
    * an `spx.Module`: every variable with `axes` metadata is placed in place; returns it.

    `partition_manager` takes the rules from that manager; the axes may also come as
    `dynamic_axes` (a sequence, or an object with `axes` and optionally `mode`). With
    `auto_correct=False` an axis that does not divide evenly is an error, not left whole.
    `apply_logical_sharding(x, axes)` (axes second) is accepted too.
    """
    if partition_manager is not None and not isinstance(partition_manager, PartitionManager):
        if isinstance(axes, str) and mode is None:  # apply_logical_sharding(x, axes, mode)
            axes, mode = None, axes
        axes, partition_manager = partition_manager, None
    if axes is None and dynamic_axes is not None:
        mode = getattr(dynamic_axes, "mode", None) if mode is None else mode
        axes = tuple(getattr(dynamic_axes, "axes", dynamic_axes))
    if partition_manager is not None and rules is None:
        rules = partition_manager.paxis.rules()
    mesh = as_jax_mesh(mesh)
    if isinstance(x, Module):
        if mesh is not None:
            plan = plan_of(x)
            specs = _module_specs(plan, {"rules": rules, "mode": mode, "mesh": mesh})
            for var, spec in zip(plan.vars, specs):
                if "axes" in var.metadata:
                    set_value(var, jax.device_put(var.value, NamedSharding(mesh, spec)))
        return x
    if axes is None:
        raise TypeError("apply_logical_sharding: give the array's logical axes, e.g. axes=('embed', 'mlp').")
    if mesh is None:
        return x
    return place(x, fitted(x, axes, mesh, rules, mode, auto_correct))


class PartitionManager:
    """Rules from a `PartitionAxis`, entered as a context (`with PartitionManager(paxis):`).

    Inside the block its rules are in force (as with `logical_axis_rules`), and
    `get_current_partition_manager()` returns it; outside any block,
    `get_partition_manager()` is the latest one made in this thread.
    """

    def __init__(self, paxis: PartitionAxis):
        self.paxis = paxis
        self._blocks: list = []
        ambient.replace(latest_manager=self)

    def resolve(self, axes: Sequence[str | None], mode: str = "train", shape: Sequence[int] | None = None):
        """The `PartitionSpec` of `axes` under this manager's rules and the active mesh."""
        return resolve(
            annotation_axes("PartitionManager.resolve", axes),
            shape=shape,
            rules=self.paxis.rules(),
            mode=mode,
        )

    def shard(self, x: Any, axes: Sequence[str | None], mode: str = "train") -> Any:
        """`x` placed by `axes` under this manager's rules (unchanged with no mesh)."""
        return apply_logical_sharding(x, axes=tuple(axes), mode=mode, rules=self.paxis.rules())

    def __enter__(self) -> PartitionManager:
        block = rules_block(self.paxis.rules(), manager=self)
        block.__enter__()
        self._blocks.append(block)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._blocks.pop().__exit__(*exc)


def get_current_partition_manager() -> PartitionManager | None:
    """The `PartitionManager` of the innermost `with manager:` block, or None."""
    return current_manager()


def get_partition_manager() -> PartitionManager | None:
    """The active `PartitionManager`, else the latest one made in this thread, else None."""
    return current_manager() or ambient.current().latest_manager


def __getattr__(name: str) -> Any:
    if name == "SpxMesh":  # the mesh type of `create_mesh`, a `spectrax_mpmd.MpmdMesh`
        return spx_mesh_class()
    raise AttributeError(f"module 'spectrax_eager.sharding' has no attribute {name!r}")


__all__ = [
    "SpxMesh",  # noqa: F822  (module __getattr__)
    "AttnKVSharding",
    "AttnQSharding",
    "ColumnWise",
    "ExpertActivations",
    "ExpertColumnWise",
    "ExpertRowWise",
    "HiddenStateSharding",
    "LogicalAxes",
    "LogitsSharding",
    "PartitionAxis",
    "PartitionManager",
    "Replicated",
    "RowWise",
    "Rules",
    "Sharding",
    "apply_logical_sharding",
    "current_axis_rules",
    "current_mesh",
    "current_mode",
    "current_rules",
    "get_current_partition_manager",
    "get_named_sharding",
    "get_partition_manager",
    "get_partition_spec",
    "lax_reshard",
    "logical_axis_rules",
    "with_partitioning",
    "with_sharding_constraint",
    "with_sharding_constraint_by_name",
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
