"""The planner's profiles: each step profiled once, with what its optimizer adds.

A stage's cells depend only on the stage cut (ranks x virtual stages) and the
microbatch size, and the bytes a plan holds per stage on the layout of stages on
ranks. So one profile per layout, microbatch count and `remat` serves every
schedule with them: for the flat layout, ZeroBubbleH1's, whose split backward
runs every stage program alone (F, I and W; B = I + W) and whose bytes less the
I cells' stash are what an unsplit backward holds; for the interleaved layout
InterleavedGPipe's; the V layout's own for its bytes, its cells timed on the
interleaved cut's (`holding_schedule`, `timing_schedule`).

A `Profiler` makes and keeps them: each profile is the step's `profile_stages`
(`StageProfile`) and the optimizer's per-rank state bytes and update seconds
(`UpdateCost`). Its steps share one `Compiler` (a program two of them have in
common compiles once), the update is timed once per stage count, and the
backend's costs (`spectrax_mpmd._planner.backend`) measured once, when asked: how
many ranks compute at once and the issuing seconds per cell from one real step of
plain Std1F1B, timed whole against its cells' work timed alone (kept in the disk
cache too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spectrax_core import schedules as S

from .._api import step_function
from .._compile.compiler import Compiler
from .._runtime import StageProfile
from .._settings import StepSettings
from ..errors import DistributedError, MeshError, MpmdError, StageSplitError, TraceContextError
from .backend import BackendCost, busy_and_wall, measure_backend, step_units
from .cache import ProfileCache, profile_key, program_digest, update_digest
from .optimizer import Owners, crosses_ranks, state_bytes, update_seconds


@dataclass(frozen=True)
class UpdateCost:
    """Per rank, the optimizer state's bytes on one device and the update's seconds; and whether
    some leaf's update reads a gradient another rank owns (`crosses_ranks`: a global-norm clip,
    a finiteness check)."""

    state: tuple[int, ...]
    seconds: tuple[float, ...]
    crosses_ranks: bool

    def validation(self, given: str, guarded: bool) -> str:
        """The validation the step's update runs with (`spectrax_core.schedules.VALIDATIONS`):
        `"sync"` when the transformation itself reads other ranks' gradients (a clip inside
        `tx` waits for them); else `given` (`"sync"` or `"post"`, as
        `sxvalue_and_grad_and_apply(validation=)`) when the step is `guarded` (its
        `max_grad_norm` or `skip_nonfinite` need the global norm); else `"none"`."""
        if self.crosses_ranks:
            return "sync"
        return given if guarded else "none"


@dataclass(frozen=True)
class Profiled:
    """One profiled step: its stages' cells and bytes, and what its optimizer adds."""

    stages: StageProfile
    update: UpdateCost


MEASURED = tuple[float, float, float, float]  # `busy_and_wall` of a step, as the disk cache keeps it


def holding_schedule(schedule):
    """The schedule whose profile gives `schedule`'s cell times and bytes per stage (the same
    layout; for the flat layout the split backward, which times every stage program alone)."""
    m, v = schedule.microbatches, schedule.virtual_stages
    if schedule.layout == "flat":
        return S.ZeroBubbleH1(microbatches=m)
    if schedule.layout == "loop":
        return S.InterleavedGPipe(microbatches=m, virtual_stages=v)
    return schedule


def timing_schedule(schedule):
    """The profile whose measured cells time `schedule` (the V layout's cells are timed on the
    interleaved cut of the same stages, as its fused cells cannot be timed apart)."""
    if schedule.layout == "v":
        return S.InterleavedGPipe(microbatches=schedule.microbatches, virtual_stages=2)
    return holding_schedule(schedule)


