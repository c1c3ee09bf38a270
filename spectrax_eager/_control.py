"""Control flow and other transforms over modules: scan, remat_scan, while_loop, fori_loop,
cond, switch, remat, vmap, eval_shape.

Modules are accepted anywhere in the arguments. Carried modules (`scan`'s
`init`, a loop's `init_val`) thread their values through the carry, so writes
that `mutable=` allows persist across iterations and are written back at the
end; modules in `scan`'s `xs` are sliced along their leading axis and are
read-only. For `cond` / `switch` / `vmap` / `remat` / `eval_shape`, modules are
closed over as inputs and writable variables come back as outputs.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax

from ._lift import Split, all_allowed_values, allowed, changes, rebuild, write_allowed
from ._module import Module, plan_of


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", "fn")


# ----------------------------------------------------------------- carries


class _Carry:
    """A pytree that may hold modules, as `(values, leaves)` to thread through a loop."""

    def __init__(self, tree: Any, mutable: Any):
        self.split = Split((tree,), {})
        self.ok = (
            allowed(self.split.plan, mutable) if mutable is not False else (False,) * len(self.split.values)
        )
        self.mutable = mutable

    def pure_in(self) -> tuple[list, list]:
        return self.split.values, self.split.leaves

    def unpack(self, carry: tuple[list, list]) -> tuple[Any, list, list, list]:
        vals, leaves = carry
        (tree,), _, roots, new_vars = rebuild(self.split.static, vals, leaves)
        return tree, roots, new_vars, vals

    def pack(self, tree: Any, roots: list, new_vars: list, vals: list, where: str) -> tuple[list, list]:
        changes(self.split.static, roots, new_vars, vals, self.ok, where, self.mutable)
        out = Split((tree,), {})
        if out.static != self.split.static:
            raise ValueError(
                f"{where}: the carry returned by the body has a different structure "
                "(module graph, pytree or module positions) than the one it received."
            )
        new_vals = out.values
        bad = [i for i, (a, b) in enumerate(zip(new_vals, vals)) if a is not b and not self.ok[i]]
        if bad:
            from ._errors import IllegalMutationError

            raise IllegalMutationError(
                f"{where}: the body returned new values for {[self.split.plan.infos[i].path for i in bad]}, "
                f"which mutable={self.mutable!r} does not allow."
            )
        return new_vals, out.leaves

    def finish(self, carry: tuple[list, list]) -> Any:
        """Write the final values back into the original modules; return the user's carry."""
        vals, leaves = carry
        if self.split.plan is not None:
            write_allowed(self.split, self.ok, [v for v, k in zip(vals, self.ok) if k])
        full = list(leaves)
        for p, r in zip(self.split.mod_pos, self.split.plan.roots if self.split.plan else ()):
            full.insert(p, r)
        if self.split.treedef is None:
            return full[0]
        (tree,), _ = jax.tree.unflatten(self.split.treedef, full)
        return tree


def scan(
    f: Callable,
    init: Any,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    *,
    mutable: Any = None,
    _checkpoint: Callable | None = None,
) -> tuple[Any, Any]:
    """`jax.lax.scan` where `init` and `xs` may contain modules.

    Modules in `init` are carried (writes allowed by `mutable` persist); modules
    in `xs` have stacked variables (leading axis = iteration) and each step sees
    one slice, read-only. Returns `(final_carry, stacked_ys)`.
    """
    where = f"spx.scan({_name(f)})"
    carry = _Carry(init, mutable)
    xsc = _Carry(xs, False)

    def body(c, x):
        c_tree, c_roots, c_vars, c_vals = carry.unpack(c)
        x_tree, x_roots, x_vars, x_vals = xsc.unpack(x)
        new_c, y = f(c_tree, x_tree)
        changes(
            xsc.split.static, x_roots, x_vars, x_vals, xsc.ok, where + " (xs modules are read-only)", None
        )
        return carry.pack(new_c, c_roots, c_vars, c_vals, where), y

    if _checkpoint is not None:
        body = _checkpoint(body)
    final, ys = jax.lax.scan(
        body, carry.pure_in(), xsc.pure_in(), length=length, reverse=reverse, unroll=unroll
    )
    return carry.finish(final), ys


def remat_scan(
    f: Callable,
    init: Any,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    *,
    mutable: Any = None,
    policy: Callable | None = None,
    prevent_cse: bool = True,
) -> tuple[Any, Any]:
    """`scan` whose body is rematerialised (`jax.checkpoint`) in the backward pass: the memory of
    one step instead of all steps, for stacked layers."""
    ckpt = functools.partial(jax.checkpoint, policy=policy, prevent_cse=prevent_cse)
    return scan(f, init, xs, length, reverse, unroll, mutable=mutable, _checkpoint=ckpt)


