"""`Optimizer`: optax over the selected variables of a model; `MultiOptimizer`: one optax
transformation per disjoint selection (e.g. a base model and its LoRA adapters); exported by
`spx.contrib` and `spx`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from .._graph.export import clone, update
from .._graph.module import Module, plan_of
from .._graph.selector import as_selector
from .._graph.state import State, state_of
from .._graph.variable import Variable
from .._graph.walk import trainable
from ..nn._containers import ModuleList


class OptState(Variable):
    """The optax state pytree (collection `"opt_state"`)."""

    __slots__ = ()
    default_kind = "opt_state"


class OptStep(Variable):
    """The number of updates applied (collection `"opt_state"`)."""

    __slots__ = ()
    default_kind = "opt_state"


class Optimizer(Module):
    """Holds an optax transformation and its state for the `wrt` variables of a model.

    `opt.update(model, grads)` applies one step: `grads` is the `State` returned
    by `spx.grad(..., wrt=wrt)` or `spx.run`; gradient leaves held elsewhere (on
    the pipeline ranks that computed them) are moved to their parameters' devices
    first. Under `spx.jit`, let the step write both the
    model and the optimizer: `mutable=("parameters", "opt_state")`.
    """

    def __init__(self, model: Module, tx: optax.GradientTransformation, wrt: Any = "parameters"):
        if not isinstance(model, Module):
            raise TypeError(f"Optimizer: expected an spx.Module as model, received {type(model).__name__}.")
        self.tx = tx
        self.wrt = wrt
        self.state = OptState(tx.init(self._params(model)))
        self.step = OptStep(jnp.zeros((), jnp.int32))

    @property
    def opt_state(self) -> Any:
        """The optax state (the value of `state`)."""
        return self.state.value

    @property
    def selector(self) -> Any:
        """`wrt` as an `spx.Selector`."""
        return as_selector(self.wrt)

    @classmethod
    def create(cls, model: Module, tx: optax.GradientTransformation, *, wrt: Any = "parameters") -> Optimizer:
        """`Optimizer(model, tx, wrt=wrt)`, spelled as a named constructor."""
        return cls(model, tx, wrt)

    def _params(self, model: Module) -> State:
        plan = plan_of(model)
        return state_of(plan, trainable(plan, self.wrt))

    def update(self, model: Module | State, grads: State) -> tuple[State, Optimizer] | None:
        """Apply one optax step with `grads` (the State from `spx.grad(..., wrt=wrt)`).

        * `opt.update(model, grads)` writes the new values into `model` and this
          optimizer (returns None);
        * `new_params, new_opt = opt.update(params, grads)` with `params` a State
          (e.g. `spx.tree_state(model).filter("parameters")`) changes nothing: it
          returns `params` with the updated entries and a new optimizer.
        """
        if isinstance(model, State):
            return self._functional_update(model, grads)
        params = self._params(model)
        self._check(params, grads)
        grads = _follow(grads, params)
        if _one_placement(params):  # committed like its outputs, so step 1 reuses step 0's program
            grads, state, params = _committed((grads, self.state.value, params))
            new_params, self.state.value = _apply_jit(self.tx, grads, state, params)
        else:
            new_params, self.state.value = _apply(self.tx, grads, self.state.value, params)
        update(model, new_params)
        self.step.value = self.step.value + 1

    def apply_eager(self, model: Module, grads: State) -> Optimizer:
        """`opt.update(model, grads)` (in place); returns this optimizer."""
        self.update(model, grads)
        return self

    def _functional_update(self, params: State, grads: State) -> tuple[State, Optimizer]:
        chosen = _trainable_part(params.filter(self.wrt))
        self._check(chosen, grads)
        new_params, opt_state = _apply(self.tx, _follow(grads, chosen), self.state.value, chosen)
        new = clone(self)
        new.state.value, new.step.value = opt_state, self.step.value + 1
        return params.overlay(new_params), new

    def _check(self, params: State, grads: Any) -> None:
        if not isinstance(grads, State) or grads._infos != params._infos:
            raise ValueError(
                "Optimizer.update: grads must be the State of exactly the optimizer's variables "
                f"(spx.grad(..., wrt={self.wrt!r})); expected paths {[i.path for i in params._infos][:6]}..., "
                f"received {[i.path for i in grads._infos][:6] if isinstance(grads, State) else type(grads).__name__}."
            )


class MultiOptimizer(Module):
    """Different optax transformations for disjoint selections of a model's variables.

    `MultiOptimizer(model, {"lora": optax.adam(1e-3), spx.not_("lora"): optax.sgd(1e-4)})`
    (or a list of `(selector, tx)` pairs). Every trainable variable the selectors match
    belongs to exactly one of them; a variable matched twice is an error. `opt.wrt` is
    their union, the selector to differentiate with: `spx.grad(loss, wrt=opt.wrt)`.
    `opt.update(model, grads)` applies each transformation to its own variables.
    """

    def __init__(
        self,
        model: Module,
        transforms: Mapping[Any, optax.GradientTransformation]
        | Sequence[tuple[Any, optax.GradientTransformation]],
    ):
        if not isinstance(model, Module):
            raise TypeError(
                f"MultiOptimizer: expected an spx.Module as model, received {type(model).__name__}."
            )
        pairs = list(transforms.items()) if isinstance(transforms, Mapping) else list(transforms)
        if not pairs or not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
            raise TypeError(
                "MultiOptimizer: transforms must be a non-empty {selector: optax transformation} dict or "
                f"list of (selector, transformation) pairs; received {transforms!r}."
            )
        plan = plan_of(model)
        owner: dict[int, int] = {}
        for g, (sel, tx) in enumerate(pairs):
            if not isinstance(tx, optax.GradientTransformation):
                raise TypeError(
                    f"MultiOptimizer: the transformation for {sel!r} must be an optax "
                    f"GradientTransformation; received {type(tx).__name__}."
                )
            chosen = [j for j, k in enumerate(trainable(plan, sel)) if k]
            if not chosen:
                raise ValueError(
                    f"MultiOptimizer: selector {sel!r} matches no trainable variable of the model."
                )
            for j in chosen:
                if j in owner:
                    raise ValueError(
                        f"MultiOptimizer: {plan.infos[j].kind}/{plan.infos[j].path} is matched by both "
                        f"{pairs[owner[j]][0]!r} and {sel!r}; the selectors must be disjoint "
                        "(subtract one from the other: `a - b` or spx.all_of(a, spx.not_(b)))."
                    )
                owner[j] = g
        self.wrt = tuple(sel for sel, _ in pairs)
        self.optimizers = ModuleList(Optimizer(model, tx, sel) for sel, tx in pairs)

    @classmethod
    def create(
        cls,
        model: Module,
        by_selector: Mapping[Any, optax.GradientTransformation]
        | Sequence[tuple[Any, optax.GradientTransformation]],
    ) -> MultiOptimizer:
        """`MultiOptimizer(model, by_selector)`, spelled as a named constructor."""
        return cls(model, by_selector)

    @property
    def subs(self) -> list[Optimizer]:
        """The per-selection `Optimizer`s, in the order the selectors were given."""
        return list(self.optimizers)

    def update(self, model: Module | State, grads: State) -> tuple[State, MultiOptimizer] | None:
        """Apply each transformation to its own variables with the matching part of `grads`:
        in place on a model, or on a State of parameters returning `(new params, new optimizer)`
        (as `Optimizer.update`)."""
        if isinstance(model, State):
            new = clone(self)
            params = model
            for j, opt in enumerate(self.optimizers):
                chosen = _trainable_part(params.filter(opt.wrt))
                params, new.optimizers[j] = opt.update(params, _pick(grads, chosen))
            return params, new
        if not isinstance(grads, State):
            raise TypeError(
                f"MultiOptimizer.update: grads must be the spx.State from spx.grad(..., wrt=opt.wrt); "
                f"received {type(grads).__name__}."
            )
        index = {(i.kind, i.path): j for j, i in enumerate(grads._infos)}
        for opt in self.optimizers:
            want = [(i.kind, i.path) for i in opt._params(model)._infos]
            missing = [k for k in want if k not in index]
            if missing:
                raise ValueError(
                    f"MultiOptimizer.update: grads lack {[f'{k}/{p}' for k, p in missing[:4]]}; take "
                    "gradients with spx.grad(..., wrt=opt.wrt)."
                )
            picked = [index[k] for k in want]
            opt.update(
                model, State(tuple(grads._infos[j] for j in picked), [grads._values[j] for j in picked])
            )


def _trainable_part(params: State) -> State:
    """The entries of `params` not frozen (`trainable=False` metadata)."""
    keep = [(i, v) for i, v in zip(params._infos, params._values) if dict(i.metadata).get("trainable", True)]
    return State(tuple(i for i, _ in keep), [v for _, v in keep])


def _pick(grads: Any, like: State) -> State:
    """The entries of `grads` at `like`'s (collection, path) pairs, in `like`'s order."""
    if not isinstance(grads, State):
        raise TypeError(
            f"MultiOptimizer.update: grads must be an spx.State; received {type(grads).__name__}."
        )
    flat = grads.flatten()
    missing = [k for k in like.flatten() if k not in flat]
    if missing:
        raise ValueError(f"MultiOptimizer.update: grads lack {[f'{c}/{p}' for c, p in missing[:4]]}.")
    return State(like._infos, [flat[k] for k in like.flatten()])


def _apply(tx: optax.GradientTransformation, grads, state, params):
    """One optax step: the new parameters and the new optimizer state."""
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


# compiled once per transformation and signature: one program instead of one dispatch per operation
_apply_jit = jax.jit(_apply, static_argnums=0)


def _one_placement(params) -> bool:
    """Whether one program can take every leaf: all are committed arrays on the same devices."""
    places = set()
    for x in jax.tree.leaves(params):
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return False
        places.add(frozenset(x.sharding.device_set) if x.committed else None)
    return len(places) == 1


def _committed(tree):
    """`tree` with every uncommitted array committed to the device it is on (one batched call)."""
    leaves, treedef = jax.tree.flatten(tree)
    loose = [k for k, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.committed]
    if loose:
        placed = jax.device_put([leaves[k] for k in loose], [leaves[k].sharding for k in loose])
        for k, x in zip(loose, placed):
            leaves[k] = x
    return treedef.unflatten(leaves)


def _follow(grads, params):
    """`grads` moved to `params`' placement in one batched copy (gradients from a pipeline live on
    the ranks that made them)."""
    g_leaves, treedef = jax.tree.flatten(grads)
    p_leaves = treedef.flatten_up_to(params)
    moving = [
        k
        for k, (g, p) in enumerate(zip(g_leaves, p_leaves))
        if isinstance(p, jax.Array)
        and isinstance(g, jax.Array)
        and not isinstance(p, jax.core.Tracer)
        and g.sharding != p.sharding
    ]
    if moving:
        moved = jax.device_put([g_leaves[k] for k in moving], [p_leaves[k].sharding for k in moving])
        for k, x in zip(moving, moved):
            g_leaves[k] = x
    return treedef.unflatten(g_leaves)


__all__ = ["MultiOptimizer", "Optimizer"]
