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

import contextvars
from typing import Any, Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

import spectrax_core as sc
from spectrax_core.sharding import BATCH, EMBED, EXPERT, HEAD, KV_HEAD, LENGTH, MLP, VOCAB, Rules

from ._module import Module, plan_of
from ._sharding_mesh import *  # noqa: F401,F403  (mesh helpers)
from ._sharding_mesh import __all__ as _mesh_names
from ._sharding_mesh import get_current_stage_mesh, place
from ._sharding_rules import (
    PartitionAxis,
    Sharding,
    annotation_axes,
    as_jax_mesh,
    current_axis_rules,
    current_mesh,
    current_mode,
    current_rules,
    logical_axis_rules,
    resolve,
)
from ._state import state_of
from ._variable import set_value

MeshAxes = str | Sequence[str] | None


class LogicalAxes(tuple):
    """A named tuple of logical axis tokens (one per array axis): usable wherever axes are.

    `Replicated` has no tokens and means "every axis unsharded" for an array of any rank.
    """

    name: str

    def __new__(cls, name: str, axes: Sequence[str | None]):
        self = super().__new__(cls, tuple(axes))
        self.name = name
        return self

    def __repr__(self) -> str:
        return f"{self.name}{tuple(self)!r}"

    def __reduce__(self):
        return (LogicalAxes, (self.name, tuple(self)))


HiddenStateSharding = LogicalAxes("HiddenStateSharding", (BATCH, LENGTH, EMBED))
AttnQSharding = LogicalAxes("AttnQSharding", (BATCH, LENGTH, HEAD, None))
AttnKVSharding = LogicalAxes("AttnKVSharding", (BATCH, LENGTH, KV_HEAD, None))
LogitsSharding = LogicalAxes("LogitsSharding", (BATCH, LENGTH, VOCAB))
ColumnWise = LogicalAxes("ColumnWise", (EMBED, MLP))  # (in, out) weight split along its outputs
RowWise = LogicalAxes("RowWise", (MLP, EMBED))  # (in, out) weight split along its inputs
Replicated = LogicalAxes("Replicated", ())
ExpertColumnWise = LogicalAxes("ExpertColumnWise", (EXPERT, EMBED, MLP))
ExpertRowWise = LogicalAxes("ExpertRowWise", (EXPERT, MLP, EMBED))
ExpertActivations = LogicalAxes("ExpertActivations", (EXPERT, None, EMBED))  # (experts, capacity, d)


def _var_axes(var: Any) -> tuple | None:
    axes = var.metadata.get("axes")
    return None if axes is None else annotation_axes("variable metadata", axes, var.ndim)


def get_partition_spec(
    x_or_axes: Any, *, rules: Rules | None = None, mode: str | None = None, mesh: Any = None
) -> Any:
    """The `PartitionSpec` of logical axes, or the specs of what an object holds.

    * a tuple of names (or a prebuilt name such as `ColumnWise`): its spec under the
      rules and mesh in force (or given);
    * an `spx.Module`: a `State` `{collection: {path: spec}}` of every variable, from
      its `axes` metadata (`PartitionSpec()` without), resolved with its shape;
    * a `jax.Array`: the spec of its current sharding;
    * any other pytree (core params): `spectrax_core.sharding.param_specs`.
    """
    mesh = as_jax_mesh(mesh)
    kw = {"rules": rules, "mode": mode, "mesh": mesh}
    if isinstance(x_or_axes, Module):
        plan = plan_of(x_or_axes)
        specs = []
        for var in plan.vars:
            axes = _var_axes(var)
            specs.append(PartitionSpec() if axes is None else resolve(axes, shape=var.shape, **kw))
        return state_of(plan, values=specs)
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


def _target(x: Any, sharding: Any, mesh: Any, rules: Rules | None, mode: str | None, fit: bool = True) -> Any:
    """The sharding `x` is constrained to: a `NamedSharding` as given, else one on `mesh` from a
    `PartitionSpec` or from logical names (resolved with `x`'s shape when `fit`: an axis that does
    not divide evenly stays whole)."""
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding
    if isinstance(sharding, PartitionSpec):
        return NamedSharding(mesh, sharding)
    axes = annotation_axes("with_sharding_constraint", sharding, x.ndim)
    return NamedSharding(
        mesh, resolve(axes, shape=x.shape if fit else None, mesh=mesh, rules=rules, mode=mode)
    )


