"""`advise`: which schedule, how many microbatches and virtual stages, under a memory budget.

Every candidate `(schedule, microbatches, virtual stages)` is simulated with costs
and bytes profiled from the compiled programs, and the optimizer's update after
it (`spectrax_mpmd._planner.optimizer`). Profiles are shared: a stage's cells
depend only on the stage cut (ranks x virtual stages) and the microbatch size,
and the bytes a plan holds per stage on the layout of stages on ranks. So one
profile per layout and microbatch count serves every schedule with it: for the
flat layout, ZeroBubbleH1's, whose split backward runs every stage program alone
(F, I and W; B = I + W) and whose bytes less the I cells' stash are what an
unsplit backward holds; for the interleaved layout InterleavedGPipe's; DualPipeV's
V layout is profiled for its bytes only (its cells are timed on the interleaved
cut's). Peak bytes follow the runtime's issue order, which is exact.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import optax

from spectrax_core import schedules as S

from .._api import check_mesh, step_function
from .._compile.compiler import Compiler
from .._trace.context import outside_context_mesh
from ..errors import DistributedError, MeshError, MpmdError, StageSplitError, TraceContextError
from .advice import Advice, Candidate, Skipped, Source, check_budget, fits, ranked
from .memory import fitted, host_bandwidth
from .optimizer import Owners, crosses_ranks, state_bytes, update_seconds, with_sync_copy

ALL = S.ALL_SCHEDULES


def _check_rounds(rounds) -> None:
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise MpmdError(
            f"advise: rounds must be a positive int (each profile runs the step that many times, cell by "
            f"cell, to time its cells), received {rounds!r}. Pass rounds=1 or more."
        )


def _candidates(schedules, microbatches, virtual_stages, n: int) -> list:
    """Every valid schedule instance for `n` ranks."""
    out = []
    for cls in schedules:
        for m in microbatches:
            for v in virtual_stages:
                try:
                    if cls is S.DualPipe:  # n model stages run twice: not the cut of an n x v profile
                        made = []
                    elif cls.layout == "v":
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
    return out


def _profile_schedule(schedule):
    """The schedule whose profile gives `schedule`'s cell times and bytes per stage (the same
    layout; for the flat layout the split backward, which times every stage program alone)."""
    m, v = schedule.microbatches, schedule.virtual_stages
    if schedule.layout == "flat":
        return S.ZeroBubbleH1(microbatches=m)
    if schedule.layout == "loop":
        return S.InterleavedGPipe(microbatches=m, virtual_stages=v)
    return schedule


def _cost_schedule(schedule):
    """The profile whose measured cells time `schedule` (the V layout's cells are timed on the
    interleaved cut of the same stages, as its fused cells cannot be timed apart)."""
    if schedule.layout == "v":
        return S.InterleavedGPipe(microbatches=schedule.microbatches, virtual_stages=2)
    return _profile_schedule(schedule)


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
    **step_kwargs,
) -> Advice:
    """Simulate every valid `(schedule, microbatches, virtual stages)` with profiled costs and
    bytes and the optimizer's update, and rank them (`Advice`; print `.table()`).

    `fn(params, *batch)` is the loss, as for `sxvalue_and_grad` and
    `sxvalue_and_grad_and_apply`; its markers cut it into as many stages as some
    `ranks x virtual stages` (other cuts are skipped); or, with no `args`,
    `fn(n_stages)` returns `(loss_fn, args)` for a model cut into `n_stages`.
    `memory_budget` is bytes per device. The optimizer counts by default: with
    `tx` (an optax transformation), its state (`jax.eval_shape(tx.init, params)`)
    sits on each parameter's rank and its update, timed, runs after each rank's
    last cell, or after every rank's when it reads all gradients (a global-norm
    clip); without `tx`, Adam is assumed; `optimizer_states=k` instead estimates
    the state as `k` copies of each rank's parameters, update not timed.
    `Advice.optimizer` says which. `comm` is one transfer's seconds; `rounds` how
    many timed runs each profile takes. With `search` (default), a table searched
    from the measured costs and bytes of the one-stage-per-rank cut
    (`spectrax_core.schedules.search`) is a candidate next to the named schedules,
    for each microbatch count. `step_kwargs` go to `sxvalue_and_grad`
    (e.g. `remat=True`). Under `memory_budget`, unless `step_kwargs` fix `remat`
    or `offload`, a configuration that does not fit gets a second candidate
    with, per stage, offload and recompute chosen to fit at the least predicted
    cost (`Candidate.memory`: the choice, the host copies' seconds at the host
    bandwidth measured once, the recomputed forwards' seconds, host peaks); its
    layout is profiled once more with `remat=True` for that. `advice.step(tx)` builds the chosen step. A
    configuration that cannot be profiled on these arguments (a microbatch count
    that does not divide the batch) is skipped and listed, with the reason, in
    `Advice.skipped`; if every one is, the error says why for each.
    """
    started = time.perf_counter()
    mesh = check_mesh("advise", mesh)
    n = mesh.mpmd_dim
    check_budget(memory_budget)
    _check_rounds(rounds)
    if tx is not None and optimizer_states is not None:
        raise MpmdError("advise: give tx= (the state is read from it) or optimizer_states=, not both.")
    if tx is not None and not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise MpmdError(f"advise: tx must be an optax.GradientTransformation, got {type(tx).__name__}.")
    candidates = _candidates(schedules, microbatches, virtual_stages, n)
    if not candidates:
        raise MpmdError(
            f"advise: no valid configuration among schedules {[c.__name__ for c in schedules]}, "
            f"microbatches {tuple(microbatches)} and virtual_stages {tuple(virtual_stages)} on {n} ranks; "
            "allow more microbatches (interleaved schedules need m >= ranks, DualPipeV m >= 2 x ranks)."
        )
    optimizer = tx if tx is not None or optimizer_states is not None else optax.adam(1e-3)
    profiles: dict = {}
    update_times: dict = {}
    compiler = Compiler()  # shared: a program two profiled steps have in common compiles once

    def profile(schedule, timed: bool, remat=None):
        key = (repr(schedule), remat)
        if key not in profiles:
            loss, loss_args = fn(schedule.num_model_stages(n)) if not args else (fn, args)
            kwargs = step_kwargs if remat is None else {**step_kwargs, "remat": remat}
            step = step_function(loss, mesh=mesh, schedule=schedule, compiler=compiler, **kwargs)
            try:
                measured = step.profile_stages(*loss_args, rounds=rounds if timed else 0)
                profiles[key] = (measured, optimizer_of(step, loss_args, measured))
            except StageSplitError as err:
                if not args:
                    raise
                profiles[key] = err  # the function's markers cut it into another number of stages
            except (TraceContextError, MeshError, DistributedError):
                raise  # the same for every configuration
            except MpmdError as err:
                profiles[key] = err  # e.g. the batch does not split into this many microbatches
        return profiles[key]

    def optimizer_of(step, loss_args, measured):
        """Per rank: the optimizer state's bytes and the update's seconds; whether it is gated."""
        if optimizer_states is not None:
            return tuple(int(round(optimizer_states * p)) for p in measured.memory.params), (0.0,) * n, False
        params = loss_args[0]
        owners = Owners.of(step.plan_for(*loss_args), params)
        stages = step.n_stages
        if stages not in update_times:
            update_times[stages] = update_seconds(optimizer, params, max(rounds, 1))
        owned = owners.per_rank(n)
        share = [b / sum(owned) if sum(owned) else 1.0 / n for b in owned]
        return (
            state_bytes(optimizer, params, owners, n),
            tuple(update_times[stages] * k for k in share),
            crosses_ranks(optimizer, params, owners),
        )

    choose_memory = memory_budget is not None and not {"remat", "offload"} & set(step_kwargs)
    bandwidth = None  # measured once, when a candidate needs host copies to fit
    rows, skipped, errors = [], [], []
    flat: dict = {}  # m -> what a split-backward, one-stage-per-rank profile measured (for the search)
    for schedule in candidates:
        m, v = schedule.microbatches, schedule.virtual_stages
        memory_of = _profile_schedule(schedule)
        timing = profile(_cost_schedule(schedule), True)
        held = profile(memory_of, repr(memory_of) == repr(_cost_schedule(schedule)))
        failed = next((p for p in (timing, held) if isinstance(p, MpmdError)), None)
        if failed is not None:
            skipped.append(Skipped(schedule, m, v, str(failed)))
            errors.append(failed)
            continue
        (timed, _), (bytes_of, (state, apply_s, sync)) = timing, held
        memory = replace(bytes_of.memory, optimizer=state)
        if not schedule.splits_backward:
            memory = replace(memory, stash=(0,) * memory.stages)
        if v == 1 and schedule.splits_backward:
            flat.setdefault(m, (timed.stage_cost(comm=comm), memory, apply_s, sync))
        predict = _predictor(schedule, n, apply_s, sync, comm)
        peaks, seconds, timeline = predict(memory, timed.stage_cost(comm=comm))
        rows.append(
            Candidate(
                schedule,
                m,
                v,
                seconds,
                timeline.bubble_fraction,
                peaks,
                fits(peaks, memory_budget),
                seconds - timeline.makespan,
            )
        )
        if choose_memory and not rows[-1].fits:
            bandwidth = bandwidth or host_bandwidth(mesh.submesh(0).devices.flat[0])
            same = repr(memory_of) == repr(_cost_schedule(schedule))
            pairs = {  # remat -> (profile timing the cells, profile sizing the buffers)
                r: (profile(_cost_schedule(schedule), True, key), profile(memory_of, same, key))
                for r, key in ((False, None), (True, True))
            }
            if not any(isinstance(p, MpmdError) for pair in pairs.values() for p in pair):
                timing = {r: t[0] for r, (t, _) in pairs.items()}
                holding = {
                    r: replace(h[0], memory=replace(h[0].memory, optimizer=state))
                    for r, (_, h) in pairs.items()
                }
                rows.append(_fitted_row(schedule, n, timing, holding, predict, memory_budget, bandwidth))
    if not rows:
        _raise_none_profiled(fn, n, virtual_stages, skipped, errors)
    if search:
        rows += [_searched(n, m, *measured, memory_budget) for m, measured in sorted(flat.items())]
    source = Source(fn, args, mesh, dict(step_kwargs), tx)
    return replace(
        ranked(rows, memory_budget, tuple(skipped)),
        optimizer=_optimizer_note(tx, optimizer_states),
        seconds=time.perf_counter() - started,
        profiles=len(profiles),
        source=source,
    )


def _fitted_row(schedule, n: int, timing, holding, predict, budget, bandwidth) -> Candidate:
    """`schedule` with the per-stage recompute and offload that fit `budget` at the least predicted
    cost, or, when none does, those with the least peak (a candidate that does not fit, which
    `Advice.smallest_peak` counts): see `spectrax_mpmd._planner.memory.fitted`."""
    choice, memory, cost = fitted(schedule, n, timing, holding, predict, budget, bandwidth)
    peaks, seconds, timeline = predict(memory, cost)
    m, v = schedule.microbatches, schedule.virtual_stages
    return Candidate(
        schedule,
        m,
        v,
        seconds,
        timeline.bubble_fraction,
        peaks,
        fits(peaks, budget),
        seconds - timeline.makespan,
        choice,
    )


def _predictor(schedule, n: int, apply_s, sync: bool, comm: float):
    """`predict(memory, cost) -> (peak bytes per rank, predicted seconds with the update, timeline)`."""

    def predict(memory, cost):
        timeline = S.simulate(schedule, n, cost, memory=memory)
        updated = S.with_update(timeline, apply_s, gate="sync" if sync else "none")
        return with_sync_copy(timeline.peak_bytes, memory, sync), updated.makespan, timeline

    return predict


def _searched(n: int, m: int, cost, memory, apply_s, sync: bool, budget) -> Candidate:
    """A table searched (`spectrax_core.schedules.search`) from the measured costs and bytes of a
    one-stage-per-rank cut, as a candidate; when none fits the budget, the table with the
    smallest peak the search found (a candidate that does not fit)."""
    try:
        found = S.search(n, m, cost, memory_budget=budget, memory=memory)
    except S.BudgetError as err:
        found = err.smallest
    timeline = S.simulate(found, n, cost, memory=memory)
    updated = S.with_update(timeline, apply_s, gate="sync" if sync else "none")
    peaks = with_sync_copy(timeline.peak_bytes, memory, sync)
    return Candidate(
        found,
        m,
        1,
        updated.makespan,
        timeline.bubble_fraction,
        peaks,
        fits(peaks, budget),
        updated.makespan - timeline.makespan,
    )


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
