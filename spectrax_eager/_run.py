"""`spx.run`: train or run an eager model on any mesh, pipelined through its own `forward`.

On a mesh with a pipeline axis the model is cut into stages without
re-chaining its children (`_stage.py` says how: a `PipelineSequential`, a
`blocks` `ModuleList`, or `assign_stage` stamps); on a mesh without one the
same computation is one SPMD `jax.jit`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from spectrax_core.schedules import GPipe

from ._module import Module, build, plan_of
from ._run_key import Uncacheable, function_key, mesh_key
from ._run_optimizer import grouped, optimizer_key, optimizers_of, selection, states_of, store
from ._run_rngs import (
    counter_positions,
    counting_loss,
    first_microbatch,
    per_microbatch,
    split_counters,
    write_counters,
)
from ._stage import StagePlan, call, run_marked, stage_plan
from ._state import State, trainable, update
from .nn._containers import ModuleList

MAX_RUNNERS = 32  # compiled configurations kept; the least recently used is dropped first


class RunKey(NamedTuple):
    """Everything that changes a run's programs, by value (see `_run_key`)."""

    graphdef: Any
    selected: tuple[bool, ...]
    mesh: tuple
    mode: str
    microbatches: int
    schedule: Any
    has_aux: bool
    stage_sizes: Any
    loss: Any
    optimizer: Any  # the optimizers' transformations and selections, by value (None: gradients out)
    memory: Any = ()  # what each stage keeps for its backward: (remat, offload), hashable


class _CurrentLoss:
    """The loss function of the latest call with this key: a retrace (a new input signature) of a
    cached runner calls it, not the function of the call that compiled the runner."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


_runners: OrderedDict[RunKey, tuple[Any, _CurrentLoss | None]] = OrderedDict()


def _cache_key(
    plan, selected, mesh, mode, microbatches, schedule, has_aux, stage_sizes, loss_fn, optimizers, memory=()
):
    """The run's `RunKey`, or None when a value it depends on has no key by content."""
    try:
        return RunKey(
            plan.graphdef,
            selected,
            mesh_key(mesh),
            mode,
            microbatches,
            schedule,
            has_aux,
            stage_sizes,
            function_key(loss_fn),
            None if optimizers is None else optimizer_key(plan, optimizers),
            _hashable(memory),
        )
    except Uncacheable:
        return None


def _hashable(value):
    """`value` with its lists and mappings as (sorted) tuples; `Uncacheable` if it cannot be hashed."""
    if isinstance(value, dict):
        value = tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    elif isinstance(value, (list, tuple)):
        value = tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError as err:
        raise Uncacheable(f"{value!r} has no key by value") from err
    return value


def _remember(key: RunKey | None, runner: Any, loss: _CurrentLoss | None) -> None:
    if key is not None:
        _runners[key] = (runner, loss)
        while len(_runners) > MAX_RUNNERS:
            _runners.popitem(last=False)


def _forward(
    graphdef,
    selected: tuple[bool, ...],
    plan: StagePlan | None,
    counters: tuple[int, ...] = (),
    mode: str = "train",
) -> Callable:
    """The run's forward over (trainable values, other values, inputs); with `counters`, it also
    returns the new values of the variables at those plan positions (see `_run_rngs`)."""

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