_NO_CARRY = object()


def while_loop(
    cond_fun: Callable, body_fun: Callable, init_val: Any, init_carry: Any = _NO_CARRY, *, mutable: Any = None
) -> Any:
    """`jax.lax.while_loop` where `init_val` may contain modules (carried; `cond_fun` may not write).

    With `init_carry`, `init_val` is a module passed to `cond_fun(module, carry)` and
    `body_fun(module, carry) -> carry`, and the final carry is returned.
    """
    if init_carry is not _NO_CARRY:
        _, out = while_loop(
            lambda mc: cond_fun(*mc),
            lambda mc: (mc[0], body_fun(*mc)),
            (init_val, init_carry),
            mutable=mutable,
        )
        return out
    where = f"spx.while_loop({_name(body_fun)})"
    carry = _Carry(init_val, mutable)
    reader = _Carry(init_val, False)

    def cond(c):
        tree, roots, new_vars, vals = carry.unpack(c)
        out = cond_fun(tree)
        changes(
            carry.split.static, roots, new_vars, vals, reader.ok, f"spx.while_loop({_name(cond_fun)})", None
        )
        return out

    def body(c):
        tree, roots, new_vars, vals = carry.unpack(c)
        return carry.pack(body_fun(tree), roots, new_vars, vals, where)

    return carry.finish(jax.lax.while_loop(cond, body, carry.pure_in()))


def fori_loop(
    lower: int,
    upper: int,
    body_fun: Callable,
    init_val: Any,
    init_carry: Any = _NO_CARRY,
    *,
    mutable: Any = None,
    unroll: int | bool | None = None,
) -> Any:
    """`jax.lax.fori_loop` where `init_val` may contain modules (carried).

    With `init_carry`, `init_val` is a module passed to `body_fun(i, module, carry) -> carry`,
    and the final carry is returned.
    """
    if init_carry is not _NO_CARRY:
        _, out = fori_loop(
            lower,
            upper,
            lambda i, mc: (mc[0], body_fun(i, *mc)),
            (init_val, init_carry),
            mutable=mutable,
            unroll=unroll,
        )
        return out
    where = f"spx.fori_loop({_name(body_fun)})"
    carry = _Carry(init_val, mutable)

    def body(i, c):
        tree, roots, new_vars, vals = carry.unpack(c)
        return carry.pack(body_fun(i, tree), roots, new_vars, vals, where)

    return carry.finish(jax.lax.fori_loop(lower, upper, body, carry.pure_in(), unroll=unroll))


# ------------------------------------------------------- functions of modules


def _pure_call(
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


def cond(pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any, mutable: Any = None) -> Any:
    """`jax.lax.cond` where the operands may contain modules; writes allowed by `mutable` come back."""
    split = Split(operands, {})
    ok = allowed(split.plan, mutable)
    branches = [
        _pure_call(b, split, ok, f"spx.cond({_name(b)})", mutable, True) for b in (false_fun, true_fun)
    ]
    out, new = jax.lax.cond(pred, branches[1], branches[0], split.values, split.leaves)
    write_allowed(split, ok, new)
    return out


def switch(index: Any, branches: Sequence[Callable], *operands: Any, mutable: Any = None) -> Any:
    """`jax.lax.switch` where the operands may contain modules; writes allowed by `mutable` come back."""
    split = Split(operands, {})
    ok = allowed(split.plan, mutable)
    pures = [_pure_call(b, split, ok, f"spx.switch({_name(b)})", mutable, True) for b in branches]
    out, new = jax.lax.switch(index, pures, split.values, split.leaves)
    write_allowed(split, ok, new)
    return out


def remat(
    fn: Callable | type | None = None,
    *,
    policy: Callable | None = None,
    prevent_cse: bool = True,
    mutable: Any = None,
    static_argnums: int | tuple[int, ...] = (),
) -> Callable:
    """`jax.checkpoint` for functions that take modules: recompute `fn` in the backward pass.

    Given a Module subclass, returns a subclass whose `forward` is checkpointed.
    `static_argnums` positions are passed as they are (Python values the function
    branches on), not traced.
    """
    opts = dict(policy=policy, prevent_cse=prevent_cse, mutable=mutable, static_argnums=static_argnums)
    if fn is None:
        return functools.partial(remat, **opts)
    if isinstance(fn, type):
        return _remat_class(fn, opts)
    fixed = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        held = {i: args[i] for i in fixed}

        def call(*traced: Any, **kw: Any) -> Any:
            it = iter(traced)
            return fn(*(held[i] if i in held else next(it) for i in range(len(args))), **kw)

        split = Split(tuple(a for i, a in enumerate(args) if i not in held), kwargs)
        ok = allowed(split.plan, mutable)
        pure = _pure_call(call, split, ok, f"spx.remat({_name(fn)})", mutable, False)
        out, upd = jax.checkpoint(pure, policy=policy, prevent_cse=prevent_cse)(split.values, split.leaves)
        if upd:
            split.write_back(upd)
        return out

    return wrapped


def _remat_class(cls: type, opts: dict) -> type:
    """A subclass of Module class `cls` whose `forward` runs under `remat`."""
    if not issubclass(cls, Module):
        raise TypeError(f"spx.remat: a class must be an spx.Module subclass; received {cls.__name__}.")
    if cls.forward is Module.forward:
        raise TypeError(
            f"spx.remat({cls.__name__}): the class checkpoints `forward`, which {cls.__name__} does not define "
            "(it defines `__call__`); wrap the function that calls it with spx.remat(fn) instead."
        )
    checkpointed = remat(cls.forward, **opts)

    def forward(self: Module, *args: Any, **kwargs: Any) -> Any:
        return checkpointed(self, *args, **kwargs)

    return type(
        cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__, "__doc__": cls.__doc__}
    )


