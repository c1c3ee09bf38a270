"""The text form of a schedule table: one line per rank, its cells' `repr` separated by spaces.

`format_table(schedule.actions(4))` starts `"0F0 0F1 0F2 0F3 0B0 ..."`; `parse_table` reads
it back (and, given the schedule, checks it as `validate` checks a schedule's own table).
"""

from __future__ import annotations

from ._actions import Action, Cell, FusedAction, ScheduleError, Table, check_table
from ._simulate import walk_table


def parse_cell(text: str) -> Cell:
    """The cell whose `repr` is `text`: an `Action` (`"2F3"`) or a `FusedAction` (`"0F3&7B1"`)."""
    return FusedAction.parse(text) if isinstance(text, str) and "&" in text else Action.parse(text)


def format_table(table: Table) -> str:
    """`table` as text: one line per rank, its cells' `repr` separated by single spaces."""
    lines = []
    for rank, row in enumerate(table):
        for index, cell in enumerate(row):
            if not isinstance(cell, (Action, FusedAction)):
                raise TypeError(
                    f"format_table: rank {rank} cell {index} is {cell!r}, not an Action or FusedAction."
                )
        lines.append(" ".join(map(repr, row)))
    return "\n".join(lines)


def parse_table(text: str, schedule=None) -> Table:
    """The table written as `text` (see `format_table`): line r is rank r's cells in order,
    separated by whitespace; blank lines around the table are ignored.

    With `schedule`, the table must be one that `schedule` could run on as many ranks as
    there are lines: `check_table`'s rules (`ScheduleError`) and no deadlock under its flow
    (`DeadlockError`), the checks `validate` makes of the schedule's own table.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_table: text must be a str, received {type(text).__name__}.")
    rows = []
    for rank, line in enumerate(text.strip().splitlines()):
        row = []
        for index, word in enumerate(line.split()):
            try:
                row.append(parse_cell(word))
            except ScheduleError as err:
                raise ScheduleError(f"parse_table: rank {rank} cell {index}: {err}") from None
        rows.append(tuple(row))
    if not rows:
        raise ScheduleError("parse_table: the text holds no table; write one line of cells per rank.")
    table = tuple(rows)
    if schedule is not None:
        n = len(table)
        check_table(schedule, n, table)
        walk_table(schedule, n, table, schedule.flow(n))
    return table
