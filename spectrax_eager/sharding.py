"""`spx.sharding`: the logical-sharding vocabulary over `spectrax_core.sharding`.

One mechanism: every name here resolves logical axis tokens (`"BATCH"`,
`"EMBED"`, ...) with `spectrax_core.sharding.spec` / `param_specs` /
`constrain` and a `spectrax_core.sharding.Rules`. This module adds the
context a PyTorch-shaped model reads them from:

* `with spx.sharding.logical_axis_rules(rules, mode="train"):` sets the rules
  (a `Rules`, a `PartitionAxis`, or a `{token: mesh axes}` mapping) that
  `current_axis_rules()` returns (default: `Rules.default()`);
* `with mesh:` (an `spx.create_mesh(...)` mesh, or `jax.set_mesh(mesh)`) sets
  the mesh that `current_mesh()` returns.

A layer given logical axes for a weight (`sharding=("EMBED", "MLP")`) places
it with `apply_logical_sharding(weight, axes)`: on the current mesh under the
current rules, unchanged when no mesh is set.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Mapping, Sequence

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

import spectrax_core as sc
from spectrax_core.sharding import BATCH, EMBED, EXPERT, HEAD, KV_HEAD, LENGTH, MLP, VOCAB, Rules

from ._module import Module, plan_of
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


def _axes_for(axes: Sequence[str | None], ndim: int | None) -> tuple[str | None, ...]:
    if isinstance(axes, PartitionSpec):
        raise TypeError("a PartitionSpec is already resolved; pass it to jax directly, not as logical axes.")
    if isinstance(axes, str):
        raise TypeError(f"axes must be a tuple of tokens (one per array axis); write ({axes!r},).")
    axes = tuple(axes)
    if not axes and ndim is not None:  # Replicated: any rank
        return (None,) * ndim
    return axes


@dataclasses.dataclass(frozen=True)
class PartitionAxis:
    """Which mesh axes each kind of array axis is split over, per mode.

    Each field is a mesh axis name, a tuple of names, or None; the defaults are
    those of `Rules.default()`. `rules()` gives the `spectrax_core.sharding.Rules`.
    """

    batch_axis: MeshAxes = ("dp", "fsdp")
    sequence_axis: MeshAxes = "sp"
    hidden_state_axis: MeshAxes = "fsdp"
    head_axis: MeshAxes = "tp"
    kv_head_axis: MeshAxes = "tp"
    mlp_axis: MeshAxes = "tp"
    vocab_axis: MeshAxes = "tp"
    expert_axis: MeshAxes = "ep"
    decode_batch_axis: MeshAxes = ("dp", "fsdp")
    decode_sequence_axis: MeshAxes = None
    decode_hidden_state_axis: MeshAxes = None

    def rules(self) -> Rules:
        """The `Rules` these axes describe (train and decode tables)."""
        train = {
            BATCH: self.batch_axis,
            LENGTH: self.sequence_axis,
            EMBED: self.hidden_state_axis,
            HEAD: self.head_axis,
            KV_HEAD: self.kv_head_axis,
            MLP: self.mlp_axis,
            VOCAB: self.vocab_axis,
            EXPERT: self.expert_axis,
        }
        decode = {
            **train,
            BATCH: self.decode_batch_axis,
            LENGTH: self.decode_sequence_axis,
            EMBED: self.decode_hidden_state_axis,
        }
        return Rules(train=train, decode=decode)


def _as_rules(rules: Rules | PartitionAxis | Mapping[str, MeshAxes]) -> Rules:
    if isinstance(rules, Rules):
        return rules
    if isinstance(rules, PartitionAxis):
        return rules.rules()
    if isinstance(rules, Mapping):
        return Rules.default().replace(**dict(rules))
    raise TypeError(
        "logical_axis_rules: expected a spectrax_core.sharding.Rules, an spx.sharding.PartitionAxis "
        f"or a {{token: mesh axes}} mapping; received {type(rules).__name__}."
    )


_rules_stack: list[tuple[Rules, str]] = []  # innermost last


@contextlib.contextmanager
def logical_axis_rules(
    rules: Rules | PartitionAxis | Mapping[str, MeshAxes], mode: str = "train"
) -> Iterator[Rules]:
    """Within the block, `current_axis_rules()` is `rules` and `current_mode()` is `mode`.

    A mapping adjusts the default rules: `logical_axis_rules({"EMBED": None})`.
    """
    resolved = _as_rules(rules)
    resolved.table(mode)  # an unknown mode fails here, with the core's message
    _rules_stack.append((resolved, mode))
    try:
        yield resolved
    finally:
        _rules_stack.pop()


def current_axis_rules() -> Rules:
    """The rules of the innermost `logical_axis_rules` block, else `Rules.default()`."""
    return _rules_stack[-1][0] if _rules_stack else Rules.default()


def current_mode() -> str:
    """The mode of the innermost `logical_axis_rules` block, else `"train"`."""
    return _rules_stack[-1][1] if _rules_stack else "train"


def current_mesh() -> Mesh | AbstractMesh | None:
    """The mesh set by `with mesh:` / `jax.set_mesh(mesh)`, or None (an MPMD axis is kept).

    While a function is traced only the mesh's shape is known: an `AbstractMesh` then.
    """
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # under a trace
        mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def _mesh(mesh: Any) -> Mesh | None:
    if mesh is None:
        return current_mesh()
    return getattr(mesh, "jax_mesh", mesh)


def get_partition_spec(
    x_or_axes: Any, *, rules: Rules | None = None, mode: str | None = None, mesh: Any = None
) -> Any:
    """The `PartitionSpec` for logical axes, or the specs of what an object holds.

    * a tuple of tokens (or a prebuilt name such as `ColumnWise`): its spec under the
      current (or given) rules and mesh;
    * an `spx.Module`: a `State` of the spec of every variable with `axes` metadata
      (others `PartitionSpec()`), resolved with the variable's shape;
    * a `jax.Array`: the spec of its current sharding;
    * any other pytree (core params): `spectrax_core.sharding.param_specs`.
    """
    rules = current_axis_rules() if rules is None else rules
    mode = current_mode() if mode is None else mode
    mesh = _mesh(mesh)
    if isinstance(x_or_axes, Module):
        plan = plan_of(x_or_axes)
        specs = [
            sc.sharding.spec(_axes_for(v.metadata["axes"], v.ndim), rules, mode, mesh, shape=v.shape)
            if "axes" in v.metadata
            else PartitionSpec()
            for v in plan.vars
        ]
        return state_of(plan, values=specs)
    if isinstance(x_or_axes, jax.Array):
        sharding = x_or_axes.sharding
        return sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
    if isinstance(x_or_axes, tuple | list) and all(a is None or isinstance(a, str) for a in x_or_axes):
        return sc.sharding.spec(_axes_for(x_or_axes, None), rules, mode, mesh)
    return sc.sharding.param_specs(x_or_axes, rules, mode, mesh)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def get_named_sharding(
    x_or_axes: Any, mesh: Any = None, *, rules: Rules | None = None, mode: str | None = None
) -> Any:
    """`get_partition_spec` wrapped in `NamedSharding`s over `mesh` (default: the current mesh)."""
    mesh = _mesh(mesh)
    if mesh is None:
        raise ValueError(
            "get_named_sharding: no mesh; pass mesh= or call inside `with mesh:` (spx.create_mesh) "
            "or `jax.set_mesh(mesh)`."
        )
    specs = get_partition_spec(x_or_axes, rules=rules, mode=mode, mesh=mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def with_sharding_constraint(
    x: jax.Array,
    axes: Sequence[str | None] | PartitionSpec,
    *,
    rules: Rules | None = None,
    mode: str | None = None,
) -> jax.Array:
    """Constrain `x`'s sharding to logical `axes` (or a `PartitionSpec`) on the current mesh.

    With no mesh set it returns `x` unchanged, so a model runs on one device as written.
    """
    mesh = current_mesh()
    if mesh is None:
        return x
    if isinstance(axes, PartitionSpec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, axes))
    rules = current_axis_rules() if rules is None else rules
    mode = current_mode() if mode is None else mode
    return sc.sharding.constrain(x, _axes_for(axes, x.ndim), rules, mesh, mode)


def apply_logical_sharding(
    x: Any,
    axes: Sequence[str | None] | None = None,
    *,
    mesh: Any = None,
    rules: Rules | None = None,
    mode: str | None = None,
) -> Any:
    """Place `x` as its logical axes say, on the current (or given) mesh.

    * an array with `axes`: traced, a sharding constraint; concrete, `jax.device_put`
      to its `NamedSharding`; returned unchanged when no mesh is set;
    * an `spx.Module`: every variable with `axes` metadata is placed in place; returns it.
    """
    mesh = _mesh(mesh)
    rules = current_axis_rules() if rules is None else rules
    mode = current_mode() if mode is None else mode
    if isinstance(x, Module):
        if mesh is not None:
            plan = plan_of(x)
            for var, spec in zip(plan.vars, get_partition_spec(x, rules=rules, mode=mode, mesh=mesh)._values):
                if "axes" in var.metadata:
                    set_value(var, jax.device_put(var.value, NamedSharding(mesh, spec)))
        return x
    if axes is None:
        raise TypeError("apply_logical_sharding: give the array's logical axes, e.g. axes=('EMBED', 'MLP').")
    if mesh is None:
        return x
    axes = _axes_for(axes, x.ndim)
    if isinstance(x, jax.core.Tracer):
        return sc.sharding.constrain(x, axes, rules, mesh, mode)
    spec = sc.sharding.spec(axes, rules, mode, mesh, shape=x.shape)
    return jax.device_put(x, NamedSharding(mesh, spec))


__all__ = [
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
    "Replicated",
    "RowWise",
    "Rules",
    "apply_logical_sharding",
    "current_axis_rules",
    "current_mesh",
    "current_mode",
    "get_named_sharding",
    "get_partition_spec",
    "logical_axis_rules",
    "with_sharding_constraint",
]
