"""`vmap` over functions that take modules: each module broadcast, or mapped along an axis
(`in_axes`, per collection with `StateAxes`); writes `mutable=` allows come back mapped."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax

from .._graph.module import Module, build, plan_of
from .lift import Split, all_allowed_values, allowed, changes, fn_name, write_allowed


class StateAxes:
    """A module's `in_axes` entry for `spx.vmap` per collection: `StateAxes({"parameters": 0,
    "rngs": None})` maps the parameters along axis 0 and broadcasts the rest (collections not
    named are broadcast)."""

    __slots__ = ("axes",)

    def __init__(self, axes: dict[str, int | None]):
        for kind, axis in dict(axes).items():
            if not isinstance(kind, str) or not (axis is None or isinstance(axis, int)):
                raise TypeError(
                    f"StateAxes: entries are collection name -> int axis or None; received {kind!r}: {axis!r}."
                )
        self.axes = dict(axes)

    def axis_of(self, kind: str) -> int | None:
        return self.axes.get(kind)

    def __repr__(self) -> str:
        return f"StateAxes({self.axes!r})"


def vmap(
    fn: Callable | None = None,
    in_axes: int | None | Sequence[Any] = 0,
    out_axes: Any = 0,
    *,
    axis_name: Any = None,
    axis_size: int | None = None,
    spmd_axis_name: Any = None,
    mutable: Any = None,
    sum_match: bool = False,
) -> Callable:
    """`jax.vmap` for functions that take modules (`sum_match` as in `jax.vmap`).

    A module argument is broadcast (its variables are shared by every batch
    element) unless `in_axes` is a tuple whose entry for it is an int: then
    all its variables are mapped along that axis (an ensemble); a `StateAxes`
    entry chooses per collection. Writes allowed
    by `mutable` come back with the module's axis.
    """
    if fn is None:  # `@spx.vmap(...)`: this call again, once given the function
        return functools.partial(vmap, **{k: v for k, v in locals().items() if k != "fn"})
    where = f"spx.vmap({fn_name(fn)})"

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        per_arg = tuple(in_axes) if isinstance(in_axes, list | tuple) else (in_axes,) * len(args)
        if len(per_arg) != len(args):
            raise ValueError(
                f"{where}: in_axes has {len(per_arg)} entries for {len(args)} positional arguments."
            )
        holes = tuple(_hole_out(a) for a in args)
        khole = {k: _hole_out(v) for k, v in kwargs.items()}
        split = Split(args, kwargs)
        ok = allowed(split.plan, mutable)
        var_axes = _variable_axes(split.plan, args, per_arg if isinstance(in_axes, list | tuple) else ())
        arg_axes = tuple(None if isinstance(a, Module) else ax for a, ax in zip(args, per_arg))
        static = split.static

        def pure(values, *call_args, **call_kwargs):
            roots, new_vars = _roots(static, values)
            full_args, full_kwargs = _fill_holes((call_args, call_kwargs), roots)
            out = fn(*full_args, **full_kwargs)
            changes(static, roots, new_vars, values, ok, where, mutable)
            return out, all_allowed_values(new_vars, ok)

        wr_axes = [ax for ax, k in zip(var_axes, ok) if k]
        mapped = jax.vmap(
            pure,
            in_axes=(var_axes, *arg_axes),
            out_axes=(out_axes, wr_axes),
            axis_name=axis_name,
            axis_size=axis_size,
            spmd_axis_name=spmd_axis_name,
            sum_match=sum_match,
        )
        out, new = mapped(split.values, *holes, **khole)
        write_allowed(split, ok, new)
        return out

    return wrapped


def _variable_axes(plan: Any, args: tuple, per_arg: tuple) -> list[Any]:
    """The vmapped axis of each variable of `plan` (None: broadcast): a module argument's
    entry of `per_arg` (an int, or a `StateAxes` choosing per collection) applies to all its
    variables; modules without an entry are broadcast."""
    var_axes: list[Any] = [None] * (len(plan.vars) if plan is not None else 0)
    if plan is not None:
        index = {id(v): i for i, v in enumerate(plan.vars)}
        for a, ax in zip(args, per_arg):
            if isinstance(a, Module) and ax is not None:
                for v in plan_of(a).vars:
                    var_axes[index[id(v)]] = ax.axis_of(v.kind) if isinstance(ax, StateAxes) else ax
    return var_axes


class _Hole:
    """Stands in for a module inside a transform's argument pytree (no leaves)."""

    __slots__ = ()


jax.tree_util.register_pytree_node(_Hole, lambda h: ((), None), lambda aux, ch: _Hole())


def _hole_out(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: _Hole() if isinstance(x, Module) else x, tree, is_leaf=lambda x: isinstance(x, Module)
    )


def _roots(static: tuple, values: list) -> tuple[list, list]:
    return build(static[0], values) if static[0] is not None else ([], [])


def _fill_holes(tree: Any, roots: list) -> Any:
    it = iter(roots)
    return jax.tree.map(
        lambda x: next(it) if isinstance(x, _Hole) else x, tree, is_leaf=lambda x: isinstance(x, _Hole)
    )
