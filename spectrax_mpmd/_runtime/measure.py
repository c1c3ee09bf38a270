"""Measurements of one step: its timeline, its peak live activations and bytes per rank.

Each replays the plan once (`replay`). Bytes are per rank: an array's bytes on
a rank are its largest per-device shard there (a replicated array counts once
per device, a sharded one its shard). A rank's live bytes are sampled between
actions (a cell with the sends after it), after the setup that creates the
accumulators, over every array alive on its devices: parameters and the batch
(alive for the whole step: the caller holds them), accumulators, and the
activations, residuals, stashes and cotangents in flight. Temporaries inside a
cell are not counted. Device and host memory are counted apart, by each array's
memory kind (`pinned_host` and `unpinned_host` are host memory): offloaded
residuals and stashes are host bytes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import jax
import numpy as np

from spectrax_core.schedules import Cost, Event, StageMemory, Timeline

from .._trace.policy import saved_bytes
from .clock import FINE_S, moves, process_clock_step
from .replay import replay
from .slots import (
    Activation,
    CellKind,
    Cotangent,
    GradAccumulator,
    Input,
    LossAccumulator,
    MicrobatchIndex,
    Offloaded,
    Residual,
    Stash,
    ZeroGrad,
)

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def clock_named(clock: str, where: str):
    """The timer `clock` names: `"wall"` (elapsed time) or `"cpu"` (this process's CPU time, all
    its threads: what a cell computes, without the waits another process's load adds), refused
    where that clock is too coarse to time a cell."""
    if clock not in CLOCKS:
        raise ValueError(f"{where}: clock must be 'wall' or 'cpu', received {clock!r}.")
    if clock == "cpu" and process_clock_step() > FINE_S:
        raise ValueError(
            f"{where}: clock='cpu' times each cell on this process's CPU clock, which on this machine "
            f"{moves(process_clock_step())}: too coarse to time a cell. Pass clock='wall'."
        )
    return CLOCKS[clock]


def action_spans(
    plan, placed_inputs: Sequence, clock: str = "wall"
) -> list[tuple[int, object, float, float]]:
    """Run once, each step alone (waiting for its results), and return per action
    `(rank, action, start, end, kind)` in seconds of `clock` from the first step: the cell and
    the sends that follow it; `kind` names the cell the plan ran (a `CellKind`, `FB` for the
    loss stage's fused forward and backward, `&`-joined when fused). Slower than `run`; for
    inspecting where a step's time goes."""
    plan.check_single_process("timeline")
    now = clock_named(clock, "timeline")
    owner = {k: j for j, (_, _, a, b) in enumerate(plan.action_steps) for k in range(a, b)}
    spans: dict[int, list[float]] = {}
    t0 = None

    def call(k, fn, args):
        nonlocal t0
        start = now()
        t0 = start if t0 is None else t0
        results = jax.block_until_ready(fn(*args))
        end = now()
        if k in owner:
            span = spans.setdefault(owner[k], [start - t0, end - t0])
            span[1] = end - t0
        return results

    replay(plan, placed_inputs, call=call, ready=True)
    return [(*plan.action_steps[j][:2], *spans[j], plan.log[j][2]) for j in sorted(spans)]


def measured_timeline(
    spans: Sequence[tuple[int, object, float, float, str]],
    n: int,
    name: str,
    stage_labels: tuple[str, ...] = (),
) -> Timeline:
    """`(rank, action, start_s, end_s, kind)` spans (`action_spans`) as a
    `spectrax_core.schedules.Timeline` in microseconds, each event named by the cell it ran."""
    rows: list[list[Event]] = [[] for _ in range(n)]
    for rank, action, start, end, kind in spans:
        rows[rank].append(Event(rank, action, start * 1e6, end * 1e6, str(kind)))
    makespan = max((e.end for row in rows for e in row), default=0.0)
    busy = tuple(sum(e.end - e.start for e in row) for row in rows)
    idle = tuple(makespan - b for b in busy)
    return Timeline(
        schedule_name=f"{name} (measured)",
        n=n,
        cost=Cost(),
        events=tuple(tuple(row) for row in rows),
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_fraction=sum(idle) / (n * makespan) if makespan else 0.0,
        peak_activations=(0,) * n,
        stage_labels=stage_labels,
    )


def peak_activations(plan, placed_inputs: Sequence) -> list[int]:
    """Run once, counting per rank the `(stage, microbatch)` pairs whose activation buffers
    are alive after each step; returns the peaks. Counted buffers: saved residuals and the
    I/W stash, or with `remat=True` the stage inputs kept for the backward — from the
    forward that consumes them on (a received input waiting for its forward is not counted)."""
    plan.check_single_process("peak_activations")
    ranks = 1 + max(plan.stage_ranks)
    peak = [0] * ranks
    started: set = set()

    def stored(k, buf):
        started.update(plan.forward_steps.get(k, ()))
        live = {
            owner
            for slot, owner in plan.activation_slots.items()
            if buf[slot] is not None and owner[1:] in started
        }
        for r in range(ranks):
            peak[r] = max(peak[r], sum(1 for owner in live if owner[0] == r))

    replay(plan, placed_inputs, stored=stored)
    return peak


class Sizer:
    """Per-rank bytes of one array (its largest per-device shard on that rank), memoised by
    shape, dtype and sharding."""

    def __init__(self, device_rank: dict):
        self.device_rank = device_rank
        self.memo: dict = {}

    def __call__(self, array) -> dict[int, int]:
        key = (array.shape, array.dtype, array.sharding)
        hit = self.memo.get(key)
        if hit is None:
            per_device = (
                int(math.prod(array.sharding.shard_shape(array.shape))) * np.dtype(array.dtype).itemsize
            )
            hit = {}
            for device in array.sharding.device_set:
                rank = self.device_rank.get(device)
                if rank is not None:
                    hit[rank] = per_device
            self.memo[key] = hit
        return hit


HOST_KINDS = frozenset({"pinned_host", "unpinned_host"})


def memory_kind(array) -> str:
    """`"host"` for an array in host memory (pinned or not), else `"device"`."""
    return "host" if array.sharding.memory_kind in HOST_KINDS else "device"


def _live(buffers, sizer: Sizer, ranks: int) -> dict[str, list[int]]:
    """Bytes per memory kind and rank of every distinct array in `buffers` (shards are even, so
    every device of a rank holds the same)."""
    total = {"device": [0] * ranks, "host": [0] * ranks}
    seen: set = set()
    for array in buffers:
        if array is None or id(array) in seen or array.is_deleted():  # donated: its buffer is reused
            continue
        seen.add(id(array))
        kind = total[memory_kind(array)]
        for rank, nbytes in sizer(array).items():
            kind[rank] += nbytes
    return total


def measure_peak_bytes(plan, placed_inputs: Sequence) -> tuple[int, ...]:
    """Run `plan` once and return, per rank, the most device bytes alive between actions (see
    `measure_peak_bytes_by_kind`)."""
    return measure_peak_bytes_by_kind(plan, placed_inputs)["device"]


def measure_peak_bytes_by_kind(plan, placed_inputs: Sequence) -> dict[str, tuple[int, ...]]:
    """Run `plan` once and return, per memory kind (`"device"`, `"host"`) and rank, the most bytes
    alive between actions (and between the steps after the schedule: the gradient reduction, an
    optimizer update): the plan's buffers, and the placed arguments and constants, which stay
    alive (held by the caller and the plan) after the plan's last read of them unless a step
    consumed them (donation)."""
    ranks = 1 + max(plan.stage_ranks)
    sizer = Sizer(plan.device_rank)
    samples = {b - 1 for _, _, a, b in plan.action_steps if b > a}
    samples.add(min((a for _, _, a, _ in plan.action_steps), default=len(plan.steps)) - 1)
    samples.update(range(max((b for *_, b in plan.action_steps), default=0), len(plan.steps)))
    held = [*placed_inputs, *plan.const_slots.values()]
    peaks = {"device": [0] * ranks, "host": [0] * ranks}

    def freed(k, buf):
        if k in samples:
            for kind, live in _live(held + buf, sizer, ranks).items():
                peaks[kind] = [max(p, q) for p, q in zip(peaks[kind], live)]

    replay(plan, placed_inputs, freed=freed)
    return {kind: tuple(values) for kind, values in peaks.items()}


def _memory_kind(key, plan) -> tuple[str, str, int] | None:
    """How `stage_memory` counts the buffer named `key`: `("rank", group, rank)` for a
    whole-step buffer, `("microbatch", what, stage)` for a per-microbatch one."""
    if isinstance(key, Input):
        return ("rank", "params" if key.kind == "param" else "other", key.rank)
    if isinstance(key, MicrobatchIndex):
        return ("rank", "other", key.rank)
    if isinstance(key, GradAccumulator):
        return ("rank", "accumulators", plan.stage_ranks[key.stage])
    if isinstance(key, LossAccumulator):
        return ("rank", "accumulators", plan.stage_ranks[key.stage])
    if isinstance(key, ZeroGrad):
        return ("rank", "accumulators", plan.stage_ranks[0])
    if isinstance(key, (Residual, Stash)):
        return ("microbatch", "residuals" if isinstance(key, Residual) else "stash", key.stage)
    if isinstance(key, Offloaded):
        return ("microbatch", f"host_{key.kind}", key.stage)
    if isinstance(key, Cotangent):
        return ("microbatch", "grads", plan.graph.edges[key.edge].src)
    return None


def buffer_sizes(plan, placed_inputs: Sequence) -> dict[int, tuple[int, int]]:
    """Run `plan` once; per slot, `(bytes on its rank's most loaded device, saved-value bytes as
    offload selection counts them)` of the first array it held."""
    sizer = Sizer(plan.device_rank)
    sizes: dict[int, tuple[int, int]] = {}

    def note(slot: int, array) -> None:
        if array is not None and slot not in sizes:
            sizes[slot] = (max(sizer(array).values(), default=0), saved_bytes(array))

    def stored(k, buf):
        for o in plan.steps[k].outs:
            note(o, buf[o])

    def start(k, buf):
        if k == -1:
            for slot, array in enumerate(buf):
                note(slot, array)

    replay(plan, placed_inputs, stored=stored, freed=start)
    return sizes


def saved_values(plan, sizes: dict) -> tuple[tuple[tuple, tuple], ...]:
    """Per stage, `(residuals, stash)`: for each value its forward saves (its I cell stashes) for
    one microbatch, `(selection bytes, device bytes)`, in order, wherever it lives."""
    found: dict = {}
    for slot, key in plan.slot_names.items():
        if isinstance(key, (Residual, Stash)) and key.microbatch == 0 and slot in sizes:
            found[(type(key), key.stage, key.k)] = sizes[slot]
    return tuple(
        tuple(
            tuple(found[(kind, s, k)] for k in range(plan.saved.get((s, cell), 0)) if (kind, s, k) in found)
            for kind, cell in ((Residual, CellKind.FORWARD), (Stash, CellKind.INPUT_GRAD))
        )
        for s in range(len(plan.stage_ranks))
    )


def stage_memory(plan, placed_inputs: Sequence = (), sizes: dict | None = None) -> StageMemory:
    """The plan's `StageMemory` (optimizer state zero), from the sizes of the buffers one run makes
    (`sizes` from `buffer_sizes`, else measured here).

    Each buffer is classified by the slot it fills: parameters, the batch and other
    arguments, accumulators; per (stage, microbatch) residuals, stashes (in device or,
    offloaded, in host memory), received activations (kept for the backward or not) and
    received cotangents. A stage's figure is its largest microbatch's.
    """
    ranks = 1 + max(plan.stage_ranks)
    if sizes is None:
        sizes = buffer_sizes(plan, placed_inputs)
    per_rank = {name: [0] * ranks for name in ("params", "accumulators", "other")}
    per_mb: dict[tuple[str, int, int], int] = {}
    moved = {
        (Residual if key.kind == "residuals" else Stash)(key.stage, key.microbatch, key.k)
        for key in plan.slot_names.values()
        if isinstance(key, Offloaded)
    }
    written = {slot for step in plan.steps for slot in step.outs}
    for slot, key in plan.slot_names.items():
        if key in moved:  # on the device only within its cell's action: counted in host memory
            continue
        nbytes = sizes.get(slot, (0, 0))[0]
        if slot in plan.const_slots and slot in written:  # an accumulator's start: the plan keeps it
            nbytes *= 2
        if isinstance(key, Activation):
            kind = (
                "microbatch",
                "kept_inputs" if slot in plan.activation_slots else "inputs",
                plan.graph.edges[key.edge].dst,
            )
        else:
            kind = _memory_kind(key, plan)
        if kind is None:
            continue
        scope, what, where = kind
        if scope == "rank":
            per_rank[what][where] += nbytes
        else:
            per_mb[(what, where, key.microbatch)] = per_mb.get((what, where, key.microbatch), 0) + nbytes
    names = ("inputs", "kept_inputs", "residuals", "grads", "stash", "host_residuals", "host_stash")
    per_stage = {name: [0] * len(plan.stage_ranks) for name in names}
    for (what, stage, _), nbytes in per_mb.items():
        per_stage[what][stage] = max(per_stage[what][stage], nbytes)
    return StageMemory(
        **{name: tuple(v) for name, v in per_stage.items()},
        params=tuple(per_rank["params"]),
        accumulators=tuple(per_rank["accumulators"]),
        optimizer=(0,) * ranks,
        other=tuple(per_rank["other"]),
    )
