"""The behaviour every schedule shares: layout, argument checks, derived figures.

A concrete schedule is a frozen dataclass subclass that sets `layout` and
implements `_rows(n)` (one list of cells per rank). Everything else —
memoised `actions`, `stage_of` / `rank_of` / `stages_of`, `validate`, and the
figures `bubble_ratio` / `total_steps` / `peak_activations` (defined on the
simulation at default costs) — lives here.
"""

from __future__ import annotations

import abc
import functools
from typing import ClassVar

from ._actions import ScheduleError, Table
from ._flow import Flow
from ._simulate import simulate
from ._timeline import Timeline


def check_count(owner: str, name: str, value, minimum: int) -> None:
    """Raise unless `value` is an int ≥ `minimum` (TypeError for a non-int)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int, received {value!r}.")
    if value < minimum:
        raise ScheduleError(
            f"{owner}: {name} must be >= {minimum}, received {value}; the smallest valid {name} is {minimum}."
        )


class Schedule(abc.ABC):
    """Base of the nine pipeline schedules (use a subclass).

    Logical stages are numbered 0 … n·v−1 in model order; `layout` says how
    they sit on ranks: `"flat"` (stage r on rank r), `"loop"` (rank r holds
    r, r+n, r+2n, …) or `"v"` (rank r holds r and 2n−1−r).
    """

    microbatches: int
    virtual_stages: int
    layout: ClassVar[str] = "flat"
    splits_backward: ClassVar[bool] = False
    """Whether the table uses split I/W backward actions."""

    def __post_init__(self):
        check_count(type(self).__name__, "microbatches", self.microbatches, 1)

    # --- the table -----------------------------------------------------------------
    @abc.abstractmethod
    def _rows(self, n: int) -> list[list]:
        """One list of cells per rank, in execution order (called once per n)."""

    def _check_n(self, n: int) -> None:
        """Per-n rules of the schedule (raise `ScheduleError` naming the smallest valid m)."""

    @functools.lru_cache(maxsize=512, typed=True)
    def actions(self, n: int) -> Table:
        """One tuple per rank of the cells that rank runs, in execution order."""
        check_count(type(self).__name__, "n (number of ranks)", n, 1)
        self._check_n(n)
        return tuple(tuple(row) for row in self._rows(n))

    # --- layout --------------------------------------------------------------------
    def stage_of(self, rank: int, v: int, n: int) -> int:
        """The logical stage that `rank` holds as its local chunk `v` (0 ≤ v < virtual_stages)."""
        name = type(self).__name__
        check_count(name, "n (number of ranks)", n, 1)
        if not 0 <= rank < n:
            raise ScheduleError(f"{name}: rank must be in 0..{n - 1}, received {rank}.")
        if not 0 <= v < self.virtual_stages:
            raise ScheduleError(
                f"{name}: local chunk v must be in 0..{self.virtual_stages - 1}, received {v}."
            )
        if self.layout == "loop":
            return v * n + rank
        if self.layout == "v":
            return rank if v == 0 else 2 * n - 1 - rank
        return rank

    def rank_of(self, stage: int, n: int) -> int:
        """The rank that holds logical `stage`."""
        name = type(self).__name__
        check_count(name, "n (number of ranks)", n, 1)
        n_stages = n * self.virtual_stages
        if not 0 <= stage < n_stages:
            raise ScheduleError(f"{name}: stage must be in 0..{n_stages - 1} on {n} ranks, received {stage}.")
        if self.layout == "loop":
            return stage % n
        if self.layout == "v":
            return stage if stage < n else 2 * n - 1 - stage
        return stage

    def stages_of(self, rank: int, n: int) -> tuple[int, ...]:
        """All logical stages of `rank`, in local-chunk order."""
        return tuple(self.stage_of(rank, c, n) for c in range(self.virtual_stages))

    def num_stages(self, n: int) -> int:
        """How many logical stages the table runs on `n` ranks (n · virtual_stages)."""
        return n * self.virtual_stages

    def num_model_stages(self, n: int) -> int:
        """How many model stages (the function's stage clusters) the table runs on `n` ranks:
        `num_stages`, fewer where logical stages are copies of model stages."""
        return len({self.model_stage(s, n) for s in range(self.num_stages(n))})

    def model_stage(self, stage: int, n: int) -> int:
        """The model stage (the function's stage cluster) that logical `stage` runs: itself,
        except where a schedule runs copies of the model's stages (DualPipe)."""
        return stage

    def microbatches_of(self, stage: int, n: int) -> range:
        """The microbatches logical `stage` runs: all of them, except where a schedule feeds
        microbatches through different copies of the stages (DualPipe)."""
        return range(self.microbatches)

    # --- data flow between stages ----------------------------------------------------
    def stage_inputs(self, n: int) -> tuple[tuple[int, ...], ...]:
        """Per stage, the stages whose forward output it reads: a chain, stage s reads s − 1."""
        return tuple((s - 1,) if s else () for s in range(self.num_stages(n)))

    def gradient_inputs(self, n: int) -> tuple[tuple[int, ...], ...]:
        """Per stage, the stages whose input gradient its backward waits for: s + 1 in a chain."""
        last = self.num_stages(n) - 1
        return tuple((s + 1,) if s < last else () for s in range(last + 1))

    def flow(self, n: int) -> Flow:
        """`stage_inputs` and `gradient_inputs` as one `Flow`: what each cell waits for."""
        return Flow(self.stage_inputs(n), self.gradient_inputs(n))

    def stage_labels(self, n: int) -> tuple[str, ...]:
        """Names of the stages in grids and traces; empty: the stage number."""
        return ()

    # --- checks and figures --------------------------------------------------------
    def validate(self, n: int) -> None:
        """Raise `ScheduleError` unless the table for `n` ranks is well formed and deadlock-free."""
        self.timeline(n)

    @functools.lru_cache(maxsize=512, typed=True)
    def timeline(self, n: int) -> Timeline:
        """The simulation at default costs (T_F = T_I = T_W = 1, T_B = 2, no comm)."""
        return simulate(self, n)

    def bubble_ratio(self, n: int) -> float:
        """Idle fraction of the ranks' time: Σ idle / (n · makespan), at default costs."""
        return self.timeline(n).bubble_fraction

    def total_steps(self, n: int) -> float:
        """Makespan in cost units (T_F = 1) at default costs."""
        return self.timeline(n).makespan

    def peak_activations(self, n: int) -> int:
        """Most (stage, microbatch) activations live at once on any rank, at default costs."""
        return max(self.timeline(n).peak_activations)
