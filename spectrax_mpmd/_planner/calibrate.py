"""The advice's absolute times, calibrated on the one step `advise` always runs: plain Std1F1B's.

The time model predicts a step from its cells each timed alone, the host's issuing and
the compute units the ranks share. What it leaves out (caches, memory traffic, the
runtime's own work between cells, load on the machine) scales a step's time by a
factor that moves with the machine and the model far more than with the schedule: its
ratios between candidates held within `MODEL_ERROR` of measured ones
(`tests/mpmd/test_mpmd_planner_costs.py`), while its absolute times missed measured
steps by up to 2x. `advise` measures one real gradient step of plain Std1F1B anyway
(for the compute units: `backend.busy_and_wall`, the least of its rounds), so every
candidate's predicted seconds are multiplied by `Calibration.scale`, measured over
modelled for that step: the ranking and every ratio stay the model's, and the
absolute times are the measured step's. `tests/mpmd/test_mpmd_planner_calibrated.py`
holds calibrated predictions to `MODEL_ERROR` of steps the advice never ran, at the load
the calibration step met (other work on shared cores slows steps, and not alike).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spectrax_core import schedules as S

from .advice import Candidate


@dataclass(frozen=True)
class Calibration:
    """Plain `schedule`'s gradient step (no optimizer update) as measured (`measured_s`, the least
    of its rounds) and as the time model predicts it (`modelled_s`); `scale` multiplies every
    predicted time."""

    schedule: S.Schedule
    measured_s: float
    modelled_s: float

    @property
    def scale(self) -> float:
        return self.measured_s / self.modelled_s

    def applied(self, candidate: Candidate) -> Candidate:
        """`candidate` with its predicted seconds (step, update, schedule alone) scaled."""
        k, c = self.scale, candidate
        return replace(c, step_s=c.step_s * k, update_s=c.update_s * k, schedule_s=c.schedule_s * k)

    def describe(self) -> str:
        return (
            f"x {self.scale:.2f} to plain Std1F1B m={self.schedule.microbatches}'s gradient step "
            f"({self.measured_s * 1e3:.4g} ms measured, {self.modelled_s * 1e3:.4g} modelled)"
        )

    def as_dict(self) -> dict:
        return {
            "microbatches": self.schedule.microbatches,
            "measured_s": self.measured_s,
            "modelled_s": self.modelled_s,
            "scale": self.scale,
        }
