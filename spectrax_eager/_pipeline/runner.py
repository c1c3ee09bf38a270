"""Building the `spectrax_mpmd.Runner` of one `spx.run` configuration: the forward over the
model's values (stage-marked when pipelined), the stage split (`stage_sizes="auto"` profiled
and balanced here) and the loss it calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spectrax_core.schedules import GPipe

from .._graph.module import Module, build
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


def _plan_stages(model: Module, mesh, schedule, sizes, inputs) -> StagePlan | None:
    import spectrax_mpmd as mp

    n_stages = mp.pipeline_stages(mesh, schedule)
    return None if n_stages == 1 else stage_plan(model, n_stages, sizes, inputs)


def _balanced_sizes(
    model, plan, selected, args, *, mesh, schedule, loss_fn, has_aux
) -> tuple[int, ...] | None:
    """`stage_sizes="auto"`: the split `spectrax_mpmd.balance` picks from the profiled blocks of
    the model's `blocks` ModuleList (None without a pipeline)."""
    import spectrax_mpmd as mp

    if mp.pipeline_stages(mesh, schedule) == 1:
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

    chosen = mp.balance(
        cut, mesh=mesh, schedule=schedule, n_blocks=len(blocks), batch_argnums=(2, 3), has_aux=has_aux
    )
    return chosen.sizes


def new_runner(
    model,
    plan,
    selected,
    args,
    counters,
    *,
    mesh,
    mode,
    loss_fn,
    microbatches,
    schedule,
    has_aux,
    sizes,
    stage_sizes,
    tx=None,
    memory: dict | None = None,
) -> tuple[Any, CurrentLoss | None]:
    """A runner for this configuration (its stage split chosen now for `stage_sizes="auto"`) and
    the holder of its current loss function."""
    import spectrax_mpmd as mp

    if stage_sizes == "auto":
        schedule = schedule if schedule is not None else GPipe(microbatches=microbatches)
        sizes = _balanced_sizes(
            model, plan, selected, args, mesh=mesh, schedule=schedule, loss_fn=loss_fn, has_aux=has_aux
        )
    loss = CurrentLoss(loss_fn) if loss_fn is not None else None
    counting = bool(counters) and mode == "train" and loss is not None
    stages = _plan_stages(model, mesh, schedule, sizes, args[2])
    runner = mp.Runner(
        _forward(plan.graphdef, selected, stages, counters, mode),
        mesh=mesh,
        mode=mode,
        loss_fn=counting_loss(loss, has_aux) if counting else loss,
        microbatches=microbatches,
        schedule=schedule,
        has_aux=has_aux or counting,
        name="spx.run",
        tx=tx,
        **(memory or {}),
    )
    return runner, loss
