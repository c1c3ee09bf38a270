"""Loops over modules: `scan`, `remat_scan`, `while_loop`, `fori_loop`, `associative_scan`.

Modules are accepted anywhere in the arguments. Carried modules (`scan`'s
`init`, a loop's `init_val`) thread their values through the carry, so writes
that `mutable=` allows persist across iterations and are written back at the
end; modules in `scan`'s `xs` are sliced along their leading axis and are
read-only.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from .._errors import IllegalMutationError
from .._graph.export import bind, export, tree_state
from .._graph.module import Module
from .lift import Split, allowed, changes, fn_name, rebuild, write_allowed


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

    The seed library's form, `ys = spx.scan(lambda module, x: y, module, xs)`, is
    accepted too: when `init` is a module and the body returns anything but a
    `(module, y)` pair, the module is carried as is and only the stacked `ys` are
    returned.
    """
    where = f"spx.scan({fn_name(f)})"
    carry = _Carry(init, mutable)
    xsc = _Carry(xs, False)
    module_form: list[bool] = []  # set while tracing the body: the seed's `fn(module, x) -> y`

    def body(c, x):
        c_tree, c_roots, c_vars, c_vals = carry.unpack(c)
        x_tree, x_roots, x_vars, x_vals = xsc.unpack(x)
        out = f(c_tree, x_tree)
        pair = isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Module)
        if isinstance(init, Module) and not pair:
            module_form.append(True)
            new_c, y = c_tree, out
        else:
            new_c, y = out
        changes(
            xsc.split.static, x_roots, x_vars, x_vals, xsc.ok, where + " (xs modules are read-only)", None
        )
        return carry.pack(new_c, c_roots, c_vars, c_vals, where), y

    if _checkpoint is not None:
        body = _checkpoint(body)
    final, ys = jax.lax.scan(
        body, carry.pure_in(), xsc.pure_in(), length=length, reverse=reverse, unroll=unroll
    )
    final = carry.finish(final)
    return ys if module_form else (final, ys)


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
    where = f"spx.while_loop({fn_name(body_fun)})"
    carry = _Carry(init_val, mutable)
    reader = _Carry(init_val, False)

    def cond(c):
        tree, roots, new_vars, vals = carry.unpack(c)
        out = cond_fun(tree)
        changes(
            carry.split.static, roots, new_vars, vals, reader.ok, f"spx.while_loop({fn_name(cond_fun)})", None
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
    where = f"spx.fori_loop({fn_name(body_fun)})"
    carry = _Carry(init_val, mutable)

    def body(i, c):
        tree, roots, new_vars, vals = carry.unpack(c)
        return carry.pack(body_fun(i, tree), roots, new_vars, vals, where)

    return carry.finish(jax.lax.fori_loop(lower, upper, body, carry.pure_in(), unroll=unroll))


def associative_scan(
    fn: Callable, module: Module, elems: Any, *, reverse: bool = False, axis: int = 0, mutable: Any = ()
) -> Any:
    """`jax.lax.associative_scan` of `fn(module, a, b)`, an associative combine that reads `module`.

    The combines run in a tree, not in order, so `module` is read-only: each combine sees a
    fresh copy of it and a write raises `IllegalMutationError`; `mutable` must stay empty.
    """
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
            raise IllegalMutationError(f"spx.associative_scan({fn_name(fn)}): the combine wrote {written}.")
        return out

    return jax.lax.associative_scan(combine, elems, reverse=reverse, axis=axis)
