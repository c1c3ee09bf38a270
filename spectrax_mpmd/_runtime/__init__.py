"""Running a plan: its steps as straight-line code (`Plan.run`), one instrumented replay, and
the measurements built on it (timelines, peak activations and bytes, the host and stage
profiles)."""

from .clock import IssueClock, issue_clock
from .host_profile import HostProfile, HostRow, host_profile
from .measure import (
    action_spans,
    measure_peak_bytes,
    measure_peak_bytes_by_kind,
    measured_timeline,
    peak_activations,
    stage_memory,
)
from .plan import Plan, Step
from .slots import CellKind, InputKind, Output
from .stage_profile import CellProfile, StageProfile, stage_profile

__all__ = [
    "IssueClock",
    "issue_clock",
    "HostProfile",
    "HostRow",
    "host_profile",
    "action_spans",
    "measure_peak_bytes",
    "measure_peak_bytes_by_kind",
    "measured_timeline",
    "peak_activations",
    "stage_memory",
    "Plan",
    "CellKind",
    "InputKind",
    "Output",
    "Step",
    "CellProfile",
    "StageProfile",
    "stage_profile",
]
