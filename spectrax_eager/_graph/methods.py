"""`Module` methods for building in steps and working on a whole model: `init` /
`sequential_init` / `materialize` (lazy layers, see `_scope.lazy`), `set_attributes`,
`perturb`, forward hooks, `sow`, and the structure digests `structure_hash` /
`shape_hash`. They reach the model's variables and sub-modules through
`Module._spx_plan_now()`."""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .._scope import ambient
from .._scope.lazy import materializing
from .hooks import RemovableHandle, add_hook
from .variable import Variable

_ABSENT = object()


def _digest(parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class ModuleMethods:
    """Mixed into `Module` (its own file to keep `module` to the graph walk and calls)."""

    def init(self, rngs=None, *example_args: Any, **example_kwargs: Any):
        """Attach `rngs` (an `spx.Rngs`) as `self.rngs` when given, and with example inputs run
        `sequential_init`; returns self."""
        if rngs is not None:
            if isinstance(rngs, int):
                raise TypeError(f"{type(self).__name__}.init: pass spx.Rngs({rngs}), not the bare seed.")
            self.rngs = rngs
        if example_args or example_kwargs:
            self.sequential_init(*example_args, **example_kwargs)
        return self

    def sequential_init(self, *example_args: Any, **example_kwargs: Any):
        """Call the module once on the example inputs with its lazy parts allowed to create their
        arrays (also those built under `spx.lazy_init()`), then `materialize()`; returns self."""
        if example_args or example_kwargs:
            with materializing():
                self(*example_args, **example_kwargs)
        return self.materialize()

    def materialize(self):
        """Create the value of every `DeferredParameter` / `DeferredBuffer` below (their shapes
        must be known); returns self."""
        with materializing():
            for var in list(self._spx_plan_now().vars):
                if not getattr(var, "is_materialized", True):
                    var.materialize()
        return self

    def set_attributes(self, *, filter_fn: Callable[[Any], bool] | None = None, **attrs: Any):
        """Set each of `attrs` on this module and every sub-module that already has that
        attribute (and passes `filter_fn`), e.g. `model.set_attributes(deterministic=True)`."""
        for _, mod in self._spx_plan_now().modules:
            if filter_fn is not None and not filter_fn(mod):
                continue
            for name, value in attrs.items():
                if name in mod.__dict__ or hasattr(type(mod), name):
                    setattr(mod, name, value)
        return self

    def perturb(self, name: str, x: Any) -> Any:
        """`x` plus the zero Variable `self.perturb_<name>` (collection `"perturbations"`, made on
        the first call): its gradient is the loss's gradient with respect to `x` at this point."""
        attr = f"perturb_{name}"
        var = self.__dict__.get(attr)
        if var is None:
            var = Variable(jax.tree.map(jnp.zeros_like, x), kind="perturbations")
            setattr(self, attr, var)
        return jax.tree.map(jnp.add, x, var.value)

    def structure_hash(self) -> str:
        """A SHA-256 hex digest of the module's structure (classes, static attributes, child
        names, collections and metadata, sharing), never of array values."""
        return _digest(self._spx_plan_now().graphdef.specs)

    def shape_hash(self) -> str:
        """`structure_hash` plus every variable's path, collection, shape and dtype."""
        plan = self._spx_plan_now()
        leaves = tuple(
            (info.path, info.kind, tuple(jnp.shape(leaf)), str(jnp.result_type(leaf)))
            for info, var in zip(plan.infos, plan.vars)
            for leaf in jax.tree.leaves(var._value)
        )
        return _digest((plan.graphdef.specs, leaves))

    def register_forward_pre_hook(
        self, hook: Callable, *, prepend: bool = False, with_kwargs: bool | None = None
    ) -> RemovableHandle:
        """Call `hook(module, args)` before each forward; a non-None result replaces `args`
        (with `with_kwargs`: `hook(module, args, kwargs)` returning None or `(args, kwargs)`; by
        default a hook requiring three positional arguments is called so).

        Hooks run in eager calls and are traced into `spx.jit` programs.
        Returns a handle whose `remove()` unregisters the hook.
        """
        return add_hook(self, hook, pre=True, with_kwargs=with_kwargs, prepend=prepend)

    def register_forward_hook(
        self, hook: Callable, *, prepend: bool = False, with_kwargs: bool | None = None
    ) -> RemovableHandle:
        """Call `hook(module, args, output)` after each forward; a non-None result replaces
        the output (with `with_kwargs`: `hook(module, args, kwargs, output)`; by default a hook
        requiring four positional arguments is called so, as the seed library's are).

        Hooks run in eager calls and are traced into `spx.jit` programs.
        Returns a handle whose `remove()` unregisters the hook.
        """
        return add_hook(self, hook, pre=False, with_kwargs=with_kwargs, prepend=prepend)

    def sow(
        self,
        collection: str,
        name: str,
        value: Any,
        *,
        reduce: Callable[[Any, Any], Any] = lambda acc, v: (*acc, v),
        init: Any = (),
    ) -> None:
        """Store an intermediate `value` in the Variable `self.<name>` of collection `collection`.

        The Variable holds `reduce(previous, value)`, starting from `init` (by default a tuple
        gaining one entry per call). It is created on first use, eagerly or inside `spx.jit`
        (the program returns it and it is added to the original module after the call).
        Collect and remove it with `spx.pop(model, collection)` so the next call finds the
        structure it was compiled for. Inside other transforms (`spx.grad`, `vmap`, `scan`,
        ..., or plain `jax` ones) nothing is recorded, so a model that sows still trains.
        """
        if not isinstance(collection, str) or not isinstance(name, str):
            raise TypeError(f"sow: collection and name must be str; received {collection!r}, {name!r}.")
        current = self.__dict__.get(name, _ABSENT)
        if current is not _ABSENT and not (isinstance(current, Variable) and current.kind == collection):
            raise ValueError(
                f"sow: {type(self).__name__}.{name} already holds {type(current).__name__}"
                f"{'(' + current.kind + ')' if isinstance(current, Variable) else ''}; sow into a "
                f"name that is free or a Variable of collection {collection!r}."
            )
        sink = ambient.current().sow_sink
        if sink is None:
            if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(value)):
                return  # traced by a transform other than spx.jit: nothing to hand back
            if current is _ABSENT:
                setattr(self, name, Variable(reduce(init, value), kind=collection))
            else:
                current.value = reduce(current.value, value)
            return
        entry = sink.get((id(self), name))
        if entry is not None:
            entry[2] = reduce(entry[2], value)
        else:
            prev = init if current is _ABSENT else current.value
            sink[(id(self), name)] = [self, collection, reduce(prev, value)]
