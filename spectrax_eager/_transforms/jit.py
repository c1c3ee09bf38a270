"""`spx.jit`: `jax.jit` over functions that take modules, with `mutable=` write-back.

The cache key is `(GraphDef, argument treedef, module positions, static
arguments)`: values never enter it, so changing them never retraces, while any
structural change (new GraphDef) compiles a new program. Per call the work is
one pytree flatten of the arguments, a read of the cached plan, a list of the
variables' values, the compiled call, and the write-back of what the function
changed (`{index: value}` returned by the program). Values bound by `spx.scope`
at the call are part of it too: arrays as inputs, other values in the cache key.

A call with the same modules in the leading positions and arrays of the same
types after them, with no structural change since (same structure epoch),
skips the split: it reads the remembered plan's values and calls the program
directly. A jitted function therefore keeps the modules of its last call alive.
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Any, Callable, Sequence

import jax

from .._graph import structure
from .._graph.module import Module, _walk
from .._graph.variable import Variable, set_value
from .._pipeline.mpmd import mpmd
from .._scope import ambient, frames
from .lift import Split, allowed, changes, rebuild

_SOWN = -1  # the key of a program's updates under which it returns what `Module.sow` stored
_value_of = operator.attrgetter("_value")
_ambient_now = ambient.current  # bound once: the hot path reads it per call


def _as_tuple(x: int | str | Sequence | None) -> tuple:
    if x is None:
        return ()
    if isinstance(x, int | str):
        return (x,)
    return tuple(x)


def jit(
    fn: Callable | None = None,
    *,
    mutable: Any = None,
    mesh: Any = None,
    schedule: Any = None,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Sequence[str] | None = None,
    in_shardings: Any = None,
    out_shardings: Any = None,
    **jax_kwargs: Any,
) -> Callable:
    """Compile `fn`, which may take modules anywhere in its arguments.

    Args:
        fn: the function (or use `@spx.jit(...)` as a decorator factory).
        mutable: selector of the variables `fn` may write; their new values are
            written back after the call. A write outside it raises
            `spx.IllegalMutationError`. The `"rngs"` collection is always writable.
        mesh: a `jax.sharding.Mesh` (or an `spectrax_mpmd` mesh without an MPMD
            axis): run SPMD under that mesh. An MPMD mesh (`mesh.is_mpmd`):
            compile with `spectrax_mpmd.sxjit(..., schedule=schedule)`.
        schedule: the pipeline schedule for an MPMD mesh.
        static_argnums, static_argnames: as `jax.jit` (hashable, part of the cache key).
        donate_argnums, donate_argnames: as `jax.jit`; a donated module donates
            all its values, which are all written back.
        in_shardings: one `Sharding` (or None: keep the argument's own) per
            positional argument; a module's entry applies to all its values.
        out_shardings: as `jax.jit` (a prefix of `fn`'s output); written-back
            variables keep the sharding the compiler infers.
        **jax_kwargs: any other `jax.jit` keyword (`keep_unused`, `device`,
            `backend`, `inline`, `compiler_options`).
    """
    if fn is None:  # `@spx.jit(...)`: this call again, once given the function
        settings = {k: v for k, v in locals().items() if k not in ("fn", "jax_kwargs")}
        return functools.partial(jit, **settings, **jax_kwargs)
    if schedule is not None and not getattr(mesh, "is_mpmd", False):
        raise ValueError("spx.jit: schedule= needs an MPMD mesh (mesh=spx.create_mesh(..., mpmd_axis=...)).")
    if getattr(mesh, "is_mpmd", False) and (
        in_shardings is not None or out_shardings is not None or jax_kwargs
    ):
        raise ValueError(
            "spx.jit: with an MPMD mesh only mutable=, schedule=, static_argnums/argnames and donate_argnums/"
            f"argnames apply; received in_shardings/out_shardings/{sorted(jax_kwargs)}. Stage shardings come "
            "from each rank's submesh and sxstage_iter(sharding=...)."
        )
    return Jitted(
        fn,
        mutable,
        mesh,
        schedule,
        _as_tuple(static_argnums),
        _as_tuple(static_argnames),
        _as_tuple(donate_argnums),
        _as_tuple(donate_argnames),
        in_shardings,
        out_shardings,
        jax_kwargs,
    )


class Jitted:
    """The callable returned by `spx.jit`."""

    def __init__(
        self,
        fn,
        mutable,
        mesh,
        schedule,
        static_argnums,
        static_argnames,
        donate_argnums,
        donate_argnames,
        in_shardings,
        out_shardings,
        jax_kwargs,
    ):
        self.fn = fn
        self.mutable = mutable
        self.mesh = mesh
        self.schedule = schedule
        self.static_argnums = static_argnums
        self.static_argnames = frozenset(static_argnames)
        self.donate_argnums = donate_argnums
        self.donate_argnames = donate_argnames
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self.jax_kwargs = jax_kwargs
        self._cache: dict = {}
        self._hot: tuple | None = None  # (epoch, nargs, modules, leaf types, program, plan)
        self._has_static = bool(static_argnums or static_argnames)
        functools.update_wrapper(self, fn)
        # `spx.jit(model.method)`: pass the module as an argument so its values are inputs,
        # not constants baked into the program.
        self._self = fn.__self__ if inspect.ismethod(fn) and isinstance(fn.__self__, Module) else None
        if self._self is not None:
            self.fn = fn.__func__
            self.static_argnums = tuple(i + 1 if i >= 0 else i for i in static_argnums)
            self.donate_argnums = tuple(i + 1 if i >= 0 else i for i in donate_argnums)
            if isinstance(in_shardings, tuple | list):
                self.in_shardings = (None, *in_shardings)

    @property
    def _spx_compile_cache(self) -> dict:
        """The programs built so far, one per module-graph structure (the seed library's name)."""
        return self._cache

    def _pull_static(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
        n = len(args)
        nums = tuple(j for j in (i + n if i < 0 else i for i in self.static_argnums) if 0 <= j < n)
        statics = tuple(args[i] for i in nums)
        args = tuple(None if i in nums else a for i, a in enumerate(args))
        named = tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames))
        kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return args, kwargs, (nums, statics, named)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hot = self._hot
        if hot is not None and not kwargs and not _ambient_now().frames:  # no `spx.scope` block open
            epoch, n, roots, leaf_types, compiled, plan = hot
            if epoch == structure.epoch and len(args) == n:
                k = len(roots)
                if all(map(operator.is_, args[:k], roots)) and tuple(map(type, args[k:])) == leaf_types:
                    out, updates = compiled(list(map(_value_of, plan.vars)), *args[k:])
                    if updates:
                        _write_back(plan, updates)
                    return out
        return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if self._self is not None:
            args = (self._self, *args)
        if self._has_static:
            args, kwargs, statics = self._pull_static(args, kwargs)
        else:
            statics = ()
        split = Split(args, kwargs)
        arrays, others = frames.partition(frames.snapshot()) if frames.active() else ({}, ())
        bound, bound_tree = jax.tree.flatten(arrays)
        key = (split.static, statics, others, bound_tree)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._cache[key] = self._compile(split, statics, args, kwargs, (others, bound_tree))
        if self.mesh is not None and not getattr(self.mesh, "is_mpmd", False):
            with jax.set_mesh(getattr(self.mesh, "jax_mesh", self.mesh)):
                out, updates = compiled(split.values, *split.leaves, *bound)
        else:
            out, updates = compiled(split.values, *split.leaves, *bound)
            if bound or others:
                self._hot = None
            else:
                self._remember(split, args, kwargs, statics, compiled)
        if updates:
            _write_back(split.plan, updates)
        return out

    def _remember(self, split: Split, args: tuple, kwargs: dict, statics: tuple, compiled: Callable) -> None:
        """Keep what the next call with the same leading modules may reuse without a split."""
        k = len(split.mod_pos)
        if (
            kwargs
            or statics
            or self._self is not None
            or split.plan is None
            or split.treedef is not None
            or split.mod_pos != tuple(range(k))
        ):
            self._hot = None
            return
        self._hot = (structure.epoch, len(args), args[:k], tuple(map(type, args[k:])), compiled, split.plan)

    def _compile(self, split: Split, statics: tuple, args: tuple, kwargs: dict, scoped: tuple) -> Callable:
        """The program of one cache key; `scoped` is `(other values, array treedef)` of `spx.scope`."""
        static = split.static
        others, bound_tree = scoped
        n_bound = bound_tree.num_leaves
        ok = allowed(split.plan, self.mutable)
        donated = _donated_leaves(self.donate_argnums, self.donate_argnames, args, kwargs)
        donate_all = donated.pop("modules")
        fn, mutable = self.fn, self.mutable
        where = f"spx.jit({getattr(fn, '__name__', 'fn')})"

        def pure(values: list, *leaves: Any) -> tuple[Any, dict]:
            leaves, bound = leaves[: len(leaves) - n_bound], leaves[len(leaves) - n_bound :]
            call_args, call_kwargs, roots, new_vars = rebuild(static, values, list(leaves))
            if statics:
                nums, svals, named = statics
                call_args = tuple(svals[nums.index(i)] if i in nums else a for i, a in enumerate(call_args))
                call_kwargs = {**call_kwargs, **dict(named)}
            sink: dict = {}
            with (
                ambient.setting("sow_sink", sink),
                frames.scope(**dict(others), **bound_tree.unflatten(bound)),
            ):
                out = fn(*call_args, **call_kwargs)
            updates = changes(static, roots, new_vars, values, ok, where, mutable)
            if donate_all:
                updates = {i: v._value for i, v in enumerate(new_vars)}
            sown = _sown(sink, roots) if sink else None
            if sown:
                updates[_SOWN] = sown
            return out, updates

        kw = dict(self.jax_kwargs)
        donate = ((0,) if donate_all else ()) + tuple(1 + i for i in donated["leaves"])
        if donate:
            kw["donate_argnums"] = donate
        if self.in_shardings is not None:
            kw["in_shardings"] = (*_leaf_shardings(self.in_shardings, split, args), *[None] * n_bound)
        if self.out_shardings is not None:
            kw["out_shardings"] = (self.out_shardings, None)  # None: write-backs keep their inferred sharding
        if getattr(self.mesh, "is_mpmd", False):
            return mpmd().sxjit(
                pure, mesh=self.mesh, schedule=self.schedule, donate_argnums=kw.get("donate_argnums", ())
            )
        return jax.jit(pure, **kw)


def _arg_leaf_ranges(args: tuple, kwargs: dict) -> tuple[list[range], dict[str, range]]:
    """Which non-module leaves belong to each positional / keyword argument."""

    def count(x: Any) -> int:
        return sum(
            not isinstance(l, Module) for l in jax.tree.leaves(x, is_leaf=lambda y: isinstance(y, Module))
        )

    ranges, start = [], 0
    for a in args:
        n = count(a)
        ranges.append(range(start, start + n))
        start += n
    named = {}
    for k in sorted(kwargs):
        n = count(kwargs[k])
        named[k] = range(start, start + n)
        start += n
    return ranges, named


def _donated_leaves(donate_argnums: tuple, donate_argnames: tuple, args: tuple, kwargs: dict) -> dict:
    """`{"modules": whether a donated argument holds a module, "leaves": the donated leaf indices}`."""
    out: dict[str, Any] = {"modules": False, "leaves": []}
    if not (donate_argnums or donate_argnames):
        return out
    ranges, named = _arg_leaf_ranges(args, kwargs)
    for i in donate_argnums:
        if _holds_module(args[i]):
            out["modules"] = True
        out["leaves"].extend(ranges[i])
    for k in donate_argnames:
        if k in kwargs:
            if _holds_module(kwargs[k]):
                out["modules"] = True
            out["leaves"].extend(named[k])
    return out


def _leaf_shardings(entries: Any, split: Split, args: tuple) -> tuple:
    """The `in_shardings` of the program: one for the module values, then one per leaf."""
    if not isinstance(entries, tuple | list) or len(entries) != len(args):
        raise ValueError(
            f"spx.jit: in_shardings must be a tuple with one Sharding (or None) per positional "
            f"argument ({len(args)}), received {entries!r}."
        )
    ranges, _ = _arg_leaf_ranges(args, {})
    leaves: list[Any] = [getattr(l, "sharding", None) for l in split.leaves]
    module_shardings = set()
    for a, sh, rng in zip(args, entries, ranges):
        if _holds_module(a) and sh is not None:
            module_shardings.add(sh)
        if sh is not None:
            for j in rng:
                leaves[j] = sh
    if len(module_shardings) > 1:
        raise ValueError(
            "spx.jit: in_shardings gives different shardings to module arguments; "
            "place module values with jax.device_put beforehand instead."
        )
    values_sharding = module_shardings.pop() if module_shardings else None
    if values_sharding is None:
        values_sharding = [getattr(v, "sharding", None) for v in split.values]
    if any(s is None for s in leaves):
        raise ValueError(
            "spx.jit: in_shardings=None entries need their arguments to be jax.Arrays "
            "(their current sharding is used)."
        )
    return (values_sharding, *leaves)


def _sown(sink: dict, roots: list) -> dict:
    """`{module index: {name: {collection: value}}}` of what `Module.sow` stored while tracing
    (module indices in plan order, the same for the traced and the original modules).

    Sows on modules that are not the function's arguments (rebuilt by a nested transform
    such as `spx.grad`, or closed over) are dropped: they have no original to land in.
    """
    index = {id(m): j for j, (_, m) in enumerate(_walk(tuple(roots)).modules)}
    out: dict = {}
    for (_, name), (module, collection, value) in sink.items():
        j = index.get(id(module))
        if j is not None:
            out.setdefault(j, {}).setdefault(name, {})[collection] = value
    return out


def _write_back(plan: Any, updates: dict) -> None:
    """Write the program's `{index: value}` updates (and any sown intermediates) into `plan`'s modules."""
    sown = updates.pop(_SOWN, None)
    vars_ = plan.vars
    for i, value in updates.items():
        set_value(vars_[i], value)
    if sown:
        for j, named in sown.items():
            module = plan.modules[j][1]
            for name, by_collection in named.items():
                for collection, value in by_collection.items():
                    current = module.__dict__.get(name)
                    if isinstance(current, Variable) and current.kind == collection:
                        set_value(current, value)
                    else:
                        setattr(module, name, Variable(value, kind=collection))


def _holds_module(x: Any) -> bool:
    return any(isinstance(l, Module) for l in jax.tree.leaves(x, is_leaf=lambda y: isinstance(y, Module)))
