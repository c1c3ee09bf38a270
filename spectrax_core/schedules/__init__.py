"""Pipeline schedules as pure tables: build, validate, simulate, render.

Nine schedules — `GPipe`, `Std1F1B`, `Eager1F1B`, `ZeroBubbleH1`,
`InterleavedH1`, `InterleavedGPipe`, `Interleaved1F1BPlusOne`, `DualPipeV`,
`KimiK2` — each a frozen dataclass built as `Schedule(microbatches=m)` (loop
schedules also take `virtual_stages=v`); five more (`MORE_SCHEDULES`):
`ZeroBubbleH2`, `ZBV`, `VHalf`, `VMin` and the bidirectional `DualPipe`. Tables
written by hand are `UserSchedule`s (rows, text or CSV); `search` builds one for
measured stage costs under a memory budget. `schedule.actions(n)` is the table:
one tuple per rank of `Action` / `FusedAction` cells in execution order.
`simulate` runs a table on a `Cost` model (and a `StageMemory` for bytes); `render_grid` and `chrome_trace`
show the result. `Flow` says what each cell waits for and `issue_order` walks a table in
that order (the simulator, the memory model, the region merge and the MPMD runtime share
both). A table has a text form: `format_table` writes it, `parse_table` reads it back
(`Action.parse("2F3")` is stage 2, forward, microbatch 3); `format_torch_csv` and
`parse_torch_csv` / `read_torch_csv` write and read PyTorch's schedule CSV. See docs/schedules.md.
"""

from ._actions import Action, FusedAction, ScheduleError, check_table
from ._base import Schedule
from ._dualpipe import DualPipe, DualPipeV
from ._flat import Eager1F1B, GPipe, Std1F1B, ZeroBubbleH1
from ._flow import DeadlockError, Dependency, Flow, Stuck, issue_order
from ._interleaved import Interleaved1F1BPlusOne, InterleavedGPipe, InterleavedH1, KimiK2
from ._memory import StageMemory, peak_bytes
from ._regions import Region, RegionSchedule, region_labels
from ._render import chrome_trace, render_grid, save_chrome_trace
from ._search import BudgetError, SearchedSchedule, search
from ._simulate import simulate, validate
from ._text import format_table, parse_cell, parse_table
from ._timeline import Cost, Event, StageCost, Timeline
from ._torch_csv import format_torch_csv, parse_torch_csv, read_torch_csv
from ._update import VALIDATIONS, UpdatedStep, with_update
from ._user import UserSchedule
from ._zb_h2 import ZeroBubbleH2
from ._zero_bubble_v import ZBV, VHalf, VMin

ALL_SCHEDULES = (
    GPipe,
    Std1F1B,
    Eager1F1B,
    ZeroBubbleH1,
    InterleavedH1,
    InterleavedGPipe,
    Interleaved1F1BPlusOne,
    DualPipeV,
    KimiK2,
)
MORE_SCHEDULES = (ZeroBubbleH2, ZBV, VHalf, VMin, DualPipe)

__all__ = [
    "UpdatedStep",
    "with_update",
    "VALIDATIONS",
    "GPipe",
    "Std1F1B",
    "Eager1F1B",
    "ZeroBubbleH1",
    "InterleavedH1",
    "InterleavedGPipe",
    "Interleaved1F1BPlusOne",
    "DualPipeV",
    "KimiK2",
    "ALL_SCHEDULES",
    "ZeroBubbleH2",
    "ZBV",
    "VHalf",
    "VMin",
    "DualPipe",
    "MORE_SCHEDULES",
    "UserSchedule",
    "SearchedSchedule",
    "search",
    "BudgetError",
    "Schedule",
    "Region",
    "RegionSchedule",
    "region_labels",
    "Action",
    "FusedAction",
    "ScheduleError",
    "DeadlockError",
    "Flow",
    "Dependency",
    "Stuck",
    "issue_order",
    "Cost",
    "StageCost",
    "StageMemory",
    "peak_bytes",
    "Event",
    "Timeline",
    "simulate",
    "validate",
    "check_table",
    "parse_cell",
    "parse_table",
    "format_table",
    "format_torch_csv",
    "parse_torch_csv",
    "read_torch_csv",
    "render_grid",
    "chrome_trace",
    "save_chrome_trace",
]
