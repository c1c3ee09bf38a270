"""One step of the main job (`examples/train_lm.py`) measured beside training: run cell by cell as a
timeline (a Chrome trace), the schedule simulated from its cell times with each rank's optimizer
update, and with --details the schedule's grid, the host cost per rank and cell kind, and each rank's
predicted and measured peak memory. Measurements run the plan step by step, in one process."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import _plots
import jax
import numpy as np
import optax

from spectrax_core import schedules


@dataclass(frozen=True)
class Measured:
    """What `measure_step` measured (None where it did not run): the cell-by-cell timeline, the
    schedule simulated from its cell times, the same with the update, and with --details the host
    profile and the peak bytes."""

    timeline: object = None
    simulated: object = None
    updated: object = None
    host: object = None
    peaks: dict | None = None


def measure_step(step, schedule, stages: int, tx, devices, call: tuple, out: Path, details: bool) -> Measured:
    """Run one update of `step` (an `mp.runner` step over `stages` ranks, on `devices`) cell by cell
    on `call` (params, optimizer state, tokens, targets), write its trace to `out`/timeline.json and
    print the simulated bubble; with `details` also the grid, the host cost and the peaks."""
    params, state, tokens, targets = call
    update = step.runner.update_step
    timeline = update.measure_timeline(params, state, None, tokens, targets)
    trace = out / "timeline.json"
    trace.write_text(json.dumps(schedules.chrome_trace(timeline, us_per_unit=1.0)))
    simulated = schedules.simulate(schedule, stages, measured_cost(timeline, schedule.num_stages(stages)))
    # the update waits for the global gradient norm (the clip), so every rank starts it together
    updated = schedules.with_update(simulated, update_us(tx, params, devices), validation="sync")
    print(
        f"pipeline bubble {simulated.bubble_fraction:.0%}, step {updated.makespan / 1e3:.1f} ms with the "
        f"update (the schedule simulated with one step's measured cell times; timeline.png)"
    )
    if not details:
        return Measured(timeline, simulated, updated)
    print("the schedule's cells as a step runs them (unit costs: F 1, B 2, the loss stage's FB 3):")
    print(_plots.grid_as_run(schedule, stages, timeline))
    print(
        f"that step, run cell by cell (one cell at a time on the whole machine, so ranks never "
        f"overlap): {timeline.makespan / 1e3:.1f} ms, idle {timeline.bubble_fraction:.0%} of it "
        f"(open {trace} in Perfetto); that idle share comes from running one cell at a time, it "
        f"is not the pipeline bubble"
    )
    print(
        f"the schedule's bubble, simulated with these measured cell times (sends free): "
        f"{simulated.bubble_fraction:.0%}, its cells {simulated.makespan / 1e3:.1f} ms, then the "
        f"update (each rank's timed alone, after the gradient norm) "
        f"{(updated.makespan - simulated.makespan) / 1e3:.1f} ms"
    )
    host = update.profile(params, state, None, tokens, targets, rounds=3)
    print(f"host cost of one step (issue time per rank and cell kind, {host.clock} clock):")
    print(host.table())
    peaks = report_memory(step.runner.step, schedule, stages, (params, None, tokens, targets))
    return Measured(timeline, simulated, updated, host, peaks)


def report_memory(grad_step, schedule, n: int, call_args) -> dict:
    """Print each rank's predicted and measured device (and host) peak bytes of the gradient step
    (the optimizer's state aside): predicted by simulating the schedule with the buffer sizes of its
    profile, measured by running it once."""
    memory = grad_step.profile_stages(*call_args, rounds=0).stage_memory()
    predicted = schedules.simulate(schedule, n, memory=memory)
    measured = grad_step.measure_peak_bytes_by_kind(*call_args)
    print("peak bytes per rank of the gradient step, predicted / measured (MiB):")
    for kind, peaks in (("device", predicted.peak_bytes), ("host", predicted.peak_host_bytes)):
        pairs = ", ".join(f"{p / 2**20:.3f} / {m / 2**20:.3f}" for p, m in zip(peaks, measured[kind]))
        print(f"  {kind}: {pairs}")
    return {"predicted": [predicted.peak_bytes, predicted.peak_host_bytes], "measured": measured}


def update_us(tx, params, devices) -> list[float]:
    """Per rank, the least of 3 timed runs (µs) of `tx`'s update on that rank's own parameter
    leaves (the leaves on `devices[rank]`), compiled once: the update each rank runs after its
    cells."""
    leaves = jax.tree.leaves(params)
    apply = jax.jit(lambda g, s, p: optax.apply_updates(p, tx.update(g, s, p)[0]))
    times = []
    for device in devices:
        mine = [x for x in leaves if device in x.devices()]
        state = tx.init(mine)
        jax.block_until_ready(apply(mine, state, mine))  # the leaves stand in for their gradients
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(apply(mine, state, mine))
            best = min(best, time.perf_counter() - t0)
        times.append(best * 1e6)
    return times


def measured_cost(timeline, n_stages: int) -> schedules.StageCost:
    """Each stage's median measured time per cell kind (µs), as a `StageCost` for `simulate`.

    The last stage's fused loss cell is its F (its B, I and W are 0); a full B
    counts as I = W = B / 2, split I and W cells as B = I + W. A fused
    forward-backward cell's time is shared evenly by its parts.
    """
    times: dict[tuple[int, str], list[float]] = {}
    for row in timeline.events:
        for event in row:
            parts = event.cell.parts
            for part in parts:
                times.setdefault((part.stage, part.kind), []).append((event.end - event.start) / len(parts))
    cost = {kind: [] for kind in "FBIW"}
    for s in range(n_stages):
        f, b, i, w = (float(np.median(times.get((s, kind), [0.0]))) for kind in "FBIW")
        if (s, "B") in times:
            i = w = b / 2
        else:
            b = i + w
        for kind, value in zip("FBIW", (f, b, i, w)):
            cost[kind].append(value)
    return schedules.StageCost(*(tuple(cost[kind]) for kind in "FBIW"))
