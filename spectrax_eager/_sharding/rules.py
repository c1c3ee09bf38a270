"""The logical-axis context: which rules are in force, and how annotations resolve.

Annotations are metadata: a layer built with `sharding=("fsdp", "tp_head")`
stores those names on its weight and resolves nothing. Names are turned into
mesh axes late, when a spec is asked for (`get_partition_spec`, placement
under a mesh, `with_sharding_constraint_by_name`), under the innermost
`logical_axis_rules(...)` block and the active mesh:

* a name a rule maps -> the rule's mesh axes (`None` = unsharded);
* else a name the mesh has as an axis -> that mesh axis;
* else, inside a `logical_axis_rules` block with a mesh active -> an error (a
  typo, detected at the first moment it can be); otherwise unsharded.

The rules start from `spectrax_core.sharding.Rules.default()` (the core
layers' own `EMBED`, `MLP`, ... tokens), and each block's pairs override the
enclosing block's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

import spectrax_core as sc
from spectrax_core.sharding import Rules

from .._compat.partition_axis import MeshAxes, PartitionAxis
from .._scope import ambient


@dataclasses.dataclass(frozen=True)
class Sharding:
    """A sharding annotation: logical `axis_names` (one per array axis), or explicit `mesh_axes`.

    Accepted wherever a layer or Variable takes `sharding=`; a plain tuple of names
    means the same as `Sharding(axis_names=...)`.
    """

    axis_names: tuple[str | None, ...] | None = None
    mesh_axes: tuple[str | None, ...] | None = None

    def __post_init__(self):
        for name in ("axis_names", "mesh_axes"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        if self.axis_names is not None and self.mesh_axes is not None:
            raise ValueError("Sharding: give axis_names or mesh_axes, not both.")

    @property
    def axes(self) -> tuple[str | None, ...] | None:
        """The names stored as a Variable's `axes` metadata."""
        return self.axis_names if self.axis_names is not None else self.mesh_axes

    def to_partition_spec(self, mesh_map: Mapping[str, MeshAxes] | None = None) -> PartitionSpec | None:
        """The spec under `mesh_map` (default: the rules in force), with no mesh consulted."""
        if self.axes is None:
            return None
        if mesh_map is not None:
            return PartitionSpec(*(None if a is None else mesh_map.get(a) for a in self.axes))
        return resolve(self.axes)


def annotation_axes(where: str, sharding: Any, ndim: int | None = None) -> tuple[str | None, ...] | None:
    """The logical names of a `sharding=` annotation (a tuple of names/None, a `Sharding`,
    or None); checks the form and, when `ndim` is known, the count. Names are not resolved."""
    if sharding is None:
        return None
    if isinstance(sharding, Sharding):
        sharding = sharding.axes
        if sharding is None:
            return None
    if isinstance(sharding, str) or not isinstance(sharding, tuple | list | PartitionSpec):
        raise TypeError(
            f"{where}: sharding= takes one logical axis name (or None) per array axis, e.g. "
            f"('embed', 'mlp'), or an spx.Sharding; received {sharding!r}."
        )
    axes = tuple(sharding)
    for name in axes:
        if name is not None and not isinstance(name, str):
            raise TypeError(
                f"{where}: each entry of sharding= must be a name (str) or None; received {sharding!r}."
            )
    if ndim is not None:
        axes = axes or (None,) * ndim  # `spx.sharding.Replicated` is () for any rank
        if len(axes) != ndim:
            raise ValueError(
                f"{where}: sharding={axes} names {len(axes)} axes but the array has {ndim}; "
                "give one name (or None) per array axis."
            )
    return axes


def _as_rules(base: Rules, rules: Any) -> Rules:
    """`rules` as a `Rules`: a Rules object replaces `base`; pairs or a mapping adjust it."""
    if isinstance(rules, Rules):
        return rules
    if isinstance(rules, PartitionAxis):
        return rules.rules()
    if isinstance(rules, Mapping):
        pairs = list(rules.items())
    elif isinstance(rules, Sequence) and not isinstance(rules, str):
        pairs = list(rules)
        for pair in pairs:
            if not (isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], str)):
                raise TypeError(
                    "logical_axis_rules: each rule is a (logical name, mesh axis | axes | None) pair, "
                    f"e.g. [('embed', 'fsdp'), ('heads', 'tp')]; received {pair!r}."
                )
    else:
        raise TypeError(
            "logical_axis_rules: expected a list of (logical name, mesh axes) pairs, a {name: mesh axes} "
            f"mapping, a spectrax_core.sharding.Rules or an spx.sharding.PartitionAxis; received "
            f"{type(rules).__name__}."
        )
    stated = dict(pairs)
    return dataclasses.replace(
        base, train={**dict(base.train), **stated}, decode={**dict(base.decode), **stated}
    )