def _new_runner(
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
) -> tuple[Any, _CurrentLoss | None]:
    """A runner for this configuration (its stage split chosen now for `stage_sizes="auto"`) and
    the holder of its current loss function."""
    import spectrax_mpmd as mp

    if stage_sizes == "auto":
        schedule = schedule if schedule is not None else GPipe(microbatches=microbatches)
        sizes = _balanced_sizes(
            model, plan, selected, args, mesh=mesh, schedule=schedule, loss_fn=loss_fn, has_aux=has_aux
        )
    loss = _CurrentLoss(loss_fn) if loss_fn is not None else None
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
    stage_sizes: Sequence[int] | str | None = None,
    wrt: Any = "parameters",
    optimizer: Any = None,
    remat: Any = False,
    offload: Any = False,
    fuse_1f1b: bool | None = None,
    fuse_zb: bool | None = None,
    max_new_tokens: Any = None,
    **options: Any,
) -> Any:
    """Train (`mode="train"`), run (`"forward"`) or generate with `model` on `mesh`, pipelined when
    it has a pipeline axis.

    `inputs` (an array, a tuple passed as `model(*inputs)`, or a dict passed as
    `model(**inputs)`) and `targets` are split into `microbatches`. Train mode
    returns `(loss, grads)`: the mean over microbatches of `loss_fn(outputs,
    targets)` and its gradients, a `State` of the model's trainable parameters
    (what `spx.grad` returns and `spx.Optimizer.update` takes). Forward mode
    returns the outputs in batch order. On a mesh without a pipeline axis the
    same computation is one `jax.jit` over the mesh; the numbers agree.
    The counters of the model's `Rngs` streams advance as in an eager call, so
    each call draws fresh dropout masks; a stream's key (any PRNG key among the
    variables) reaches microbatch `i` as `jax.random.fold_in(key, i)`. Buffers
    and other non-parameter variables are read, not written back.
    `fuse_1f1b` / `fuse_zb` may be given as False (or None): the schedule's table says which
    forward and backward run as one fused cell (`KimiK2`, `DualPipeV` have them).
    `stage_sizes="auto"` splits the `blocks` by their profiled costs (see
    `spectrax_mpmd.balance`), once per configuration.

    `wrt` selects the variables to differentiate (any selector: `"lora"`, a
    collection, a filter; default the `"parameters"` collection). With
    `optimizer=` (an `spx.Optimizer` or `spx.MultiOptimizer`), train mode is the
    whole training step: the optimizer's variables are differentiated and
    updated inside the compiled step (on each parameter's pipeline rank), the
    model and the optimizer's state are written in place, and the loss is
    returned (`(loss, aux)` with `has_aux`), as `opt.update(model, grads)` after
    a gradient run would leave them.

    `remat` and `offload` set what each pipeline stage keeps for its backward:
    recompute (`True` or a `jax.checkpoint_policies` name) and saved values in
    host memory (see `spectrax_mpmd.sxvalue_and_grad`), for every stage or per
    stage; a run without a pipeline axis ignores them.

    Compiled runs are cached by value (model structure, configuration, the mesh's
    devices and axes, and the loss function's code with the values it reads; see
    `_run_key`), so an inline `loss_fn=lambda ...` compiles once; the 32 most
    recently used are kept.

    `mode="generate"` continues the left-padded prompt `inputs` by
    `max_new_tokens` tokens with a core LM (`spectrax_core.models.TransformerLM`,
    e.g. the parameters a pipelined training step returned, used where they
    are): `spectrax_mpmd.run(..., mode="generate")`, whose other keywords
    (`groups`, `sampler`, `keys`, `stop_tokens`, ...) it passes on.
    """
    import spectrax_mpmd as mp

    no_fusion("spx.run", fuse_1f1b=fuse_1f1b, fuse_zb=fuse_zb)
    if mode == "generate" or options or max_new_tokens is not None:
        return _generate(model, inputs, mesh, mode, schedule, stage_sizes, max_new_tokens, options)

    plan = plan_of(model)
    optimizers = optimizers_of(optimizer) if optimizer is not None else None
    if optimizers is not None and mode != "train":
        raise mp.MpmdError("spx.run: optimizer= updates a training step; use mode='train'.")
    selected = trainable(plan, wrt) if optimizers is None else selection(plan, optimizers)
    values = [v._value for v in plan.vars]
    if isinstance(stage_sizes, str) and stage_sizes != "auto":
        raise mp.MpmdError(f"spx.run: stage_sizes must be block counts, None or 'auto', got {stage_sizes!r}.")
    sizes = None if stage_sizes is None or stage_sizes == "auto" else tuple(stage_sizes)
    config = (mode, microbatches, schedule, has_aux, sizes or stage_sizes)
    memory = {"remat": remat, "offload": offload}
    key = _cache_key(plan, selected, mesh, *config, loss_fn, optimizers, memory)
    runner, loss = _runners.get(key, (None, None)) if key is not None else (None, None)
    diff = [v for v, s in zip(values, selected) if s]
    rest = [v for v, s in zip(values, selected) if not s]
    counters = counter_positions(plan)
    if runner is None:
        runner, loss = _new_runner(
            model,
            plan,
            selected,
            (diff, rest, inputs, targets),
            counters,
            mesh=mesh,
            mode=mode,
            loss_fn=loss_fn,
            microbatches=microbatches,
            schedule=schedule,
            has_aux=has_aux,
            sizes=sizes,
            stage_sizes=stage_sizes,
            tx=None if optimizers is None else grouped(plan, selected, optimizers),
            memory=memory,
        )
        _remember(key, runner, loss)
    elif loss is not None:
        loss.fn = loss_fn
    if key is not None:
        _runners.move_to_end(key)
    if optimizers is not None:
        value, diff, states = runner.update(diff, states_of(optimizers), rest, inputs, targets)
        result = (value, diff)
    else:
        result = runner(diff, rest, inputs, targets)
    if counters:
        result, stacked = split_counters(result, mode, has_aux)
        write_counters(plan, counters, first_microbatch(stacked, mesh))
    if mode == "forward":
        return result
    value, grads = result
    infos = tuple(info for info, s in zip(plan.infos, selected) if s)
    if optimizers is None:
        return value, State(infos, list(grads))
    update(model, State(infos, list(grads)))
    store(optimizers, states)
    return value


def _generate(model, inputs, mesh, mode, schedule, stage_sizes, max_new_tokens, options) -> Any:
    import spectrax_mpmd as mp

    if isinstance(model, Module):
        raise mp.MpmdError(
            f"spx.run: mode='generate' runs a core LM (spectrax_core.models.TransformerLM), got the eager "
            f"module {type(model).__name__}; pass the core parameters (e.g. what a training step returned)."
        )
    return mp.run(
        model,
        inputs=inputs,
        mesh=mesh,
        mode=mode,
        schedule=schedule,
        stage_sizes=stage_sizes,
        max_new_tokens=max_new_tokens,
        **options,
    )


def no_fusion(name: str, **flags) -> None:
    """Refuse a `fuse_*` flag given as True: which cells fuse is the schedule's table."""
    import spectrax_mpmd as mp

    for key, value in flags.items():
        if value:
            raise mp.MpmdError(
                f"{name}: {key}=True is not taken: which forward and backward run as one fused cell is "
                "the schedule's table (KimiK2 and DualPipeV fuse); leave it unset."
            )
