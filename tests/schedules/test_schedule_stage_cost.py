"""`StageCost`: per-stage durations in the simulator (pipelines whose stages differ)."""

import pytest

from spectrax_core.schedules import (
    ALL_SCHEDULES,
    Cost,
    DualPipeV,
    Interleaved1F1BPlusOne,
    InterleavedGPipe,
    InterleavedH1,
    KimiK2,
    StageCost,
    Std1F1B,
    simulate,
)

LOOP = (InterleavedH1, Interleaved1F1BPlusOne, KimiK2, InterleavedGPipe)


def _schedule(cls, n):
    if cls is DualPipeV:
        return cls(2 * n)
    return cls(2 * n, 2) if cls in LOOP else cls(2 * n)


@pytest.mark.parametrize("cls", ALL_SCHEDULES)
def test_uniform_stage_cost_is_the_scalar_cost(cls):
    """The same durations on every stage give exactly the timeline of the scalar `Cost`."""
    n = 4
    schedule = _schedule(cls, n)
    stages = n * schedule.virtual_stages
    scalar = Cost(F=1.0, B=2.5, I=1.5, W=1.0, comm=0.25)
    per_stage = StageCost(
        F=(1.0,) * stages, B=(2.5,) * stages, I=(1.5,) * stages, W=(1.0,) * stages, comm=0.25
    )
    a, b = simulate(schedule, n, scalar), simulate(schedule, n, per_stage)
    assert a.makespan == b.makespan and a.busy == b.busy
    assert [[(e.start, e.end) for e in row] for row in a.events] == [
        [(e.start, e.end) for e in row] for row in b.events
    ]


def test_each_rank_is_busy_for_its_own_stages():
    """Std1F1B, m microbatches: rank r runs m forwards and m backwards of stage r."""
    n, m = 4, 6
    f, b = (1.0, 3.0, 2.0, 0.5), (2.0, 5.0, 4.0, 1.0)
    timeline = simulate(Std1F1B(m), n, StageCost(F=f, B=b, I=(0.0,) * n, W=(0.0,) * n))
    assert timeline.busy == tuple(m * (f[r] + b[r]) for r in range(n))
    # the slowest stage sets the pace: the makespan is at least its m cells
    assert timeline.makespan >= m * (f[1] + b[1])


def test_fused_cells_cost_their_parts():
    n = 4
    schedule = DualPipeV(2 * n)
    stages = 2 * n
    cost = StageCost(
        F=tuple(1.0 + s for s in range(stages)), B=(2.0,) * stages, I=(1.0,) * stages, W=(1.0,) * stages
    )
    for row in simulate(schedule, n, cost).events:
        for e in row:
            assert e.end - e.start == pytest.approx(sum(getattr(cost, a.kind)[a.stage] for a in e.cell.parts))


def test_stage_cost_errors_name_the_field():
    with pytest.raises(ValueError, match="B must be a tuple with one duration per stage"):
        StageCost(F=(1.0, 1.0), B=(1.0,), I=(1.0, 1.0), W=(1.0, 1.0))
    with pytest.raises(ValueError, match=r"W\[1\] must be a non-negative"):
        StageCost(F=(1.0, 1.0), B=(1.0, 1.0), I=(1.0, 1.0), W=(1.0, -1.0))
    with pytest.raises(ValueError, match="has 3 stages but Std1F1B on 2 ranks has 2"):
        simulate(Std1F1B(2), 2, StageCost(F=(1.0,) * 3, B=(1.0,) * 3, I=(1.0,) * 3, W=(1.0,) * 3))
