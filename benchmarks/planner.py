"""Planner accuracy: predicted vs measured peak bytes and busy time per rank.

A heterogeneous pipeline (an embedding; one block of hidden width `--wide`,
the rest `--narrow`; a head with its loss) on 4 ranks, for Std1F1B,
ZeroBubbleH1, InterleavedH1 (v=2) and DualPipeV, with saved residuals and
with `remat=True`. Peak bytes: `simulate(..., memory=profile.stage_memory())`
against `step.measure_peak_bytes`, and the device-time sweep
(`peak_bytes(order="time")`) beside them. Busy time: the simulator given one
profile's cell times (an earlier call; mean per stage and kind) against the
median of separately measured steps, on the CPU clock and on the wall clock, on
a larger model (`--time-d`, `--time-hidden`: cells of about a millisecond),
with the simulated makespan, the measured busy time over the cores and the
step's wall time beside them (DualPipeV fuses some cells, so it has none).
Prints one line per configuration and writes benchmarks/results/planner.json.

    python benchmarks/planner.py
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

from _devices import cpu_devices

cpu_devices(8)  # before JAX is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import interleaved, summary  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core import schedules as S  # noqa: E402

OUT = pathlib.Path(__file__).parent / "results" / "planner.json"
VOCAB, D, LENGTH, BATCH, M, BLOCKS = 32, 16, 8, 32, 8, 8


def model(wide: int, narrow: int, d: int = D, length: int = LENGTH):
    keys = jax.random.split(jax.random.key(0), 2 * BLOCKS + 4)
    hidden = (wide,) + (narrow,) * (BLOCKS - 1)
    blocks = [
        {
            "w1": jax.random.normal(keys[2 * k], (d, h)) / 4,
            "w2": jax.random.normal(keys[2 * k + 1], (h, d)) / 4,
        }
        for k, h in enumerate(hidden)
    ]
    params = {
        "embed": jax.random.normal(keys[-4], (VOCAB, d)),
        "blocks": blocks,
        "head": jax.random.normal(keys[-3], (d, VOCAB)) / d**0.5,
    }
    tokens = jax.random.randint(keys[-2], (BATCH, length), 0, VOCAB)
    return params, tokens, jax.random.randint(keys[-1], (BATCH, length), 0, VOCAB)


def loss_of(n_stages: int):
    ends = set(np.cumsum(mp.stage_sizes(BLOCKS, n_stages))[:-1].tolist())

    def loss(params, tokens, targets):
        x = params["embed"][tokens]
        for k, block in enumerate(params["blocks"]):
            x = x + jnp.tanh(x @ block["w1"]) @ block["w2"]
            if k + 1 in ends:
                x = mp.sxstage_iter(x)
        logp = jax.nn.log_softmax(x @ params["head"])
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    return loss


def busy_prediction(step, data, schedule, clock: str, runs: int) -> dict:
    """Each rank's busy time predicted from a profile (cells timed in an earlier call, mean per
    stage and kind) against the median of `runs` separately measured steps, both on `clock`; the
    simulated makespan next to the step's wall time when its ranks run concurrently."""
    profile = step.profile_stages(*data, rounds=runs, clock=clock)
    predicted = S.simulate(schedule, 4, profile.stage_cost(statistic="mean"))
    measured = np.median([step.measure_timeline(*data, clock=clock).busy for _ in range(runs)], axis=0) * 1e-6
    wall, cpu = interleaved({"step": lambda: step(*data)}, runs)
    steps = summary(wall["step"], cpu["step"], unit="s")
    return {
        "clock": clock,
        "predicted_busy_s": list(predicted.busy),
        "measured_busy_s": measured.tolist(),
        "worst_busy_error": max(abs(p - m) / m for p, m in zip(predicted.busy, measured)),
        "simulated_makespan_s": predicted.makespan,
        "busy_over_cores_s": sum(measured) / (os.cpu_count() or 1),
        "step_wall_min_s": steps["min_s"],
        "step_wall_median_s": steps["median_s"],
        "step_wall_spread": steps["spread"],
        "step_cpu_median_s": steps["cpu_median_s"],
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wide", type=int, default=128, help="hidden width of the first block")
    p.add_argument("--narrow", type=int, default=16, help="hidden width of the other blocks")
    p.add_argument("--time-d", type=int, default=128, help="model width of the time model's run")
    p.add_argument("--time-hidden", type=int, default=512, help="hidden width of every block there")
    p.add_argument("--runs", type=int, default=5, help="profile rounds and measured steps per clock")
    args = p.parse_args(argv)
    mesh = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])
    data = model(args.wide, args.narrow)
    big = model(args.time_hidden, args.time_hidden, d=args.time_d, length=32)
    schedules = [
        S.Std1F1B(microbatches=M),
        S.ZeroBubbleH1(microbatches=M),
        S.InterleavedH1(microbatches=M, virtual_stages=2),
        S.DualPipeV(microbatches=M),
    ]
    records = []
    for schedule in schedules:
        for remat in (False, True):
            step = mp.sxvalue_and_grad(
                loss_of(4 * schedule.virtual_stages), mesh=mesh, schedule=schedule, remat=remat
            )
            memory = step.profile_stages(*data, rounds=1).stage_memory()
            timeline = S.simulate(schedule, 4, memory=memory)
            measured = step.measure_peak_bytes(*data)
            record = {
                "schedule": repr(schedule),
                "remat": remat,
                "predicted_bytes": list(timeline.peak_bytes),
                "measured_bytes": list(measured),
                "device_time_bytes": list(S.peak_bytes(timeline, memory, order="time")),
            }
            line = (
                f"{repr(schedule):42} remat={remat!s:5} peak KiB predicted "
                f"{[round(b / 1024, 1) for b in timeline.peak_bytes]} "
                f"measured {[round(b / 1024, 1) for b in measured]}"
            )
            print(line)
            if schedule.layout != "v":
                timed = mp.sxvalue_and_grad(
                    loss_of(4 * schedule.virtual_stages), mesh=mesh, schedule=schedule, remat=remat
                )
                for clock in ("cpu", "wall"):
                    t = record[f"time_{clock}"] = busy_prediction(timed, big, schedule, clock, args.runs)
                    predicted = [round(b * 1e3, 2) for b in t["predicted_busy_s"]]
                    measured_busy = [round(b * 1e3, 2) for b in t["measured_busy_s"]]
                    print(
                        f"{'':42} {clock:4} busy ms predicted {predicted} measured {measured_busy} "
                        f"(worst {t['worst_busy_error']:.1%}); makespan ms simulated "
                        f"{t['simulated_makespan_s'] * 1e3:.1f}, "
                        f"busy/cores {t['busy_over_cores_s'] * 1e3:.1f}, "
                        f"step wall median {t['step_wall_median_s'] * 1e3:.1f} (min "
                        f"{t['step_wall_min_s'] * 1e3:.1f}, spread {t['step_wall_spread']:.2f}, thread CPU "
                        f"{t['step_cpu_median_s'] * 1e3:.1f})"
                    )
            records.append(record)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(records, indent=1))
    return records


if __name__ == "__main__":
    main()
