"""The planner's predictions of a step with `LengthBuckets`, whose microbatches differ in length.

`predicted_step` is the planner's prediction of the step from its cells measured one at a time
per (stage, kind, bucket), on the compute units and issuing cost a plain step measured
(`spectrax_mpmd._planner.shared`). `predicted_peaks` predicts each rank's peak device bytes:
the schedule's buffers sized per microbatch by its bucket (`BucketMemory`), each bucket's bytes
per stage profiled on a batch whose microbatches all fall in it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import jax
import numpy as np

from spectrax_core.schedules import StageMemory, simulate

from .._buckets import CellCost, key_path
from .._trace.args import positional_names
from .backend import cell_work
from .shared import shared_makespan


def measured_cells(step, args, rounds: int = 3) -> dict:
    """`(kind, stage, microbatch) -> seconds` of each cell of `step` on `args`, run one at a time
    (`measure_timeline`), the least of `rounds`; a fused cell's time is shared by its parts."""
    cells: dict = {}
    for _ in range(rounds):
        for row in step.measure_timeline(*args).events:
            for e in row:
                parts = e.cell.parts
                for a in parts:
                    seconds = (e.end - e.start) * 1e-6 / len(parts)
                    key = (a.kind, a.stage, a.microbatch)
                    cells[key] = min(cells.get(key, seconds), seconds)
    return cells


def predicted_step(
    schedule, n: int, cells: Mapping, units: float, issue_s: float, shares_host: bool
) -> float:
    """Predicted seconds of `schedule` on `n` ranks whose cells took `cells` (`measured_cells`),
    each doing its time less its issuing `issue_s`, on `units` compute units shared as
    `shared_makespan` says."""
    work = {key: cell_work((t,), issue_s) for key, t in cells.items()}
    cost = CellCost.of_cells(work, schedule.num_stages(n))
    return shared_makespan(schedule, n, cost, units, issue_s, shares_host)


@dataclass(frozen=True)
class BucketMemory(StageMemory):
    """A `StageMemory` whose microbatch `i` holds `per_microbatch[i]`'s bytes per stage (its bucket's);
    the per-rank bytes are the step's own."""

    per_microbatch: tuple = ()

    def of(self, name: str, stage: int, microbatch: int) -> int:
        return getattr(self.per_microbatch[microbatch], name)[stage]


def within_bucket(step, args, length: int) -> tuple:
    """`args` (a call of `step`, a step with `LengthBuckets`) with every padded leaf of its batch
    arguments cut to `length` and the row lengths clipped to it: a batch whose microbatches all
    fall in that bucket."""
    settings = step.settings
    buckets, axis = settings.length_buckets, settings.length_buckets.axis
    batch = [k for k in range(len(args)) if k not in settings.positions and k not in settings.static_argnums]
    long = [x for k in batch for x in jax.tree.leaves(args[k]) if np.ndim(x) > axis]
    padded = max(np.shape(x)[axis] for x in long)

    where = buckets.path(step.name, positional_names(step.fn))

    def cut(path, x):
        if key_path(path) == where:
            return np.minimum(np.asarray(x), length).astype(np.int32)
        if path[0].idx in batch and np.ndim(x) > axis and np.shape(x)[axis] == padded:
            return np.asarray(x)[(slice(None),) * axis + (slice(0, length),)]
        return x

    return jax.tree_util.tree_map_with_path(cut, tuple(args))


def bucket_memory(step, args, optimizer_states: float = 0.0) -> BucketMemory:
    """The `BucketMemory` of `step` on `args`: per stage, each microbatch's bucket's bytes (profiled
    on `within_bucket` batches), per rank the step's own (its parameters, accumulators, and the
    batch it places: each microbatch's leaves at its length)."""
    own = step.profile_stages(*args, rounds=1).stage_memory(optimizer_states)
    lengths = step.bucket_summary(*args).lengths
    by_length = {
        length: step.profile_stages(*within_bucket(step, args, length), rounds=1).memory
        for length in set(lengths)
    }
    per_stage = {f.name: getattr(by_length[lengths[0]], f.name) for f in fields(StageMemory)}
    per_rank = {name: getattr(own, name) for name in ("params", "accumulators", "optimizer", "other")}
    return BucketMemory(**{**per_stage, **per_rank}, per_microbatch=tuple(by_length[k] for k in lengths))


def predicted_peaks(step, args, optimizer_states: float = 0.0) -> tuple[int, ...]:
    """Each rank's predicted peak device bytes of `step` (a step with `LengthBuckets`) on `args`."""
    memory = bucket_memory(step, args, optimizer_states)
    return simulate(step.settings.schedule, step.mesh.mpmd_dim, memory=memory).peak_bytes
