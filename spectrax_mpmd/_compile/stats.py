"""Where a first call's time goes: per-phase wall time of building a plan."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("trace", "analysis", "split", "lower", "compile", "relocate", "plan", "first_run")


@dataclass
class BuildStats:
    """Seconds per phase and program counts of one build (a first call for one signature).

    Phases: `trace` (the function to a jaxpr), `analysis` (proving the loss exact under
    microbatching, `spectrax_mpmd._trace.exact_loss`), `split` (jaxpr to stage graph),
    `lower` (each distinct cell to StableHLO), `compile` (XLA, parallel threads:
    wall time, not the sum over threads), `relocate` (serializing programs and
    loading them onto other ranks' devices), `plan` (the rest of building the
    plan: slots, schedule order, constants), `first_run` (issuing and running the
    first step). `compiled` and `relocated` count programs, `lowered` the cells lowered
    (a cell whose traced program was lowered before, on any ranks, is not lowered again).
    """

    seconds: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    compiled: int = 0
    relocated: int = 0
    lowered: int = 0
    _open: list = field(default_factory=list)

    @contextmanager
    def timed(self, phase: str):
        """Add the time spent inside to `phase`, excluding phases timed inside it."""
        start = time.perf_counter()
        self._open.append(0.0)
        try:
            yield
        finally:
            inner = self._open.pop()
            spent = time.perf_counter() - start
            self.seconds[phase] += spent - inner
            if self._open:
                self._open[-1] += spent

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.compiled = self.relocated = self.lowered = 0

    def report(self) -> dict:
        """A copy: `{"seconds": {phase: s}, "total_s": s, "compiled": k, "relocated": k}`."""
        return {
            "seconds": dict(self.seconds),
            "total_s": sum(self.seconds.values()),
            "compiled": self.compiled,
            "relocated": self.relocated,
            "lowered": self.lowered,
        }
