"""The time model's one simulation (`shared_makespan`): a table on compute units its ranks share,
the issuing thread a serial resource that, on CPU devices, shares them too. Checked on every
flat and V schedule against what must hold at its ends: a unit per rank and free issuing is the
plain simulation; one unit runs the work back to back; issuing alone sets a step of no work."""

import pytest

from spectrax_core import schedules as S
from spectrax_mpmd._planner.shared import shared_makespan

N, M = 4, 8
SCHEDULES = [
    S.GPipe(microbatches=M),
    S.Std1F1B(microbatches=M),
    S.ZeroBubbleH1(microbatches=M),
    S.InterleavedH1(microbatches=M, virtual_stages=2),
    S.VMin(microbatches=M),
]


def _cost(schedule) -> S.StageCost:
    """Uneven cells (stage k forward (k + 1) ms), a backward twice its forward, split in half."""
    k = schedule.num_stages(N)
    forward = tuple(1e-3 * (1 + s % 3) for s in range(k))
    backward = tuple(2 * f for f in forward)
    return S.StageCost(forward, backward, tuple(b / 2 for b in backward), tuple(b / 2 for b in backward))


def _cells(schedule) -> int:
    return sum(map(len, S.simulate(schedule, N).events))


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: type(s).__name__)
def test_a_unit_per_rank_and_free_issuing_is_the_plain_simulation(schedule):
    cost = _cost(schedule)
    plain = S.simulate(schedule, N, cost).makespan
    assert shared_makespan(schedule, N, cost, float(N), 0.0, False) == pytest.approx(plain, rel=1e-9)
    assert shared_makespan(schedule, N, cost, float(N), 0.0, True) == pytest.approx(plain, rel=1e-9)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: type(s).__name__)
def test_one_unit_runs_the_work_back_to_back_and_a_shared_host_adds_its_issuing(schedule):
    cost, issue = _cost(schedule), 1e-4
    timeline = S.simulate(schedule, N, cost)
    work = sum(timeline.busy)
    assert shared_makespan(schedule, N, cost, 1.0, 0.0, False) == pytest.approx(work, rel=1e-9)
    shared = shared_makespan(schedule, N, cost, 1.0, issue, True)
    assert shared == pytest.approx(work + _cells(schedule) * issue, rel=1e-9)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: type(s).__name__)
def test_issuing_sets_a_step_of_no_work_and_more_units_never_take_longer(schedule):
    free = S.StageCost(*((0.0,) * schedule.num_stages(N),) * 4)
    assert shared_makespan(schedule, N, free, 2.0, 1e-4, True) == pytest.approx(_cells(schedule) * 1e-4)
    cost = _cost(schedule)
    times = [shared_makespan(schedule, N, cost, p, 5e-5, True) for p in (1.0, 1.5, 2.0, 3.0, float(N))]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(times, times[1:])), times
    assert times[0] > times[-1]
