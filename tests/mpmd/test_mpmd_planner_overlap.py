"""How many ranks compute at once, measured on a real step of plain Std1F1B (its cells' seconds,
each timed alone, over the step's wall seconds): between 1 and the rank count, about 1 for a step whose cells run
one after another by construction (one microbatch: each cell waits for the one before), and the
ranks-at-once every candidate of the advice is predicted with."""

import pytest
from planner_cases import MESH, init, lm_loss

import spectrax_mpmd as mp
from spectrax_mpmd._planner.backend import ranks_at_once
from spectrax_mpmd._planner.profiler import Profiler

N = 4


@pytest.fixture(scope="module")
def profiler():
    return Profiler(
        lambda n: (lm_loss(n), init()),
        (),
        mp.StepSettings("advise", mesh=MESH),
        rounds=2,
        optimizer_states=2.0,
    )


def test_ranks_at_once_is_busy_over_wall_between_one_and_the_rank_count():
    assert ranks_at_once(3.0, 1.5, N) == pytest.approx(2.0)
    assert ranks_at_once(0.5, 1.0, N) == 1.0  # issuing and waiting longer than the cells
    assert ranks_at_once(9.0, 1.0, N) == float(N)
    with pytest.raises(ValueError, match="wall_s must be positive"):
        ranks_at_once(1.0, 0.0, N)


@pytest.mark.timing
def test_a_serialized_step_computes_about_one_rank_at_once(profiler):
    at_once = profiler.at_once((1,))  # each cell timed alone adds a wait a step does not have
    assert 1.0 <= at_once <= 1.5, at_once


@pytest.mark.timing
def test_the_advice_backend_takes_the_step_measured_ranks_at_once(profiler):
    at_once = profiler.at_once((2, 8))  # the most microbatches whose profile can be made
    assert 1.0 <= at_once <= N
    backend = profiler.backend(None, (2, 8))
    assert backend.parallelism_source == "step" and 1.0 <= backend.parallelism <= N
    assert profiler.at_once((3,)) is None  # 3 microbatches do not split the batch of 32
