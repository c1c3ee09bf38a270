"""Building the `spectrax_mpmd.Runner` of one `spx.run` configuration: the forward over the
model's values (stage-marked when pipelined), the stage split (`stage_sizes="auto"` profiled
and balanced here) and the loss it calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._graph.module import build
from ..nn._containers import ModuleList
from .counters import counting_loss, per_microbatch
from .stages import StagePlan, call, run_marked, stage_plan


class CurrentLoss:
    """The loss function of the latest call with this key: a retrace (a new input signature) of a
    cached runner calls it, not the function of the call that compiled the runner."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def _forward(
    graphdef,
    selected: tuple[bool, ...],
    plan: StagePlan | None,
    counters: tuple[int, ...] = (),
    mode: str = "train",
) -> Callable:
    """The run's forward over (trainable values, other values, inputs); with `counters`, it also
    returns the new values of the variables at those plan positions (see `counters`)."""

    def forward(diff_values: list, rest_values: list, inputs: Any) -> Any:
        diff, rest = iter(diff_values), iter(rest_values)
        values = [next(diff) if s else next(rest) for s in selected]
        roots, variables = build(graphdef, values)
        out = call(roots[0], inputs) if plan is None else run_marked(roots[0], plan, inputs)
        if not counters:
            return out
        return out, per_microbatch(tuple(variables[j].value for j in counters), mode)

    return forward


def _balanced_sizes(model, plan, selected, args, settings, loss_fn) -> tuple[int, ...] | None:
    """`stage_sizes="auto"`: the split `spectrax_mpmd.auto_balance` picks from the profiled blocks
    of the model's `blocks` ModuleList, as for `spectrax_mpmd.run` (None without a pipeline)."""
    import spectrax_mpmd as mp

    if settings.model_stages() == 1:
        return None
    if loss_fn is None:
        raise mp.MpmdError(
            "spx.run: stage_sizes='auto' balances a training step; pass loss_fn= (mode='train')."
        )
    blocks = model.__dict__.get("blocks")
    if not isinstance(blocks, ModuleList):
        raise mp.StageSplitError(
            f"spx.run: stage_sizes='auto' splits a `blocks` ModuleList, which {type(model).__name__} does not "
            "hold; give the block counts yourself, or keep the repeated layers in `self.blocks`."
        )
    inputs = args[2]

    def cut(sizes):
        forward = _forward(plan.graphdef, selected, stage_plan(model, len(sizes), sizes, inputs))
        return mp.train_loss(forward, loss_fn), args

    return mp.auto_balance(cut, len(blocks), settings).sizes


def new_runner(model, plan, selected, args, counters, settings, loss_fn) -> tuple[Any, CurrentLoss | None]:
    """A runner for this configuration (`settings`, a `spectrax_mpmd.StepSettings`; its stage
    split chosen now for `stage_sizes="auto"`) and the holder of its current loss function."""
    import spectrax_mpmd as mp

    sizes = settings.stage_sizes
    if sizes == "auto":
        sizes = _balanced_sizes(model, plan, selected, args, settings, loss_fn)
    loss = CurrentLoss(loss_fn) if loss_fn is not None else None
    counting = bool(counters) and settings.mode == "train" and loss is not None
    if counting and settings.length_buckets is not None:
        raise mp.MpmdError(
            "spx.run: length_buckets runs microbatches whose outputs besides the loss would change shape "
            "with their length, and the model's Rngs streams come back per microbatch; drop "
            "length_buckets, or draw the model's randomness from a key passed in the inputs."
        )
    n_stages = settings.model_stages()
    stages = None if n_stages == 1 else stage_plan(model, n_stages, sizes, args[2])
    runner = mp.Runner.of(
        _forward(plan.graphdef, selected, stages, counters, settings.mode),
        counting_loss(loss, settings.has_aux) if counting else loss,
        settings.replace(has_aux=settings.has_aux or counting),
    )
    return runner, loss
