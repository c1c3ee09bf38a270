"""`Optimizer`: optax over the selected variables of a model."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from ._module import Module, plan_of
from ._state import State, state_of, trainable, update
from ._variable import Variable


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

    def _params(self, model: Module) -> State:
        plan = plan_of(model)
        return state_of(plan, trainable(plan, self.wrt))

    def update(self, model: Module, grads: State) -> None:
        """Apply one optax step to `model`'s `wrt` variables with `grads`."""
        params = self._params(model)
        if not isinstance(grads, State) or grads._infos != params._infos:
            raise ValueError(
                "Optimizer.update: grads must be the State of exactly the optimizer's variables "
                f"(spx.grad(..., wrt={self.wrt!r})); expected paths {[i.path for i in params._infos][:6]}..., "
                f"received {[i.path for i in grads._infos][:6] if isinstance(grads, State) else type(grads).__name__}."
            )
        grads = jax.tree.map(_follow, grads, params)
        updates, self.state.value = self.tx.update(grads, self.state.value, params)
        update(model, optax.apply_updates(params, updates))
        self.step.value = self.step.value + 1


def _follow(grad: Any, param: Any) -> Any:
    """`grad` moved to `param`'s placement (gradients from a pipeline live on the ranks that made them)."""
    if (
        not isinstance(param, jax.Array)
        or not isinstance(grad, jax.Array)
        or isinstance(param, jax.core.Tracer)
    ):
        return grad
    return grad if grad.sharding == param.sharding else jax.device_put(grad, param.sharding)
