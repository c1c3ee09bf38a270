"""The run-ahead bound: pipelined steps' time under each bound, and the latency that makes a small
bound cost. Sections (`--sections`, all by default):

  latency  one small program: a call issued alone against a call and the wait for its result. A
           bound of k makes the host wait before a rank's next cell whenever its k youngest
           cells were issued within that latency, however little the device has to do.
  steps    one rank on JAX's default device (the accelerator where there is one) trains the
           4-layer tanh MLP of `fused_cells.py` as 4 virtual stages (InterleavedH1, m=8: 57
           cells), one call per cell (`$SPECTRAX_MPMD_FUSE_CELLS=1`, as a rank of a multi-rank
           step issues its cells), the step built under each bound of `$SPECTRAX_MPMD_RUN_AHEAD`
           (`--bounds`; `none`: no bound), at each of `--sizes`.
  ranks    4 ranks, one device each (skipped with fewer devices: on one accelerator chip), the
           same MLP at D=256, B=64, m=8, Std1F1B and GPipe, one layer a rank, under each bound.

Each over `--rounds` interleaved rounds: ms per step (min, median, spread) and the issuing
thread's time, waits included (`issue_clock`: its CPU time, or the wall clock where that is too
coarse). On CPU, 8 fake devices.

    python benchmarks/run_ahead.py [--rounds 5] [--sections latency,steps,ranks]
        [--sizes 256/64,4096/2048] [--bounds 1,2,4,8,none] [--json benchmarks/results/run_ahead.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from _devices import cpu_devices

cpu_devices(8)  # before JAX starts: the ranks section's devices on a CPU-only machine

import jax
import jax.numpy as jnp
from _timing import interleaved, issue_clock, ratio, summary
from fused_cells import FUSE_ENV, LAYERS, close, loss

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._env import RUN_AHEAD_ENV

MICROBATCHES, VIRTUAL = 8, 4
SECTIONS = ("latency", "steps", "ranks")


def step_under(bound: str, mesh, schedule, args, fuse: str | None = "1"):
    """The step with its plan built under `bound` (read when the plan is built), one call per
    cell unless `fuse` is None (the default fusion)."""
    saved = {name: os.environ.get(name) for name in (RUN_AHEAD_ENV, FUSE_ENV)}
    os.environ[RUN_AHEAD_ENV] = bound
    if fuse is not None:
        os.environ[FUSE_ENV] = fuse
    try:
        step = mp.sxvalue_and_grad(lambda p, b: loss(p, b, True), mesh=mesh, schedule=schedule)
        jax.block_until_ready(step(*args))
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    return step


def steps_section(d: int, batch: int, bounds: list[str], rounds: int) -> list[dict]:
    device = jax.devices()[0]
    keys = jax.random.split(jax.random.key(0), LAYERS + 2)
    params = [jax.device_put(jax.random.normal(k, (d, d)) / d**0.5, device) for k in keys[:LAYERS]]
    data = tuple(jax.device_put(jax.random.normal(k, (batch, d)), device) for k in keys[LAYERS:])
    args = (params, data)
    mesh = mp.create_mesh((1, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=[device])
    schedule = S.InterleavedH1(microbatches=MICROBATCHES, virtual_stages=VIRTUAL)
    steps = {bound: step_under(bound, mesh, schedule, args) for bound in bounds}
    return timed(steps, args, rounds, f"D={d}, B={batch}", {"D": d, "batch": batch})


def ranks_section(bounds: list[str], rounds: int) -> list[dict]:
    """4 ranks, one layer each, fused as the step is by default, under each bound."""
    keys = jax.random.split(jax.random.key(0), LAYERS + 2)
    params = [jax.random.normal(k, (256, 256)) / 16 for k in keys[:LAYERS]]
    args = (params, (jax.random.normal(keys[-2], (64, 256)), jax.random.normal(keys[-1], (64, 256))))
    mesh = mp.create_mesh((LAYERS, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:LAYERS])
    rows = []
    for schedule in (S.Std1F1B(microbatches=MICROBATCHES), S.GPipe(microbatches=MICROBATCHES)):
        name = type(schedule).__name__
        steps = {bound: step_under(bound, mesh, schedule, args, fuse=None) for bound in bounds}
        rows += timed(steps, args, rounds, name, {"schedule": name})
    return rows


def timed(steps: dict, args, rounds: int, label: str, fields: dict) -> list[dict]:
    """Each bound's step checked against `value_and_grad` of the unsplit loss, then timed in
    interleaved rounds: a row per bound, against the last bound's median."""
    reference = jax.value_and_grad(loss)(*args)
    for bound, step in steps.items():
        if not close(step(*args), reference):
            raise SystemExit(f"{label}, bound {bound}: the step differs from value_and_grad of the unsplit loss")
    contenders = {bound: (lambda s=step: s(*args)) for bound, step in steps.items()}
    wall, cpu = interleaved(contenders, rounds, calls=3, warmup=1)
    bounds = list(steps)
    rows, baseline = [], summary(wall[bounds[-1]])["median_ms"]
    for bound in bounds:
        row = {**fields, "bound": bound, **summary(wall[bound], cpu[bound])}
        row["vs_unbounded"] = ratio(row["median_ms"], baseline)
        rows.append(row)
        print(f"{label:>16} {bound:>5} {row['min_ms']:8.2f} {row['median_ms']:9.2f} {row['spread']:6.2f} "
              f"{row['cpu_median_ms']:9.2f} {row['vs_unbounded']:8.2f}", flush=True)  # fmt: skip
    return rows


def latency_section(rounds: int) -> dict:
    """Microseconds of a small program's call alone and of its call and the wait for its result."""
    x = jnp.ones((256, 256))
    double = jax.jit(lambda a: a * 2)
    jax.block_until_ready(double(x))
    contenders = {"call": lambda: double(x), "call_and_wait": lambda: jax.block_until_ready(double(x))}
    wall, _ = interleaved(contenders, rounds, calls=200, wait=None)
    out = {name: summary(wall[name], unit="us") for name in contenders}
    print(f"a small program: call {out['call']['median_us']:.1f} us, call and wait for its result "
          f"{out['call_and_wait']['median_us']:.1f} us (medians)")  # fmt: skip
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="of: " + ", ".join(SECTIONS))
    parser.add_argument("--sizes", default="256/64,4096/2048", help="D/batch pairs")
    parser.add_argument("--bounds", default="1,2,4,8,none", help="bounds to build under; the last is the baseline")
    parser.add_argument("--json", default="benchmarks/results/run_ahead.json")
    args = parser.parse_args(argv)
    bounds, sections = args.bounds.split(","), args.sections.split(",")
    device = jax.devices()[0]
    print(f"{device.device_kind}; issue times on the {issue_clock().name} clock")
    result: dict = {"device": device.device_kind, "clock": issue_clock().name}
    if "latency" in sections:
        result["latency"] = latency_section(args.rounds)
    print(f"{'':>16} {'bound':>5} {'min ms':>8} {'median ms':>9} {'spread':>6} {'issue ms':>9} "
          f"{'/' + bounds[-1]:>8}")  # fmt: skip
    if "steps" in sections:
        result["steps"] = []
        for size in args.sizes.split(","):
            d, batch = (int(x) for x in size.split("/"))
            result["steps"] += steps_section(d, batch, bounds, args.rounds)
    if "ranks" in sections:
        if len(jax.devices()) < LAYERS:
            print(f"ranks: skipped, {len(jax.devices())} device(s) where the 4-rank step needs {LAYERS}")
        else:
            result["ranks"] = ranks_section(bounds, args.rounds)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
