"""`spx.run(..., optimizer=)`: the optimizer's update inside the run's compiled step.

An `spx.Optimizer` (or each optimizer of an `spx.MultiOptimizer`) holds an
optax transformation and its state for the variables its `wrt` selects. The run
differentiates the union of those variables and hands the step one optax
transformation over their values (`grouped`), which applies each optimizer's
transformation to its own variables, seen as the same `State` the optimizer was
initialised with: the state pytrees and the arithmetic are the optimizer's own,
so the step and `opt.update(model, grads)` give the same numbers.
"""

from __future__ import annotations

from typing import Any

import optax

from .._graph.state import State
from .._graph.walk import trainable
from ..contrib import MultiOptimizer, Optimizer


def optimizers_of(optimizer: Any) -> list[Optimizer]:
    """The optimizers a run updates: `optimizer` itself, or each of a `MultiOptimizer`'s."""
    if isinstance(optimizer, MultiOptimizer):
        return list(optimizer.optimizers)
    if isinstance(optimizer, Optimizer):
        return [optimizer]
    raise TypeError(
        f"spx.run: optimizer must be an spx.Optimizer or spx.MultiOptimizer, received {type(optimizer).__name__}; "
        "wrap the optax transformation: spx.Optimizer(model, tx, wrt=...)."
    )


def selection(plan, optimizers: list[Optimizer]) -> tuple[bool, ...]:
    """The variables a run with these optimizers trains: the union of their selections."""
    masks = [trainable(plan, opt.wrt) for opt in optimizers]
    return tuple(any(column) for column in zip(*masks))


def grouped(plan, selected: tuple[bool, ...], optimizers: list[Optimizer]) -> optax.GradientTransformation:
    """One transformation over the list of selected values: each optimizer's on its own variables."""
    infos = [info for info, s in zip(plan.infos, selected) if s]
    position = {(info.kind, info.path): k for k, info in enumerate(infos)}
    groups = []
    for opt in optimizers:
        mine = [info for info, s in zip(plan.infos, trainable(plan, opt.wrt)) if s]
        groups.append((opt.tx, tuple(mine), [position[(i.kind, i.path)] for i in mine]))

    def part(values, infos_g, index) -> State:
        return State(infos_g, [values[k] for k in index])

    def init(params):
        return tuple(tx.init(part(params, infos_g, index)) for tx, infos_g, index in groups)

    def update(grads, states, params=None):
        updates = list(grads)
        new_states = []
        for (tx, infos_g, index), state in zip(groups, states):
            sub_params = None if params is None else part(params, infos_g, index)
            sub, state = tx.update(part(grads, infos_g, index), state, sub_params)
            for k, value in zip(index, sub._values):
                updates[k] = value
            new_states.append(state)
        return updates, tuple(new_states)

    return optax.GradientTransformation(init, update)


def states_of(optimizers: list[Optimizer]) -> tuple:
    return tuple(opt.state.value for opt in optimizers)


def store(optimizers: list[Optimizer], states: tuple) -> None:
    """Keep the step's optimizer states and count the step, as `opt.update` does."""
    for opt, state in zip(optimizers, states):
        opt.state.value = state
        opt.step.value = opt.step.value + 1
