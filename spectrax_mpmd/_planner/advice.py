"""What `advise` returns: candidates ranked under a budget, and the step of the one chosen.

`Advice.step(tx)` builds the chosen configuration's whole training step
(`sxvalue_and_grad_and_apply`: the update inside the pipelined plan) and
`Advice.arguments()` gives the arguments it was profiled on (for a function of
the stage count, the model cut for that configuration).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from spectrax_core import schedules as S

from .._api.apply import UPDATE_OPTIONS, Update, apply_step
from .._settings import StepSettings
from ..errors import MpmdError
from . import report
from .memory import MemoryChoice
from .model_error import MODEL_ERROR


@dataclass(frozen=True)
class Candidate:
    """One simulated configuration: `step_s` predicted seconds per step (the optimizer's update
    included: `update_s` of it comes after the schedule's last cell), `bubble` the schedule's
    idle fraction, `peak_bytes[r]` rank r's predicted peak (per device, the optimizer's state
    included), `fits` within the budget. `memory`, when not None, is the per-stage recompute and
    offload the candidate needs to fit (the step is built with them) and what they cost.
    `limit` says what sets the predicted time (`spectrax_mpmd._planner.predict.LIMITS`: the
    schedule's critical path, the issuing thread, or ranks sharing compute); `schedule_s` is
    the simulated step alone (each rank on a device of its own), which breaks ties. Every
    seconds figure is calibrated on a measured step when `Advice.calibration` is set."""

    schedule: S.Schedule
    microbatches: int
    virtual_stages: int
    step_s: float
    bubble: float
    peak_bytes: tuple[int, ...]
    fits: bool
    update_s: float = 0.0
    memory: MemoryChoice | None = None
    limit: str = "schedule"
    schedule_s: float = 0.0

    @property
    def name(self) -> str:
        return type(self.schedule).__name__

    @property
    def label(self) -> str:
        """The schedule's name with what tells its variants apart: ZeroBubbleH2's transfer latency,
        a V schedule's activation limit."""
        extra = [
            f"{short} {getattr(self.schedule, attr)}"
            for attr, short in (("latency", "lat"), ("activation_limit", "act"))
            if getattr(self.schedule, attr, None) is not None
        ]
        return " ".join([self.name, *extra])

    def brief(self) -> str:
        """`Std1F1B m=8 v=1` and, when it offloads or recomputes, what (`off 0-2 rc 3`)."""
        mem = "" if self.memory is None else f" with {self.memory.label()}"
        return f"{self.label} m={self.microbatches} v={self.virtual_stages}{mem}"


@dataclass(frozen=True)
class Skipped:
    """A valid configuration that could not be profiled on these arguments, and why (e.g. a
    microbatch count that does not divide the batch)."""

    schedule: S.Schedule
    microbatches: int
    virtual_stages: int
    reason: str

    @property
    def name(self) -> str:
        return type(self.schedule).__name__


@dataclass(frozen=True)
class Source:
    """What the advice was made from: `fn` and `args` as given to `advise`, the step's settings
    (its mesh and optimizer among them) and the update's (`max_grad_norm`, `skip_nonfinite`,
    `validation`, as `sxvalue_and_grad_and_apply` takes them)."""

    fn: Callable
    args: tuple
    settings: StepSettings
    update: dict = field(default_factory=dict)

    @property
    def mesh(self):
        return self.settings.pipeline_mesh

    @property
    def tx(self):
        return self.settings.tx

    def loss_and_args(self, candidate: Candidate) -> tuple[Callable, tuple]:
        if self.args:
            return self.fn, self.args
        return self.fn(candidate.schedule.num_model_stages(self.mesh.mpmd_dim))


@dataclass(frozen=True)
class Advice:
    """Candidates ranked: those that fit the budget first, each group by predicted step time.

    `smallest_peak` is the candidate whose largest per-rank peak is smallest, and
    `binding_rank` its rank holding that peak: what a budget must at least allow. It is
    taken over every candidate, those with a per-stage offload and recompute choice and
    searched tables included (under a budget nothing fits, each of those is the one with
    the least peak, listed as not fitting).
    `skipped` lists the configurations that could not be profiled, with the reason.
    `optimizer` says how the optimizer's state and update were counted; `seconds` is
    how long the advice took, `profiles` how many steps it profiled and `cached` how many of
    those profiles it read from the disk cache (`spectrax_mpmd._planner.cache`). `backend` holds
    the measured costs beyond the cells (`spectrax_mpmd._planner.backend.BackendCost`);
    `measured` the candidates run to confirm the pick, each with its median step seconds,
    fastest first; `confidence` how the pick was made (`spectrax_mpmd._planner.confirm`);
    `devices`, when `advise` was given `devices=`, the devices per stage chosen
    (`spectrax_mpmd._planner.device_advice.DeviceBalance`); `calibration` the measured plain
    Std1F1B step every predicted time was scaled to (`spectrax_mpmd._planner.calibrate`; None
    when none could be run, and the times are the model's alone).
    `print(advice)` is a short summary, `advice.table()` one line per candidate.
    """

    candidates: tuple[Candidate, ...]
    memory_budget: int | None
    smallest_peak: Candidate
    skipped: tuple[Skipped, ...] = ()
    optimizer: str = ""
    seconds: float = 0.0
    profiles: int = 0
    cached: int = 0
    source: Source | None = field(default=None, repr=False, compare=False)
    backend: object = field(default=None, repr=False, compare=False)
    measured: tuple = ()
    confidence: str = ""
    devices: object = field(default=None, repr=False, compare=False)
    calibration: object = field(default=None, repr=False, compare=False)

    @property
    def binding_rank(self) -> int:
        peaks = self.smallest_peak.peak_bytes
        return peaks.index(max(peaks))

    def under(self, memory_budget: int | None) -> Advice:
        """The same candidates ranked for another budget (bytes per device; None: no limit)."""
        check_budget(memory_budget)
        rows = [replace(c, fits=fits(c.peak_bytes, memory_budget)) for c in self.candidates]
        advice = replace(ranked(rows, memory_budget, self.skipped), **self._about())
        return replace(advice, confidence=predicted_confidence(advice))

    def _about(self) -> dict:
        return dict(
            optimizer=self.optimizer,
            seconds=self.seconds,
            profiles=self.profiles,
            cached=self.cached,
            source=self.source,
            backend=self.backend,
            devices=self.devices,
            calibration=self.calibration,
        )

    @property
    def default(self) -> Candidate | None:
        """Plain Std1F1B (no offload, no recompute) at its fastest predicted microbatch count: what
        one runs without advice, and what the pick is never predicted slower than when it fits."""
        plain = [c for c in self.candidates if c.name == "Std1F1B" and c.memory is None]
        return min(plain, key=lambda c: c.step_s, default=None)

    @property
    def fitting(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.fits)

    @property
    def best(self) -> Candidate:
        """The fastest candidate that fits; an error says what to change when none does."""
        if not self.fitting:
            raise MpmdError(
                f"advise: no configuration fits the budget of {self.memory_budget} bytes per device; "
                f"{self.least_budget(lambda b: f'{b} bytes')} Or pass candidate= to build one that does "
                "not fit."
            )
        return self.fitting[0]

    def least_budget(self, size: Callable[[int], str]) -> str:
        """What the least budget is and where it binds, over every candidate (`size` formats bytes)."""
        s = self.smallest_peak
        per_rank = ", ".join(size(p) for p in s.peak_bytes)
        where = (
            f"{size(max(s.peak_bytes))} on rank {self.binding_rank} ({s.name}, m={s.microbatches}, "
            f"v={s.virtual_stages}{'' if s.memory is None else ', with its per-stage choice'}; per rank "
            f"{per_rank})"
        )
        if any(c.memory is not None for c in self.candidates):
            return (
                f"the smallest peak of every configuration considered, per-stage offload and recompute "
                f"included, is {where}. Raise the budget to at least that (advice.under(bytes) ranks "
                "these candidates for another budget), or use more ranks."
            )
        return (
            f"the smallest peak is {where}. Raise the budget to at least that (advice.under(bytes) "
            "ranks these candidates for another budget), let advise choose per-stage offload and "
            "recompute (memory_budget= given, remat and offload left unset), or use more ranks."
        )

    def arguments(self, candidate: Candidate | None = None) -> tuple:
        """The arguments `candidate` (default `best`) was profiled on: `(params, *batch)`."""
        return self._source().loss_and_args(candidate or self.best)[1]

    def step(self, tx=None, *, candidate: Candidate | None = None, **kwargs) -> Callable:
        """The whole training step of `candidate` (default `best`):
        `sxvalue_and_grad_and_apply(loss, tx, mesh=, schedule=<its schedule>, ...)`, called as
        `step(params, opt_state, *batch) -> (loss, params, opt_state)` with `params, *batch =
        advice.arguments()` and `opt_state = tx.init(params)`. `tx` defaults to the one `advise`
        was given, and the step's `max_grad_norm`, `skip_nonfinite` and `validation` are the ones
        `advise` modelled; `kwargs` (e.g. `donate=False`) go to `sxvalue_and_grad_and_apply`
        after the keyword arguments `advise` profiled with."""
        source = self._source()
        tx = tx if tx is not None else source.tx
        if tx is None:
            raise MpmdError(
                "Advice.step: pass the optax transformation, e.g. advice.step(optax.adamw(1e-3))."
            )
        chosen = candidate or self.best
        loss, _ = source.loss_and_args(chosen)
        memory = (
            {} if chosen.memory is None else {"remat": chosen.memory.remat, "offload": chosen.memory.offload}
        )
        if source.settings.positions != (0,):
            raise MpmdError("Advice.step: the step updates the first argument; advise with argnums=0.")
        updating = {k: v for k, v in kwargs.items() if k in UPDATE_OPTIONS}
        stepping = {**memory, **{k: v for k, v in kwargs.items() if k not in UPDATE_OPTIONS}}
        settings = source.settings.replace(
            name="sxvalue_and_grad_and_apply", schedule=chosen.schedule, argnums=0, tx=tx, **stepping
        )
        return apply_step(loss, settings, Update(**{**source.update, **updating}))

    def _source(self) -> Source:
        if self.source is None:
            raise MpmdError("Advice: this advice does not know its function; make it with mp.advise.")
        return self.source

    def __str__(self) -> str:
        """The pick, why, the runner-up and the default with its cost (`report.summary`)."""
        return report.summary(self)

    def table(self) -> str:
        """One line per candidate within 120 characters (`report.table`)."""
        return report.table(self)

    def as_dict(self) -> dict:
        return report.as_dict(self)


def predicted_confidence(advice: Advice) -> str:
    """How far the pick's prediction is ahead of the next fitting candidate's, against the ratio
    error `MODEL_ERROR`: beyond it (the runner-up predicted over `1 + MODEL_ERROR` times the
    pick's) the pick measures faster; within it, either may."""
    if not advice.fitting:
        return "nothing fits the budget"
    if len(advice.fitting) < 2:
        return "predicted: the only candidate that fits"
    first, second = advice.fitting[:2]
    gap = second.step_s / first.step_s - 1
    if gap > MODEL_ERROR:
        return (
            f"predicted {gap:.0%} faster than the runner-up, beyond the model's {MODEL_ERROR:.0%} ratio "
            "error: it measures faster"
        )
    return (
        f"predicted {gap:.0%} faster than the runner-up, within the model's {MODEL_ERROR:.0%} ratio "
        "error: either may measure faster"
    )


def check_budget(memory_budget) -> None:
    if memory_budget is not None and (
        isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or memory_budget <= 0
    ):
        raise MpmdError(
            f"advise: memory_budget must be a positive number of bytes per device (or None), "
            f"received {memory_budget!r}."
        )


def fits(peaks: tuple[int, ...], memory_budget) -> bool:
    return memory_budget is None or max(peaks) <= memory_budget


def ranked(rows: list[Candidate], memory_budget, skipped: tuple[Skipped, ...] = ()) -> Advice:
    rows = sorted(rows, key=lambda c: (not c.fits, c.step_s, c.schedule_s))
    return Advice(tuple(rows), memory_budget, min(rows, key=lambda c: max(c.peak_bytes)), tuple(skipped))
