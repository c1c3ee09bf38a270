"""The main job's startup: its first call against the plan-and-compile part of it, whole runs.

Each round runs `python examples/train_lm.py` in a fresh process (a first call happens once per
process) and reads from its `metrics.json` the first call (`first_call_s`: from the start of
training to the first step's loss, owner-rank initialisation included) and its plan-and-compile
part (`first_call.total_s`, the step's own build report, which holds the owner-rank init
programs where they compile with the step's); the command's wall time and its CPU
time (children's user + system) are timed around it. With `--base PATH` (another checkout of the
project, e.g. `git worktree add /tmp/base main`) each round runs both trees one after the other,
alternating which goes first, so that both see the same load, and the tree's first call is also
given against the base's plan and compile (for a base that compiles the init programs apart, the
step's own build). Each round also runs plain JAX on the same model, in a fresh process of its
own (`jax`): `jax.jit(init)` on one device, then the unsplit step's first update as one program
(train_lm's `--compile-reference` step), its `first_call_s` the two together and its
`plan_compile_s` the step's alone: what the ratio is when nothing is pipelined.

    python benchmarks/startup.py [--rounds 3] [--steps 20] [--base PATH] [--json FILE]

`--json` defaults to `$OUT/startup.json` where `$OUT` is set (the accelerator machine's output
folder), else `benchmarks/results/startup.json`. Other arguments after `--` go to train_lm.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import once, spread

HERE = Path(__file__).resolve().parent.parent


def children_cpu() -> float:
    """CPU seconds (user + system) of the finished child processes."""
    t = os.times()
    return t.children_user + t.children_system


def one_run(tree: Path, steps: int, extra: list[str]) -> dict:
    """One fresh run of `tree`'s main job: its first call, plan-and-compile part, wall and CPU, and
    its training loop's wall seconds."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "examples/train_lm.py", "--steps", str(steps), "--sample-tokens", "4"]
        command += ["--out", out, *extra]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
        ran = {}

        def run():
            ran["done"] = subprocess.run(
                command, cwd=tree, env=env, capture_output=True, text=True, check=False
            )

        wall, cpu = once(run, wait=None, clock=children_cpu)
        done = ran["done"]
        if done.returncode != 0:
            raise SystemExit(f"{tree}: train_lm.py failed:\n{done.stderr[-3000:]}")
        metrics = json.loads((Path(out) / "metrics.json").read_text())
    first, plan = metrics["first_call_s"], metrics["first_call"]["total_s"]
    return {
        "first_call_s": first,
        "plan_compile_s": plan,
        "ratio": first / plan,
        "wall_s": wall,
        "cpu_s": cpu,
        "train_s": metrics["wall_s"],  # the training loop after the first call
    }


def plain_jax_once(extra: list[str]) -> None:
    """In this (fresh) process: train_lm's model initialised by `jax.jit(init)` on one device (the
    pipeline's first: a fake CPU device where train_lm puts its ranks there), then the unsplit
    step's first update; prints the two times as JSON."""
    sys.path.insert(0, str(HERE / "examples"))
    import train_lm  # first: it sets the XLA flags JAX starts with

    args = train_lm.parse_args(extra)
    import jax
    import numpy as np
    import optax

    devices, _ = train_lm.choose_devices(args.stages, jax.devices(), lambda: jax.devices("cpu"))
    jax.config.update("jax_default_device", devices[0])
    jax.block_until_ready(jax.jit(lambda x: x + 1)(np.zeros(4)))  # the backend's own start
    lr = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10), args.steps)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr))

    init = train_lm.lm_init(args, args.stages * train_lm.make_schedule(args).virtual_stages)
    made = {}

    def make():
        made["params"] = jax.jit(init)(jax.random.key(0))
        return made["params"]

    init_s, _ = once(make)
    step_s = train_lm.unsplit_first_call(args, made.pop("params"), tx, devices[0])
    print(json.dumps({"init_s": init_s, "step_s": step_s}))


def plain_jax_run(steps: int, extra: list[str]) -> dict:
    """`plain_jax_once` in a child process, as `one_run`'s figures (no whole-run wall or CPU)."""
    command = [sys.executable, __file__, "--plain-jax-once", "--", "--steps", str(steps), *extra]
    done = subprocess.run(command, cwd=HERE, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"plain JAX startup failed:\n{done.stderr[-3000:]}")
    timed = json.loads(done.stdout.strip().splitlines()[-1])
    first = timed["init_s"] + timed["step_s"]
    return {"first_call_s": first, "plan_compile_s": timed["step_s"], "ratio": first / timed["step_s"]}


def summarized(runs: list[dict]) -> dict:
    """Per figure of `runs`: min, median and spread over the rounds."""
    out = {"rounds": runs}
    for name in runs[0]:
        values = [r[name] for r in runs]
        out[name] = {"min": min(values), "median": statistics.median(values), "spread": spread(values)}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="training steps of each run (default 20)")
    parser.add_argument("--base", default=None, help="another checkout to run in alternation (before/after)")
    default = Path(os.environ["OUT"]) / "startup.json" if os.environ.get("OUT") else None
    parser.add_argument("--json", default=default or HERE / "benchmarks" / "results" / "startup.json")
    parser.add_argument("--plain-jax-once", action="store_true", help=argparse.SUPPRESS)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    if args.plain_jax_once:
        return plain_jax_once(extra)
    trees = {"tree": HERE} | ({"base": Path(args.base).resolve()} if args.base else {})
    contenders = {name: (lambda t=tree: one_run(t, args.steps, extra)) for name, tree in trees.items()}
    contenders["jax"] = lambda: plain_jax_run(args.steps, extra)
    runs: dict = {name: [] for name in contenders}
    for r in range(args.rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            runs[name].append(contenders[name]())
            row = runs[name][-1]
            whole = f", whole run {row['wall_s']:.1f} s (CPU {row['cpu_s']:.1f} s)" if "wall_s" in row else ""
            print(f"round {r} {name:9}: first call {row['first_call_s']:.2f} s, plan and compile "
                  f"{row['plan_compile_s']:.2f} s ({row['ratio']:.2f}x){whole}", flush=True)  # fmt: skip
    result = {"cpus": os.cpu_count(), "steps": args.steps, "train_lm_args": extra}
    result |= {name: summarized(rows) for name, rows in runs.items()}
    if "base" in result:  # the first call against compiling the step alone, as the base builds it
        first, plan = result["tree"]["first_call_s"]["median"], result["base"]["plan_compile_s"]["median"]
        result["first_vs_base_plan"] = first / plan
    result["first_vs_jax"] = (
        result["tree"]["first_call_s"]["median"] / result["jax"]["first_call_s"]["median"]
    )
    print(
        f"{'tree':9} {'first s':>8} {'plan s':>7} {'ratio':>6} {'run s':>7} {'cpu s':>7} (medians; spread of first)"
    )
    for name in contenders:
        s = result[name]
        run_s, cpu_s = (f"{s[k]['median']:7.1f}" if k in s else f"{'-':>7}" for k in ("wall_s", "cpu_s"))
        print(f"{name:9} {s['first_call_s']['median']:8.2f} {s['plan_compile_s']['median']:7.2f} "
              f"{s['ratio']['median']:6.2f} {run_s} {cpu_s} ({s['first_call_s']['spread']:.2f})")  # fmt: skip
    if "base" in result:
        print(f"first call (tree) / plan and compile (base): {result['first_vs_base_plan']:.2f} (medians)")
    print(f"first call (tree) / plain JAX's (jit(init) and the unsplit step): {result['first_vs_jax']:.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