class RulesBlock(NamedTuple):
    """One open rules block on the ambient `rules` stack (the only stack of rules)."""

    rules: Rules
    mode: str
    manager: Any = None  # the `PartitionManager` that opened it (None: `logical_axis_rules`)


@contextlib.contextmanager
def rules_block(rules: Any, mode: str = "train", manager: Any = None) -> Iterator[Rules]:
    """The block of `logical_axis_rules`, opened for `manager` when a `PartitionManager` enters."""
    resolved = _as_rules(current_rules(), rules)
    resolved.table(mode)  # an unknown mode fails here, with the core's message
    with ambient.pushing("rules", RulesBlock(resolved, mode, manager)):
        yield resolved


@contextlib.contextmanager
def logical_axis_rules(rules: Any, mode: str = "train") -> Iterator[Rules]:
    """Within the block, logical names resolve with `rules` (in `mode`: "train" or "decode").

    `rules` is a list of `(name, mesh axis | tuple of axes | None)` pairs, or a
    mapping of the same; they override the enclosing block's rules (at top
    level: the defaults). A `spectrax_core.sharding.Rules` replaces them whole.
    """
    with rules_block(rules, mode) as resolved:
        yield resolved


def current_rules() -> Rules:
    """The `Rules` of the innermost `logical_axis_rules` block, else `Rules.default()`."""
    blocks = ambient.current().rules
    return blocks[-1].rules if blocks else Rules.default()


def current_manager() -> Any:
    """The `PartitionManager` of the innermost block a manager opened, or None."""
    for block in reversed(ambient.current().rules):
        if block.manager is not None:
            return block.manager
    return None


def current_axis_rules() -> dict[str, tuple[str, ...] | str | None]:
    """`{logical name: mesh axes}` in force now (current mode): a fresh dict.

    A name maps to None (unsharded), one mesh axis name, or a tuple of names.
    """
    table = current_rules().table(current_mode())
    return {name: None if not axes else axes[0] if len(axes) == 1 else axes for name, axes in table.items()}


def current_mode() -> str:
    """The mode of the innermost `logical_axis_rules` block, else `"train"`."""
    blocks = ambient.current().rules
    return blocks[-1].mode if blocks else "train"


def rules_active() -> bool:
    """Whether a `logical_axis_rules` block is open (then unknown names are errors under a mesh)."""
    return bool(ambient.current().rules)


def current_mesh() -> Mesh | AbstractMesh | None:
    """The mesh set by `with mesh:` (an `spx.create_mesh` mesh) / `jax.set_mesh(mesh)`, or None.

    While a function is traced only the mesh's shape is known: an `AbstractMesh` then. A
    pipeline mesh's `with mesh:` leaves JAX's context mesh unset (see `_pipeline/spx_mesh.py`):
    outside a trace its `jax_mesh` is the current mesh then.
    """
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # under a trace
        mesh = jax.sharding.get_abstract_mesh()
        return None if mesh is None or mesh.empty else mesh
    if mesh is None or mesh.empty:
        pipeline = ambient.current().mesh
        return None if pipeline is None else pipeline.jax_mesh
    return mesh


def as_jax_mesh(mesh: Any) -> Mesh | AbstractMesh | None:
    """`mesh` as a jax mesh (an MPMD mesh gives its `jax_mesh`); None gives the current mesh."""
    if mesh is None:
        return current_mesh()
    return getattr(mesh, "jax_mesh", mesh)


def unknown_policy(mesh: Any) -> str:
    """How names nobody knows resolve: an error under a mesh and active rules, else unsharded."""
    return "error" if mesh is not None and rules_active() else "replicate"


def resolve(
    axes: Sequence[str | None],
    *,
    shape: Sequence[int] | None = None,
    mesh: Any = None,
    rules: Rules | None = None,
    mode: str | None = None,
) -> PartitionSpec:
    """The `PartitionSpec` of logical `axes` under the rules and mesh in force (or given)."""
    mesh = as_jax_mesh(mesh)
    rules = current_rules() if rules is None else rules
    mode = current_mode() if mode is None else mode
    if not tuple(axes) and shape is not None:
        axes = (None,) * len(shape)
    return sc.sharding.spec(tuple(axes), rules, mode, mesh, shape=shape, unknown=unknown_policy(mesh))
