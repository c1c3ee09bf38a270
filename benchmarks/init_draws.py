"""Compile time of owner-rank init programs with their random draws hashed together or each alone.

The main job's LM (`examples/train_lm.py`: d128, 4 blocks staged over 4 ranks), traced as
`mp.init_on_owners` traces it. Two programs of `init_on_owners`: the first rank's blocks (its
rows of the stacked blocks, the program every rank runs) and the leaves that are not blocks
(embedding, final norm, head, made whole). Each is built as `draws` together (the library's
way: a wave of draws by one threefry hash) and `alone` (every draw lowered by JAX on its own),
fresh each round (a new trace, lowering and XLA compile), the contenders interleaved. The
table gives the loops each lowered program holds, the compile seconds (min, median, spread;
the process's CPU seconds next to them: XLA compiles in threads of its own) and whether both
give the same values, bit for bit. `jax.jit(init)` of the whole model is timed the same way,
for reference.

    python benchmarks/init_draws.py [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from _timing import interleaved, summary

import spectrax_mpmd as mp
from spectrax_mpmd._trace import draws, rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_lm import TransformerLM

RANKS = 4


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


def build(closed, outputs, together: bool):
    """A freshly traced, lowered and compiled program and its arguments."""
    cap = draws.MAX_ELEMENTS
    draws.MAX_ELEMENTS = cap if together else 0  # 0: every draw bound on its own, as JAX writes it
    try:
        fn, offsets = rows.rows_program(closed, outputs)
        args = (np.asarray(offsets, np.int32), jax.random.key(0))
        lowered = jax.jit(fn).lower(*args)
    finally:
        draws.MAX_ELEMENTS = cap
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
    contenders = {}
    for name, (closed, outputs) in found.items():
        for how in ("draws", "alone"):
            contenders[name, how] = lambda c=closed, o=outputs, t=how == "draws": build(c, o, t)[1]
    contenders["whole model", "jax.jit(init)"] = lambda: fresh_jit().lower(jax.random.key(0)).compile()
    wall, cpu = interleaved(contenders, args.rounds, wait=None, clock=time.process_time)
    out = []
    print(
        f"{'program':24} {'how':14} {'loops':>5} {'min s':>7} {'median s':>9} {'spread':>7} {'cpu s':>7}  same"
    )
    for (name, how), seconds in wall.items():
        row = summary(seconds, cpu[name, how], "s")
        if how == "jax.jit(init)":
            lowered, same = fresh_jit().lower(jax.random.key(0)), None
        else:
            closed, outputs = found[name]
            lowered, compiled, call = build(closed, outputs, how == "draws")
            _, other, _ = build(closed, outputs, how != "draws")
            same = all(np.array_equal(a, b) for a, b in zip(compiled(*call), other(*call)))
        row |= {"program": name, "how": how, "loops": loops(lowered), "same_values": same}
        out.append(row)
        print(
            f"{name:24} {how:14} {row['loops']:5d} {row['min_s']:7.3f} {row['median_s']:9.3f} "
            f"{row['spread']:7.2f} {row['cpu_median_s']:7.3f}  {'' if same is None else same}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
