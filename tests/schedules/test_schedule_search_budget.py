"""`search` under tight memory budgets: every budget a valid table can meet is met.

One stage per rank runs with one live activation per rank (one microbatch at a
time); a V holds two stages of a microbatch per rank, so it needs two. Budgets
down to those floors must give a valid table whose simulated peak fits, in live
activations or, with a `StageMemory`, in bytes.
"""

import pytest

from spectrax_core import schedules as S
from spectrax_core.schedules import Cost, ScheduleError, simulate


def stage_memory(n_stages: int, n_ranks: int, residual: int = 100) -> S.StageMemory:
    """`residual` bytes per live activation on every stage, 1000 bytes of parameters per rank."""
    zeros = (0,) * n_stages
    return S.StageMemory(
        inputs=zeros,
        kept_inputs=zeros,
        residuals=(residual,) * n_stages,
        grads=zeros,
        stash=zeros,
        params=(1000,) * n_ranks,
        accumulators=(0,) * n_ranks,
        optimizer=(0,) * n_ranks,
        other=(0,) * n_ranks,
    )


@pytest.mark.parametrize("n, m", [(2, 4), (3, 5), (4, 8)])
def test_every_activation_budget_down_to_one_is_met(n, m):
    cost = Cost(F=1, B=2, I=1, W=1, comm=0.25)
    for budget in range(1, n + 1):
        found = S.search(n, m, cost, memory_budget=budget)
        timeline = simulate(found, n, cost)  # raises on an invalid table
        assert max(timeline.peak_activations) <= budget, (budget, timeline.peak_activations)


def test_a_tighter_budget_is_never_faster():
    n, m = 4, 8
    spans = [simulate(S.search(n, m, Cost(), memory_budget=b), n).makespan for b in range(1, n + 1)]
    assert spans == sorted(spans, reverse=True)
    assert spans[0] > spans[-1]


def test_a_v_cut_meets_every_budget_down_to_two():
    n, m = 4, 8
    for budget in range(2, 2 * n + 1):
        found = S.search(n, m, Cost(), memory_budget=budget, virtual_stages=2)
        assert max(simulate(found, n).peak_activations) <= budget
    with pytest.raises(ScheduleError, match=r"smallest peak found is 2 .*at least 2"):
        S.search(n, m, Cost(), memory_budget=1, virtual_stages=2)


def test_a_budget_in_bytes_below_the_grid_is_met():
    n, m = 4, 8
    memory = stage_memory(n, n)
    for activations in (1, 2, 3):
        budget = 1000 + 100 * activations
        found = S.search(n, m, Cost(), memory_budget=budget, memory=memory)
        assert max(simulate(found, n, memory=memory).peak_bytes) == budget  # the largest cap that fits
    with pytest.raises(ScheduleError, match=r"smallest peak found is 1100 .*at least 1100"):
        S.search(n, m, Cost(), memory_budget=1099, memory=memory)
