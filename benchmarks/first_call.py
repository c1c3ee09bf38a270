"""Where the main job's first call goes, program by program, against the unsplit step's.

The LM configurations of `mpmd_overhead.py --sections lm` (the pipelined update step and the
same model and update as one program over one rank's devices). JAX reports each lowering
(jaxpr to StableHLO) and each XLA compile with the program's name and duration through
`jax.monitoring`; this script listens to both during each first call and prints, per program,
the seconds of each, then the totals. Each XLA
compile's seconds are its own thread's wall time (the pipeline compiles two programs at a time on
two cores, so its compile phase is shorter than the sum, and each compile's time is inflated by
the others); a third build (`serial`) compiles one program at a time
(`SPECTRAX_MPMD_COMPILE_THREADS=1`), so each program's time is its own. A program of one
addition, compiled `--trivial` times, gives XLA's fixed cost per program.

Two floors fall out of the table: the fixed cost of each distinct program, and the block code
each stage program holds (the unsplit step scans its blocks: it compiles one block's forward and
backward whatever the depth).

    python benchmarks/first_call.py [--configs lm,lm-large] [--trivial 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

from _devices import cpu_devices

cpu_devices(8)  # before JAX is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _timing import interleaved, ratio, summary, times  # noqa: E402
from mpmd_overhead import LM_CONFIGS, Updating, first_call_cpu, lm_steps  # noqa: E402

from spectrax_mpmd._env import COMPILE_THREADS_ENV  # noqa: E402

LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
OUT = Path(__file__).parent / "results" / "first_call.json"


class Listener:
    """The lowerings and compiles JAX reports while `recording` is on, in order, by program name."""

    def __init__(self):
        self.events: list = []
        self.recording = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, seconds: float, **info) -> None:
        if self.recording and event in (LOWER_EVENT, COMPILE_EVENT):
            kind = "lower" if event == LOWER_EVENT else "compile"
            self.events.append((kind, info.get("fun_name", "?"), seconds))

    def record(self, fn) -> tuple[float, float, list]:
        """Wall and process CPU seconds of `fn()`'s first call, and the events it caused."""
        self.events, self.recording = [], True
        try:
            wall, cpu = first_call_cpu(fn)
        finally:
            self.recording = False
        return wall, cpu, self.events


def by_program(events: list) -> dict:
    """`{name: {"lowered": k, "lower_s": s, "compiled": k, "compile_s": s}}`, summed per name."""
    out: dict = {}
    for kind, name, seconds in events:
        row = out.setdefault(name, {"lowered": 0, "lower_s": 0.0, "compiled": 0, "compile_s": 0.0})
        row["lowered" if kind == "lower" else "compiled"] += 1
        row[f"{kind}_s"] += seconds
    return out


def trivial_compile_s(times: int) -> float:
    """The median wall seconds XLA takes to compile a one-addition program (fresh each time)."""
    fresh, lowered = itertools.count(), {}

    def lower(name):  # a new function each round: nothing cached
        k = next(fresh)
        lowered["it"] = jax.jit(lambda x, k=k: x + k).lower(jnp.zeros(4))

    wall, _ = interleaved({"compile": lambda: lowered["it"].compile()}, times, setup=lower, wait=None)
    return summary(wall["compile"], unit="s")["median_s"]


def first_call_record(listener: Listener, contender) -> dict:
    """One first call: wall and CPU seconds, its programs, and their summed lowering and compiles."""
    wall, cpu, events = listener.record(contender)
    programs = by_program(events)
    return {
        "first_s": wall,
        "first_cpu_s": cpu,
        "programs": programs,
        "lower_s": sum(p["lower_s"] for p in programs.values()),
        "compile_s": sum(p["compile_s"] for p in programs.values()),
        "compiles": sum(p["compiled"] for p in programs.values()),
    }


def profile(name: str, listener: Listener) -> dict:
    d_model, blocks, per_rank, sequences = LM_CONFIGS[name]
    (mpmd_step, staged), (spmd_step, lm), tx, batch = lm_steps(d_model, blocks, per_rank, sequences)
    runs = {
        "unsplit": first_call_record(listener, Updating(spmd_step, lm, tx, batch)),
        "pipeline": first_call_record(listener, Updating(mpmd_step, staged, tx, batch)),
    }
    runs["pipeline"]["phases"] = mpmd_step.runner.update_step.timings()["seconds"]
    os.environ[COMPILE_THREADS_ENV] = "1"  # again, fresh, one compile at a time: each program's own time
    try:
        (serial_step, staged), _, tx, batch = lm_steps(d_model, blocks, per_rank, sequences)
        runs["serial"] = first_call_record(listener, Updating(serial_step, staged, tx, batch))
    finally:
        del os.environ[COMPILE_THREADS_ENV]
    return {"config": name, **runs}


def print_profile(row: dict, fixed_s: float) -> None:
    print(f"\n{row['config']}: program                     lowered  lower s  compiled  compile s")
    for side in ("unsplit", "pipeline", "serial"):
        run = row[side]
        for program, p in sorted(run["programs"].items(), key=lambda kv: -kv[1]["compile_s"]):
            print(
                f"  {side:9} {program[:28]:28} {p['lowered']:7d} {p['lower_s']:8.3f} "
                f"{p['compiled']:9d} {p['compile_s']:10.3f}"
            )
        print(
            f"  {side:9} {'total':28} {'':7} {run['lower_s']:8.3f} {run['compiles']:9d} "
            f"{run['compile_s']:10.3f}   first call {run['first_s']:.2f} s wall, "
            f"{run['first_cpu_s']:.2f} s CPU"
        )
    pipe, unsplit, serial = row["pipeline"], row["unsplit"], row["serial"]
    print(
        f"  ratios: first call {pipe['first_s'] / unsplit['first_s']:.2f}x, CPU "
        f"{times(ratio(pipe['first_cpu_s'], unsplit['first_cpu_s']))}, lowering "
        f"{pipe['lower_s'] / unsplit['lower_s']:.2f}x, XLA compile (summed over threads) "
        f"{pipe['compile_s'] / unsplit['compile_s']:.2f}x; fixed cost per program {fixed_s * 1e3:.0f} ms "
        f"x {pipe['compiles']} = {fixed_s * pipe['compiles']:.2f} s"
    )
    print(
        f"  one compile at a time: XLA compile {serial['compile_s']:.2f} s = "
        f"{serial['compile_s'] / unsplit['compile_s']:.2f}x the unsplit step's, first call "
        f"{serial['first_s'] / unsplit['first_s']:.2f}x"
    )
    print("  pipeline phases (s): " + ", ".join(f"{k} {v:.3f}" for k, v in pipe["phases"].items()))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="lm,lm-large")
    ap.add_argument("--trivial", type=int, default=5, help="fresh one-addition compiles for the fixed cost")
    args = ap.parse_args(argv)
    listener = Listener()
    fixed_s = trivial_compile_s(args.trivial)
    rows = []
    for name in args.configs.split(","):
        row = profile(name, listener)
        row["fixed_compile_s"] = fixed_s
        print_profile(row, fixed_s)
        rows.append(row)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
