"""The text form of actions and tables: `Action.parse`, `FusedAction.parse`, `parse_table`, `format_table`."""

from dataclasses import dataclass, field

import pytest

from spectrax_core import schedules as S
from spectrax_core.schedules import (
    Action,
    DeadlockError,
    FusedAction,
    ScheduleError,
    format_table,
    parse_cell,
    parse_table,
)

N = 4


def every_schedule():
    for cls in S.ALL_SCHEDULES:
        yield cls(microbatches=2 * N)
        if cls.__dataclass_fields__["virtual_stages"].init:
            yield cls(microbatches=2 * N + 1, virtual_stages=3)


SCHEDULES = list(every_schedule())


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_every_cell_of_every_schedule_round_trips(schedule):
    cells = [cell for row in schedule.actions(N) for cell in row]
    for cell in cells:
        assert parse_cell(repr(cell)) == cell
        assert type(cell).parse(repr(cell)) == cell
        for a in cell.parts:
            assert Action.parse(repr(a)) == a
            assert Action.parse(f"{a.stage}{a.kind}{a.microbatch}") == a


def test_the_round_trips_cover_every_kind_of_cell():
    kinds = {cell.kind for s in SCHEDULES for row in s.actions(N) for cell in row}
    assert kinds == {"F", "B", "I", "W", "F&B"}


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_a_parsed_table_is_the_schedules_own(schedule):
    table = schedule.actions(N)
    text = format_table(table)
    assert len(text.splitlines()) == N
    assert text.splitlines()[0].split()[0] == repr(table[0][0])
    assert parse_table(text) == table
    assert parse_table(text, schedule) == table
    assert parse_table(f"\n    {text.replace(' ', '   ')}\n\n", schedule) == table


def test_the_kinds_of_the_text_form():
    assert Action.parse("2F3") == Action("F", 2, 3)
    assert Action.parse("0B10") == Action("B", 0, 10)
    assert Action.parse("12I0") == Action("I", 12, 0)
    assert Action.parse("5W7") == Action("W", 5, 7)
    fused = FusedAction.parse("0F3&7B1")
    assert fused == FusedAction((Action("F", 0, 3), Action("B", 7, 1)))
    assert parse_cell("1F2&1I0") == FusedAction((Action("F", 1, 2), Action("I", 1, 0)))
    assert str(fused) == "F3&B1" and repr(fused) == "0F3&7B1"  # the grid label keeps no stage


@pytest.mark.parametrize(
    "text", ["2X3", "F3", "2F", "02F3", "2F03", " 2F3", "2f3", "2F3 ", "-1F3", "2F3&1B1", "", 23, None]
)
def test_bad_action_text_is_a_clear_error(text):
    with pytest.raises(ScheduleError, match=r"Action.parse: expected stage, kind and microbatch .*'2F3'"):
        Action.parse(text)


@pytest.mark.parametrize(
    "text, message",
    [
        ("0F3", "FusedAction.parse: expected a forward and a backward"),
        ("0F3&1B1&2B2", "FusedAction.parse: expected a forward and a backward"),
        ("0F3&", "Action.parse: expected"),
        ("0B1&0F3", "FusedAction: parts must be"),
        ("0F1&0W1", "FusedAction: parts must be"),
    ],
)
def test_bad_fused_text_is_a_clear_error(text, message):
    with pytest.raises(ScheduleError, match=message):
        FusedAction.parse(text)


GOOD = "0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1"


@pytest.mark.parametrize(
    "text, error, message",
    [
        ("0F0 0F1 0B0 0B1\n1F0 1B0 1X1 1B1", ScheduleError, r"parse_table: rank 1 cell 2: Action.parse"),
        ("0F0 0F1 0B0 0B1\n1F0 1B0 1F1", ScheduleError, r"stage 1, microbatch 1\) has backward actions \[\]"),
        # one line: one rank, which holds stage 0 only
        ("0F0 0F1 0B0 0B1 1F0 1B0 1F1 1B1", ScheduleError, "out of range: stages are 0..0"),
        ("0F0 0F1 0B0 0B1 1F0\n1B0 1F1 1B1", ScheduleError, "lives on rank 1"),
        ("0F0 0F1 0B0 0B1\n1F0 1F1&1B0 1B1 1F0", ScheduleError, "appears twice"),
        ("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1", DeadlockError, r"rank 1 at cell 0 \(1F1\) waits for the"),
        ("  \n ", ScheduleError, "holds no table"),
    ],
)
def test_a_bad_table_text_is_a_clear_error(text, error, message):
    parse_table(GOOD, S.Std1F1B(2))
    with pytest.raises(error, match=message):
        parse_table(text, S.Std1F1B(2))


def test_a_deadlocking_table_parses_without_a_schedule_and_fails_with_one():
    text = "0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1"
    assert len(parse_table(text)) == 2
    with pytest.raises(DeadlockError, match="Std1F1B: the table deadlocks on n=2 ranks"):
        parse_table(text, S.Std1F1B(2))


def test_format_table_refuses_what_is_not_a_cell():
    with pytest.raises(TypeError, match="rank 0 cell 1 is 'F1', not an Action or FusedAction"):
        format_table(((Action("F", 0, 0), "F1"),))
    with pytest.raises(TypeError, match="text must be a str"):
        parse_table(["0F0"])


@dataclass(frozen=True)
class Written(S.Schedule):
    """A schedule whose table is written as text."""

    microbatches: int = 2
    virtual_stages: int = field(default=1, init=False)

    def _rows(self, n):
        return parse_table(
            """
            0F0 0F1 0B0 0B1
            1F0 1I0 1F1 1I1 1W0 1W1
            """
        )


def test_a_schedule_written_as_text_simulates():
    t = S.simulate(Written(), 2)
    assert [[repr(e.cell) for e in row] for row in t.events] == [
        ["0F0", "0F1", "0B0", "0B1"],
        ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"],
    ]
    # unit costs, B = 2: 0B0 waits for 1I0 (ends at 3), 0B1 for 1I1 (ends at 5)
    assert [[(e.start, e.end) for e in row] for row in t.events] == [
        [(0, 1), (1, 2), (3, 5), (5, 7)],
        [(1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7)],
    ]
