"""Per-stage profile of a pipelined training step: what XLA says of each compiled cell, the
bytes each rank holds and each edge carries, and each cell's measured time.

The runtime compiles one program per stage and cell kind, so XLA's own cost and
memory analysis of those programs describe the step exactly; a short timed run
(each action alone, waited for) adds what the cells cost on these devices.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from spectrax_core.schedules import StageCost, StageMemory

from .measure import action_spans, buffer_sizes, saved_values, stage_memory
from .slots import CellKind, GradAccumulator


@dataclass(frozen=True)
class CellProfile:
    """One stage's cell of one kind (`F`, `B`, `I`, `W`, or the last stage's fused `FB`).

    `flops` and `bytes_accessed` come from XLA's cost analysis; `argument_bytes`,
    `output_bytes` and `temp_bytes` from its memory analysis; `saved_bytes` is
    what one microbatch leaves behind for later (a forward's residuals, an I
    cell's stash for W); `seconds` is the measured time of the action alone with
    its sends (the least over microbatches and timed rounds: other load on the
    machine only ever adds time), None when the cell only ran fused with another.
    """

    stage: int
    rank: int
    kind: str
    flops: float
    bytes_accessed: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    saved_bytes: int
    seconds: float | None
    mean_seconds: float | None = None


@dataclass(frozen=True)
class StageProfile:
    """The profile of one step: cells, per-rank parameter and accumulator bytes, edge bytes.

    `param_bytes[r]` counts the parameter leaves rank r reads (each once);
    `accumulator_bytes[r]` the gradient accumulators (and loss) it holds during a
    step; `edges` is `(source stage, destination stage, bytes per microbatch)`;
    `memory` the bytes per stage and microbatch and per rank, on one device of
    each rank (see `stage_memory`); `stage_param_bytes[s]` the parameters stage s reads (a leaf read by several
    stages counts in each); `saved_values[s]` is `(residuals, stash)`, for each value stage s's
    forward saves (I cell stashes) per microbatch its `(selection bytes, device bytes)`: what the
    memory model needs to place any offload choice (`spectrax_mpmd._trace.policy.offloaded`).
    """

    cells: tuple[CellProfile, ...]
    param_bytes: tuple[int, ...]
    accumulator_bytes: tuple[int, ...]
    edges: tuple[tuple[int, int, int], ...]
    memory: StageMemory
    stage_param_bytes: tuple[int, ...]
    saved_values: tuple = ()

    def stage_memory(self, optimizer_states: float = 0.0) -> StageMemory:
        """The profiled bytes as a `spectrax_core.schedules.StageMemory`, for `simulate(memory=)`.

        `optimizer_states` estimates the optimizer's state as that many copies of each
        rank's parameters (0: plain SGD, 1: momentum, 2: Adam's two moments).
        """
        if (
            isinstance(optimizer_states, bool)
            or not isinstance(optimizer_states, (int, float))
            or optimizer_states < 0
        ):
            raise ValueError(
                f"stage_memory: optimizer_states must be a non-negative number (2 for Adam), "
                f"received {optimizer_states!r}."
            )
        return replace(
            self.memory, optimizer=tuple(int(round(optimizer_states * p)) for p in self.memory.params)
        )

    def cell(self, stage: int, kind: str) -> CellProfile:
        return next(c for c in self.cells if c.stage == stage and c.kind == kind)

    def stage_cost(self, comm: float = 0.0, statistic: str = "min") -> StageCost:
        """The measured cell times as a `spectrax_core.schedules.StageCost` (seconds), for
        `simulate` with any schedule over the same stages.

        `statistic="min"` takes each cell's least time (a lower bound, steady under other
        load: good for comparing schedules); `"mean"` its average time, whose sums predict
        what a step's ranks are busy for (a median would not: other load skews cell times
        upwards, so the median of each cell sums to less than the cells take).

        The last stage's fused loss cell is its F (its B, I and W are then 0). A stage
        profiled with a full backward gets `I = W = B / 2`; one profiled with split
        I and W cells gets `B = I + W` (a stage without an I cell has I = 0).
        """
        if statistic not in ("min", "mean"):
            raise ValueError(f"stage_cost: statistic must be 'min' or 'mean', received {statistic!r}.")
        field = "seconds" if statistic == "min" else "mean_seconds"
        measured = {(c.stage, c.kind): getattr(c, field) for c in self.cells}
        last = max(c.stage for c in self.cells)
        rows: list[tuple[float, float, float, float]] = []
        for s in range(last + 1):
            if s == last:
                f, b, i, w = self._seconds(measured, s, CellKind.LOSS), 0.0, 0.0, 0.0
            elif (s, CellKind.BACKWARD) in measured:
                f, b = (
                    self._seconds(measured, s, CellKind.FORWARD),
                    self._seconds(measured, s, CellKind.BACKWARD),
                )
                i = w = b / 2
            else:
                f, w = (
                    self._seconds(measured, s, CellKind.FORWARD),
                    self._seconds(measured, s, CellKind.WEIGHT_GRAD),
                )
                has_i = (s, CellKind.INPUT_GRAD) in measured
                i = self._seconds(measured, s, CellKind.INPUT_GRAD) if has_i else 0.0
                b = i + w
            rows.append((f, b, i, w))
        return StageCost(*(tuple(column) for column in zip(*rows)), comm=comm)

    @staticmethod
    def _seconds(measured: dict, stage: int, kind: str) -> float:
        seconds = measured.get((stage, kind))
        if seconds is None:
            raise ValueError(
                f"stage_cost: stage {stage}'s {kind} cell has no measured time (it ran only fused, or "
                "not at all); profile the step with a schedule that runs it alone, e.g. Std1F1B."
            )
        return seconds

    def as_dict(self) -> dict:
        return {
            "cells": [asdict(c) for c in self.cells],
            "param_bytes": list(self.param_bytes),
            "accumulator_bytes": list(self.accumulator_bytes),
            "edges": [list(e) for e in self.edges],
            "memory": self.memory.as_dict(),
            "stage_param_bytes": list(self.stage_param_bytes),
            "saved_values": [[list(map(list, kind)) for kind in stage] for stage in self.saved_values],
        }

    def table(self) -> str:
        head = f"{'stage':>5} {'rank':>4} {'kind':4} {'MFLOP':>9} {'MB accessed':>11} {'temp KB':>8} {'saved KB':>9} {'ms':>8}"
        lines = [head]
        for c in self.cells:
            ms = "n/a" if c.seconds is None else f"{c.seconds * 1e3:.3f}"
            lines.append(
                f"{c.stage:>5} {c.rank:>4} {c.kind:4} {c.flops / 1e6:>9.2f} {c.bytes_accessed / 1e6:>11.3f} "
                f"{c.temp_bytes / 1e3:>8.1f} {c.saved_bytes / 1e3:>9.1f} {ms:>8}"
            )
        for r, (p, a) in enumerate(zip(self.param_bytes, self.accumulator_bytes)):
            lines.append(f"rank {r}: parameters {p / 1e6:.3f} MB, gradient accumulators {a / 1e6:.3f} MB")
        return "\n".join(lines)


def _nbytes(aval) -> int:
    return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    return cost or {}


def _cell_seconds(plan, spans) -> dict:
    """`(stage, kind) -> seconds of each` single-part action among one round's spans."""
    times: dict = {}
    for rank, action, start, end, _ in spans:
        parts = getattr(action, "parts", None)
        if parts is None or len(parts) != 1:
            continue
        part = parts[0]
        loss = (part.stage, CellKind.LOSS) in plan.cells
        kind = CellKind.LOSS if loss else part.kind
        if loss and part.kind != CellKind.FORWARD:
            continue
        times.setdefault((part.stage, kind), []).append(end - start)
    return times