def eval_shape(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """`jax.eval_shape` for functions that take modules (nothing is computed or written)."""
    split = Split(args, kwargs)
    ok = allowed(split.plan, True)
    pure = _pure_call(fn, split, ok, f"spx.eval_shape({_name(fn)})", True, False)
    out, _ = jax.eval_shape(pure, split.values, split.leaves)
    return out


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
    if fn is None:
        return functools.partial(
            vmap,
            in_axes=in_axes,
            out_axes=out_axes,
            axis_name=axis_name,
            axis_size=axis_size,
            spmd_axis_name=spmd_axis_name,
            mutable=mutable,
            sum_match=sum_match,
        )
    where = f"spx.vmap({_name(fn)})"

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
        plan = split.plan
        ok = allowed(plan, mutable)
        var_axes: list[Any] = [None] * (len(plan.vars) if plan is not None else 0)
        if plan is not None:
            index = {id(v): i for i, v in enumerate(plan.vars)}
            for a, ax in zip(args, per_arg):
                if isinstance(a, Module) and isinstance(in_axes, list | tuple) and ax is not None:
                    for v in plan_of(a).vars:
                        var_axes[index[id(v)]] = ax.axis_of(v.kind) if isinstance(ax, StateAxes) else ax
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


class _Hole:
    """Stands in for a module inside a transform's argument pytree (no leaves)."""

    __slots__ = ()


jax.tree_util.register_pytree_node(_Hole, lambda h: ((), None), lambda aux, ch: _Hole())


def _hole_out(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: _Hole() if isinstance(x, Module) else x, tree, is_leaf=lambda x: isinstance(x, Module)
    )


def _roots(static: tuple, values: list) -> tuple[list, list]:
    from ._module import build

    return build(static[0], values) if static[0] is not None else ([], [])


def _fill_holes(tree: Any, roots: list) -> Any:
    it = iter(roots)
    return jax.tree.map(
        lambda x: next(it) if isinstance(x, _Hole) else x, tree, is_leaf=lambda x: isinstance(x, _Hole)
    )


def associative_scan(
    fn: Callable, module: Module, elems: Any, *, reverse: bool = False, axis: int = 0, mutable: Any = ()
) -> Any:
    """`jax.lax.associative_scan` of `fn(module, a, b)`, an associative combine that reads `module`.

    The combines run in a tree, not in order, so `module` is read-only: each combine sees a
    fresh copy of it and a write raises `IllegalMutationError`; `mutable` must stay empty.
    """
    from ._errors import IllegalMutationError
    from ._state import bind, export, tree_state

    if mutable:
        raise ValueError(
            "spx.associative_scan: mutable= must be empty; combines run in a tree, so a write has no order. "
            "Use spx.scan for a carried module."
        )
    graphdef, state = export(module)

    def combine(a: Any, b: Any) -> Any:
        copy = bind(graphdef, state)
        out = fn(copy, a, b)
        written = [p for (_, p, v), w in zip(tree_state(copy).items(), state._values) if v is not w]
        if written:
            raise IllegalMutationError(f"spx.associative_scan({_name(fn)}): the combine wrote {written}.")
        return out

    return jax.lax.associative_scan(combine, elems, reverse=reverse, axis=axis)
