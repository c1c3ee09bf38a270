"""`Module` methods for building in steps and working on a whole model: `init` /
`sequential_init` / `materialize` (lazy layers, see `_lazy`), `set_attributes`,
`perturb`, and the structure digests `structure_hash` / `shape_hash`. They reach
the model's variables and sub-modules through `Module._spx_plan_now()`."""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ._lazy import materializing
from ._variable import Variable


def _digest(parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class ModuleMethods:
    """Mixed into `Module` (its own file to keep `_module` to the graph walk and calls)."""

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