def stage_profile(
    plan, compile_spec, param_leaves: dict, placed_inputs, rounds: int = 3, clock: str = "wall"
) -> StageProfile:
    """The `StageProfile` of a training plan.

    `compile_spec` gives a cell spec's executable (the step's compiler),
    `param_leaves` maps each parameter leaf index to an array or ShapeDtypeStruct,
    `placed_inputs` are the plan's inputs (for the timed rounds, on `clock`: see `action_spans`).
    """
    per_cell: dict = {}
    for _ in range(rounds):
        for key, seconds in _cell_seconds(plan, action_spans(plan, placed_inputs, clock)).items():
            per_cell.setdefault(key, []).extend(seconds)
    best = {key: min(values) for key, values in per_cell.items()}
    mean = {key: float(np.mean(values)) for key, values in per_cell.items()}
    ranks = 1 + max(plan.stage_ranks)
    cells = []
    for (stage, kind), spec in sorted(plan.cells.items()):
        if (stage, kind) not in plan.ran:
            continue
        compiled = compile_spec(spec)
        memory, cost = compiled.memory_analysis(), _cost(compiled)
        kept = plan.saved.get((stage, kind), 0)
        outs = list(compiled.out_info) if kept else []
        cells.append(
            CellProfile(
                stage=stage,
                rank=plan.stage_ranks[stage],
                kind=kind,
                flops=float(cost.get("flops", 0.0)),
                bytes_accessed=float(cost.get("bytes accessed", 0.0)),
                argument_bytes=int(memory.argument_size_in_bytes),
                output_bytes=int(memory.output_size_in_bytes),
                temp_bytes=int(memory.temp_size_in_bytes),
                saved_bytes=sum(_nbytes(o) for o in outs[len(outs) - kept :]),
                seconds=best.get((stage, kind)),
                mean_seconds=mean.get((stage, kind)),
            )
        )
    params = [0] * ranks
    for _, key in plan.input_keys:
        if key.kind == "param":
            params[key.rank] += _nbytes(param_leaves[key.leaf])
    accumulators = [0] * ranks
    for _, value in plan.accumulator_starts():
        device = min(value.sharding.device_set, key=lambda d: d.id)
        accumulators[plan.device_rank[device]] += _nbytes(value)
    edges = tuple((e.src, e.dst, _nbytes(e.aval)) for e in plan.graph.edges)
    sizes = buffer_sizes(plan, placed_inputs)
    memory = stage_memory(plan, sizes=sizes)
    stage_params = [0] * len(plan.stage_ranks)
    for key in plan.slot_names.values():
        if isinstance(key, GradAccumulator):
            stage_params[key.stage] += _nbytes(param_leaves[key.leaf])
    return StageProfile(
        tuple(cells),
        tuple(params),
        tuple(accumulators),
        edges,
        memory,
        tuple(stage_params),
        saved_values(plan, sizes),
    )
