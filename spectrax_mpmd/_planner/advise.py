"""`advise`: which schedule, how many microbatches and virtual stages, under a memory budget.

Every candidate `(schedule, microbatches, virtual stages)` is simulated with costs
and bytes profiled from the compiled programs (`spectrax_mpmd._planner.profiler`:
one profile per layout and microbatch count serves every schedule with it), and
the optimizer's update after it (`spectrax_mpmd._planner.optimizer`), run with
the validation the step will have. Peak bytes follow the runtime's issue order,
which is exact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import optax

from spectrax_core import schedules as S
from spectrax_core.schedules import StageCost, StageMemory

from .._api.validation import VALIDATIONS
from .._settings import StepSettings
from .._trace.context import outside_context_mesh
from ..errors import MpmdError, StageSplitError
from .advice import Advice, Candidate, Skipped, Source, check_budget, fits, ranked
from .balance import _optimizer_copies
from .cache import ProfileCache, default_directory
from .calibrate import Calibration
from .confirm import confirmed
from .device_advice import advise_devices, device_options
from .memory import fitted
from .predict import Predicted, predictor
from .profiler import Profiled, Profiler

ALL = (*S.ALL_SCHEDULES, S.ZeroBubbleH2, S.ZBV, S.VHalf, S.VMin, S.DualPipe)  # every schedule shipped
DUALPIPE = (
    "its two directions make a graph of stages, whose peak bytes the simulator does not model (a "
    "chain only); build it with sxvalue_and_grad and measure it (measure_peak_bytes, measure_timeline)"
)


def _check_arguments(memory_budget, rounds, tx, optimizer_states, validation, confirm) -> None:
    """Raise, before anything is profiled, on an argument no configuration could use."""
    check_budget(memory_budget)
    if isinstance(confirm, bool) or not isinstance(confirm, int) or confirm < 0:
        raise MpmdError(
            f"advise: confirm must be an int >= 0 (how many close candidates to run and measure), "
            f"received {confirm!r}. Pass 0 to trust the prediction alone."
        )
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise MpmdError(
            f"advise: rounds must be a positive int (each profile runs the step that many times, cell by "
            f"cell, to time its cells), received {rounds!r}. Pass rounds=1 or more."
        )
    if tx is not None and optimizer_states is not None:
        raise MpmdError("advise: give tx= (the state is read from it) or optimizer_states=, not both.")
    if tx is not None and not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise MpmdError(f"advise: tx must be an optax.GradientTransformation, got {type(tx).__name__}.")
    if not isinstance(validation, str) or validation not in VALIDATIONS:
        raise MpmdError(
            f"advise: validation must be one of {VALIDATIONS} (as sxvalue_and_grad_and_apply's "
            f"validation=), received {validation!r}."
        )


def _candidates(schedules, microbatches, virtual_stages, n: int) -> list:
    """Every valid schedule instance for `n` ranks; an error says what to allow when there is none."""
    out = []
    for cls in schedules:
        for m in microbatches:
            for v in virtual_stages:
                try:
                    if cls.layout == "v":
                        made = [cls(microbatches=m)] if v == 2 else []
                    elif cls.layout == "loop":
                        made = [cls(microbatches=m, virtual_stages=v)] if v >= 2 else []
                    elif cls is S.ZeroBubbleH2:  # built for 0, ½ and 1 slot of transfer latency
                        made = [cls(microbatches=m, latency=x) for x in (0.0, 0.5, 1.0)] if v == 1 else []
                    else:
                        made = [cls(microbatches=m)] if v == 1 else []
                    for schedule in made:
                        schedule.validate(n)
                        out.append(schedule)
                except ValueError:
                    continue
    if not out:
        raise MpmdError(
            f"advise: no valid configuration among schedules {[c.__name__ for c in schedules]}, "
            f"microbatches {tuple(microbatches)} and virtual_stages {tuple(virtual_stages)} on {n} ranks; "
            "allow more microbatches (interleaved schedules need m >= ranks, DualPipeV m >= 2 x ranks)."
        )
    return out


def _optimizer_note(tx, optimizer_states) -> str:
    if optimizer_states is not None:
        return (
            f"state estimated as {optimizer_states:g} copies of each rank's parameters (optimizer_states); "
            "update not timed"
        )
    if tx is None:
        return (
            "assumed Adam (no tx given): two moments per parameter and a step count, on each parameter's "
            "rank, and Adam's update timed; pass tx= for your optimizer"
        )
    return "from tx: tx.init's state on each parameter's rank, and its update timed"


def _check_guard(max_grad_norm, skip_nonfinite) -> None:
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not max_grad_norm > 0):
        raise MpmdError(
            f"advise: max_grad_norm must be a positive number or None (as sxvalue_and_grad_and_apply's), "
            f"received {max_grad_norm!r}."
        )
    if not isinstance(skip_nonfinite, bool):
        raise MpmdError(f"advise: skip_nonfinite must be True or False, received {skip_nonfinite!r}.")


@outside_context_mesh
def advise(
    fn: Callable,
    *args,
    mesh,
    memory_budget: int | None = None,
    schedules: Sequence[type] = ALL,
    microbatches: Sequence[int] = (4, 8),
    virtual_stages: Sequence[int] = (1, 2),
    tx: optax.GradientTransformation | None = None,
    optimizer_states: float | None = None,
    comm: float = 0.0,
    rounds: int = 2,
    search: bool = True,
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
    validation: str = "sync",
    confirm: int = 3,
    profile_cache: bool | str | os.PathLike = True,
    devices: int | None = None,
    device_sizes: Sequence[int] = (1, 2, 4),
    device_axis: str = "tp",
    cost_model: str = "measured",
    **step_kwargs,
) -> Advice:
    """Simulate every valid `(schedule, microbatches, virtual stages)` with profiled costs and
    bytes and the optimizer's update, and rank them (`Advice`; print `.table()`).

    `fn(params, *batch)` is the loss, as for `sxvalue_and_grad` and
    `sxvalue_and_grad_and_apply`; its markers cut it into as many stages as some
    `ranks x virtual stages` (other cuts are skipped); or, with no `args`,
    `fn(n_stages)` returns `(loss_fn, args)` for a model cut into `n_stages`.
    `memory_budget` is bytes per device. The optimizer counts by default: with `tx`
    (an optax transformation), its state (`jax.eval_shape(tx.init, params)`) sits on
    each parameter's rank and its update, timed, runs after each rank's last cell;
    without `tx`, Adam is assumed; `optimizer_states=k` instead estimates the state
    as `k` copies of each rank's parameters, update not timed. `Advice.optimizer`
    says which. `max_grad_norm`, `skip_nonfinite` and `validation` are the step's, as
    `sxvalue_and_grad_and_apply` takes them: with either of the first two, the update
    waits for the global gradient norm as `validation` says (`"sync"`: every rank waits
    for every rank's last backward and the verdict; `"post"`: each rank updates right
    after its own last cell, then waits for the verdict;
    `spectrax_core.schedules.with_update`); a `tx` whose update reads other ranks'
    gradients (a clip inside it) always waits (`"sync"`); otherwise nothing gates the
    update (`"none"`). `comm` is one transfer's
    seconds; `rounds` how many timed runs each profile takes. With `search`
    (default), a table searched from the measured costs and bytes of the
    one-stage-per-rank cut (`spectrax_core.schedules.search`) is a candidate next to
    the named schedules, for each microbatch count. `step_kwargs` go to
    `sxvalue_and_grad` (e.g. `remat=True`). Under `memory_budget`, unless
    `step_kwargs` fix `remat` or `offload`, a configuration that does not fit gets a
    second candidate with, per stage, offload and recompute chosen to fit at the
    least predicted cost (`Candidate.memory`: the choice, its host copies' count and
    seconds at the copy costs measured once, the recomputed forwards' seconds, host
    peaks); its layout is profiled once more with `remat=True`.
    Predicted times simulate the table on the measured compute units, the issuing thread a
    serial resource among them (`spectrax_mpmd._planner.predict`), and are calibrated: one
    real gradient step of plain Std1F1B (at the most of `microbatches` that splits the
    batch) always runs, to measure how many ranks compute at once, and every predicted time
    is scaled so that this step's prediction equals its measured time (`Advice.calibration`;
    the ranking and the ratios between candidates stay the model's). Which candidates are
    test-run (built as whole training steps and timed): none when there is no
    `memory_budget` or plain Std1F1B fits it (the pick, the fastest predicted, is then
    never predicted slower than plain Std1F1B); when the budget rules plain Std1F1B out and
    `confirm` (default 3) is at least 2, the up to `confirm` fastest fitting candidates
    predicted within the model's ratio error (`MODEL_ERROR`, 25%) of the fastest, and the
    fastest measured is picked (`Advice.measured`, `Advice.confidence`;
    `spectrax_mpmd._planner.confirm`). `confirm` 0 or 1 trusts the prediction.
    Every schedule shipped is a candidate by default. Profiles are
    kept on disk keyed by the program (`spectrax_mpmd._planner.cache`): `profile_cache`
    True (default) uses `$SPECTRAX_MPMD_PROFILE_CACHE` or `~/.cache/spectrax_mpmd/profiles`,
    a path that directory, False none; `Advice.cached` counts the profiles read back.
    With `devices` (a device count), `Advice.devices` says how many devices each
    stage would best get, at most `devices` in all: each stage of the one-stage-per-rank
    cut profiled on a rank of each of `device_sizes` devices along `device_axis`, ranked
    for Std1F1B at the pick's microbatch count (`balance(devices=)`, whose `cost_model`
    this is).
    `advice.step(tx)` builds the chosen step, with these three settings. A
    configuration that cannot be profiled on these arguments (a microbatch count
    that does not divide the batch) is skipped and listed, with the reason, in
    `Advice.skipped`; if every one is, the error says why for each.
    """
    settings = StepSettings.of("advise", {"mesh": mesh, "tx": tx}, **step_kwargs)
    mesh = settings.pipeline_mesh
    started = time.perf_counter()
    n = mesh.mpmd_dim
    _check_arguments(memory_budget, rounds, tx, optimizer_states, validation, confirm)
    _check_guard(max_grad_norm, skip_nonfinite)
    on = device_options(mesh, devices, device_sizes, device_axis, cost_model)  # checked, or None
    update = {"max_grad_norm": max_grad_norm, "skip_nonfinite": skip_nonfinite, "validation": validation}
    candidates = _candidates(schedules, microbatches, virtual_stages, n)
    optimizer = tx if tx is not None or optimizer_states is not None else optax.adam(1e-3)
    directory = default_directory() if profile_cache is True else profile_cache
    cache = None if profile_cache is False else ProfileCache(directory)
    measured = {"optimizer": optimizer, "optimizer_states": optimizer_states, "cache": cache}
    profiler = Profiler(fn, args, settings, rounds=rounds, **measured)
    choose_memory = memory_budget is not None and not {"remat", "offload"} & set(step_kwargs)
    guarded = max_grad_norm is not None or skip_nonfinite
    rows, skipped, errors, unsupported = [], [], [], []
    flat: dict = {}  # m -> what a split-backward, one-stage-per-rank profile measured (for the search)
    for schedule in candidates:
        m, v = schedule.microbatches, schedule.virtual_stages
        if isinstance(schedule, S.DualPipe):
            unsupported.append(Skipped(schedule, m, v, DUALPIPE))
            continue
        timing, holding = profiler.pair(schedule)
        failed = next((p for p in (timing, holding) if isinstance(p, MpmdError)), None)
        if failed is not None:
            skipped.append(Skipped(schedule, m, v, str(failed)))
            errors.append(failed)
            continue
        backend = profiler.backend(holding.stages, microbatches)
        inputs = _inputs(schedule, timing, holding, comm, holding.update.validation(validation, guarded))
        if v == 1 and schedule.splits_backward:
            flat.setdefault(m, inputs)
        rows += _rows(schedule, n, inputs, memory_budget, backend, profiler if choose_memory else None)
    if not rows and not errors:
        names = [c.__name__ for c in schedules]
        raise MpmdError(f"advise: no schedule among {names} can be advised: {DUALPIPE}.")
    if not rows:
        _raise_none_profiled(fn, n, virtual_stages, skipped, errors)
    if search:
        rows += [_searched(n, m, measured, memory_budget, backend) for m, measured in sorted(flat.items())]
    calibration, rows = _calibrated(rows, profiler, microbatches, n, comm, (validation, guarded), backend)
    source = Source(fn, args, settings, update)
    advice = replace(
        ranked(rows, memory_budget, (*skipped, *unsupported)),
        optimizer=_optimizer_note(tx, optimizer_states),
        profiles=profiler.count,
        cached=profiler.cached,
        source=source,
        backend=backend,
        calibration=calibration,
    )
    advice = confirmed(advice, confirm, profiler.rounds)
    advice = _with_devices(advice, on, tx, optimizer_states, memory_budget, rounds)
    return replace(advice, seconds=time.perf_counter() - started)


def _calibrated(rows, profiler, microbatches, n: int, comm: float, update: tuple, backend) -> tuple:
    """`(calibration, rows calibrated)`: plain Std1F1B's gradient step as measured
    (`Profiler.plain_measured`) and as modelled from its profiles (the update left out, as the
    measured step has none); `(None, rows)` when no such step could be run or profiled on these
    arguments. `update` is `(validation, guarded)`."""
    plain = profiler.plain_measured(microbatches)
    if plain is None:
        return None, rows
    schedule, measured = plain
    timing, holding = profiler.pair(schedule)
    if isinstance(timing, MpmdError) or isinstance(holding, MpmdError):
        return None, rows
    inputs = _inputs(schedule, timing, holding, comm, holding.update.validation(*update))
    predict = predictor(schedule, n, inputs.update_s, inputs.validation, backend)
    predicted = predict(inputs.memory, inputs.cost)
    calibration = Calibration(schedule, measured[1], predicted.seconds - predicted.update_s)
    return calibration, [calibration.applied(c) for c in rows]


def _with_devices(advice: Advice, on: dict | None, tx, optimizer_states, memory_budget, rounds) -> Advice:
    """`advice` with the devices per stage for its function (`advise_devices`, as `on` says; none
    when None), at its pick's microbatch count, the optimizer's state counted as `balance` does."""
    if on is None:
        return advice
    pick = advice.candidates[0]
    copies = _optimizer_copies(tx, optimizer_states, advice.source.loss_and_args(pick)[1][0])[0]
    split = advise_devices(advice.source, on, pick.microbatches, memory_budget, copies, rounds)
    return replace(advice, devices=split)


@dataclass(frozen=True)
class Inputs:
    """What a candidate's simulation reads: its cells' costs, the bytes it holds per stage (the
    optimizer's state included), the update's seconds per rank and the validation it runs with
    (`UpdateCost.validation`)."""

    cost: StageCost
    memory: StageMemory
    update_s: tuple[float, ...]
    validation: str


def _inputs(schedule, timing: Profiled, holding: Profiled, comm: float, validation: str) -> Inputs:
    """`schedule`'s simulation inputs from the profiles timing and sizing it; an unsplit backward
    holds no I cells' stash."""
    memory = replace(holding.stages.memory, optimizer=holding.update.state)
    if not schedule.splits_backward:
        memory = replace(memory, stash=(0,) * memory.stages)
    return Inputs(timing.stages.stage_cost(comm=comm), memory, holding.update.seconds, validation)


def _rows(schedule, n: int, inputs: Inputs, budget, backend, profiler: Profiler | None) -> list[Candidate]:
    """`schedule`'s candidate; when it does not fit and a `profiler` is given (per-stage offload and
    recompute may be chosen), next to it the candidate with those chosen to fit, when the
    profiles with and without `remat` can be made."""
    predict = predictor(schedule, n, inputs.update_s, inputs.validation, backend)
    row = _candidate(schedule, predict(inputs.memory, inputs.cost), budget)
    if profiler is None or row.fits or schedule.num_stages(n) != schedule.num_model_stages(n):
        return [row]
    pairs = {r: profiler.pair(schedule, key) for r, key in ((False, None), (True, True))}
    if any(isinstance(p, MpmdError) for pair in pairs.values() for p in pair):
        return [row]
    timing = {r: t.stages for r, (t, _) in pairs.items()}
    sized = {
        r: replace(h.stages, memory=replace(h.stages.memory, optimizer=inputs.memory.optimizer))
        for r, (_, h) in pairs.items()
    }
    choice, memory, cost = fitted(schedule, n, timing, sized, predict, budget, backend)
    return [row, _candidate(schedule, predict(memory, cost, choice.copies), budget, choice)]


def _candidate(schedule, predicted: Predicted, budget, choice=None) -> Candidate:
    """The row of `schedule` from its prediction; with the per-stage recompute and offload
    `choice` it needs to fit, when one was made."""
    return Candidate(
        schedule,
        schedule.microbatches,
        schedule.virtual_stages,
        predicted.seconds,
        predicted.timeline.bubble_fraction,
        predicted.peaks,
        fits(predicted.peaks, budget),
        predicted.update_s,
        choice,
        predicted.limit,
        predicted.schedule_s,
    )


def _searched(n: int, m: int, inputs: Inputs, budget, backend) -> Candidate:
    """A table searched (`spectrax_core.schedules.search`) from the measured costs and bytes of a
    one-stage-per-rank cut, as a candidate; when none fits the budget, the table with the
    smallest peak the search found (a candidate that does not fit). The row is the searched
    table even when a named schedule's table was the best found (the search starts from them):
    which one wins can turn on a measured microsecond, and the row stays the search's."""
    try:
        found = S.search(n, m, inputs.cost, memory_budget=budget, memory=inputs.memory)
    except S.BudgetError as err:
        found = err.smallest
    if not isinstance(found, S.SearchedSchedule):
        found = S.SearchedSchedule(tuple(map(tuple, found.actions(n))))
    predict = predictor(found, n, inputs.update_s, inputs.validation, backend)
    return _candidate(found, predict(inputs.memory, inputs.cost), budget)


def _raise_none_profiled(fn, n: int, virtual_stages, skipped: list[Skipped], errors: list[MpmdError]):
    """Every configuration was skipped: say why (another cut, or each one's reason)."""
    failed = [(s, err) for s, err in zip(skipped, errors) if not isinstance(err, StageSplitError)]
    if not failed:
        raise MpmdError(
            f"advise: {getattr(fn, '__name__', 'fn')} is cut into a number of stages that no configuration "
            f"uses ({n} ranks x virtual_stages {tuple(virtual_stages)}); pass virtual_stages matching its "
            "markers, or a function of the stage count (see the docstring)."
        )
    reasons = "\n".join(f"  {s.name} m={s.microbatches} v={s.virtual_stages}: {s.reason}" for s, _ in failed)
    raise MpmdError(
        f"advise: no configuration could be profiled on these arguments; each was skipped:\n{reasons}"
    ) from failed[0][1]
