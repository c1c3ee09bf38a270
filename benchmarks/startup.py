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
step's own build).

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
    """One fresh run of `tree`'s main job: its first call, plan-and-compile part, wall and CPU."""
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
    }


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
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    trees = {"tree": HERE} | ({"base": Path(args.base).resolve()} if args.base else {})
    runs: dict = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            runs[name].append(one_run(trees[name], args.steps, extra))
            row = runs[name][-1]
            print(f"round {r} {name:9}: first call {row['first_call_s']:.2f} s, plan and compile "
                  f"{row['plan_compile_s']:.2f} s ({row['ratio']:.2f}x), whole run {row['wall_s']:.1f} s "
                  f"(CPU {row['cpu_s']:.1f} s)", flush=True)  # fmt: skip
    result = {"cpus": os.cpu_count(), "steps": args.steps, "train_lm_args": extra}
    result |= {name: summarized(rows) for name, rows in runs.items()}
    if "base" in result:  # the first call against compiling the step alone, as the base builds it
        first, plan = result["tree"]["first_call_s"]["median"], result["base"]["plan_compile_s"]["median"]
        result["first_vs_base_plan"] = first / plan
    print(
        f"{'tree':9} {'first s':>8} {'plan s':>7} {'ratio':>6} {'run s':>7} {'cpu s':>7} (medians; spread of first)"
    )
    for name in trees:
        s = result[name]
        print(f"{name:9} {s['first_call_s']['median']:8.2f} {s['plan_compile_s']['median']:7.2f} "
              f"{s['ratio']['median']:6.2f} {s['wall_s']['median']:7.1f} {s['cpu_s']['median']:7.1f} "
              f"({s['first_call_s']['spread']:.2f})")  # fmt: skip
    if "base" in result:
        print(f"first call (tree) / plan and compile (base): {result['first_vs_base_plan']:.2f} (medians)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
