"""One entry point for a model on any mesh: `run`, `runner`, `sxcall`, and `gather`.

A run is a forward function `forward(params, extra, inputs) -> outputs` plus
what to do with it: train (`loss_fn(outputs, targets)`, returns the loss and
the gradients of `params`) or forward (returns the outputs in batch order),
run by a `Runner`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from spectrax_core import apply

from .._planner.balance import auto_balance
from .._settings import StepSettings
from .._stages import _blocks_of, stage_blocks
from .._trace.marker import sxstage_iter
from ..errors import MpmdError
from .generate.entry import Generation, check_options
from .runner import Runner, call_with, train_loss


def core_forward(apply_fn: Callable, n_stages: int, sizes: Sequence[int] | None) -> Callable:
    """The forward of a core model whose `blocks` are cut into `n_stages` by a `StagedStack`; a
    model without `blocks` is cut where its forward places `sxstage_iter` markers and regions."""

    def forward(model, _extra, inputs):
        if n_stages > 1 and hasattr(model, "blocks"):
            model = stage_blocks(model, n_stages, sizes)
        return call_with(apply_fn, model, inputs)

    return forward


def _auto_runner(settings: StepSettings, apply_fn: Callable, loss_fn: Callable) -> Callable:
    """A train step whose stage sizes are chosen on its first call by `auto_balance` (kept as
    `step.balance`); later calls reuse that split."""
    settings = settings.with_schedule()

    def step(model, inputs, targets=None):
        if step.runner is None:

            def cut(sizes):
                forward = core_forward(apply_fn, len(sizes), sizes)
                return train_loss(forward, loss_fn), (model, None, inputs, targets)

            step.balance = auto_balance(cut, _blocks_of(model).n_layers, settings)
            forward = core_forward(apply_fn, settings.model_stages(), step.balance.sizes)
            step.runner = Runner.of(forward, loss_fn, settings)
        return step.runner(model, None, inputs, targets)

    step.runner = step.balance = None
    step.generate = Generation(settings.mesh, settings.schedule, lambda: step.balance and step.balance.sizes)
    return step


def _advised(advice, given: dict) -> StepSettings:
    """The settings of a `runner` call with `advice`: the mesh, schedule, optimizer and per-stage
    `remat`/`offload` of its best configuration (the caller's `tx`, `remat` and `offload` win
    when set)."""
    if given["mesh"] is not None or given["schedule"] is not None:
        raise MpmdError(
            "runner: advice= gives the mesh and the schedule (its best configuration); drop mesh= and "
            "schedule=, or drop advice= (e.g. schedule=advice.candidates[k].schedule for another one)."
        )
    if getattr(advice, "source", None) is None:
        raise MpmdError(f"runner: advice= takes what mp.advise returns, got {type(advice).__name__}.")
    chosen, memory = advice.best.memory, {}
    if chosen is not None and given["remat"] is False and given["offload"] is False:
        memory = {"remat": chosen.remat, "offload": chosen.offload}
    tx = given["tx"] if given["tx"] is not None else advice.source.tx
    return StepSettings.of(
        "run", {**given, **memory, "mesh": advice.source.mesh, "schedule": advice.best.schedule, "tx": tx}
    )


def runner(
    *,
    mesh=None,
    mode: str = "train",
    loss_fn: Callable | None = None,
    microbatches: int = 1,
    schedule=None,
    has_aux: bool = False,
    stage_sizes: Sequence[int] | str | None = None,
    apply_fn: Callable = apply,
    rules=None,
    memory_budget: int | None = None,
    region_ranks: dict | None = None,
    tx=None,
    remat=False,
    offload=False,
    advice=None,
    microbatch_weight_fn: Callable | None = None,
    length_buckets=None,
) -> Callable:
    """`run` as a reusable step: `step(model, inputs, targets=None)`, compiled once per signature.

    Use this in a training loop; `run` builds (and compiles) a new step on every call.
    With an optax `tx`, `step.update(model, opt_state, inputs, targets)` is the whole
    training step, `(loss, model, opt_state)`, the update inside the pipelined plan on
    each parameter's rank (`opt_state = tx.init(model)`; both are consumed).
    With `stage_sizes="auto"` the first call profiles the model's blocks and picks
    the split (`step.balance` says which, with its predicted per-stage times).
    `region_ranks` places the `sxstage_region`s of a model without `blocks` (see
    `sxvalue_and_grad`). `remat` and `offload` set, per stage or for all, what a
    pipelined step keeps for its backward (see `sxvalue_and_grad`).
    `step.generate(model, prompt, max_new_tokens, **options)` generates with the
    run's layout (a core LM; options as `PipelineDecoder.generate`): each leaf is
    used where the training step left it, and the next step's parameters reuse
    the compiled programs.
    With `advice` (what `mp.advise` returns), the mesh and the schedule are those of
    its best configuration, `tx` defaults to the one it was advised with and
    `remat`/`offload` to the per-stage choice it fits with; the
    model's `blocks` are cut into that configuration's ranks x virtual stages
    (evenly, or by `stage_sizes`), as the advised function cut them.
    `length_buckets` is `run`'s; `step.update` takes it too.
    """
    settings = StepSettings.of("run", locals()) if advice is None else _advised(advice, locals())
    if settings.mesh is None:
        raise MpmdError("runner: mesh= is required (an mp.create_mesh mesh), or advice= from mp.advise.")
    return _runner_of(settings, apply_fn, loss_fn)


def _runner_of(settings: StepSettings, apply_fn: Callable, loss_fn: Callable | None) -> Callable:
    """The step `runner` returns for `settings`."""
    if settings.stage_sizes == "auto":
        if settings.tx is not None:
            raise MpmdError(
                "run: tx= needs the stage sizes fixed; pass the block counts (e.g. a balance's sizes)."
            )
        if settings.mode != "train":
            raise MpmdError(
                "run: stage_sizes='auto' balances a training step from its profiled costs; with "
                "mode='forward' give the block counts (e.g. the `balance.sizes` of a training run)."
            )
        if settings.model_stages() > 1:
            if loss_fn is None:
                raise MpmdError(
                    "run: mode='train' needs loss_fn=, a function (outputs, targets) -> scalar loss."
                )
            return _auto_runner(settings, apply_fn, loss_fn)
        settings = settings.replace(stage_sizes=None)
    inner = Runner.of(
        core_forward(apply_fn, settings.model_stages(), settings.stage_sizes), loss_fn, settings
    )

    @functools.wraps(inner.__call__)
    def step(model, inputs, targets=None):
        return inner(model, None, inputs, targets)

    def update(model, opt_state, inputs, targets=None):
        return inner.update(model, opt_state, None, inputs, targets)

    step.runner, step.update = inner, update
    step.generate = Generation(settings.mesh, settings.schedule, lambda: settings.stage_sizes)
    return step


def run(
    model,
    *,
    inputs,
    targets=None,
    mesh,
    mode: str = "train",
    loss_fn: Callable | None = None,
    microbatches: int = 1,
    schedule=None,
    has_aux: bool = False,
    stage_sizes: Sequence[int] | str | None = None,
    apply_fn: Callable = apply,
    rules=None,
    memory_budget: int | None = None,
    region_ranks: dict | None = None,
    remat=False,
    offload=False,
    microbatch_weight_fn: Callable | None = None,
    length_buckets=None,
    max_new_tokens=None,
    **options,
):
    """Train, run or generate with a core model on `mesh`: SPMD without a pipeline axis, MPMD with one.

    `apply_fn(model, inputs)` is the forward (`spectrax_core.apply` by default;
    a tuple of inputs is passed as `*inputs`, a dict as `**inputs`). On an MPMD
    mesh, the model's `blocks` (a `BlockStack`, or a `StagedStack` from
    `stage_blocks`) are cut into `mesh.mpmd_dim x virtual_stages` stages — evenly,
    by `stage_sizes`, or with `stage_sizes="auto"` where the profiled per-block
    costs say (within `memory_budget` bytes per device, if given; see `balance`) —
    through the model's own forward: what runs before the blocks is on the first
    stage, what runs after on the last. A model without `blocks` is cut where its
    forward places `sxstage_iter` markers and `sxstage_region`s (placed by
    `region_ranks`, as in `sxvalue_and_grad`).

    `mode="train"`: returns `(loss, grads)`, `loss_fn(outputs, targets)` of the
    whole batch (see `sxvalue_and_grad` for which losses split exactly; other
    losses are averaged over `microbatches`, or weighed by
    `microbatch_weight_fn(inputs, targets)`) and its gradients, shaped like `model`.
    `mode="forward"`: returns the outputs in batch order. `remat` and `offload`
    set what each pipelined stage keeps for its backward (see `sxvalue_and_grad`).
    `length_buckets=mp.LengthBuckets(("targets", "lengths"))` runs each microbatch
    at its rows' length bucket (the lengths named by a path into `inputs` or
    `targets`; see `docs/variable-length.md`).
    Each call compiles;
    in a loop use `runner(...)` once and call the step it returns.
    `mode="generate"`: `model` is a core LM and `inputs` a left-padded prompt;
    returns `max_new_tokens` new tokens per sequence, the other keywords being
    `PipelineDecoder.generate`'s options (`groups`, `sampler`, `keys`, ...).
    """
    if mode == "generate":
        if max_new_tokens is None:
            raise MpmdError("run: mode='generate' needs max_new_tokens=, an int or one per sequence.")
        sizes = None if stage_sizes is None or isinstance(stage_sizes, str) else tuple(stage_sizes)
        return Generation(mesh, schedule, lambda: sizes)(model, inputs, max_new_tokens, **options)
    if options or max_new_tokens is not None:
        check_options(options, "run")
        raise MpmdError(
            f"run: {sorted(options) or ['max_new_tokens']} are generation options; pass mode='generate'."
        )
    step = _runner_of(StepSettings.of("run", locals()), apply_fn, loss_fn)
    return step(model, inputs, targets)


def sxcall(
    stages: Sequence[tuple[Callable, Any]],
    batch,
    *,
    mesh,
    schedule=None,
    loss_fn: Callable | None = None,
    mode: str = "train",
):
    """Run a list of `(apply_fn, params)` stages as a pipeline, stage `k` on its own rank.

    `mode="train"`: `batch` is `(inputs, targets)`; returns `(loss, grads)` with
    one gradient tree per stage. `mode="forward"`: `batch` is the inputs;
    returns the last stage's outputs in batch order.
    """
    settings = StepSettings.of("sxcall", locals())
    if not stages or not all(isinstance(s, tuple) and len(s) == 2 and callable(s[0]) for s in stages):
        raise MpmdError(
            "sxcall: stages must be a non-empty list of (apply_fn, params) pairs; for an eager "
            "PipelineSequential use spectrax_eager.sxcall (or spx.run)."
        )
    fns = tuple(fn for fn, _ in stages)

    def forward(params, _extra, inputs):
        x = inputs
        for k, (fn, p) in enumerate(zip(fns, params)):
            x = fn(p, x)
            if k < len(fns) - 1:
                x = sxstage_iter(x)
        return x

    step = Runner.of(forward, loss_fn, settings)
    params = [p for _, p in stages]
    if mode == "train":
        if not (isinstance(batch, tuple) and len(batch) == 2):
            raise MpmdError("sxcall: with mode='train', batch must be a pair (inputs, targets).")
        return step(params, None, *batch)
    return step(params, None, batch)
