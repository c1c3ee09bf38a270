"""`spx.run`: train or run an eager model on any mesh, pipelined through its own `forward`.

On a mesh with a pipeline axis the model is cut into stages without
re-chaining its children: a `PipelineSequential` is used as given (one stage
per child); otherwise the model's `blocks` `ModuleList` is divided into
consecutive groups (evenly, or by `stage_sizes`) and the model's own forward
runs with a stage marker on the output of each group's last block. What the
forward does before the first block runs on the first stage, what it does
after the last block on the last stage. Each block must run exactly once per
forward, in list order; anything else is an error, so a split can never drop
or repeat a layer.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from . import _module
from ._module import Module, build, plan_of
from ._state import State, trainable
from .nn._containers import ModuleList, PipelineSequential

# Compiled runs per loss function (weakly held, as jax.jit holds functions), then per configuration.
_runners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_no_loss: dict = {}


def _stage_groups(model: Module, n_stages: int, sizes: Sequence[int] | None) -> tuple[list[Module], tuple]:
    import spectrax_mpmd as mp

    if isinstance(model, PipelineSequential):
        stages = model.stages
        if sizes is not None or len(stages) != n_stages:
            raise mp.StageSplitError(
                f"spx.run: the PipelineSequential has {len(stages)} stages and is used as given, but the "
                f"mesh and schedule need {n_stages} (pipeline ranks x virtual stages); regroup its "
                "children or change the mesh / schedule (stage_sizes does not apply to it)."
            )
        return stages, (1,) * n_stages
    blocks = model.__dict__.get("blocks")
    if not isinstance(blocks, ModuleList):
        raise mp.StageSplitError(
            f"spx.run: {type(model).__name__} cannot be cut into pipeline stages: it is neither a "
            "PipelineSequential nor holds a `blocks` ModuleList. Keep the repeated layers in "
            "`self.blocks = spx.nn.ModuleList([...])` and call them in forward, wrap the stages in "
            "spx.nn.PipelineSequential, or mark boundaries yourself with spx.sxstage_iter and use "
            "spectrax_mpmd.sxvalue_and_grad."
        )
    return list(blocks), mp.stage_sizes(len(blocks), n_stages, sizes)


@contextlib.contextmanager
def _stage_marks(blocks: list[Module], sizes: Sequence[int]):
    """While active, the output of each stage's last block passes through a stage marker.

    Yields the list of block indices in the order the forward called them.
    """
    import spectrax_mpmd as mp

    ends, total = set(), 0
    for size in sizes[:-1]:
        total += size
        ends.add(total - 1)
    calls: list[int] = []

    def transform(module: Any, out: Any) -> Any:
        for k, block in enumerate(blocks):
            if block is module:
                calls.append(k)
                return mp.sxstage_iter(out) if k in ends else out
        return out

    _module._output_transforms.append(transform)
    try:
        yield calls
    finally:
        _module._output_transforms.remove(transform)


def _check_calls(model: Module, calls: list[int], n_blocks: int) -> None:
    if calls != list(range(n_blocks)):
        import spectrax_mpmd as mp

        raise mp.StageSplitError(
            f"spx.run: {type(model).__name__}.forward called its blocks in the order {calls}; pipeline "
            f"stages need each of the {n_blocks} blocks called exactly once, in list order, so that "
            "no layer is dropped or run twice. Call self.blocks in order in forward (or mark stages "
            "yourself with spx.sxstage_iter)."
        )


def _call(model: Module, inputs: Any) -> Any:
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def _forward(graphdef, selected: tuple[bool, ...], n_stages: int, sizes) -> Callable:
    def forward(diff_values: list, rest_values: list, inputs: Any) -> Any:
        diff, rest = iter(diff_values), iter(rest_values)
        values = [next(diff) if s else next(rest) for s in selected]
        model = build(graphdef, values)[0][0]
        if n_stages == 1:
            return _call(model, inputs)
        blocks, group_sizes = _stage_groups(model, n_stages, sizes)
        with _stage_marks(blocks, group_sizes) as calls:
            out = _call(model, inputs)
        _check_calls(model, calls, len(blocks))
        return out

    return forward


def run(
    model: Module,
    *,
    inputs: Any,
    targets: Any = None,
    mesh,
    mode: str = "train",
    loss_fn: Callable | None = None,
    microbatches: int = 1,
    schedule=None,
    has_aux: bool = False,
    stage_sizes: Sequence[int] | None = None,
) -> Any:
    """Train (`mode="train"`) or run (`"forward"`) `model` on `mesh`, pipelined when it has a pipeline axis.

    `inputs` (an array, a tuple passed as `model(*inputs)`, or a dict passed as
    `model(**inputs)`) and `targets` are split into `microbatches`. Train mode
    returns `(loss, grads)`: the mean over microbatches of `loss_fn(outputs,
    targets)` and its gradients, a `State` of the model's trainable parameters
    (what `spx.grad` returns and `spx.Optimizer.update` takes). Forward mode
    returns the outputs in batch order. On a mesh without a pipeline axis the
    same computation is one `jax.jit` over the mesh; the numbers agree.
    Buffers and other non-parameter variables are read, not written back; a
    PRNG key among them reaches microbatch `i` as `jax.random.fold_in(key, i)`.
    """
    import spectrax_mpmd as mp

    plan = plan_of(model)
    selected = trainable(plan, "parameters")
    values = [v._value for v in plan.vars]
    sizes = None if stage_sizes is None else tuple(stage_sizes)
    key = (plan.graphdef, selected, mesh, mode, microbatches, schedule, has_aux, sizes)
    cache = _runners.setdefault(loss_fn, {}) if loss_fn is not None else _no_loss
    runner = cache.get(key)
    if runner is None:
        runner = cache[key] = mp.Runner(
            _forward(plan.graphdef, selected, mp.pipeline_stages(mesh, schedule), sizes),
            mesh=mesh,
            mode=mode,
            loss_fn=loss_fn,
            microbatches=microbatches,
            schedule=schedule,
            has_aux=has_aux,
            name="spx.run",
        )
    diff = [v for v, s in zip(values, selected) if s]
    rest = [v for v, s in zip(values, selected) if not s]
    result = runner(diff, rest, inputs, targets)
    if mode == "forward":
        return result
    value, grads = result
    infos = tuple(info for info, s in zip(plan.infos, selected) if s)
    return value, State(infos, list(grads))
