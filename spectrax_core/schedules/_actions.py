"""Schedule cells: `Action`, `FusedAction`, and the structural table check.

A schedule table is one tuple per pipeline rank of cells in execution order.
A cell is an `Action` (one forward / backward / input-grad / weight-grad of
one logical stage on one microbatch) or a `FusedAction` (a forward and a
backward that run as one overlapped cell, as in DualPipeV and KimiK2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

KINDS = ("F", "B", "I", "W")
_ACTION_TEXT = re.compile(r"(0|[1-9][0-9]*)([FBIW])(0|[1-9][0-9]*)")


class ScheduleError(ValueError):
    """A schedule's parameters or table break a rule (the message names it)."""


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of pipeline work.

    `kind` is `"F"` (forward), `"B"` (full backward), `"I"` (input-gradient
    half of a backward) or `"W"` (weight-gradient half); `stage` is the logical
    stage (0 … n·v−1, in model order) and `microbatch` the microbatch index.
    `str` gives the grid label (`F3`); `repr` adds the stage (`2F3`), the text form that
    `Action.parse` reads back.
    """

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ScheduleError(f"Action: kind must be one of {KINDS}, received {self.kind!r}.")
        for name in ("stage", "microbatch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ScheduleError(f"Action: {name} must be a non-negative int, received {value!r}.")

    @property
    def parts(self) -> tuple["Action"]:
        """The actions this cell runs: itself (mirrors `FusedAction.parts`)."""
        return (self,)

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action whose `repr` is `text`: `"2F3"` is stage 2, kind F, microbatch 3."""
        match = _ACTION_TEXT.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(
                "Action.parse: expected stage, kind and microbatch as repr writes them ('2F3': stage 2, "
                f"kind F, B, I or W, microbatch 3; numbers without leading zeros), received {text!r}."
            )
        return cls(match[2], int(match[1]), int(match[3]))

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True, slots=True)
class FusedAction:
    """A forward and a backward run as one overlapped cell (`kind == "F&B"`).

    `parts` is `(forward, backward)`: an `F` action and a `B` or `I` action of
    the same rank. The backward must not depend on the forward (different
    microbatches), otherwise the cell would wait on itself.
    """

    parts: tuple[Action, Action]

    def __post_init__(self):
        parts = tuple(self.parts)
        ok = (
            len(parts) == 2
            and all(isinstance(p, Action) for p in parts)
            and parts[0].kind == "F"
            and parts[1].kind in ("B", "I")
        )
        if not ok:
            raise ScheduleError(
                "FusedAction: parts must be (forward Action 'F', backward Action 'B' or "
                f"'I'), received {self.parts!r}."
            )
        object.__setattr__(self, "parts", parts)

    @property
    def kind(self) -> str:
        return "F&B"

    @property
    def fwd(self) -> Action:
        """The forward part."""
        return self.parts[0]

    @property
    def bwd(self) -> Action:
        """The backward part."""
        return self.parts[1]

    def split(self) -> tuple[Action, Action]:
        """`(forward, backward)`: the two actions the cell runs."""
        return self.parts

    @classmethod
    def parse(cls, text: str) -> FusedAction:
        """The fused cell whose `repr` is `text`: `"0F3&7B1"`, its forward then its backward."""
        parts = text.split("&") if isinstance(text, str) else ()
        if len(parts) != 2:
            raise ScheduleError(
                "FusedAction.parse: expected a forward and a backward action joined by '&' as repr "
                f"writes them ('0F3&7B1'), received {text!r}."
            )
        return cls(tuple(Action.parse(p) for p in parts))

    def __str__(self) -> str:
        return f"{self.parts[0]}&{self.parts[1]}"

    def __repr__(self) -> str:
        return f"{self.parts[0]!r}&{self.parts[1]!r}"


Cell = Union[Action, FusedAction]
Table = tuple[tuple[Cell, ...], ...]


def cell_label(cell: Cell, stage_labels: tuple[str, ...] = ()) -> str:
    """A cell's name with its stage: `2F5`, or with named stages `V1F5` (`&` joins fused parts)."""
    if not stage_labels:
        return repr(cell)
    return "&".join(f"{stage_labels[a.stage]}{a}" for a in cell.parts)


