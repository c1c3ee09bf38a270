"""The cost of the one entry point, and pipelined decoding, side by side in one process.

Rows:
  train   `spx.run` MPMD train step of an eager model (embed -> 4 residual tanh
          blocks -> head, D=256, B=64, m=8, 4 ranks, Std1F1B) against the same
          step written by hand with `sxvalue_and_grad` over plain arrays with the
          same weights and markers (target: spx.run / hand <= 1.05).
  decode  greedy tokens/s of the main job's LM (byte vocabulary, d_model 128,
          4 blocks) through `PipelineDecoder` on 4 ranks, against the unsplit
          `greedy_decode` on one device (report: the pipelined per-token cost is
          one cell per rank plus the transfers between them).

Rounds interleave the two sides; each reports min, median and spread ((max - min) / median)
of wall time, and the issuing thread's CPU time (`_timing.issue_clock`) next to it. JSON: per side
`min_ms`, `median_ms`, `spread`, `cpu_min_ms`, `cpu_median_ms` (per call).

    python benchmarks/run.py [--rounds 7] [--out benchmarks/results/run.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import interleaved, summary  # noqa: E402

import spectrax_eager as spx  # noqa: E402
import spectrax_mpmd as mp  # noqa: E402
from spectrax_core.models import TransformerLM, greedy_decode  # noqa: E402
from spectrax_core.schedules import Std1F1B  # noqa: E402

D, B, M, RANKS, BLOCKS = 256, 64, 8, 4, 4


class Net(spx.Module):
    def __init__(self, rngs):
        self.embed = spx.nn.Linear(D, D, rngs=rngs)
        self.blocks = spx.nn.ModuleList([spx.nn.Linear(D, D, rngs=rngs) for _ in range(BLOCKS)])
        self.head = spx.nn.Linear(D, D, rngs=rngs)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + jnp.tanh(block(h))
        return self.head(h)


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def hand_loss(p, x, y):
    """The same network over a list of (weight, bias) pairs, cut where `spx.run` cuts it: a marker
    on the output of blocks 0, 1 and 2 (so the residual stream crosses each boundary too)."""
    h = x @ p[0][0] + p[0][1]
    for k in range(BLOCKS):
        w, b = p[1 + k]
        out = h @ w + b
        if k < BLOCKS - 1:
            out = mp.sxstage_iter(out)
        h = h + jnp.tanh(out)
    return mse(h @ p[-1][0] + p[-1][1], y)


def measure(fns: dict, rounds: int, calls: int) -> dict:
    """Interleaved rounds (one untimed call of each side before its timed ones in every round):
    per name, the summary of its per-call wall and issuing-thread CPU time."""
    wall, cpu = interleaved(fns, rounds, calls, warmup=1)
    return {name: summary(wall[name], cpu[name]) for name in fns}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "run.json"))
    args = parser.parse_args(argv)
    devices = jax.devices()[:RANKS]
    mesh = mp.create_mesh((RANKS, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=devices)
    schedule = Std1F1B(microbatches=M)

    model = Net(spx.Rngs(0))
    x, y = jax.random.normal(jax.random.key(1), (B, D)), jax.random.normal(jax.random.key(2), (B, D))
    params = spx.tree_state(model)["parameters"]
    layers = ["embed", *[f"blocks.{k}" for k in range(BLOCKS)], "head"]
    p = [(params[f"{name}.weight"], params[f"{name}.bias"]) for name in layers]
    hand = mp.sxvalue_and_grad(hand_loss, mesh=mesh, schedule=schedule)

    def via_run():
        return spx.run(model, inputs=x, targets=y, mesh=mesh, loss_fn=mse, schedule=schedule)

    run_loss, hand_loss_value = float(via_run()[0]), float(hand(p, x, y)[0])
    assert np.isclose(run_loss, hand_loss_value, rtol=1e-5), (run_loss, hand_loss_value)

    lm = TransformerLM.init(jax.random.key(0), vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=512)
    prompt = jnp.asarray([list(b"Alice was beginning to ")], jnp.int32)
    steps = 32
    decoder = mp.PipelineDecoder(lm, mesh=mesh)
    want = np.asarray(greedy_decode(lm, prompt, steps))
    assert np.array_equal(np.asarray(decoder.generate(prompt, steps)), want)

    train = measure({"spx.run": via_run, "hand": lambda: hand(p, x, y)}, args.rounds, 10)
    decode = measure(
        {
            "pipelined": lambda: decoder.generate(prompt, steps),
            "unsplit": lambda: greedy_decode(lm, prompt, steps),
        },
        args.rounds,
        2,
    )
    report = {"train": train, "decode": decode, "decode_tokens": steps, "rounds": args.rounds}
    rt, ht = train["spx.run"], train["hand"]
    pd, ud = decode["pipelined"], decode["unsplit"]
    print(f"{'row':8s} {'side':10s} {'wall min ms':>11s} {'median':>8s} {'spread':>7s} "
          f"{'cpu median ms':>13s}")  # fmt: skip
    for row, sides in (("train", train), ("decode", decode)):
        for side, s in sides.items():
            print(f"{row:8s} {side:10s} {s['min_ms']:11.2f} {s['median_ms']:8.2f} {s['spread']:7.2f} "
                  f"{s['cpu_median_ms']:13.2f}")  # fmt: skip
    print(
        f"spx.run / hand (median wall): {rt['median_ms'] / ht['median_ms']:.3f}  "
        f"(min: {rt['min_ms'] / ht['min_ms']:.3f})"
    )
    print(
        f"decode tokens/s: pipelined {steps / pd['median_ms'] * 1e3:.0f}, "
        f"unsplit {steps / ud['median_ms'] * 1e3:.0f}"
    )
    report["ratios"] = {
        "run_vs_hand_median": rt["median_ms"] / ht["median_ms"],
        "run_vs_hand_min": rt["min_ms"] / ht["min_ms"],
        "decode_tokens_per_s": {
            "pipelined": steps / pd["median_ms"] * 1e3,
            "unsplit": steps / ud["median_ms"] * 1e3,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
