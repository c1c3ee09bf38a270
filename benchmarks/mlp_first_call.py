"""The first call of a 4-stage homogeneous MLP step against the unsplit jitted step's, each fresh.

The model of `mpmd_overhead.py --sections first` (4 tanh layers of D=256, one per rank, Std1F1B
over 8 microbatches of a 64-row batch): `sxvalue_and_grad` over 4 ranks against
`jax.jit(jax.value_and_grad(loss))` on one device. A first call happens once per process, so each
round runs both contenders in fresh processes, one after the other, alternating which goes first.
Each process warms JAX up first (its backend and a one-addition program, which every process
pays once whatever it runs) and puts the arguments on their devices, then times the first call
to its result: wall and process CPU seconds (every thread: tracing, lowering, the compiler's
threads). The pipelined result is checked against the unsplit one (rtol 1e-5) after the timing.
With `--base PATH` (another checkout of the project) each round also runs the pipelined step with
that checkout's packages, in the same alternation: before and after under the same load.

    python benchmarks/mlp_first_call.py [--rounds 5] [--base PATH] [--json FILE]
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

HERE = Path(__file__).resolve().parent
CONTENDERS = ("unsplit", "pipeline")
RANKS, MICROBATCHES, D, ROWS = 4, 8, 256, 64


def first_call(contender: str) -> dict:
    """In this (fresh) process: the wall and CPU seconds of `contender`'s first call."""
    from mpmd_overhead import allclose, pipeline, references  # first: it sets JAX's flags

    import jax
    import jax.numpy as jnp
    from _timing import once

    from spectrax_core import schedules as S

    jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.zeros(4)))  # the backend's own start
    step, args, local = pipeline(RANKS, S.Std1F1B(microbatches=MICROBATCHES), RANKS, D, ROWS)
    _, unsplit = references(RANKS, MICROBATCHES)
    fn, fn_args = (step, args) if contender == "pipeline" else (unsplit, local)
    jax.block_until_ready(fn_args)
    wall, cpu = once(lambda: fn(*fn_args))
    if contender == "unsplit":
        return {"first_s": wall, "first_cpu_s": cpu}
    if not allclose(step(*args), unsplit(*local)):
        raise SystemExit("the pipelined step differs from the unsplit step")
    built = step.timings()
    return {"first_s": wall, "first_cpu_s": cpu, **{k: built[k] for k in ("lowered", "compiled", "relocated")}}


def fresh(contender: str, base: Path | None) -> dict:
    """`first_call(contender)` in a child process; `"base"` runs the pipeline on `base`'s packages."""
    env = dict(os.environ)
    if contender == "base":
        contender = "pipeline"
        env["PYTHONPATH"] = os.pathsep.join([str(base), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, __file__, "--one", contender], capture_output=True, text=True, check=False, env=env
    )
    if done.returncode != 0:
        raise SystemExit(f"{contender}: failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarized(values: list) -> dict:
    return {"min": min(values), "median": statistics.median(values), "spread": spread(values)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--one", choices=CONTENDERS, help=argparse.SUPPRESS)  # a child's contender
    parser.add_argument("--base", type=Path, default=None, help="another checkout, run in alternation")
    parser.add_argument("--json", default=HERE / "results" / "mlp_first_call.json")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(first_call(args.one)))
        return {}
    names = (*CONTENDERS, "base") if args.base else CONTENDERS
    runs: dict = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            runs[name].append(fresh(name, args.base))
        ratio = runs["pipeline"][-1]["first_s"] / runs["unsplit"][-1]["first_s"]
        print(f"round {r}: " + ", ".join(f"{n} {runs[n][-1]['first_s']:.2f} s" for n in names)
              + f" ({ratio:.2f}x)", flush=True)  # fmt: skip
    result = {"cpus": os.cpu_count(), "rounds": runs}
    for name in names[1:]:
        key = "ratio" if name == "pipeline" else f"{name}_ratio"
        result[key] = summarized([p["first_s"] / u["first_s"] for p, u in zip(runs[name], runs["unsplit"])])
    for name in names:
        result[name] = {k: summarized([run[k] for run in runs[name]]) for k in ("first_s", "first_cpu_s")}
    result["programs"] = {k: runs["pipeline"][-1][k] for k in ("lowered", "compiled", "relocated")}
    print(f"{'contender':9} {'min s':>7} {'median s':>9} {'spread':>7} {'cpu median s':>13}")
    for name in names:
        wall, cpu = result[name]["first_s"], result[name]["first_cpu_s"]
        print(f"{name:9} {wall['min']:7.2f} {wall['median']:9.2f} {wall['spread']:7.2f} {cpu['median']:13.2f}")
    for name in names[1:]:
        r = result["ratio" if name == "pipeline" else f"{name}_ratio"]
        print(f"{name} / unsplit, per round: min {r['min']:.2f}x, median {r['median']:.2f}x, spread {r['spread']:.2f}")
    print("pipeline programs: " + ", ".join(f"{k} {v}" for k, v in result["programs"].items()))
    if args.base:
        print("base programs: " + ", ".join(f"{k} {runs['base'][-1][k]}" for k in ("lowered", "compiled", "relocated")))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
