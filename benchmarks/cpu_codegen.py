"""XLA:CPU's two code generators for small fusions: what each costs a first call and a step.

A pipelined step compiles one program per distinct stage cell, where the unsplit step compiles
one. On XLA:CPU every program pays a fixed compile cost whatever it holds, and much of it is the
setup of XLA's MLIR fusion emitters (its default). XLA can instead emit fusions with its older
loop emitters (`XLA_FLAGS=--xla_cpu_use_fusion_emitters=false`), cheaper to compile, slower to run.
This measures both sides, each round in fresh processes under each setting, alternating which goes
first:

  main job   `python examples/train_lm.py` (`startup.one_run`): its first call (owner-rank init
             included), the step's plan and compile, and the mean step of the training loop
  mlp        the 4-stage MLP's first call against the unsplit jitted step's, both under the same
             setting (`mlp_first_call.fresh`)

The flag applies to the whole process (the unsplit step too); the library passes no compiler
option of its own.

    python benchmarks/cpu_codegen.py [--rounds 3] [--steps 40] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
from contextlib import contextmanager
from pathlib import Path

from mlp_first_call import fresh
from startup import HERE, one_run, summarized

SETTINGS = {"fusion": "", "loop": "--xla_cpu_use_fusion_emitters=false"}


@contextmanager
def xla_flags(extra: str):
    """Child processes started inside see `extra` appended to `$XLA_FLAGS`."""
    saved = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = f"{saved or ''} {extra}".strip()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("XLA_FLAGS")
        else:
            os.environ["XLA_FLAGS"] = saved


def one_round(extra: str, steps: int) -> dict:
    """Every figure of one setting, each workload in a fresh process."""
    with xla_flags(extra):
        main = one_run(HERE, steps, [])
        pipeline, unsplit = fresh("pipeline", None), fresh("unsplit", None)
    return {
        "main_first_call_s": main["first_call_s"],
        "main_plan_compile_s": main["plan_compile_s"],
        "main_step_ms": 1e3 * main["train_s"] / max(1, steps - 1),
        "main_run_s": main["wall_s"],
        "mlp_first_s": pipeline["first_s"],
        "mlp_unsplit_first_s": unsplit["first_s"],
        "mlp_ratio": pipeline["first_s"] / unsplit["first_s"],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="training steps of each main-job run")
    parser.add_argument("--json", default=HERE.joinpath("benchmarks", "results", "cpu_codegen.json"))
    args = parser.parse_args(argv)
    runs: dict = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name in SETTINGS if r % 2 == 0 else reversed(SETTINGS):
            runs[name].append(one_round(SETTINGS[name], args.steps))
            row = runs[name][-1]
            print(f"round {r} {name:6}: main first call {row['main_first_call_s']:.2f} s, step "
                  f"{row['main_step_ms']:.1f} ms; mlp {row['mlp_first_s']:.3f} s "
                  f"({row['mlp_ratio']:.2f}x)", flush=True)  # fmt: skip
    result: dict = {"cpus": os.cpu_count(), "steps": args.steps, "flags": SETTINGS}
    result |= {name: summarized(rows) for name, rows in runs.items()}
    med = {name: {k: result[name][k]["median"] for k in rows[0]} for name, rows in runs.items()}
    result["loop_vs_fusion"] = {k: med["loop"][k] / med["fusion"][k] for k in med["fusion"]}
    print(f"{'figure (median)':22} {'fusion':>9} {'loop':>9} {'loop/fusion':>12}")
    for k, r in result["loop_vs_fusion"].items():
        print(f"{k:22} {med['fusion'][k]:9.3f} {med['loop'][k]:9.3f} {r:12.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
