"""`spx.run`: train or run an eager model on any mesh, pipelined through its own `forward`.

On a mesh with a pipeline axis the model is cut into stages without
re-chaining its children (`stages.py` says how: a `PipelineSequential`, a
`blocks` `ModuleList`, or `assign_stage` stamps); on a mesh without one the
same computation is one SPMD `jax.jit`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from .._graph.export import update
from .._graph.module import Module, plan_of
from .._graph.state import State
from .._graph.walk import trainable
from .counters import counter_positions, first_microbatch, split_counters, write_counters
from .key import RunKey, run_key
from .optimizer import grouped, optimizers_of, selection, states_of, store
from .runner import CurrentLoss, new_runner

MAX_RUNNERS = 32  # compiled configurations kept; the least recently used is dropped first

# A cache, not ambient state: the compiled runners by `RunKey`, least recently used first.
_runners: OrderedDict[RunKey, tuple[Any, CurrentLoss | None]] = OrderedDict()


def _remember(key: RunKey | None, runner: Any, loss: CurrentLoss | None) -> None:
    if key is not None:
        _runners[key] = (runner, loss)
        while len(_runners) > MAX_RUNNERS:
            _runners.popitem(last=False)


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
    microbatch_weight_fn: Callable | None = None,
    memory_budget: int | None = None,
    fuse_1f1b: bool | None = None,
    fuse_zb: bool | None = None,
    max_new_tokens: Any = None,
    **options: Any,
) -> Any:
    """Train (`mode="train"`), run (`"forward"`) or generate with `model` on `mesh`, pipelined when
    it has a pipeline axis.

    `inputs` (an array, a tuple passed as `model(*inputs)`, or a dict passed as
    `model(**inputs)`) and `targets` are split into `microbatches`. Train mode
    returns `(loss, grads)`: `loss_fn(outputs, targets)` of the whole batch for
    the losses `spectrax_mpmd.sxvalue_and_grad` splits exactly (a padded token
    mean among them), else the mean over microbatches or, with
    `microbatch_weight_fn(inputs, targets)`, the mean weighted by it; and its
    gradients, a `State` of the model's trainable parameters
    (what `spx.grad` returns and `spx.Optimizer.update` takes; on a pipeline
    mesh `grads[r]` is rank `r`'s part, as `spectrax-lib` returns one per rank). Forward mode
    returns the outputs in batch order. On a mesh without a pipeline axis the
    same computation is one `jax.jit` over the mesh; the numbers agree.
    The counters of the model's `Rngs` streams advance as in an eager call, so
    each call draws fresh dropout masks; a stream's key (any PRNG key among the
    variables) reaches microbatch `i` as `jax.random.fold_in(key, i)`. Buffers
    and other non-parameter variables are read, not written back.
    `fuse_1f1b` / `fuse_zb` may be given as False (or None): the schedule's table says which
    forward and backward run as one fused cell (`KimiK2`, `DualPipeV` have them).
    `stage_sizes="auto"` splits the `blocks` by their profiled costs, once per configuration,
    as `spectrax_mpmd.run` does (`spectrax_mpmd.auto_balance`: the microbatch weights, `remat`,
    `offload`, the optimizer and `memory_budget`, bytes per device, all count).

    `wrt` selects the variables to differentiate (any selector: `"lora"`, a
    collection, a filter; default the `"parameters"` collection). With
    `optimizer=` (an `spx.Optimizer` or `spx.MultiOptimizer`), train mode is the
    whole training step: the optimizer's variables are differentiated and
    updated inside the compiled step (on each parameter's pipeline rank), the
    model and the optimizer's state are written in place, and the loss is
    returned (`(loss, aux)` with `has_aux`), as `opt.update(model, grads)` after
    a gradient run would leave them. The step donates the arrays it replaces (the model's
    trained variables and the optimizer's state, as `jax.jit(donate_argnums=...)`): a
    module sharing them (an `spx.clone`) sees them deleted.

    `remat` and `offload` set what each pipeline stage keeps for its backward:
    recompute (`True` or a `jax.checkpoint_policies` name) and saved values in
    host memory (see `spectrax_mpmd.sxvalue_and_grad`), for every stage or per
    stage; a run without a pipeline axis ignores them.

    Compiled runs are cached by value (model structure, configuration, the mesh's
    devices and axes, and the loss function's code with the values it reads; see
    `key`), so an inline `loss_fn=lambda ...` compiles once; the 32 most
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

    settings = mp.StepSettings.of("spx.run", locals())
    return run_with(model, inputs, targets, settings, loss_fn, wrt, optimizer)


def run_with(model: Module, inputs, targets, settings, loss_fn, wrt="parameters", optimizer=None) -> Any:
    """`run` with its step's settings made (`settings`, a `spectrax_mpmd.StepSettings`)."""
    import spectrax_mpmd as mp

    plan, mode = plan_of(model), settings.mode
    optimizers = optimizers_of(optimizer) if optimizer is not None else None
    if optimizers is not None and mode != "train":
        raise mp.MpmdError("spx.run: optimizer= updates a training step; use mode='train'.")
    selected = trainable(plan, wrt) if optimizers is None else selection(plan, optimizers)
    values = [v._value for v in plan.vars]
    diff = [v for v, s in zip(values, selected) if s]
    rest = [v for v, s in zip(values, selected) if not s]
    args, counters = (diff, rest, inputs, targets), counter_positions(plan)
    runner = _runner(model, plan, selected, args, counters, settings, loss_fn, optimizers)
    mesh = settings.mesh
    result, states = _step(
        runner, plan, counters, args, optimizers, mesh=mesh, mode=mode, has_aux=settings.has_aux
    )
    if mode == "forward":
        return result
    value, grads = result
    grads = State(tuple(info for info, s in zip(plan.infos, selected) if s), list(grads), _ranks(grads, mesh))
    if optimizers is None:
        return value, grads
    update(model, grads)
    store(optimizers, states)
    return value


def _ranks(leaves: Sequence, mesh: Any) -> tuple[int | None, ...] | None:
    """The pipeline rank holding each leaf (`state[rank]` reads them), or None without a pipeline."""
    if getattr(mesh, "mpmd_dim", 1) == 1:
        return None
    return tuple(mesh.rank_of(leaf) for leaf in leaves)


def _step(runner, plan, counters, args, optimizers, *, mesh, mode, has_aux) -> tuple[Any, tuple | None]:
    """Call `runner` on `args` (a training step with the optimizers' states when given) and
    write the new stream counters back; returns the result and the new optimizer states."""
    diff, rest, inputs, targets = args
    states = None
    if optimizers is not None:
        value, diff, states = runner.update(diff, states_of(optimizers), rest, inputs, targets)
        result = (value, diff)
    else:
        result = runner(diff, rest, inputs, targets)
    if counters:
        result, stacked = split_counters(result, mode, has_aux)
        write_counters(plan, counters, first_microbatch(stacked, mesh))
    return result, states


def _runner(model, plan, selected, args, counters, settings, loss_fn, optimizers) -> Any:
    """The runner of this configuration: the cached one (its loss function now `loss_fn`), or a
    new one, remembered."""
    key = run_key(plan, selected, settings, loss_fn, optimizers)
    runner, loss = _runners.get(key, (None, None)) if key is not None else (None, None)
    if runner is None:
        tx = None if optimizers is None else grouped(plan, selected, optimizers)
        runner, loss = new_runner(model, plan, selected, args, counters, settings.replace(tx=tx), loss_fn)
        _remember(key, runner, loss)
    elif loss is not None:
        loss.fn = loss_fn
    if key is not None:
        _runners.move_to_end(key)
    return runner


def _generate(model, inputs, mesh, mode, schedule, stage_sizes, max_new_tokens, options) -> Any:
    import spectrax_mpmd as mp

    if isinstance(model, Module):
        raise mp.MpmdError(
            f"spx.run: mode='generate' runs a core LM (spectrax_core.models.TransformerLM), got the eager "
            f"module {type(model).__name__}; pass the core parameters (e.g. what a training step returned)."
        )
    layout = dict(mesh=mesh, schedule=schedule, stage_sizes=stage_sizes)
    return mp.run(model, inputs=inputs, mode=mode, max_new_tokens=max_new_tokens, **layout, **options)


def no_fusion(name: str, **flags) -> None:
    """Refuse a `fuse_*` flag given as True: which cells fuse is the schedule's table."""
    import spectrax_mpmd as mp

    for key, value in flags.items():
        if value:
            raise mp.MpmdError(
                f"{name}: {key}=True is not taken: which forward and backward run as one fused cell is "
                "the schedule's table (KimiK2 and DualPipeV fuse); leave it unset."
            )
