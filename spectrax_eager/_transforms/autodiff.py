"""Differentiation over modules: `grad`, `value_and_grad`, `jvp`, `vjp`.

For a module argument, the differentiated inputs are its variables selected by
`wrt` (default `"parameters"`) minus frozen ones; its gradient comes back as a
`State` of exactly those variables (root-relative paths), the same structure as
`spx.tree_state(model).filter(wrt)`. Non-module arguments are differentiated
as ordinary pytrees.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import jax

from .._graph.module import Module, plan_of
from .._graph.state import State
from .._graph.walk import trainable
from .lift import Split, allowed, changes, rebuild


class _Diff:
    """The split of one call into differentiated values and everything else."""

    def __init__(self, args: tuple, kwargs: dict, argnums: tuple[int, ...], wrt: Any, where: str):
        for k in argnums:
            if k >= len(args):
                raise ValueError(
                    f"{where}: argnums={argnums} but only {len(args)} positional arguments were given."
                )
        self.argnums = argnums
        self.diff_arrays = {k: args[k] for k in argnums if not isinstance(args[k], Module)}
        for k, a in self.diff_arrays.items():
            if any(
                isinstance(l, Module) for l in jax.tree.leaves(a, is_leaf=lambda y: isinstance(y, Module))
            ):
                raise TypeError(
                    f"{where}: argument {k} contains modules inside a container; pass the module "
                    "itself as a positional argument to differentiate it."
                )
        stripped = tuple(None if k in self.diff_arrays else a for k, a in enumerate(args))
        self.split = Split(stripped, kwargs)
        plan = self.split.plan
        self.roots: dict[int, Module] = {k: args[k] for k in argnums if isinstance(args[k], Module)}
        self.root_maps: dict[int, tuple[Any, list[int], tuple[bool, ...]]] = {}
        diff = [False] * (len(plan.vars) if plan is not None else 0)
        if self.roots:
            index = {id(v): i for i, v in enumerate(plan.vars)}
            for k, root in self.roots.items():
                rp = plan_of(root)
                sel = trainable(rp, wrt)
                joint = [index[id(v)] for v in rp.vars]
                self.root_maps[k] = (rp, joint, sel)
                for j, s in zip(joint, sel):
                    diff[j] = diff[j] or s
        self.diff = tuple(diff)

    def values(self) -> tuple[list, list]:
        vals = self.split.values
        return [v for v, d in zip(vals, self.diff) if d], [v for v, d in zip(vals, self.diff) if not d]

    def function(self, fn: Callable, has_aux: bool, mutable: Any, where: str) -> Callable:
        """`fn` as a function of the differentiated values and arrays, the rest held fixed:
        `(diff_vals, diff_arrays) -> (out, (aux, variable updates))`."""
        static, ok, array_nums = self.split.static, allowed(self.split.plan, mutable), tuple(self.diff_arrays)
        _, rest_vals = self.values()

        def pure(diff_vals, diff_arrays):
            values = self.merge(diff_vals, rest_vals)
            call_args, _, roots, new_vars = rebuild(static, values, self.split.leaves)
            call_args = tuple(
                diff_arrays[array_nums.index(k)] if k in array_nums else a for k, a in enumerate(call_args)
            )
            out = fn(*call_args)
            out, aux = out if has_aux else (out, None)
            return out, (aux, changes(static, roots, new_vars, values, ok, where, mutable))

        return pure

    def merge(self, diff_vals: list, rest_vals: list) -> list:
        a, b = iter(diff_vals), iter(rest_vals)
        return [next(a) if d else next(b) for d in self.diff]

    def outputs(self, grads_vals: list, grads_arrays: dict[int, Any]) -> Any:
        """Per argnum: a State for a module, the gradient pytree otherwise."""
        pos = {j: n for n, j in enumerate(i for i, d in enumerate(self.diff) if d)}
        out = []
        for k in self.argnums:
            if k in self.roots:
                rp, joint, sel = self.root_maps[k]
                vals = [grads_vals[pos[j]] for j, s in zip(joint, sel) if s]
                out.append(State(tuple(i for i, s in zip(rp.infos, sel) if s), vals))
            else:
                out.append(grads_arrays[k])
        return out


def _norm_argnums(argnums: int | Sequence[int]) -> tuple[tuple[int, ...], bool]:
    if isinstance(argnums, int):
        return (argnums,), True
    return tuple(argnums), False


def value_and_grad(
    fn: Callable | None = None,
    argnums: int | Sequence[int] = 0,
    *,
    wrt: Any = "parameters",
    has_aux: bool = False,
    mutable: Any = None,
    argnum: int | None = None,
    holomorphic: bool = False,
    allow_int: bool = False,
    reduce_axes: Sequence[Any] = (),
) -> Callable:
    """Like `jax.value_and_grad`, for functions that take modules.

    Args:
        fn: returns a scalar loss, or `(loss, aux)` with `has_aux=True`.
        argnums: which positional arguments to differentiate (int or tuple).
        wrt: selector of the variables of module arguments to differentiate.
        has_aux: whether `fn` returns `(loss, aux)`.
        mutable: selector of variables `fn` may write (written back after the call).
        argnum: the same as `argnums` with one int (the spelling of the seed library).
        holomorphic, allow_int: as in `jax.value_and_grad`.
        reduce_axes: named axes (of an enclosing `vmap` / `shard_map`) the gradients are
            summed over.

    Returns:
        `wrapped(*args, **kwargs) -> (value, grads)`; `grads` is one entry (or
        a tuple for tuple `argnums`): a `State` for a module, a pytree otherwise.
    """
    opts = dict(wrt=wrt, has_aux=has_aux, mutable=mutable, holomorphic=holomorphic, allow_int=allow_int)
    if fn is None:
        return functools.partial(
            value_and_grad, argnums=argnums, argnum=argnum, reduce_axes=reduce_axes, **opts
        )
    nums, single = _norm_argnums(argnums if argnum is None else argnum)
    where = f"spx.value_and_grad({getattr(fn, '__name__', 'fn')})"

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        d = _Diff(args, kwargs, nums, wrt, where)
        split = d.split
        static = split.static
        ok = allowed(split.plan, mutable)
        array_nums = tuple(d.diff_arrays)

        def pure(diff_vals, diff_arrays, rest_vals, leaves):
            values = d.merge(diff_vals, rest_vals)
            call_args, call_kwargs, roots, new_vars = rebuild(static, values, leaves)
            call_args = tuple(
                diff_arrays[array_nums.index(k)] if k in array_nums else a for k, a in enumerate(call_args)
            )
            out = fn(*call_args, **call_kwargs)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, changes(static, roots, new_vars, values, ok, where, mutable))

        diff_vals, rest_vals = d.values()
        arrays = tuple(d.diff_arrays[k] for k in array_nums)
        (loss, (aux, updates)), (g_vals, g_arrays) = jax.value_and_grad(
            pure, argnums=(0, 1), has_aux=True, holomorphic=holomorphic, allow_int=allow_int
        )(diff_vals, arrays, rest_vals, split.leaves)
        if reduce_axes:
            g_vals, g_arrays = jax.lax.psum((g_vals, g_arrays), tuple(reduce_axes))
        if updates:
            split.write_back(updates)
        grads = d.outputs(g_vals, dict(zip(array_nums, g_arrays)))
        grads = grads[0] if single else tuple(grads)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def grad(fn: Callable | None = None, argnums: int | Sequence[int] = 0, **options: Any) -> Callable:
    """Like `jax.grad` for functions that take modules; the keywords of `value_and_grad`.

    Returns `grads` (or `(grads, aux)` with `has_aux=True`).
    """
    try:
        grad.__signature__.bind(fn, argnums, **options)
    except TypeError as e:
        raise TypeError(f"grad(): {e}") from None
    if fn is None:
        return functools.partial(grad, argnums=argnums, **options)
    vg = value_and_grad(fn, argnums, **options)
    has_aux = options.get("has_aux", False)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped


grad.__signature__ = inspect.signature(value_and_grad)


def _module_tangents(d: _Diff, k: int, t: Any, where: str) -> dict[int, Any]:
    rp, joint, sel = d.root_maps[k]
    if not isinstance(t, State):
        raise TypeError(
            f"{where}: the tangent/cotangent for module argument {k} must be a spx.State "
            f"like spx.tree_state(model).filter(wrt); received {type(t).__name__}."
        )
    flat = t.flat()
    out = {}
    for j, s, info in zip(joint, sel, rp.infos):
        if s:
            key = (info.kind, info.path)
            if key not in flat:
                raise ValueError(f"{where}: the State for argument {k} lacks {info.kind}/{info.path}.")
            out[j] = flat[key]
    return out


def jvp(
    fn: Callable | None = None,
    primals: tuple | None = None,
    tangents: tuple | None = None,
    *,
    wrt: Any = "parameters",
    has_aux: bool = False,
    mutable: Any = None,
) -> Any:
    """Like `jax.jvp`; a module primal's tangent is a `State` of its `wrt` variables.

    Returns `(fn(*primals), tangent_out)` (and `aux` third with `has_aux=True`, `fn`
    then returning `(out, aux)`). Without `primals` and `tangents` it returns
    `lambda primals, tangents: jvp(fn, primals, tangents, ...)`.
    """
    if fn is None:
        return functools.partial(jvp, wrt=wrt, has_aux=has_aux, mutable=mutable)
    if primals is None and tangents is None:
        return lambda p, t: jvp(fn, p, t, wrt=wrt, has_aux=has_aux, mutable=mutable)
    where = f"spx.jvp({getattr(fn, '__name__', 'fn')})"
    primals, tangents = tuple(primals), tuple(tangents)
    if len(primals) != len(tangents):
        raise ValueError(f"{where}: {len(primals)} primals but {len(tangents)} tangents.")
    d = _Diff(primals, {}, tuple(range(len(primals))), wrt, where)
    split, array_nums = d.split, tuple(d.diff_arrays)
    mod_t: dict[int, Any] = {}
    for k in d.roots:
        mod_t.update(_module_tangents(d, k, tangents[k], where))
    diff_idx = [i for i, s in enumerate(d.diff) if s]
    t_vals = [
        mod_t[j] if j in mod_t else jax.tree.map(jax.numpy.zeros_like, split.values[j]) for j in diff_idx
    ]
    t_arrays = tuple(tangents[k] for k in array_nums)

    diff_vals, _ = d.values()
    arrays = tuple(d.diff_arrays[k] for k in array_nums)
    out, t_out, (aux, updates) = jax.jvp(
        d.function(fn, has_aux, mutable, where),
        (diff_vals, arrays),
        (t_vals, t_arrays),
        has_aux=True,
    )
    if updates:
        split.write_back(updates)
    return (out, t_out, aux) if has_aux else (out, t_out)


def vjp(
    fn: Callable | None = None,
    *primals: Any,
    wrt: Any = "parameters",
    has_aux: bool = False,
    mutable: Any = None,
    reduce_axes: Sequence[Any] = (),
) -> Any:
    """Like `jax.vjp`; the pullback returns one cotangent per primal, a `State` for a module.

    Returns `(out, pullback)` (or `(out, pullback, aux)` with `has_aux=True`). Without
    primals it returns `lambda *primals: vjp(fn, *primals, ...)`. `reduce_axes`: named
    axes the cotangents are summed over.
    """
    if fn is None:
        return functools.partial(vjp, wrt=wrt, has_aux=has_aux, mutable=mutable, reduce_axes=reduce_axes)
    if not primals:
        return lambda *p: vjp(fn, *p, wrt=wrt, has_aux=has_aux, mutable=mutable, reduce_axes=reduce_axes)
    where = f"spx.vjp({getattr(fn, '__name__', 'fn')})"
    d = _Diff(primals, {}, tuple(range(len(primals))), wrt, where)
    split, array_nums = d.split, tuple(d.diff_arrays)
    diff_vals, _ = d.values()
    arrays = tuple(d.diff_arrays[k] for k in array_nums)
    out, pull, (aux, updates) = jax.vjp(
        d.function(fn, has_aux, mutable, where), diff_vals, arrays, has_aux=True
    )
    if updates:
        split.write_back(updates)

    def pullback(ct: Any) -> tuple:
        g_vals, g_arrays = pull(ct)
        if reduce_axes:
            g_vals, g_arrays = jax.lax.psum((g_vals, g_arrays), tuple(reduce_axes))
        return tuple(d.outputs(g_vals, dict(zip(array_nums, g_arrays))))

    return (out, pullback, aux) if has_aux else (out, pullback)
