"""Tokens per second of a long-tailed batch: microbatches at their length bucket against every row
padded to the batch's longest.

The main job's LM (TransformerLM, vocab 256, d=128, 4 layers, 4 heads, d_ff 512) on 4 pipeline
ranks (`--schedule`, m=8, 32 rows): row lengths drawn log-normal (median `--median` tokens) and
clipped to [32, 1024], so most rows are short and a few near the longest; the loss is the token
mean masked by the lengths. Contenders, the same function and batch:
  padded    `sxvalue_and_grad`: every row padded to the batch's longest
  buckets   the same with `length_buckets=mp.LengthBuckets(lengths=3)`: rows sorted by length,
            each microbatch padded to the power of two above its longest row, one step
Both give the same loss and gradients (checked). Reported: each one's first call and program
count, `--rounds` interleaved rounds of one step (wall min, median, spread; the issuing thread's
CPU time), real tokens per second (the sum of the lengths over the median step) and their ratio;
and the planner's predicted step for the bucketed batch (`spectrax_mpmd._planner.buckets`: its
cells measured one at a time per (stage, kind, bucket), on the compute units and issuing cost the
padded step measured) against its measured median. Writes benchmarks/results/length_buckets.json.

    python benchmarks/length_buckets.py [--rounds 5] [--schedule Std1F1B]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib

from _devices import cpu_devices

cpu_devices(8)  # before JAX is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import interleaved, once, summary, times  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core import apply  # noqa: E402
from spectrax_core import schedules as S  # noqa: E402
from spectrax_core.models import TransformerLM  # noqa: E402
from spectrax_mpmd._planner.backend import busy_and_wall, shares_host, step_units  # noqa: E402
from spectrax_mpmd._planner.buckets import measured_cells, predicted_step  # noqa: E402
from spectrax_mpmd._planner.model_error import MODEL_ERROR  # noqa: E402

OUT = pathlib.Path(__file__).parent / "results" / "length_buckets.json"
ROWS, MICROBATCHES, RANKS, SHORTEST, LONGEST = 32, 8, 4, 32, 1024


def loss(params, tokens, targets, lengths):
    """The token mean of the LM's cross-entropy over each row's first `lengths` tokens."""
    ce = optax.softmax_cross_entropy_with_integer_labels(apply(params, tokens), targets)
    mask = (jnp.arange(tokens.shape[1])[None] < lengths[:, None]).astype(jnp.float32)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def long_tailed_batch(median: float, seed: int = 0):
    """`(tokens, targets, lengths)`: lengths log-normal around `median`, clipped to [32, 1024],
    the longest at 1024; every row padded to the longest."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 1.0, ROWS), SHORTEST, LONGEST).astype(np.int32)
    lengths[np.argmax(lengths)] = LONGEST
    padded = int(lengths.max())
    tokens = rng.integers(0, 256, (ROWS, padded + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:], lengths


def contenders(schedule_name: str, median: float):
    lm = TransformerLM.init(jax.random.key(0), vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=512)
    params = mp.stage_blocks(lm, RANKS)
    mesh = mp.create_mesh((RANKS, 1, -1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:RANKS])
    schedule = getattr(S, schedule_name)(microbatches=MICROBATCHES)
    step = functools.partial(mp.sxvalue_and_grad, loss, mesh=mesh, schedule=schedule)
    steps = {"padded": step(), "buckets": step(length_buckets=mp.LengthBuckets(lengths=3))}
    args = (params, *long_tailed_batch(median))
    return steps, args, schedule


def programs(step) -> int:
    return len({id(st.fn) for st in step.last_entry.plan.steps if hasattr(st.fn, "cost_analysis")})


def prediction(steps: dict, args, schedule) -> dict:
    """The planner's predicted step for the bucketed batch, and what it is made of."""
    devices = jax.devices()[:RANKS]
    measured = busy_and_wall(steps["padded"], args)
    units, issue = step_units(measured, devices), measured[2]
    cells = measured_cells(steps["buckets"], args)
    seconds = predicted_step(schedule, RANKS, cells, units, issue, shares_host(devices))
    return {"predicted_ms": seconds * 1e3, "units": units, "issue_us": issue * 1e6}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--schedule", default="Std1F1B")
    p.add_argument("--median", type=float, default=128.0)
    a = p.parse_args(argv)
    steps, args, schedule = contenders(a.schedule, a.median)
    lengths = args[3]
    tokens = int(lengths.sum())
    rows, firsts = {}, {}
    for name, step in steps.items():
        firsts[name] = once(lambda step=step: step(*args))[0]
    (l0, g0), (l1, g1) = steps["padded"](*args), steps["buckets"](*args)
    np.testing.assert_allclose(l0, l1, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    wall, cpu = interleaved({name: functools.partial(s, *args) for name, s in steps.items()}, a.rounds)
    print(
        f"{a.schedule}, {RANKS} ranks, {ROWS} rows x m={MICROBATCHES}: {tokens} real tokens, padded "
        f"length {args[1].shape[1]} ({tokens / lengths.size / args[1].shape[1]:.0%} real)"
    )
    print(f"{'contender':9} {'1st call s':>10} {'programs':>8} {'min ms':>8} {'median ms':>9} {'spread':>7} "
          f"{'cpu ms':>7} {'tokens/s':>9}")  # fmt: skip
    for name, step in steps.items():
        row = {"first_s": firsts[name], "programs": programs(step), **summary(wall[name], cpu[name])}
        row["tokens_per_s"] = tokens / (row["median_ms"] * 1e-3)
        rows[name] = row
        print(
            f"{name:9} {row['first_s']:10.1f} {row['programs']:8d} {row['min_ms']:8.0f} {row['median_ms']:9.0f} "
            f"{row['spread']:7.2f} {row['cpu_median_ms']:7.1f} {row['tokens_per_s']:9.0f}"
        )
    speedup = rows["buckets"]["tokens_per_s"] / rows["padded"]["tokens_per_s"]
    summary_line = str(steps["buckets"].bucket_summary(*args))
    predicted = prediction(steps, args, schedule)
    error = predicted["predicted_ms"] / rows["buckets"]["median_ms"] - 1
    print(f"buckets: {summary_line}")
    print(f"tokens/s, buckets over padded: {times(speedup)}")
    print(
        f"planner's predicted bucketed step {predicted['predicted_ms']:.0f} ms against "
        f"{rows['buckets']['median_ms']:.0f} ms measured ({error:+.0%}; documented error {MODEL_ERROR:.0%})"
    )
    record = {
        "schedule": a.schedule,
        "rows": rows,
        "tokens": tokens,
        "padded_length": int(args[1].shape[1]),
        "lengths": sorted(int(x) for x in lengths),
        "microbatch_lengths": list(steps["buckets"].bucket_summary(*args).lengths),
        "speedup": speedup,
        "prediction": {**predicted, "error": error, "model_error": MODEL_ERROR},
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