def with_sharding_constraint(
    x: Any,
    sharding: Any,
    *,
    mesh: Any = None,
    stage: Any = None,
    stage_mesh: Any = None,
    metadata: Any = None,
    ignore_mpmd: bool = False,
    rules: Rules | None = None,
    mode: str | None = None,
) -> Any:
    """Constrain `x` (an array or a pytree of arrays) to `sharding`: logical names (one per axis,
    resolved under the rules in force; mesh axis names stand for themselves), a `PartitionSpec`,
    or a `NamedSharding`. Under a trace it is a sharding constraint, eagerly a `jax.device_put`.

    With no mesh (given or active) it returns `x` unchanged, so a model runs on one device as
    written. On an MPMD mesh the constraint is on one stage's submesh (`stage`, `stage_mesh` or
    the `"stage"` of `metadata`); with no stage known, or `ignore_mpmd=True`, `x` is returned.
    """
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda a: place(a, sharding), x)
    given = current_mesh() if mesh is None else mesh
    if ignore_mpmd and getattr(given, "is_mpmd", False):
        return x
    target = get_current_stage_mesh(given, stage=stage, stage_mesh=stage_mesh, metadata=metadata)
    if target is None:
        return x
    return jax.tree.map(lambda a: place(a, _target(a, sharding, target, rules, mode)), x)


def with_sharding_constraint_by_name(x: Any, axis_names: Sequence[str | None]) -> Any:
    """Constrain `x` to logical `axis_names` under the rules and mesh in force (no mesh: `x`)."""
    return with_sharding_constraint(x, tuple(axis_names))


def lax_reshard(
    arr: Any,
    sharding: Any,
    *,
    mesh: Any = None,
    stage: Any = None,
    stage_mesh: Any = None,
    metadata: Any = None,
    ignore_mpmd: bool = False,
) -> Any:
    """`with_sharding_constraint` over a pytree: one sharding for every leaf, or a pytree of them
    like `arr` (`stage`, `stage_mesh`, `metadata`, `ignore_mpmd` as there)."""
    stage = dict(stage=stage, stage_mesh=stage_mesh, metadata=metadata, ignore_mpmd=ignore_mpmd)
    single = isinstance(sharding, jax.sharding.Sharding | PartitionSpec | Sharding | tuple | list)
    if single or sharding is None:
        return arr if sharding is None else with_sharding_constraint(arr, sharding, mesh=mesh, **stage)
    return jax.tree.map(lambda a, s: with_sharding_constraint(a, s, mesh=mesh, **stage), arr, sharding)


def with_partitioning(init: Callable[..., jax.Array], axis_names: Any) -> Callable[..., jax.Array]:
    """`init` annotated with logical `axis_names`: a layer given it as its weight initializer
    (without `sharding=`) stores those names on the weight."""

    def annotated(key: jax.Array, shape: Sequence[int], dtype: Any = None) -> jax.Array:
        return init(key, shape) if dtype is None else init(key, shape, dtype)

    annotated.sharding = Sharding(axis_names=annotation_axes("with_partitioning", axis_names))
    return annotated


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
            specs = get_partition_spec(x, rules=rules, mode=mode, mesh=mesh)._values
            for var, spec in zip(plan.vars, specs):
                if "axes" in var.metadata:
                    set_value(var, jax.device_put(var.value, NamedSharding(mesh, spec)))
        return x
    if axes is None:
        raise TypeError("apply_logical_sharding: give the array's logical axes, e.g. axes=('embed', 'mlp').")
    if mesh is None:
        return x
    return place(x, _target(x, axes, mesh, rules, mode, auto_correct))


class PartitionManager:
    """Rules from a `PartitionAxis`, entered as a context (`with PartitionManager(paxis):`).

    Inside the block its rules are in force (as with `logical_axis_rules`), and
    `get_current_partition_manager()` returns it; the latest one made is
    `get_partition_manager()`.
    """

    def __init__(self, paxis: PartitionAxis):
        self.paxis = paxis
        self._blocks: list = []
        _latest[0] = self

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
        block = logical_axis_rules(self.paxis.rules())
        block.__enter__()
        self._blocks.append((block, _current.set(self)))
        return self

    def __exit__(self, *exc: Any) -> None:
        block, token = self._blocks.pop()
        _current.reset(token)
        block.__exit__(*exc)


_current: contextvars.ContextVar[PartitionManager | None] = contextvars.ContextVar(
    "spx_partition_manager", default=None
)
_latest: list[PartitionManager | None] = [None]  # the latest manager made, process-wide


def get_current_partition_manager() -> PartitionManager | None:
    """The `PartitionManager` of the innermost `with manager:` block, or None."""
    return _current.get()


def get_partition_manager() -> PartitionManager | None:
    """The active `PartitionManager`, else the latest one made, else None."""
    return _current.get() or _latest[0]


def __getattr__(name: str) -> Any:
    if name == "SpxMesh":  # the mesh type of `create_mesh`, from the MPMD runtime
        import spectrax_mpmd

        return spectrax_mpmd.MpmdMesh
    raise AttributeError(f"module 'spectrax_eager.sharding' has no attribute {name!r}")


__all__ = [
    "SpxMesh",  # noqa: F405  (module __getattr__)
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
    *_mesh_names,
]
