"""Train a byte-level LM on sequences of very different lengths without padding every row to the longest.

Each batch holds `--rows` lines of `examples/data/corpus.txt` joined into sequences whose lengths
follow a long tail (log-normal, clipped to [`--shortest`, `--longest`]): most are short, a few
near the longest. The step is `mp.sxvalue_and_grad` with `length_buckets=mp.LengthBuckets(...)`:
each call sorts the rows by length and runs every microbatch padded only to its length bucket (a
power of two), all in one pipelined step over `--stages` ranks. A batch whose microbatches fall
in buckets seen before reuses their programs (a new composition builds a plan, compiling nothing). The loss is the token mean over
each row's real tokens: the first step checks it and its gradients against the unsplit function
on the padded batch, then the model trains with `StagedOptimizer`. It prints each step's buckets,
the loss and real tokens per second; `--compare` also times the same step with every row padded
to `--longest`.

    python examples/variable_length.py                      # 4 ranks, Std1F1B, 8 microbatches
    python examples/variable_length.py --schedule ZeroBubbleH1 --steps 20 --compare
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # must precede importing JAX; affects the CPU backend only
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core import apply  # noqa: E402
from spectrax_core import schedules as S  # noqa: E402
from spectrax_core.models import TransformerLM  # noqa: E402

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def loss(params, tokens, targets, lengths):
    """The token mean of the cross-entropy over each row's first `lengths` tokens."""
    ce = optax.softmax_cross_entropy_with_integer_labels(apply(params, tokens), targets)
    mask = (jnp.arange(tokens.shape[1])[None] < lengths[:, None]).astype(jnp.float32)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def batches(args):
    """Endless `(tokens, targets, lengths)`: rows of the corpus at long-tailed lengths, each padded
    with zeros to `--longest` (a fixed padded length keeps the buckets the same from batch to
    batch: the padded length is always one)."""
    text = np.frombuffer(CORPUS.read_bytes(), np.uint8).astype(np.int32)
    rng = np.random.default_rng(args.seed)
    while True:
        lengths = rng.lognormal(np.log(args.median), 1.0, args.rows)
        lengths = np.clip(lengths, args.shortest, args.longest).astype(np.int32)
        data = np.zeros((args.rows, args.longest + 1), np.int32)
        for row, length in enumerate(lengths):
            start = rng.integers(0, len(text) - length - 1)
            data[row, : length + 1] = text[start : start + length + 1]
        yield data[:, :-1], data[:, 1:], lengths


def check_exact(step, params, batch) -> None:
    value, grads = step(params, *batch)
    ref_value, ref_grads = jax.value_and_grad(loss)(params, *batch)
    close = all(
        np.allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))
    )
    print(
        f"loss {float(value):.6f}, unsplit on the padded batch {float(ref_value):.6f}; gradients equal: {close}"
    )


def timed(step, params, batch) -> float:
    jax.block_until_ready(step(params, *batch))  # builds the plan of this composition of buckets
    start = time.perf_counter()
    jax.block_until_ready(step(params, *batch))
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--schedule", default="Std1F1B", help="a schedule of spectrax_core.schedules")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--median", type=float, default=96.0, help="median row length (log-normal)")
    p.add_argument("--shortest", type=int, default=32)
    p.add_argument("--longest", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", action="store_true", help="also time every row padded to --longest")
    args = p.parse_args(argv)

    lm = TransformerLM.init(
        jax.random.key(0),
        vocab_size=256,
        d_model=args.d_model,
        n_layers=args.stages,
        n_heads=4,
        d_ff=4 * args.d_model,
    )
    params = mp.stage_blocks(lm, args.stages)
    mesh = mp.create_mesh((args.stages, 1, -1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[: args.stages])
    schedule = getattr(S, args.schedule)(microbatches=args.microbatches)
    step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=schedule, length_buckets=mp.LengthBuckets(lengths=3))
    data = batches(args)
    first = next(data)
    check_exact(step, params, first)
    print(step.bucket_summary(params, *first))
    if args.compare:
        padded = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=schedule)
        seconds = {
            "padded to --longest": timed(padded, params, first),
            "length buckets": timed(step, params, first),
        }
        for name, s in seconds.items():
            print(f"{name:22} {s * 1e3:8.0f} ms  {first[2].sum() / s:8.0f} real tokens/s")

    opt = mp.StagedOptimizer(optax.adamw(3e-3), max_grad_norm=1.0)
    state = None
    for it in range(args.steps):
        batch = first if it == 0 else next(data)
        start = time.perf_counter()
        value, grads = step(params, *batch)
        state = opt.init(params, grads) if state is None else state
        params, state = opt.update(grads, state, params)
        seconds = time.perf_counter() - start
        lengths = step.last_entry.lengths
        print(
            f"step {it:3d}  loss {float(value):.4f}  {batch[2].sum() / seconds:8.0f} tokens/s  microbatch lengths {lengths}"
        )


if __name__ == "__main__":
    main()
