"""What an exact padded token mean costs a pipelined training step.

The main job's LM (TransformerLM, vocab 256, d=128, 4 layers: 1.12 M parameters) on 4
pipeline ranks (Std1F1B, m=4, batch 16 x 32 tokens), `mp.runner(...)` steps (loss and
gradients) with three losses:
  mean      the plain token mean (`softmax_cross_entropy`)
  padded    the padded token mean `sum(ce * mask) / max(sum(mask), 1)`: its count is taken over
            the whole batch, on the loss rank
  weighted  the padded mean with `microbatch_weight_fn` (each microbatch's real tokens)
For each: the first call (trace, split, compile; the trace phase and the loss analysis that
proves the loss exact separately) and `--rounds` interleaved rounds of `--calls` calls: wall
time min, median and spread, and the issuing thread's CPU time. Then the analysis's share of
the first call of a 16-block LM (the padded loss, 4 ranks). Writes
benchmarks/results/loss_weights.json.

    python benchmarks/loss_weights.py [--rounds 7] [--calls 10]
"""

from __future__ import annotations

import argparse
import json
import pathlib

from _devices import cpu_devices

cpu_devices(8)  # before JAX is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _timing import interleaved, once, summary  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core.losses import softmax_cross_entropy  # noqa: E402
from spectrax_core.models import TransformerLM  # noqa: E402
from spectrax_core.schedules import Std1F1B  # noqa: E402

OUT = pathlib.Path(__file__).parent / "results" / "loss_weights.json"


def padded(logits, targets):
    labels, mask = targets
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def contenders(n_layers: int = 4) -> dict:
    lm = TransformerLM.init(
        jax.random.key(0), vocab_size=256, d_model=128, n_layers=n_layers, n_heads=4, d_ff=512
    )
    tokens = jax.random.randint(jax.random.key(1), (16, 32), 0, 256)
    labels = jnp.roll(tokens, -1, axis=1)
    lengths = jax.random.randint(jax.random.key(2), (16, 1), 0, 33)
    mask = (jnp.arange(32)[None, :] < lengths).astype(jnp.float32)
    mesh = mp.create_mesh((4, 1, -1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])
    params = mp.stage_blocks(lm, 4)
    schedule = Std1F1B(microbatches=4)
    steps = {
        "mean": (mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, schedule=schedule), labels),
        "padded": (mp.runner(mesh=mesh, loss_fn=padded, schedule=schedule), (labels, mask)),
        "weighted": (
            mp.runner(
                mesh=mesh,
                loss_fn=padded,
                schedule=schedule,
                microbatch_weight_fn=lambda inputs, targets: jnp.sum(targets[1]),
            ),
            (labels, mask),
        ),
    }
    return {name: (step, lambda step=step, t=t: step(params, tokens, t)) for name, (step, t) in steps.items()}


def first_call(step, call) -> dict:
    """The first call's wall seconds, with its trace and loss-analysis phases."""
    seconds = once(call)[0]
    phases = step.runner.step.timings()["seconds"]
    return {"first_s": seconds, "trace_s": phases["trace"], "analysis_s": phases["analysis"]}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=10)
    args = p.parse_args(argv)
    steps = contenders()
    firsts = {name: first_call(step, call) for name, (step, call) in steps.items()}
    wall, cpu = interleaved({name: call for name, (_, call) in steps.items()}, args.rounds, args.calls)
    records = []
    print(
        f"{'loss':9} {'1st call s':>10} {'trace s':>8} {'analysis s':>10} {'min ms':>8} {'median ms':>9} "
        f"{'spread':>7} {'cpu ms':>7}"
    )
    for name in steps:
        row = {"loss": name, **firsts[name]}
        row.update(summary(wall[name], cpu[name]))
        records.append(row)
        print(
            f"{name:9} {row['first_s']:10.2f} {row['trace_s']:8.3f} {row['analysis_s']:10.3f} "
            f"{row['min_ms']:8.2f} {row['median_ms']:9.2f} {row['spread']:7.2f} {row['cpu_median_ms']:7.2f}"
        )
    step, call = contenders(n_layers=16)["padded"]
    deep = {"loss": "padded, 16 blocks", **first_call(step, call)}
    records.append(deep)
    share = deep["analysis_s"] / deep["first_s"]
    print(
        f"16-block LM, padded loss: first call {deep['first_s']:.2f} s, analysis {deep['analysis_s']:.3f} s "
        f"({share:.1%} of it)"
    )
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(records, indent=1))
    return records


if __name__ == "__main__":
    main()
