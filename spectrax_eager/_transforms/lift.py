"""Turning calls on modules into pure functions of arrays, and back.

Every transform does the same three steps:

1. `split(args, kwargs)`: find the modules among the arguments (anywhere in
   the pytrees), take the joint `Plan` of them (shared Variables appear once)
   and their current values; everything else stays as ordinary leaves.
2. inside the JAX transform, `rebuild(...)` makes fresh module objects holding
   the traced values and calls the user's function on them;
3. `changes(...)` reports which Variables the function wrote, raising
   `IllegalMutationError` for writes its `mutable=` selector does not allow and
   `StructureChangeError` if the graph changed; the caller writes the allowed
   new values back into the original Variables.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from .._errors import IllegalMutationError, StructureChangeError
from .._graph.module import Module, Plan, _walk, build, joint_plan
from .._graph.selector import mask
from .._graph.variable import set_value


def _is_module(x: Any) -> bool:
    return isinstance(x, Module)


class Split:
    """The arguments of one call, split into the module plan and the other leaves."""

    __slots__ = ("plan", "treedef", "mod_pos", "leaves")

    def __init__(self, args: tuple, kwargs: dict):
        if not kwargs:  # fast path: top-level modules and arrays only (the common call)
            pos, leaves = [], []
            for i, a in enumerate(args):
                if isinstance(a, Module):
                    pos.append(i)
                elif isinstance(a, jax.Array):
                    leaves.append(a)
                else:
                    break
            else:
                self.treedef = None
                self.mod_pos = tuple(pos)
                self.leaves = leaves
                self.plan = joint_plan(tuple(args[i] for i in pos)) if pos else None
                return
        leaves, self.treedef = jax.tree.flatten((args, kwargs), is_leaf=_is_module)
        self.mod_pos = tuple(i for i, x in enumerate(leaves) if isinstance(x, Module))
        if self.mod_pos:
            self.plan: Plan | None = joint_plan(tuple(leaves[i] for i in self.mod_pos))
            self.leaves = [x for x in leaves if not isinstance(x, Module)]
        else:
            self.plan = None
            self.leaves = leaves

    @property
    def values(self) -> list:
        return [v._value for v in self.plan.vars] if self.plan is not None else []

    @property
    def static(self) -> tuple:
        """What a traced function closes over: structure only, hashable."""
        return (self.plan.graphdef if self.plan is not None else None, self.treedef, self.mod_pos)

    def write_back(self, updates: dict[int, Any]) -> None:
        vars_ = self.plan.vars
        for i, value in updates.items():
            set_value(vars_[i], value)


def rebuild(static: tuple, values: list, leaves: list) -> tuple[tuple, dict, list, list]:
    """`(args, kwargs, roots, variables)` with fresh modules holding `values`."""
    graphdef, treedef, mod_pos = static
    roots, new_vars = build(graphdef, values) if graphdef is not None else ([], [])
    full = list(leaves)
    for p, r in zip(mod_pos, roots):
        full.insert(p, r)
    if treedef is None:  # the fast path's layout: positional arguments only
        return tuple(full), {}, roots, new_vars
    args, kwargs = jax.tree.unflatten(treedef, full)
    return args, kwargs, roots, new_vars


def allowed(plan: Plan | None, mutable: Any) -> tuple[bool, ...]:
    """Which variables a function may write: `mutable`'s selection plus the `"rngs"` collection."""
    if plan is None:
        return ()
    key = ("mutable", mutable if not isinstance(mutable, list) else tuple(mutable))
    try:
        hit = plan.masks.get(key)
    except TypeError:
        key, hit = None, None
    if hit is None:
        hit = tuple(m or i.kind == "rngs" for m, i in zip(mask(plan, mutable), plan.infos))
        if key is not None:
            plan.masks[key] = hit
    return hit


def changes(
    static: tuple, roots: list, new_vars: list, values: list, ok: tuple[bool, ...], where: str, mutable: Any
) -> dict[int, Any]:
    """`{index: new value}` of the variables the function wrote; raises on illegal writes."""
    graphdef = static[0]
    if graphdef is None:
        return {}
    if _walk(tuple(roots)).graphdef != graphdef:
        raise StructureChangeError(
            f"{where}: the function added, removed or replaced a sub-module or Variable (or changed a "
            "static attribute) of a module it received. Structure must be fixed inside a transform: "
            "build it before (lazy layers: call the model once eagerly first)."
        )
    out = {i: v._value for i, v in enumerate(new_vars) if v._value is not values[i]}
    bad = [i for i in out if not ok[i]]
    if bad:
        infos = [_info(roots, new_vars, i) for i in bad]
        raise IllegalMutationError(
            f"{where}: the function wrote {', '.join(infos)}, which mutable={mutable!r} does not allow. "
            f"Pass mutable= a selector covering it (e.g. mutable={sorted({_kind(new_vars, i) for i in bad})!r})."
        )
    return out


def _kind(new_vars: list, i: int) -> str:
    return new_vars[i].kind


def _info(roots: list, new_vars: list, i: int) -> str:
    plan = _walk(tuple(roots))
    return f"{plan.infos[i].kind}/{plan.infos[i].path}"


def all_allowed_values(new_vars: list, ok: tuple[bool, ...]) -> list:
    """The current values of every writable variable (for transforms that need fixed outputs)."""
    return [v._value for v, k in zip(new_vars, ok) if k]


def write_allowed(split: Split, ok: tuple[bool, ...], new_values: list) -> None:
    """Write `new_values` (one per writable variable, in order) into the original variables."""
    it = iter(new_values)
    for var, k in zip(split.plan.vars if split.plan is not None else (), ok):
        if k:
            set_value(var, next(it))


def fn_name(fn: Callable) -> str:
    """`fn`'s name for messages (`"fn"` when it has none)."""
    return getattr(fn, "__name__", "fn")


def pure_call(
    fn: Callable, split: Split, ok: tuple[bool, ...], where: str, mutable: Any, fixed: bool
) -> Callable:
    """`pure(values, leaves) -> (out, updates)`; `fixed` returns every writable value (branches, vmap)."""
    static = split.static

    def pure(values: list, leaves: list) -> tuple[Any, Any]:
        args, kwargs, roots, new_vars = rebuild(static, values, leaves)
        out = fn(*args, **kwargs)
        upd = changes(static, roots, new_vars, values, ok, where, mutable)
        return out, (all_allowed_values(new_vars, ok) if fixed else upd)

    return pure
