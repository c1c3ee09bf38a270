"""`advise`: which schedule, how many microbatches and virtual stages, under a memory budget.

Every candidate `(schedule, microbatches, virtual stages)` is simulated with costs
and bytes profiled from the compiled programs. Profiles are shared: a stage's
cell times depend only on the stage cut (ranks x virtual stages) and the
microbatch size, so one profile per cut and microbatch count serves every
schedule; the bytes a plan holds per stage depend on the layout of stages on
ranks and on whether the backward is split, so one profile per layout serves
every schedule with it. Peak bytes follow the runtime's issue order, which is
exact; step times follow the measured cell times (one profile's per cut and
microbatch count, so schedules are compared on the same times; ZeroBubbleH1
divides B into I and W as its split cells measured).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from spectrax_core import schedules as S

from .._api import check_mesh, step_function
from .._compile.compiler import Compiler
from ..errors import DistributedError, MeshError, MpmdError, StageSplitError, TraceContextError

ALL = S.ALL_SCHEDULES


@dataclass(frozen=True)
class Candidate:
    """One simulated configuration: `step_s` predicted seconds per step, `bubble` the idle
    fraction, `peak_bytes[r]` rank r's predicted peak (per device), `fits` within the budget."""

    schedule: object
    microbatches: int
    virtual_stages: int
    step_s: float
    bubble: float
    peak_bytes: tuple[int, ...]
    fits: bool

    @property
    def name(self) -> str:
        return type(self.schedule).__name__


@dataclass(frozen=True)
class Skipped:
    """A valid configuration that could not be profiled on these arguments, and why (e.g. a
    microbatch count that does not divide the batch)."""

    schedule: object
    microbatches: int
    virtual_stages: int
    reason: str

    @property
    def name(self) -> str:
        return type(self.schedule).__name__


@dataclass(frozen=True)
class Advice:
    """Candidates ranked: those that fit the budget first, each group by predicted step time.

    `smallest_peak` is the candidate whose largest per-rank peak is smallest, and
    `binding_rank` its rank holding that peak: what a budget must at least allow.
    `skipped` lists the configurations that could not be profiled, with the reason.
    """

    candidates: tuple[Candidate, ...]
    memory_budget: int | None
    smallest_peak: Candidate
    skipped: tuple[Skipped, ...] = ()

    @property
    def binding_rank(self) -> int:
        peaks = self.smallest_peak.peak_bytes
        return peaks.index(max(peaks))

    def under(self, memory_budget: int | None) -> Advice:
        """The same candidates ranked for another budget (bytes per device; None: no limit)."""
        _check_budget(memory_budget)
        rows = [replace(c, fits=_fits(c.peak_bytes, memory_budget)) for c in self.candidates]
        return _ranked(rows, memory_budget, self.skipped)

    @property
    def fitting(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.fits)

    def table(self) -> str:
        budget = "none" if self.memory_budget is None else f"{self.memory_budget / 2**20:.2f} MiB"
        lines = [f"memory budget per device: {budget}"]
        lines.append(
            f"{'schedule':24} {'m':>3} {'v':>2} {'step ms':>9} {'bubble':>7} {'fits':>5}  peak MiB per rank"
        )
        for c in self.candidates:
            peaks = " ".join(f"{p / 2**20:.3f}" for p in c.peak_bytes)
            lines.append(
                f"{c.name:24} {c.microbatches:>3} {c.virtual_stages:>2} {c.step_s * 1e3:>9.3f} "
                f"{c.bubble:>7.1%} {'yes' if c.fits else 'no':>5}  {peaks}"
            )
        if not self.fitting:
            s = self.smallest_peak
            lines.append(
                f"no configuration fits: the smallest peak is {max(s.peak_bytes) / 2**20:.3f} MiB on rank "
                f"{self.binding_rank} ({s.name}, m={s.microbatches}, v={s.virtual_stages}; per rank "
                + ", ".join(f"{p / 2**20:.3f}" for p in s.peak_bytes)
                + " MiB); raise the budget to at least that, or use remat=True or more ranks."
            )
        for s in self.skipped:
            lines.append(f"skipped {s.name}, m={s.microbatches}, v={s.virtual_stages}: {s.reason}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            "memory_budget": self.memory_budget,
            "candidates": [
                {
                    "schedule": c.name,
                    "microbatches": c.microbatches,
                    "virtual_stages": c.virtual_stages,
                    "step_s": c.step_s,
                    "bubble": c.bubble,
                    "peak_bytes": list(c.peak_bytes),
                    "fits": c.fits,
                }
                for c in self.candidates
            ],
            "binding_rank": self.binding_rank,
            "skipped": [
                {
                    "schedule": s.name,
                    "microbatches": s.microbatches,
                    "virtual_stages": s.virtual_stages,
                    "reason": s.reason,
                }
                for s in self.skipped
            ],
        }


def _check_budget(memory_budget) -> None:
    if memory_budget is not None and (
        isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or memory_budget <= 0
    ):
        raise MpmdError(
            f"advise: memory_budget must be a positive number of bytes per device (or None), "
            f"received {memory_budget!r}."
        )


def _check_rounds(rounds) -> None:
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise MpmdError(
            f"advise: rounds must be a positive int (each profile runs the step that many times, cell by "
            f"cell, to time its cells), received {rounds!r}. Pass rounds=1 or more."
        )


def _fits(peaks: tuple[int, ...], memory_budget) -> bool:
    return memory_budget is None or max(peaks) <= memory_budget


