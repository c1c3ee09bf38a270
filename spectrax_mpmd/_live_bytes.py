"""Bytes a training plan holds: per rank over a real step, and per stage and microbatch.

Bytes are per device: an array counts, on each device of its sharding, the
size of its shard there, and a rank's figure is its most loaded device (a rank
whose submesh has several devices holds a shard of each array on each). A rank's
live bytes are sampled between actions (a cell with the sends after it), after
the setup that creates the accumulators, over every array alive on its devices:
parameters and the batch (alive for the whole step: the caller holds them),
accumulators, and the activations, residuals, stashes and cotangents in flight.
Temporaries inside a cell are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from spectrax_core.schedules import StageMemory


class _Sizer:
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


def _live(buffers, sizer: _Sizer, ranks: int) -> list[int]:
    """Bytes per rank of every distinct array in `buffers` (shards are even, so every device of a
    rank holds the same)."""
    total = [0] * ranks
    seen: set = set()
    for array in buffers:
        if array is None or id(array) in seen:
            continue
        seen.add(id(array))
        for rank, nbytes in sizer(array).items():
            total[rank] += nbytes
    return total


def measure_peak_bytes(plan, placed_inputs: Sequence) -> tuple[int, ...]:
    """Run `plan` once and return, per rank, the most bytes alive between actions: the plan's
    buffers, and the placed arguments and constants, which stay alive (held by the caller and
    the plan) after the plan's last read of them."""
    ranks = 1 + max(plan.stage_ranks)
    sizer = _Sizer(plan.device_rank)
    samples = {b - 1 for _, _, a, b in plan.action_steps if b > a}
    samples.add(min((a for _, _, a, _ in plan.action_steps), default=len(plan.steps)) - 1)
    held = [*placed_inputs, *plan.const_slots.values()]
    buf = plan._buffers(placed_inputs)
    peaks = _live(held + buf, sizer, ranks) if -1 in samples else [0] * ranks
    for k, (fn, ins, outs, frees) in enumerate(plan.steps):
        results = fn(*[buf[i] for i in ins])
        for o, r in zip(outs, results):
            buf[o] = r
        for f in frees:
            buf[f] = None
        if k in samples:
            peaks = [max(p, q) for p, q in zip(peaks, _live(held + buf, sizer, ranks))]
    return tuple(peaks)


def stage_memory(plan, placed_inputs: Sequence) -> StageMemory:
    """The plan's `StageMemory` (optimizer state zero), from the sizes of the buffers one run makes.

    Each buffer is classified by the slot it fills: parameters, the batch and other
    arguments, accumulators; per (stage, microbatch) residuals, stashes, received
    activations (kept for the backward or not) and received cotangents. A stage's
    figure is its largest microbatch's.
    """
    ranks = 1 + max(plan.stage_ranks)
    stages = len(plan.stage_ranks)
    sizer = _Sizer(plan.device_rank)
    sizes: dict[int, int] = {}  # slot -> bytes on its rank

    def note(slot: int, array) -> None:
        if array is not None and slot not in sizes:
            sizes[slot] = max(sizer(array).values(), default=0)

    buf = plan._buffers(placed_inputs)
    for slot, array in enumerate(buf):
        note(slot, array)
    for fn, ins, outs, frees in plan.steps:
        results = fn(*[buf[i] for i in ins])
        for o, r in zip(outs, results):
            buf[o] = r
            note(o, r)
        for f in frees:
            buf[f] = None
    per_rank = {name: [0] * ranks for name in ("params", "accumulators", "other")}
    per_mb: dict[tuple[str, int, int], int] = {}
    edges = plan.graph.edges
    for slot, key in plan.slot_names.items():
        nbytes = sizes.get(slot, 0)
        kind = key if isinstance(key, str) else key[0]
        if kind in ("param", "fixed", "batch"):
            per_rank["params" if kind == "param" else "other"][key[2]] += nbytes
        elif kind == "idx":
            per_rank["other"][key[1]] += nbytes
        elif kind in ("acc", "loss", "zero_grad"):
            owner = (
                plan.stage_ranks[key[1]] if kind == "acc" else plan.stage_ranks[-1 if kind == "loss" else 0]
            )
            per_rank["accumulators"][owner] += nbytes
        elif kind in ("res", "stash"):
            what = "residuals" if kind == "res" else "stash"
            per_mb[(what, key[1], key[2])] = per_mb.get((what, key[1], key[2]), 0) + nbytes
        elif kind in ("edge", "ct"):
            e = edges[key[1]]
            if kind == "ct":
                what, stage = "grads", e.src
            else:
                what, stage = ("kept_inputs" if slot in plan.activation_slots else "inputs"), e.dst
            per_mb[(what, stage, key[2])] = per_mb.get((what, stage, key[2]), 0) + nbytes
    per_stage = {name: [0] * stages for name in ("inputs", "kept_inputs", "residuals", "grads", "stash")}
    for (what, stage, _), nbytes in per_mb.items():
        per_stage[what][stage] = max(per_stage[what][stage], nbytes)
    return StageMemory(
        **{name: tuple(v) for name, v in per_stage.items()},
        params=tuple(per_rank["params"]),
        accumulators=tuple(per_rank["accumulators"]),
        optimizer=(0,) * ranks,
        other=tuple(per_rank["other"]),
    )
