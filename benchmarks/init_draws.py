"""Compile and run time of owner-rank init programs, their random draws hashed with or without a loop.

The main job's LM (`examples/train_lm.py`: d128, 4 blocks staged over 4 ranks), traced as
`mp.init_on_owners` traces it. Two programs of `init_on_owners`: the first rank's blocks (its
rows of the stacked blocks, the program every rank runs) and the leaves that are not blocks
(embedding, final norm, head, made whole). Each is built `written out` (the library's way:
each draw's threefry hash as its 20 rounds of arithmetic, `spectrax_mpmd._trace.draws`) and
with `JAX's loop` (every draw left to JAX, which writes the hash as a loop on CPU), fresh each
round (a new trace, lowering and XLA compile), the contenders interleaved. The table gives
the loops each lowered program holds, the compile seconds (min, median, spread; the
process's CPU seconds next to them: XLA compiles in threads of its own), one run's
milliseconds (median over the rounds), XLA's temporaries and whether both give the same
values, bit for bit. `jax.jit(init)` of the whole model is compiled the same way, for
reference.

    python benchmarks/init_draws.py [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import json
import statistics
import sys
from pathlib import Path

import jax
import numpy as np
from _timing import interleaved, process_cpu, summary

import spectrax_mpmd as mp
from spectrax_mpmd._trace import rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_lm import TransformerLM

RANKS = 4
HOWS = ("written out", "JAX's loop")


def init_staged(key):
    lm = TransformerLM.init(key, vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=512)
    return mp.stage_blocks(lm, RANKS)


def programs() -> dict:
    """Name -> `(the traced init's jaxpr, the outputs the program makes)`."""
    closed = jax.make_jaxpr(init_staged)(jax.random.key(0))
    n = len(closed.jaxpr.outvars)
    sliced = rows.plan(closed, range(n)).sliced
    blocks = [k for k in range(n) if sliced[k]]
    return {
        "a rank's blocks": (closed, blocks[: len(blocks) // RANKS]),
        "embedding, norm, head": (closed, [k for k in range(n) if not sliced[k]]),
    }


def build(closed, outputs, written_out: bool):
    """A freshly traced, lowered and compiled program and its arguments."""
    fn, offsets = rows.rows_program(closed, outputs)
    args = (np.asarray(offsets, np.int32), jax.random.key(0))
    hashable = rows.hashable
    if not written_out:  # every draw left to JAX, as an init program made them before
        rows.hashable = lambda *a: False
    try:
        lowered = jax.jit(fn).lower(*args)
    finally:
        rows.hashable = hashable
    return lowered, lowered.compile(), args


def fresh_jit():
    """`jax.jit(init)` of a new function object: traced, lowered and compiled anew."""
    return jax.jit(lambda key: init_staged(key))


def loops(lowered) -> int:
    return lowered.as_text().count("stablehlo.while")


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/init_draws.json")
    args = parser.parse_args(argv)
    found = programs()
    builds = {}
    for name, (closed, outputs) in found.items():
        for how in HOWS:
            builds[name, how] = lambda c=closed, o=outputs, w=how == HOWS[0]: build(c, o, w)
    builds["whole model", "jax.jit(init)"] = lambda: (
        (lowered := fresh_jit().lower(jax.random.key(0))),
        lowered.compile(),
        (jax.random.key(0),),
    )
    compile_wall, compile_cpu = interleaved(
        {k: lambda b=b: b()[1] for k, b in builds.items()}, args.rounds, wait=None, clock=process_cpu
    )
    built = {k: b() for k, b in builds.items()}
    run_wall, _ = interleaved(
        {k: lambda c=c, a=a: c(*a) for k, (_, c, a) in built.items()}, args.rounds, calls=3
    )
    out = []
    print(
        f"{'program':24} {'how':14} {'loops':>5} {'compile s':>9} {'spread':>6} {'cpu s':>6} {'run ms':>7} {'temp MiB':>8}  same"
    )
    for (name, how), seconds in compile_wall.items():
        lowered, compiled, call = built[name, how]
        row = summary(seconds, compile_cpu[name, how], "s") | {
            "program": name,
            "how": how,
            "loops": loops(lowered),
            "run_ms": statistics.median(run_wall[name, how]) * 1e3,
            "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
            "same_values": None,
        }
        if name in found:  # the other way of the same program gives the same values
            other = built[name, HOWS[how == HOWS[0]]][1]
            row["same_values"] = all(np.array_equal(a, b) for a, b in zip(compiled(*call), other(*call)))
        out.append(row)
        print(
            f"{name:24} {how:14} {row['loops']:5d} {row['median_s']:9.3f} {row['spread']:6.2f} "
            f"{row['cpu_median_s']:6.2f} {row['run_ms']:7.2f} {row['temp_mib']:8.2f}  "
            f"{'' if row['same_values'] is None else row['same_values']}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
