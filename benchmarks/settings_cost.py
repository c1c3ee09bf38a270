"""A step's first call and warm host cost per cell: this version against another checkout, alternating.

The model of `mpmd_overhead.py --sections host` (4 tanh layers of D=256, one per rank, Std1F1B over
8 microbatches of a 64-row batch, `sxvalue_and_grad` over 4 ranks). Each round runs one fresh process
per version (this tree, and `--base`: another checkout, e.g. `git worktree add runs/base REV`),
alternating which goes first, so both see the same load. A process imports its version's packages
(`PYTHONPATH`), uses only their public API, and times:

  first call     the step's first call to its result: wall and process CPU seconds (every thread)
  warm step      `--calls` calls per inner round over `--inner` rounds: the median wall time of a
                 call and the issuing thread's time per schedule cell of the whole call
                 (`call_issue_per_cell_us`, the clock stopped while the result is waited for)
  plan issue     `step.profile`: the plan's issue time per schedule cell (`per_cell_us`)

Per version the table gives min, median and spread over the rounds, and whether this tree's median
lies within the base's range (min to max).

    python benchmarks/settings_cost.py --base runs/base [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _timing import spread

ROOT = Path(__file__).resolve().parents[1]
RANKS, MICROBATCHES, D, ROWS = 4, 8, 256, 64
FIGURES = ("first_s", "first_cpu_s", "step_us", "call_issue_per_cell_us", "per_cell_us")


def measure(inner: int, calls: int) -> dict:
    """In this (fresh) process: the figures of the step built by the packages on `PYTHONPATH`."""
    from mpmd_overhead import pipeline  # first: it sets JAX's flags

    import jax
    import jax.numpy as jnp
    from _timing import interleaved, issue_clock, once

    import spectrax_mpmd
    from spectrax_core import schedules as S

    jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.zeros(4)))  # the backend's own start
    step, args, _ = pipeline(RANKS, S.Std1F1B(microbatches=MICROBATCHES), RANKS, D, ROWS)
    jax.block_until_ready(args)
    first_s, first_cpu_s = once(lambda: step(*args))
    wall, issue = interleaved({"step": lambda: step(*args)}, inner, calls, issue_cpu_only=True)
    host = step.profile(*args, rounds=inner)
    return {
        "package": str(Path(spectrax_mpmd.__file__).resolve().parents[1]),
        "clock": issue_clock().name,
        "cells": host.cells,
        "first_s": first_s,
        "first_cpu_s": first_cpu_s,
        "step_us": statistics.median(wall["step"]) * 1e6,
        "call_issue_per_cell_us": statistics.median(issue["step"]) * 1e6 / host.cells,
        "per_cell_us": host.per_cell_us,
    }


def fresh(tree: Path, inner: int, calls: int) -> dict:
    """`measure` in a child process importing `tree`'s packages."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, __file__, "--one", "--inner", str(inner), "--calls", str(calls)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(row["package"]) != tree:
        raise SystemExit(f"{tree}: the child imported the packages of {row['package']}")
    return row


def summarized(rows: list[dict]) -> dict:
    """Per figure: min, max, median and spread over the rounds."""
    out = {}
    for name in FIGURES:
        values = [row[name] for row in rows]
        out[name] = {"min": min(values), "max": max(values), "median": statistics.median(values)}
        out[name]["spread"] = spread(values)
    return out


def within(tree: dict, base: dict) -> dict:
    """Per figure: whether this tree's median lies within the base's range over the rounds."""
    return {name: base[name]["min"] <= tree[name]["median"] <= base[name]["max"] for name in FIGURES}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="another checkout, run in alternation with this one")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inner", type=int, default=5, help="warm rounds inside each process")
    parser.add_argument("--calls", type=int, default=10, help="warm calls per inner round")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--json", default=ROOT / "benchmarks" / "results" / "settings_cost.json")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.inner, args.calls)))
        return {}
    if args.base is None:
        parser.error("--base PATH: another checkout of the project to compare with is required")
    trees = {"tree": ROOT, "base": Path(args.base).resolve()}
    runs: dict = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in trees if r % 2 == 0 else reversed(trees):
            row = fresh(trees[name], args.inner, args.calls)
            runs[name].append(row)
            print(f"round {r} {name}: " + ", ".join(f"{k} {row[k]:.4g}" for k in FIGURES), flush=True)
    result = {"cpus": os.cpu_count(), "clock": runs["tree"][0]["clock"], "cells": runs["tree"][0]["cells"]}
    result |= {"rounds": runs, **{name: summarized(rows) for name, rows in runs.items()}}
    result["tree_within_base"] = within(result["tree"], result["base"])
    print(f"issue times on the {result['clock']} clock; {result['cells']} schedule cells per step")
    print(f"{'figure':24} {'version':5} {'min':>9} {'median':>9} {'spread':>7}  tree median within base range")
    for figure in FIGURES:
        for name in trees:
            s = result[name][figure]
            verdict = result["tree_within_base"][figure] if name == "tree" else ""
            print(f"{figure:24} {name:5} {s['min']:9.4g} {s['median']:9.4g} {s['spread']:7.2f}  {verdict}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
