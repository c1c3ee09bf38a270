"""The host's cost of issuing a one-rank pipelined step, per cell, against one raw `jax.jit` call on
the same device.

One rank (JAX's default device: the accelerator where there is one) trains a 4-layer tanh MLP
(D=512, batch 64) cut into `--virtual-stages` stages: Std1F1B for one, InterleavedH1 for two, m=8.
Rows, each timed over `--rounds` interleaved rounds of `--calls` calls:

  raw jax.jit       `jax.jit(jax.value_and_grad(loss))` of one microbatch: a call's issue time
                    (the clock stops while the result is waited for) and wall time
  raw whole batch   the same on the whole batch: the unsplit step
  pipelined step    `sxvalue_and_grad` on the rank: the whole step, and from its host profile
                    (`step.profile`) the issue time per schedule cell, with and without the
                    plan's own work (`per_cell_us`, `calls_per_cell_us`), per call the step
                    issues (`per_call_us`: consecutive cells of the rank run as one program),
                    and per cell replayed as its own call (`cell_call_us`)

Issue times are on the issuing thread's CPU clock, or the wall clock where this machine's is too
coarse to time a call (`_timing.issue_clock`; the JSON's `clock` says which).

    python benchmarks/host_cost.py [--rounds 7] [--calls 20] [--virtual-stages 1]
        [--json benchmarks/results/host_cost.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from _timing import interleaved, issue_clock, ratio, summary, times

import spectrax_mpmd as mp
from spectrax_core import schedules as S

D, B, M, LAYERS = 512, 64, 8, 4


def loss(params, batch, cut: bool = False):
    x, y = batch
    for k, w in enumerate(params):
        x = jnp.tanh(x @ w)
        if cut and k == LAYERS // 2 - 1:
            x = mp.sxstage_iter(x)
    return jnp.mean((x - y) ** 2)


def measure(rounds: int, calls: int, virtual_stages: int) -> dict:
    device = jax.devices()[0]
    keys = jax.random.split(jax.random.key(0), LAYERS + 2)
    params = [jax.device_put(jax.random.normal(k, (D, D)) / D**0.5, device) for k in keys[:LAYERS]]
    batch = tuple(jax.device_put(jax.random.normal(k, (B, D)), device) for k in keys[LAYERS:])
    micro = tuple(x[: B // M] for x in batch)
    cut = virtual_stages > 1
    schedule = S.InterleavedH1(microbatches=M, virtual_stages=2) if cut else S.Std1F1B(microbatches=M)
    mesh = mp.create_mesh((1, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=[device])
    step = mp.sxvalue_and_grad(lambda p, b: loss(p, b, cut), mesh=mesh, schedule=schedule)
    raw = jax.jit(jax.value_and_grad(loss))
    contenders = {
        "raw jax.jit": lambda: raw(params, micro),
        "raw whole batch": lambda: raw(params, batch),
        "pipelined step": lambda: step(params, batch),
    }
    for call in contenders.values():
        jax.block_until_ready(call())
    wall, issue = interleaved(contenders, rounds, calls, issue_cpu_only=True)
    rows = [{"name": name, **summary(wall[name], issue[name], unit="us")} for name in contenders]
    host = step.profile(params, batch, rounds=rounds)
    raw_issue = rows[0]["cpu_median_us"]
    replayed = sum(row.calls + row.transfers for row in host.rows)
    cell_call_us = sum(row.issue_us for row in host.rows) / replayed
    return {
        "device": device.device_kind,
        "clock": issue_clock().name,
        "schedule": repr(schedule),
        "rows": rows,
        "per_cell_us": host.per_cell_us,
        "calls_per_cell_us": host.calls_per_cell_us,
        "cells": host.cells,
        "calls": host.calls,
        "copies": host.copies,
        "per_call_us": host.per_call_us,
        "cell_call_us": cell_call_us,
        "issue_share": host.issue_share,
        "per_cell_vs_raw_call": ratio(host.per_cell_us, raw_issue),
        "per_call_vs_raw_call": ratio(host.per_call_us, raw_issue),
        "cell_call_vs_raw_call": ratio(cell_call_us, raw_issue),
        "host": host.as_dict(),
        "host_table": host.table(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--virtual-stages", type=int, default=1, choices=(1, 2))
    ap.add_argument("--json", default="benchmarks/results/host_cost.json")
    args = ap.parse_args()
    result = measure(args.rounds, args.calls, args.virtual_stages)
    print(f"{result['device']}, {result['schedule']} on one rank; issue times on the {result['clock']} clock")
    if issue_clock().note:
        print(issue_clock().note)
    print(f"{'':16} {'wall min us':>11} {'median':>9} {'spread':>6} {'issue median us':>15}")
    for row in result["rows"]:
        print(
            f"{row['name']:16} {row['min_us']:11.1f} {row['median_us']:9.1f} {row['spread']:6.0%} "
            f"{row['cpu_median_us']:15.1f}"
        )
    print(result["host_table"])
    print(
        f"issue per schedule cell {result['per_cell_us']:.1f} us = {times(result['per_cell_vs_raw_call'])} "
        f"a raw jax.jit call's; {result['cells']} cells issued as calls and copies: {result['calls']} and "
        f"{result['copies']}, {result['per_call_us']:.1f} us each = {times(result['per_call_vs_raw_call'])}; "
        f"a cell replayed as its own call {result['cell_call_us']:.1f} us = "
        f"{times(result['cell_call_vs_raw_call'])}"
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
