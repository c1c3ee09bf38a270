"""The clock that times issuing work: the calling thread's CPU time where it ticks finely enough.

Issuing a compiled call or a copy costs the host tens of microseconds. The thread's
CPU clock (`time.thread_time`) measures that without counting other processes' load,
but not every kernel keeps it finely: some sandboxed runtimes (gVisor, as on the
TPU v5e machine of `docs/measurements`) advance a thread's CPU time only at
scheduler ticks, in steps of 10 ms there, so one call reads 0 and a table of such
readings is all zeros.
`issue_clock()` measures the step of the thread clock once per process: where it
is at most `FINE_S` it returns that clock, else the wall clock (`time.perf_counter`),
which for a call that only issues work (dispatch is asynchronous) is its issue time,
waits inside the call and other load on the machine included. `IssueClock.name`
says which one a figure was taken on.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

FINE_S = 1e-5  # the coarsest step that still times one issue of tens of microseconds


def clock_step(clock: Callable[[], float], budget_s: float = 0.05, changes: int = 3) -> float:
    """The smallest step `clock` was seen to take while read in a tight loop, over its first
    `changes` changes or `budget_s` seconds of wall time, whichever ends first; `math.inf` when it
    never moved (a clock that does not run)."""
    steps, deadline = [], time.perf_counter() + budget_s
    last = clock()
    while len(steps) < changes and time.perf_counter() < deadline:
        now = clock()
        if now != last:
            steps.append(now - last)
            last = now
    return min(steps, default=math.inf)


@dataclass(frozen=True)
class IssueClock:
    """The clock issuing is timed on (`now()` in seconds), its name (`"thread CPU"` or `"wall"`)
    and the measured step of this machine's thread CPU clock, which decided it."""

    now: Callable[[], float]
    name: str
    cpu_step_s: float

    @property
    def note(self) -> str:
        """Why the wall clock times issuing here (empty on the thread CPU clock)."""
        if self.name == "thread CPU":
            return ""
        return (
            f"this machine's thread CPU clock {moves(self.cpu_step_s)}, too coarse for one issue: "
            "issuing is timed on the wall clock, waits and other load included"
        )


def moves(step_s: float) -> str:
    """How a clock of step `step_s` moves, in words."""
    return f"moves in steps of {step_s * 1e3:g} ms" if math.isfinite(step_s) else "did not move"


@functools.cache
def process_clock_step() -> float:
    """The measured step of this process's CPU clock (`time.process_time`), once per process."""
    return clock_step(time.process_time)


@functools.cache
def issue_clock() -> IssueClock:
    """This process's `IssueClock` (see the module docstring), measured on first use."""
    step = clock_step(time.thread_time)
    if step <= FINE_S:
        return IssueClock(time.thread_time, "thread CPU", step)
    return IssueClock(time.perf_counter, "wall", step)
