"""Logical axes turned into constraints and placements of arrays: named axis tuples
(`ColumnWise`, ...), `with_sharding_constraint` and its pytree and by-name forms, initializers
annotated with axes, and placing an array by its axes on the current mesh."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from spectrax_core.sharding import BATCH, EMBED, EXPERT, HEAD, KV_HEAD, LENGTH, MLP, VOCAB, Rules

from .mesh import get_current_stage_mesh
from .named import place
from .rules import Sharding, annotation_axes, as_jax_mesh, current_mesh, resolve


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


def fitted(x: Any, sharding: Any, mesh: Any, rules: Rules | None, mode: str | None, fit: bool = True) -> Any:
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
    return jax.tree.map(lambda a: place(a, fitted(a, sharding, target, rules, mode)), x)


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


def place_by_axes(x: Any, axes: Any) -> Any:
    """`x` placed by its logical `axes` under the rules in force on the current mesh (unchanged
    with no mesh): `apply_logical_sharding(x, axes=axes)` for an array."""
    mesh = as_jax_mesh(None)
    return x if mesh is None else place(x, fitted(x, axes, mesh, None, None))
