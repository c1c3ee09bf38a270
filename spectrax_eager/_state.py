"""State: a model's values as `{collection: {path: value}}`, and the functions that move them.

`export(model)` splits a model into its structure (`GraphDef`, hashable) and a
`State`; `bind` rebuilds a model; `update` writes a State into a live model;
`clone`, `tree_state`, `iter_variables`, `partition_state`, `freeze` build on them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax

from . import _graph
from ._graph import GraphDef, VarInfo
from ._module import Module, Plan, _walk, build, plan_of
from ._selector import as_selector, info_variable, mask
from ._variable import Variable, set_value


class State(Mapping):
    """An immutable mapping `{collection: {path: value}}`, and a pytree over the values.

    Two States with the same variables (paths, classes, collections, metadata)
    have the same pytree structure, so `jax.tree.map(f, params, grads)` and
    optax work on them directly.
    """

    __slots__ = ("_infos", "_values")

    def __init__(self, infos: tuple[VarInfo, ...], values: list):
        self._infos = tuple(infos)
        self._values = list(values)

    def __getitem__(self, collection: str) -> dict[str, Any]:
        out = {i.path: v for i, v in zip(self._infos, self._values) if i.kind == collection}
        if not out:
            raise KeyError(f"State has no collection {collection!r}; it has {sorted(self)}.")
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(i.kind for i in self._infos))

    def __len__(self) -> int:
        return len(set(i.kind for i in self._infos))

    def flat(self) -> dict[tuple[str, str], Any]:
        """`{(collection, path): value}`."""
        return {(i.kind, i.path): v for i, v in zip(self._infos, self._values)}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """A plain nested dict `{collection: {path: value}}`."""
        return {k: self[k] for k in self}

    def filter(self, selector: Any) -> State:
        """The sub-State of the entries `selector` matches."""
        sel = as_selector(selector)
        keep = [(i, v) for i, v in zip(self._infos, self._values) if sel.match(i, info_variable(i, v))]
        return State(tuple(i for i, _ in keep), [v for _, v in keep])

    def __repr__(self) -> str:
        lines = [f"  {i.kind}/{i.path}: {_short(v)}" for i, v in zip(self._infos, self._values)]
        return "State(\n" + "\n".join(lines) + "\n)" if lines else "State()"


def _short(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{value.dtype}[{','.join(map(str, value.shape))}]"
    return repr(value)


jax.tree_util.register_pytree_with_keys(
    State,
    lambda s: (
        [(jax.tree_util.GetAttrKey(f"{i.kind}/{i.path}"), v) for i, v in zip(s._infos, s._values)],
        s._infos,
    ),
    lambda infos, values: State(infos, values),
    lambda s: (s._values, s._infos),
)


def state_of(plan: Plan, selected: tuple[bool, ...] | None = None, values: list | None = None) -> State:
    """The State of a single-root plan (optionally only the `selected` variables / given values)."""
    vals = [v._value for v in plan.vars] if values is None else values
    if selected is None:
        return State(plan.infos, vals)
    return State(
        tuple(i for i, s in zip(plan.infos, selected) if s), [v for v, s in zip(vals, selected) if s]
    )


def _require_module(obj: Any, fn: str) -> Module:
    if not isinstance(obj, Module):
        raise TypeError(f"{fn}: expected an spx.Module, received {type(obj).__name__}.")
    return obj


def export(model: Module) -> tuple[GraphDef, State]:
    """Split `model` into its hashable structure and a State of all its values."""
    plan = plan_of(_require_module(model, "export"))
    return plan.graphdef, state_of(plan)


def tree_state(model: Module) -> State:
    """A State of every variable of `model` (use `.filter(selector)` for a subset)."""
    return state_of(plan_of(_require_module(model, "tree_state")))


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
    plan = plan_of(_require_module(model, "update"))
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
    """A structurally identical, independent copy of `model` (arrays are shared; they are immutable)."""
    return bind(*export(model))


def iter_variables(model: Module, select: Any = True) -> Iterator[tuple[str, Variable]]:
    """Yield `(path, variable)` for each variable `select` matches, in plan order."""
    plan = plan_of(_require_module(model, "iter_variables"))
    for info, var, keep in zip(plan.infos, plan.vars, mask(plan, select)):
        if keep:
            yield info.path, var


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


def freeze(model: Module, selector: Any = True) -> Module:
    """Mark the selected variables `trainable=False`: `grad` and `Optimizer` then skip them."""
    for _, var in list(iter_variables(model, selector)):
        var.metadata["trainable"] = False
    _graph.bump()
    return model


def unfreeze(model: Module, selector: Any = True) -> Module:
    """Undo `freeze` for the selected variables."""
    for _, var in list(iter_variables(model, selector)):
        var.metadata.pop("trainable", None)
    _graph.bump()
    return model


def trainable(plan: Plan, wrt: Any) -> tuple[bool, ...]:
    """`wrt`'s mask minus frozen variables (cached)."""
    key = ("trainable", wrt if not isinstance(wrt, list) else tuple(wrt))
    try:
        hit = plan.masks.get(key)
    except TypeError:
        key, hit = None, None
    if hit is not None:
        return hit
    sel = mask(plan, wrt)
    out = tuple(s and v.metadata.get("trainable", True) is not False for s, v in zip(sel, plan.vars))
    if key is not None:
        plan.masks[key] = out
    return out
