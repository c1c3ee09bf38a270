"""Which microbatch a step with `LengthBuckets` runs first: the order whose simulated step is shorter.

The microbatches' rows are the same either way (the sorted rows cut into equal microbatches), only
their order in the schedule differs, and with it how a long microbatch's cells overlap the others'.
Each cell costs the schedule's unit cost of its kind times its microbatch's length
(`scaled_cost`); the step's loss and gradients are sums over the microbatches, so the order
changes them by float rounding only.
"""

from __future__ import annotations

from dataclasses import dataclass

from spectrax_core.schedules import StageCost, simulate


@dataclass(frozen=True)
class ScaledCost(StageCost):
    """A `StageCost` whose cells of microbatch `i` take `scale[i]` times the stage's duration."""

    scale: tuple = ()

    def of(self, cell) -> float:
        return float(sum(getattr(self, a.kind)[a.stage] * self.scale[a.microbatch] for a in cell.parts))


def scaled_cost(cost: StageCost, scale) -> ScaledCost:
    """`cost` with each microbatch's cells scaled by `scale[i]` (e.g. its length over the longest)."""
    return ScaledCost(cost.F, cost.B, cost.I, cost.W, cost.comm, tuple(float(x) for x in scale))


def unit_cost(schedule, n: int) -> StageCost:
    """The unit cost of every stage of `schedule` on `n` ranks: F = I = W = 1, B = 2."""
    stages = schedule.num_stages(n)
    return StageCost((1.0,) * stages, (2.0,) * stages, (1.0,) * stages, (1.0,) * stages)


def simulated_step(schedule, n: int, lengths, cost: StageCost | None = None) -> float:
    """The simulated step of `schedule` on `n` ranks with microbatch `i` at `lengths[i]`, each cell
    `cost`'s (default: unit costs) times its length over the longest."""
    top = max(lengths)
    base = cost if cost is not None else unit_cost(schedule, n)
    return simulate(schedule, n, scaled_cost(base, [x / top for x in lengths])).makespan


def longest_first(step, rows) -> bool:
    """Whether `step` (a step with `LengthBuckets`) runs its longest microbatch first, for the
    microbatches `rows` (sorted longest first): as its `order` says, or for `"auto"` the order
    whose simulated step is shorter (longest first on a tie)."""
    order = step.settings.length_buckets.order
    if order != "auto":
        return order == "longest_first"
    schedule, n = step.settings.schedule, step.mesh.mpmd_dim
    lengths = rows.lengths
    return simulated_step(schedule, n, lengths) <= simulated_step(schedule, n, lengths[::-1])
