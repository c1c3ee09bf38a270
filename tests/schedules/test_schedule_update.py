"""The update after a simulated step: its start per validation, checked against the timeline's events."""

from __future__ import annotations

import pytest

from spectrax_core import schedules as S


@pytest.fixture(scope="module")
def timeline():
    return S.simulate(S.Std1F1B(microbatches=8), 4, S.Cost(F=1.0, B=2.0, comm=0.25))


def test_ungated_updates_follow_each_ranks_last_cell(timeline):
    step = S.with_update(timeline, [1.0, 2.0, 3.0, 4.0])
    for row, (start, end), cost in zip(timeline.events, step.spans, [1.0, 2.0, 3.0, 4.0]):
        assert start == row[-1].end and end == start + cost
    assert step.makespan == max(end for _, end in step.spans)


def test_a_synchronous_update_waits_for_every_rank_and_the_verdict(timeline):
    step = S.with_update(timeline, 1.5, validation="sync")
    last = max(row[-1].end for row in timeline.events)
    assert {start for start, _ in step.spans} == {last + 0.5}
    assert step.makespan == last + 0.5 + 1.5
    assert step.makespan > S.with_update(timeline, 1.5).makespan


def test_post_validation_costs_the_check_past_the_ungated_update(timeline):
    free = S.with_update(timeline, 1.5)
    post = S.with_update(timeline, 1.5, validation="post", validate=0.1)
    sync = S.with_update(timeline, 1.5, validation="sync")
    assert free.makespan <= post.makespan <= sync.makespan
    assert post.spans == free.spans
    assert 0 < post.update_share < 1


def test_bad_arguments():
    timeline = S.simulate(S.GPipe(microbatches=2), 2)
    with pytest.raises(ValueError, match="validation must be one of"):
        S.with_update(timeline, 1.0, validation="later")
    with pytest.raises(ValueError, match="3 update durations for 2 ranks"):
        S.with_update(timeline, [1.0, 1.0, 1.0])
