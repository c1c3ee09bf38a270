"""Planner accuracy: predicted vs measured peak bytes and busy time per rank.

A heterogeneous pipeline (an embedding; one block of hidden width `--wide`,
the rest `--narrow`; a head with its loss) on 4 ranks, for Std1F1B,
ZeroBubbleH1, InterleavedH1 (v=2) and DualPipeV, with saved residuals and
with `remat=True`. Peak bytes: `simulate(..., memory=profile.stage_memory())`
against `step.measure_peak_bytes`, and the device-time sweep
(`peak_bytes(order="time")`) beside them. Busy time: the simulator given one
measured run's cell times against that run's per-rank sums (DualPipeV fuses
some cells, so it has none). Prints one line per configuration and writes
benchmarks/results/planner.json.

    python benchmarks/planner.py
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # must precede importing JAX; affects the CPU backend only
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core import schedules as S  # noqa: E402

OUT = pathlib.Path(__file__).parent / "results" / "planner.json"
VOCAB, D, LENGTH, BATCH, M, BLOCKS = 32, 16, 8, 32, 8, 8


def model(wide: int, narrow: int):
    keys = jax.random.split(jax.random.key(0), 2 * BLOCKS + 4)
    hidden = (wide,) + (narrow,) * (BLOCKS - 1)
    blocks = [
        {
            "w1": jax.random.normal(keys[2 * k], (D, h)) / 4,
            "w2": jax.random.normal(keys[2 * k + 1], (h, D)) / 4,
        }
        for k, h in enumerate(hidden)
    ]
    params = {
        "embed": jax.random.normal(keys[-4], (VOCAB, D)),
        "blocks": blocks,
        "head": jax.random.normal(keys[-3], (D, VOCAB)),
    }
    tokens = jax.random.randint(keys[-2], (BATCH, LENGTH), 0, VOCAB)
    return params, tokens, jax.random.randint(keys[-1], (BATCH, LENGTH), 0, VOCAB)


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


def run_cost(timeline, n_stages: int) -> S.StageCost:
    """Mean seconds per stage and cell kind in one measured run."""
    seconds: dict = {}
    for row in timeline.events:
        for e in row:
            (a,) = e.cell.parts
            seconds.setdefault((a.stage, a.kind), []).append((e.end - e.start) * 1e-6)
    mean = {k: sum(v) / len(v) for k, v in seconds.items()}
    rows = {"F": [], "B": [], "I": [], "W": []}
    for s in range(n_stages):
        b = mean.get((s, "B"))
        i, w = (
            (mean.get((s, "I"), 0.0), mean[(s, "W")])
            if (s, "W") in mean
            else ((b or 0.0) / 2, (b or 0.0) / 2)
        )
        for kind, value in zip("FBIW", (mean[(s, "F")], b if b is not None else i + w, i, w)):
            rows[kind].append(value)
    return S.StageCost(*(tuple(rows[k]) for k in "FBIW"))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wide", type=int, default=128, help="hidden width of the first block")
    p.add_argument("--narrow", type=int, default=16, help="hidden width of the other blocks")
    args = p.parse_args(argv)
    mesh = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])
    data = model(args.wide, args.narrow)
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
                f"{[round(b / 1024, 1) for b in timeline.peak_bytes]} measured {[round(b / 1024, 1) for b in measured]}"
            )
            if schedule.layout != "v":
                run = step.measure_timeline(*data)
                busy = S.simulate(schedule, 4, run_cost(run, 4 * schedule.virtual_stages)).busy
                record["predicted_busy_s"] = list(busy)
                record["measured_busy_s"] = [b * 1e-6 for b in run.busy]
                line += f"; busy ms predicted {[round(b * 1e3, 3) for b in busy]} measured {[round(b / 1e3, 3) for b in run.busy]}"
            print(line)
            records.append(record)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(records, indent=1))
    return records


if __name__ == "__main__":
    main()