def check_table(schedule, n: int, table) -> None:
    """Raise `ScheduleError` unless `table` is a well-formed table for `schedule` on `n` ranks.

    Rules: one row per rank; every cell is an `Action`/`FusedAction` of a stage
    the row's rank holds (`schedule.rank_of`) and a microbatch < m; each
    (stage, microbatch) has exactly one F and either exactly one B or exactly
    one I and one W; F comes before its B/I and I before its W in the row; the
    stage layout (`stage_of`, `rank_of`, `stages_of`) is a consistent bijection.
    """
    name = type(schedule).__name__
    m = schedule.microbatches
    n_stages = schedule.num_stages(n)
    _check_layout(schedule, n)
    if len(table) != n:
        raise ScheduleError(f"{name}: table has {len(table)} rows, expected one per rank ({n}).")
    position: dict[tuple[str, int, int], tuple[int, int]] = {}
    for rank, row in enumerate(table):
        for index, cell in enumerate(row):
            if not isinstance(cell, (Action, FusedAction)):
                raise ScheduleError(
                    f"{name}: rank {rank} cell {index} is {cell!r}, not an Action or FusedAction."
                )
            for a in cell.parts:
                where = f"{name}: rank {rank} cell {index} ({a!r})"
                if a.stage >= n_stages or a.microbatch >= m:
                    raise ScheduleError(
                        f"{where} is out of range: stages are 0..{n_stages - 1}, microbatches 0..{m - 1}."
                    )
                runs = schedule.microbatches_of(a.stage, n)
                if a.microbatch not in runs:
                    raise ScheduleError(
                        f"{where}: stage {a.stage} runs microbatches {runs.start}..{runs.stop - 1} only."
                    )
                if schedule.rank_of(a.stage, n) != rank:
                    raise ScheduleError(
                        f"{where}: stage {a.stage} lives on rank "
                        f"{schedule.rank_of(a.stage, n)}, not on rank {rank}."
                    )
                key = (a.kind, a.stage, a.microbatch)
                if key in position:
                    raise ScheduleError(f"{where} appears twice (first at {position[key]}).")
                position[key] = (rank, index)
    for s in range(n_stages):
        for mb in schedule.microbatches_of(s, n):
            _check_pair(name, position, s, mb)


def _check_pair(name, position, s, mb) -> None:
    has = {k: (k, s, mb) in position for k in KINDS}
    what = f"{name}: (stage {s}, microbatch {mb})"
    if not has["F"]:
        raise ScheduleError(f"{what} has no F action; every pair needs exactly one F.")
    if has["B"] == (has["I"] or has["W"]) or has["I"] != has["W"]:
        got = [k for k in "BIW" if has[k]]
        raise ScheduleError(f"{what} has backward actions {got}; it needs exactly one B, or one I and one W.")
    f_at = position[("F", s, mb)]
    first_bwd = position[("B", s, mb)] if has["B"] else position[("I", s, mb)]
    if f_at >= first_bwd:
        raise ScheduleError(
            f"{what}: its F must come before its B/I in the rank's order (F at rank {f_at[0]} cell "
            f"{f_at[1]}, B/I at cell {first_bwd[1]})."
        )
    if has["I"] and position[("I", s, mb)] >= position[("W", s, mb)]:
        i_at, w_at = position[("I", s, mb)], position[("W", s, mb)]
        raise ScheduleError(
            f"{what}: its I must come before its W in the rank's order (I at rank {i_at[0]} cell "
            f"{i_at[1]}, W at cell {w_at[1]})."
        )


def _check_layout(schedule, n: int) -> None:
    name = type(schedule).__name__
    owner: dict[int, int] = {}
    for rank in range(n):
        stages = schedule.stages_of(rank, n)
        if stages != tuple(schedule.stage_of(rank, c, n) for c in range(len(stages))):
            raise ScheduleError(f"{name}: stages_of({rank}) disagrees with stage_of.")
        for s in stages:
            if s in owner or schedule.rank_of(s, n) != rank:
                raise ScheduleError(
                    f"{name}: stage {s} layout is inconsistent (rank_of says "
                    f"{schedule.rank_of(s, n)}, held by rank {rank}"
                    + (f" and rank {owner[s]})." if s in owner else ").")
                )
            owner[s] = rank
    n_stages = schedule.num_stages(n)
    if sorted(owner) != list(range(n_stages)):
        raise ScheduleError(f"{name}: the ranks do not hold every stage 0..{n_stages - 1} once.")
