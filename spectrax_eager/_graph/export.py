"""Moving values between models and `State`s: `export(model)` splits a model into its structure
(`GraphDef`, hashable) and a `State`; `bind` rebuilds a model; `update` writes a State into a live
model; `clone`, `tree_state` and `partition_state` build on them."""

from __future__ import annotations

from typing import Any

from .module import Module, Plan, _walk, build, plan_of, require_module
from .selector import as_selector, info_variable
from .state import State, state_of
from .structure import GraphDef, VarInfo
from .variable import set_value


def export(model: Module) -> tuple[GraphDef, State]:
    """Split `model` into its hashable structure and a State of all its values."""
    plan = plan_of(require_module(model, "export"))
    return plan.graphdef, state_of(plan)


def tree_state(model: Module) -> State:
    """A State of every variable of `model` (use `.filter(selector)` for a subset)."""
    return state_of(plan_of(require_module(model, "tree_state")))


def _path_index(plan: Plan) -> dict[tuple[str, str], int]:
    idx = plan.masks.get("paths")
    if idx is None:
        idx = plan.masks["paths"] = {(i.kind, i.path): j for j, i in enumerate(plan.infos)}
    return idx


def bind(graphdef: GraphDef, *states: State) -> Module:
    """A new module with `graphdef`'s structure and the values of `states` (merged, later wins)."""
    if not isinstance(graphdef, GraphDef):
        raise TypeError(f"bind: expected a GraphDef from spx.export, received {type(graphdef).__name__}.")
    roots, _ = build(graphdef, [None] * graphdef.num_variables)
    plan = _walk(tuple(roots))
    values: list[Any] = [_MISSING] * graphdef.num_variables
    index = _path_index(plan)
    for state in states:
        for key, value in state.flat().items():
            j = index.get(key)
            if j is None:
                raise ValueError(
                    f"bind: the State has {key[0]}/{key[1]}, which the GraphDef does not contain."
                )
            values[j] = value
    missing = [f"{i.kind}/{i.path}" for i, v in zip(plan.infos, values) if v is _MISSING]
    if missing:
        raise ValueError(f"bind: no value given for {missing}; pass the full State from spx.export.")
    for var, value in zip(plan.vars, values):
        set_value(var, value)
    return roots[0]


_MISSING = object()


def update(model: Module, *states: State) -> None:
    """Write the values of `states` into the matching variables of `model` (by collection and path)."""
    plan = plan_of(require_module(model, "update"))
    index = _path_index(plan)
    for state in states:
        if not isinstance(state, State):
            raise TypeError(f"update: expected spx.State values, received {type(state).__name__}.")
        for info, value in zip(state._infos, state._values):
            j = index.get((info.kind, info.path))
            if j is None:
                raise ValueError(
                    f"update: {type(model).__name__} has no variable {info.kind}/{info.path}; "
                    f"its variables are {sorted(index)[:8]}..."
                )
            set_value(plan.vars[j], value)


def clone(model: Module) -> Module:
    """A structurally identical, independent copy of `model`. Arrays are shared (they are
    immutable), so a call that donates them (`spx.run(..., optimizer=)`, `spx.jit` with
    `donate_argnums`) consumes them for both: copy them (`jax.tree.map(jnp.copy, ...)`) for a
    copy that must outlive such a call."""
    return bind(*export(model))


def partition_state(model: Module | State, *selectors: Any) -> tuple[State, ...]:
    """Split the State (of a model, or a State) by `selectors`: one State each, plus the rest.

    Each variable goes to the first selector that matches it.
    """
    state = tree_state(model) if isinstance(model, Module) else model
    sels = [as_selector(s) for s in selectors]
    groups: list[list[tuple[VarInfo, Any]]] = [[] for _ in range(len(sels) + 1)]
    for info, value in zip(state._infos, state._values):
        var = info_variable(info, value)
        g = next((k for k, s in enumerate(sels) if s.match(info, var)), len(sels))
        groups[g].append((info, value))
    return tuple(State(tuple(i for i, _ in g), [v for _, v in g]) for g in groups)
