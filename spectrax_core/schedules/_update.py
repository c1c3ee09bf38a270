"""The optimizer update after a simulated step: when each rank's update runs, and when the step ends.

A training step that updates inside the schedule ends when the last rank's
update ends. When the update starts depends on its validation (the one name
for what gates it, as `sxvalue_and_grad_and_apply(validation=)` says it):

* `"none"`: nothing global gates the update (it reads no other rank's
  gradients): each rank updates right after its own last cell;
* `"sync"`: a global condition (a gradient norm for clipping, a finiteness
  check): each rank's partial result crosses to one rank and the verdict comes
  back (two transfers), so every rank waits for the last backward of all;
* `"post"`: each rank updates speculatively right after its own last cell and
  then waits for the verdict to validate it (`validate` long) — a step where
  the verdict triggers pays the update again, which `with_update` does not model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._timeline import Timeline

VALIDATIONS = ("none", "sync", "post")


@dataclass(frozen=True)
class UpdatedStep:
    """A simulated step with its update: per rank, when the update ran; the step's end, and the
    schedule's own makespan before any update."""

    timeline: Timeline
    validation: str
    spans: tuple[tuple[float, float], ...]
    makespan: float

    @property
    def update_share(self) -> float:
        """The fraction of the step spent after the schedule's last cell."""
        return (self.makespan - self.timeline.makespan) / self.makespan if self.makespan else 0.0


def with_update(
    timeline: Timeline,
    apply: float | Sequence[float],
    *,
    validation: str = "none",
    validate: float = 0.0,
) -> UpdatedStep:
    """`timeline` followed by each rank's update of duration `apply` (one per rank, or the same
    for all), gated as `validation` (one of `VALIDATIONS`) says; the verdict's two transfers cost
    `timeline.cost.comm` each."""
    if validation not in VALIDATIONS:
        raise ValueError(f"with_update: validation must be one of {VALIDATIONS}, got {validation!r}.")
    n = timeline.n
    costs = [float(apply)] * n if isinstance(apply, (int, float)) else [float(a) for a in apply]
    if len(costs) != n:
        raise ValueError(f"with_update: {len(costs)} update durations for {n} ranks; give one per rank.")
    ends = [row[-1].end if row else 0.0 for row in timeline.events]
    verdict = max(ends) + 2 * float(timeline.cost.comm)
    spans, finish = [], []
    for end, cost in zip(ends, costs):
        start = verdict if validation == "sync" else end
        spans.append((start, start + cost))
        finish.append(max(start + cost, verdict) + validate if validation == "post" else start + cost)
    return UpdatedStep(timeline, validation, tuple(spans), max(finish))