class Profiler:
    """Profiles of `fn`'s pipelined training step with `settings` (its mesh and step settings;
    each profile sets the schedule), each made once.

    `fn(params, *batch)` is the loss and `args` its arguments, or, with no `args`,
    `fn(n_stages)` returns `(loss_fn, args)` for a model cut into `n_stages`.
    `rounds` is how many timed runs a
    profile takes. `optimizer` (an optax transformation) is the one whose state
    and update are counted; with `optimizer_states=k` instead the state is `k`
    copies of each rank's parameters and the update is not timed.
    """

    def __init__(
        self,
        fn: Callable,
        args: tuple,
        settings: StepSettings,
        *,
        rounds: int,
        optimizer=None,
        optimizer_states: float | None = None,
        cache: ProfileCache | None = None,
    ):
        self.fn, self.args, self.settings, self.mesh = fn, args, settings, settings.pipeline_mesh
        self.rounds, self.optimizer, self.optimizer_states = rounds, optimizer, optimizer_states
        self.compiler = Compiler()  # shared: a program two profiled steps have in common compiles once
        self._profiles: dict = {}
        self._update_times: dict = {}  # stage count -> the whole tree's update seconds
        self._backend: BackendCost | None = None
        self._plain: dict = {}  # microbatch counts -> `plain_measured`'s answer
        self.cache, self.cached = cache, 0  # profiles read from the disk cache

    @property
    def count(self) -> int:
        """How many steps were profiled (a failed one included)."""
        return len(self._profiles)

    def profile(self, schedule, timed: bool, remat=None) -> Profiled | MpmdError:
        """The profile of the step under `schedule` (its cells timed when `timed`; with `remat`,
        when not None, replacing the step's), or the error that says why the arguments cannot
        be profiled that way (e.g. a batch that does not split into its microbatches; a function
        whose markers cut it into another number of stages). Made once per `(schedule, remat)`:
        the first call decides whether it is timed."""
        key = (repr(schedule), remat)
        if key not in self._profiles:
            self._profiles[key] = self._made(schedule, timed, remat)
        return self._profiles[key]

    def pair(self, schedule, remat=None) -> tuple[Profiled | MpmdError, Profiled | MpmdError]:
        """`(timing, holding)`: the profiles whose cells time `schedule` and whose bytes size it
        (the same one when its layout times its own cells; the holding one is timed only then)."""
        timing, holding = timing_schedule(schedule), holding_schedule(schedule)
        return self.profile(timing, True, remat), self.profile(holding, repr(holding) == repr(timing), remat)

    def backend(self, profile: StageProfile | None = None, microbatches: Sequence[int] = ()) -> BackendCost:
        """What the backend charges beyond the cells (`measure_backend`: copies fitted over sizes
        that include the values `profile` saves; the issuing thread's seconds per call and ranks
        computing at once as `step_measured(microbatches)` measures them), measured once, on each
        rank's first device."""
        if self._backend is None:
            saved = () if profile is None else profile.saved_values
            sizes = sorted({b for stage in saved for kind in stage for _, b in kind})
            devices = [self.mesh.submesh(r).devices.flat[0] for r in range(self.mesh.mpmd_dim)]
            measured = self.step_measured(microbatches)
            at_once, issue = (None, None)
            if measured is not None:
                at_once, issue = step_units(measured, devices), measured[2]
            self._backend = measure_backend(devices, sizes[:2] + sizes[-4:], at_once, issue)  # least, most
        return self._backend

    def at_once(self, microbatches: Sequence[int]) -> float | None:
        """The compute units the ranks share, measured on a real step of plain Std1F1B at the most
        of `microbatches` that splits the arguments (`step_units` of its `busy_and_wall`); None
        when none does."""
        measured = self.step_measured(microbatches)
        devices = [self.mesh.submesh(r).devices.flat[0] for r in range(self.mesh.mpmd_dim)]
        return None if measured is None else step_units(measured, devices)

    def step_measured(self, microbatches: Sequence[int]) -> tuple[float, float, float, float] | None:
        """`busy_and_wall` of a real step of plain Std1F1B at the most of `microbatches` that
        splits the arguments (over `rounds`, at least 3); None when none does. Kept in the disk
        cache next to the profiles."""
        plain = self.plain_measured(microbatches)
        return None if plain is None else plain[1]

    def plain_measured(self, microbatches: Sequence[int]) -> tuple[S.Std1F1B, MEASURED] | None:
        """`(schedule, busy_and_wall)` of the real step `step_measured` measures: plain Std1F1B at
        the most of `microbatches` that splits the arguments; None when none does. Measured once."""
        counts = tuple(sorted(set(microbatches), reverse=True))
        if counts not in self._plain:
            self._plain[counts] = self._plain_step(counts)
        return self._plain[counts]

    def _plain_step(self, microbatches: Sequence[int]) -> tuple[S.Std1F1B, MEASURED] | None:
        for m in microbatches:
            schedule = S.Std1F1B(microbatches=m)
            loss, loss_args = self._loss(schedule)
            measure = ("work, wall, issue and issuing", repr(schedule))
            key = self._key(loss, loss_args, measure, self.settings, True)
            measured = None if self.cache is None else self.cache.get(key, MEASURED)
            if measured is None:
                settings = self.settings.replace(schedule=schedule)
                step = step_function(loss, settings, compiler=self.compiler)
                try:
                    measured = busy_and_wall(step, loss_args, max(self.rounds, 3))
                except MpmdError:
                    continue  # e.g. the batch does not split into m microbatches, or cut for v > 1
                if self.cache is not None:
                    self.cache.put(key, measured)
            return schedule, tuple(measured)
        return None

    def _loss(self, schedule) -> tuple[Callable, tuple]:
        """The loss and its arguments for `schedule`'s cut."""
        if self.args:
            return self.fn, self.args
        return self.fn(schedule.num_model_stages(self.mesh.mpmd_dim))

    def _made(self, schedule, timed: bool, remat) -> Profiled | MpmdError:
        """The profile from the disk cache when it holds this program's, else measured (and
        stored there)."""
        loss, loss_args = self._loss(schedule)
        settings = self.settings if remat is None else self.settings.replace(remat=remat)
        key = self._key(loss, loss_args, schedule, settings, timed)
        stored = None if self.cache is None else self.cache.get(key, Profiled)
        if stored is not None:
            self.cached += 1
            return stored
        made = self._measured(schedule, timed, loss, loss_args, settings)
        if self.cache is not None and not isinstance(made, MpmdError):
            self.cache.put(key, made)
        return made

    def _key(self, loss, loss_args, schedule, settings: StepSettings, timed: bool) -> str | None:
        if self.cache is None:
            return None
        program = program_digest(loss, *loss_args)
        update = update_digest(self.optimizer, self.optimizer_states, loss_args[0])
        step = tuple(sorted(settings.keywords().items()))
        return profile_key(program, update, (repr(schedule), step, self.rounds if timed else 0), self.mesh)

    def _measured(
        self, schedule, timed: bool, loss, loss_args, settings: StepSettings
    ) -> Profiled | MpmdError:
        step = step_function(loss, settings.replace(schedule=schedule), compiler=self.compiler)
        try:
            measured = step.profile_stages(*loss_args, rounds=self.rounds if timed else 0)
            return Profiled(measured, self._update(step, loss_args, measured))
        except StageSplitError as err:
            if not self.args:
                raise
            return err  # the function's markers cut it into another number of stages
        except (TraceContextError, MeshError, DistributedError):
            raise  # the same for every configuration
        except MpmdError as err:
            return err  # e.g. the batch does not split into this many microbatches

    def _update(self, step, loss_args, measured: StageProfile) -> UpdateCost:
        """What the optimizer adds to `step` on `loss_args` (`measured` is its profile)."""
        n = self.mesh.mpmd_dim
        if self.optimizer_states is not None:
            state = tuple(round(self.optimizer_states * p) for p in measured.memory.params)
            return UpdateCost(state, (0.0,) * n, False)
        params = loss_args[0]
        owners = Owners.of(step.plan_for(*loss_args), params)
        stages = step.n_stages
        if stages not in self._update_times:
            self._update_times[stages] = update_seconds(self.optimizer, params, max(self.rounds, 1))
        owned = owners.per_rank(n)
        share = [b / sum(owned) if sum(owned) else 1.0 / n for b in owned]
        return UpdateCost(
            state_bytes(self.optimizer, params, owners, n),
            tuple(self._update_times[stages] * k for k in share),
            crosses_ranks(self.optimizer, params, owners),
        )