def _ranked(rows: list[Candidate], memory_budget, skipped: tuple[Skipped, ...] = ()) -> Advice:
    rows = sorted(rows, key=lambda c: (not c.fits, c.step_s))
    return Advice(tuple(rows), memory_budget, min(rows, key=lambda c: max(c.peak_bytes)), tuple(skipped))


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


def _cost_schedule(m: int, v: int):
    """A schedule running every cell alone, for the cell times of an n x v cut."""
    return S.Std1F1B(microbatches=m) if v == 1 else S.InterleavedGPipe(microbatches=m, virtual_stages=v)


def _memory_schedule(schedule):
    """The schedule whose plan holds the same bytes per stage as `schedule`'s (same layout, same
    backward split)."""
    m, v = schedule.microbatches, schedule.virtual_stages
    if schedule.layout == "flat":
        return S.ZeroBubbleH1(microbatches=m) if schedule.splits_backward else S.Std1F1B(microbatches=m)
    if schedule.layout == "loop":
        return S.InterleavedGPipe(microbatches=m, virtual_stages=v)
    return schedule


def _split_like(cost: S.StageCost, split: S.StageCost) -> S.StageCost:
    """`cost` with each stage's B divided into I and W in the proportions `split` measured, so that
    schedules of one cut are compared on the same backward times."""
    shares = [i / (i + w) if i + w > 0 else 0.5 for i, w in zip(split.I, split.W)]
    return S.StageCost(
        cost.F,
        cost.B,
        tuple(b * k for b, k in zip(cost.B, shares)),
        tuple(b * (1 - k) for b, k in zip(cost.B, shares)),
        cost.comm,
    )


def advise(
    fn: Callable,
    *args,
    mesh,
    memory_budget: int | None = None,
    schedules: Sequence[type] = ALL,
    microbatches: Sequence[int] = (4, 8),
    virtual_stages: Sequence[int] = (1, 2),
    optimizer_states: float = 0.0,
    comm: float = 0.0,
    rounds: int = 2,
    **step_kwargs,
) -> Advice:
    """Simulate every valid `(schedule, microbatches, virtual stages)` with profiled costs and
    bytes, and rank them (`Advice`; print `.table()`).

    `fn(*args)` is the loss as for `sxvalue_and_grad`, its markers cutting it into
    as many stages as some `ranks x virtual stages` (other cuts are skipped); or,
    with no `args`, `fn(n_stages)` returns `(loss_fn, args)` for a model cut into
    `n_stages`. `memory_budget` is bytes per device; `optimizer_states` estimates
    the optimizer's state as that many copies of each rank's parameters (2 for
    Adam); `comm` is one transfer's seconds; `rounds` how many timed runs each
    profile takes. `step_kwargs` go to `sxvalue_and_grad` (e.g. `remat=True`).
    A configuration that cannot be profiled on these arguments (a microbatch
    count that does not divide the batch) is skipped and listed, with the
    reason, in `Advice.skipped`; if every one is, the error says why for each.
    """

    mesh = check_mesh("advise", mesh)
    n = mesh.mpmd_dim
    _check_budget(memory_budget)
    _check_rounds(rounds)
    candidates = _candidates(schedules, microbatches, virtual_stages, n)
    if not candidates:
        raise MpmdError(
            f"advise: no valid configuration among schedules {[c.__name__ for c in schedules]}, "
            f"microbatches {tuple(microbatches)} and virtual_stages {tuple(virtual_stages)} on {n} ranks; "
            "allow more microbatches (interleaved schedules need m >= ranks, DualPipeV m >= 2 x ranks)."
        )
    profiles: dict = {}
    compiler = Compiler()  # shared: a program two profiled steps have in common compiles once

    def profile(schedule):
        key = repr(schedule)
        if key not in profiles:
            loss, loss_args = fn(n * schedule.virtual_stages) if not args else (fn, args)
            step = step_function(loss, mesh=mesh, schedule=schedule, compiler=compiler, **step_kwargs)
            try:
                profiles[key] = step.profile_stages(*loss_args, rounds=rounds)
            except StageSplitError as err:
                if not args:
                    raise
                profiles[key] = err  # the function's markers cut it into another number of stages
            except (TraceContextError, MeshError, DistributedError):
                raise  # the same for every configuration
            except MpmdError as err:
                profiles[key] = err  # e.g. the batch does not split into this many microbatches
        return profiles[key]

    rows, skipped, errors = [], [], []
    for schedule in candidates:
        m, v = schedule.microbatches, schedule.virtual_stages
        timing, held = profile(_cost_schedule(m, v)), profile(_memory_schedule(schedule))
        failed = next((p for p in (timing, held) if isinstance(p, MpmdError)), None)
        if failed is not None:
            skipped.append(Skipped(schedule, m, v, str(failed)))
            errors.append(failed)
            continue
        cost = timing.stage_cost(comm=comm)
        if schedule.splits_backward and schedule.layout == "flat":
            cost = _split_like(cost, held.stage_cost(comm=comm))
        timeline = S.simulate(schedule, n, cost, memory=held.stage_memory(optimizer_states))
        peaks = timeline.peak_bytes
        fits = _fits(peaks, memory_budget)
        rows.append(Candidate(schedule, m, v, timeline.makespan, timeline.bubble_fraction, peaks, fits))
    if not rows:
        _raise_none_profiled(fn, n, virtual_stages, skipped, errors)
    return _ranked(rows, memory_budget, tuple(skipped))


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
