"""Table checks and simulator semantics on hand-written tables, timelines worked out by hand."""

from dataclasses import dataclass, field

import pytest

from spectrax_core.schedules import (
    Action,
    Cost,
    FusedAction,
    Schedule,
    ScheduleError,
    Std1F1B,
    check_table,
    simulate,
    validate,
)


@dataclass(frozen=True)
class Hand(Schedule):
    """A flat schedule whose table is given literally (rows of repr strings like '0F1')."""

    microbatches: int
    rows: tuple = ()
    virtual_stages: int = field(default=1, init=False)

    def _rows(self, n):
        return [[_parse(c) for c in row] for row in self.rows]


def _parse(text):
    if "&" in text:
        return FusedAction(tuple(_parse(p) for p in text.split("&")))
    for kind in "FBIW":
        if kind in text:
            s, mb = text.split(kind)
            return Action(kind, int(s), int(mb))
    raise AssertionError(text)


GOOD = (("0F0", "0F1", "0B0", "0B1"), ("1F0", "1B0", "1F1", "1I1", "1W1"))


def test_hand_table_passes():
    validate(Hand(2, GOOD), 2)


@pytest.mark.parametrize(
    "rows, rule",
    [
        ((("0F0", "0F1", "0B0", "0B1"),), "one per rank"),
        ((("0F0", "0F1", "0B0"), GOOD[1]), r"stage 0, microbatch 1\) has backward actions \[\]"),
        ((("0F0", "0F1", "0B0", "0B1", "0B1"), GOOD[1]), "appears twice"),
        ((("0F0", "0B0", "0F1", "0B1", "0I1", "0W1"), GOOD[1]), "exactly one B, or one I"),
        ((("0F0", "0B0", "0F1", "0I1"), GOOD[1]), "exactly one B, or one I"),
        ((("0F0", "0B0", "0B1", "0F1"), GOOD[1]), "F must come before its B/I"),
        ((GOOD[0], ("1F0", "1B0", "1F1", "1W1", "1I1")), "I must come before its W"),
        ((GOOD[0], ("1F0", "1B0", "1B1")), r"stage 1, microbatch 1\) has no F"),
        ((GOOD[0], ("1F0", "1B0", "1F1", "1B1", "0F2")), "out of range"),
        ((("0F0", "0F1", "0B0", "0B1", "1F0"), ("1B0", "1F1", "1B1")), "lives on rank 1"),
        ((GOOD[0], ("1F0&1B0", "1F1", "1B1")), "F must come before"),
    ],
)
def test_check_table_names_the_broken_rule(rows, rule):
    s = Hand(2, rows)
    with pytest.raises(ScheduleError, match=rule):
        check_table(s, 2, s.actions(2))


def test_deadlock_is_reported_with_what_each_rank_waits_for():
    rows = (("0F0", "0B0", "0F1", "0B1"), ("1F1", "1F0", "1B0", "1B1"))
    with pytest.raises(ScheduleError, match="deadlocks") as info:
        validate(Hand(2, rows), 2)
    message = str(info.value)
    assert "rank 0 at cell 1 (0B0) waits for the input gradient of stage 1, microbatch 0" in message
    assert "rank 1 at cell 0 (1F1) waits for the forward of stage 0, microbatch 1" in message


def test_fusing_can_deadlock_a_table_that_runs_unfused():
    rank1 = ("1F0", "1F1", "1B0", "1B1")
    validate(Hand(2, (("0F0", "0F1", "0B0", "0B1"), rank1)), 2)
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(Hand(2, (("0F0", "0F1&0B0", "0B1"), rank1)), 2)


PLAIN = (("0F0", "0F1", "0B0", "0B1"), ("1F0", "1F1", "1B0", "1B1"))
FUSED = (("0F0", "0F1", "0B0", "0B1"), ("1F0", "1F1&1B0", "1B1"))


def _times(timeline):
    return [[(repr(e.cell), e.start, e.end) for e in row] for row in timeline.events]


def test_cross_rank_inputs_arrive_comm_later():
    t = simulate(Hand(2, PLAIN), 2, Cost(F=1, B=2, comm=0.5))
    assert _times(t) == [
        [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 6, 8), ("0B1", 8, 10)],
        [("1F0", 1.5, 2.5), ("1F1", 2.5, 3.5), ("1B0", 3.5, 5.5), ("1B1", 5.5, 7.5)],
    ]
    assert t.makespan == 10 and t.busy == (6, 6) and t.idle == (4, 4)
    assert t.bubble_fraction == pytest.approx(8 / 20)
    assert t.peak_activations == (2, 2)


@pytest.mark.parametrize("fb, cell_end, makespan", [(None, 5, 9), (2.5, 4.5, 8.5)])
def test_fused_cell_costs_its_parts_unless_fb_given(fb, cell_end, makespan):
    t = simulate(Hand(2, FUSED), 2, Cost(FB=fb))
    assert _times(t)[1][1] == ("1F1&1B0", 2, cell_end)
    assert t.makespan == makespan
    # 1F0 is live until the cell ends and 1F1 from the cell's start: both at once
    assert t.peak_activations[1] == 2


def test_split_activation_lives_until_its_w():
    t = simulate(Hand(2, (("0F0", "0I0", "0F1", "0W0", "0I1", "0W1"),)), 1)
    assert [e.end for e in t.events[0]] == [1, 2, 3, 4, 5, 6]
    assert t.peak_activations == (2,)  # 0F0 lives until 0W0 ends at 4, 0F1 starts at 2


def test_release_and_allocation_at_the_same_time_do_not_overlap():
    t = simulate(Hand(2, (("0F0", "0B0", "0F1", "0B1"),)), 1)
    assert t.peak_activations == (1,)


def test_bubble_fraction_is_idle_over_total_time():
    t = simulate(Std1F1B(6), 3, Cost(F=1.5, B=2.5, comm=0.25))
    assert t.bubble_fraction == pytest.approx(sum(t.idle) / (3 * t.makespan))
    assert all(b + i == pytest.approx(t.makespan) for b, i in zip(t.busy, t.idle))
    assert [len(row) for row in t.events] == [len(row) for row in Std1F1B(6).actions(3)]


@pytest.mark.parametrize("field", ["F", "B", "I", "W", "comm", "FB"])
def test_cost_rejects_negative_or_non_numbers(field):
    with pytest.raises(ValueError, match=f"Cost: {field} must be a non-negative number"):
        Cost(**{field: -1})
    with pytest.raises(ValueError, match=f"Cost: {field}"):
        Cost(**{field: True})


def test_simulate_rejects_a_non_cost():
    with pytest.raises(TypeError, match="cost must be a Cost"):
        simulate(Std1F1B(2), 2, cost={"F": 1})
