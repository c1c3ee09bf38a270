"""Tables written by hand: a schedule from per-rank lists of actions, from text or from CSV.

`UserSchedule(rows)` takes one sequence of cells per rank (`Action`s, `FusedAction`s
or their text, `"2F3"`, `"0F3&7B1"`). The table fixes everything else: `n` is its
number of rows, `microbatches` one more than its largest microbatch, the stages
of a rank those its cells name (`stages_of` in increasing order), and
`virtual_stages` the most stages a rank holds. It is checked when built: every
action once (`check_table`) and no deadlock under the order the MPMD runtime
issues cells (`issue_order`); the error names the first offending action.
`read_torch_csv` (`spectrax_core.schedules._torch_csv`) reads PyTorch's schedule CSV.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass, field

from ._actions import Action, FusedAction, ScheduleError
from ._base import Schedule
from ._text import parse_cell, parse_table


@dataclass(frozen=True)
class UserSchedule(Schedule):
    """A hand-written table; `rows[r]` is rank r's cells in order (see the module docstring)."""

    rows: tuple
    microbatches: int = field(init=False)
    virtual_stages: int = field(init=False)
    layout = "table"

    def __post_init__(self):
        rows = _cells(type(self).__name__, self.rows)
        object.__setattr__(self, "rows", rows)
        parts = [a for row in rows for cell in row for a in cell.parts]
        if not parts:
            raise ScheduleError(
                f"{type(self).__name__}: the table holds no actions; give one row of cells per rank."
            )
        object.__setattr__(self, "microbatches", 1 + max(a.microbatch for a in parts))
        holders: dict[int, set] = {}
        for rank, row in enumerate(rows):
            for cell in row:
                for a in cell.parts:
                    holders.setdefault(a.stage, set()).add(rank)
        for stage, ranks in sorted(holders.items()):
            if len(ranks) > 1:
                raise ScheduleError(
                    f"{type(self).__name__}: stage {stage} appears on ranks {sorted(ranks)}; a stage lives "
                    "on one rank (its actions go in that rank's row)."
                )
        missing = sorted(set(range(1 + max(holders))) - set(holders))
        if missing:
            raise ScheduleError(
                f"{type(self).__name__}: the table never runs stage(s) {missing}; stages number 0..S-1 "
                "in model order and every one needs its actions."
            )
        owner = tuple(next(iter(holders[s])) for s in range(len(holders)))
        object.__setattr__(self, "_owner", owner)
        held = [sum(1 for o in owner if o == r) for r in range(len(rows))]
        object.__setattr__(self, "virtual_stages", max(held))
        super().__post_init__()
        self.validate(len(rows))

    @classmethod
    def from_text(cls, text: str) -> UserSchedule:
        """The table written as text: one line per rank, its cells' text separated by spaces."""
        return cls(parse_table(text))

    @classmethod
    def from_csv(cls, source) -> UserSchedule:
        """The table in CSV: one line per rank, one cell per field (`0F0,0F1,0B0,...`); empty
        fields (a shorter rank's padding) are skipped. `source` is a path or a text file."""
        if isinstance(source, (str, os.PathLike)):
            with open(source, newline="") as f:
                return cls.from_csv(f)
        if not isinstance(source, io.IOBase) and not hasattr(source, "read"):
            raise TypeError(
                "UserSchedule.from_csv: source must be a path or a text file, received "
                f"{type(source).__name__}; wrap CSV text in io.StringIO."
            )
        rows = [[c.strip() for c in line if c.strip()] for line in csv.reader(source)]
        return cls([row for row in rows if row])

    @property
    def splits_backward(self) -> bool:
        return any(a.kind in ("I", "W") for row in self.rows for cell in row for a in cell.parts)

    def _check_n(self, n):
        if n != len(self.rows):
            raise ScheduleError(
                f"{type(self).__name__}: the table has {len(self.rows)} rows (ranks), not n={n}."
            )

    def _rows(self, n):
        return [list(row) for row in self.rows]

    def num_stages(self, n):
        return len(self._owner)

    def rank_of(self, stage, n):
        if not 0 <= stage < len(self._owner):
            raise ScheduleError(
                f"{type(self).__name__}: stage must be in 0..{len(self._owner) - 1}, received {stage}."
            )
        return self._owner[stage]

    def stages_of(self, rank, n):
        return tuple(s for s, o in enumerate(self._owner) if o == rank)

    def stage_of(self, rank, v, n):
        stages = self.stages_of(rank, n)
        if not 0 <= v < len(stages):
            raise ScheduleError(
                f"{type(self).__name__}: rank {rank} holds {len(stages)} stage(s), received v={v}."
            )
        return stages[v]


def _cells(owner: str, rows) -> tuple:
    if isinstance(rows, str) or not hasattr(rows, "__iter__"):
        raise TypeError(
            f"{owner}: rows must be one sequence of cells per rank, received {type(rows).__name__}."
        )
    out = []
    for rank, row in enumerate(rows):
        if isinstance(row, str):
            raise TypeError(
                f"{owner}: row {rank} is a str; give a list of cells (or use UserSchedule.from_text)."
            )
        cells = []
        for index, cell in enumerate(row):
            if isinstance(cell, str):
                try:
                    cell = parse_cell(cell)
                except ScheduleError as err:
                    raise ScheduleError(f"{owner}: rank {rank} cell {index}: {err}") from None
            if not isinstance(cell, (Action, FusedAction)):
                raise ScheduleError(
                    f"{owner}: rank {rank} cell {index} is {cell!r}, not an Action or FusedAction."
                )
            cells.append(cell)
        out.append(tuple(cells))
    return tuple(out)
