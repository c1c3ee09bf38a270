"""Per-token decode cost of a BlockStack with a stacked KV cache, for 1, 2 and 4 blocks.

The model is a TransformerLM (byte vocabulary, d_model 128, 4 heads, d_ff 512) with `n` blocks;
a batch of `--batch` prompts of 8 tokens is prefilled into a cache of `--max-len` positions, then
`--tokens` one-token steps of `lm_generate_step` (jitted, the cache donated) are timed. A row is
the per-token wall time (min / median / spread over rounds) and the issuing thread's CPU time; the
last column is the per-token time over the 1-block row's (a decode that costs what its blocks cost
is about `n`).

Rounds interleave the block counts. With `--trees A B ...` every round runs this script once per
tree (a child process with `PYTHONPATH=tree`, in turn), so two versions of the library are
measured in interleaved rounds on the same machine; one table row per tree and block count.

    python benchmarks/stack_decode.py [--rounds 5] [--out benchmarks/results/stack_decode.json]
    python benchmarks/stack_decode.py --trees /path/to/before /path/to/after --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _timing import summary  # noqa: E402

BLOCKS = (1, 2, 4)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--trees", nargs="*", default=None, help="library trees to compare, one child each")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="benchmarks/results/stack_decode.json")
    return p.parse_args()


def decoders(args) -> dict:
    """Per block count: a function that decodes `args.tokens` tokens after a prefill (compiled once)."""
    from spectrax_core.models import TransformerLM, init_cache
    from spectrax_core.models._generate import lm_generate_step
    from spectrax_core.models._sample import Sampler, gen_state

    prompt = jax.random.randint(jax.random.key(1), (args.batch, 8), 0, 256)
    starts = jnp.zeros((args.batch,), jnp.int32)
    out = {}
    for n in BLOCKS:
        lm = TransformerLM.init(
            jax.random.key(0), vocab_size=256, d_model=128, n_layers=n, n_heads=4, d_ff=512
        )

        def run(lm=lm) -> float:
            """Prefill, then time the one-token steps: (wall, thread CPU) seconds per token."""
            state = gen_state(args.batch, args.tokens + 1, None, ())
            cache = init_cache(lm, args.batch, args.max_len)
            tokens, cache, state = lm_generate_step(lm, prompt, cache, starts, state, Sampler(), 0)
            jax.block_until_ready((tokens, cache))
            w0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(args.tokens):
                tokens, cache, state = lm_generate_step(lm, tokens, cache, starts, state, Sampler(), 0)
            jax.block_until_ready((tokens, cache))
            return (time.perf_counter() - w0) / args.tokens, (time.thread_time() - c0) / args.tokens

        run()  # compile
        out[n] = run
    return out


def rounds_here(args, rounds: int) -> dict:
    """`rounds` interleaved rounds in this process: {n: {"wall": [...], "cpu": [...]}}."""
    fns = decoders(args)
    times = {n: {"wall": [], "cpu": []} for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            wall, cpu = fn()
            times[n]["wall"].append(wall)
            times[n]["cpu"].append(cpu)
    return times


def rounds_trees(args) -> dict:
    """Each round runs one child per tree in turn: {tree: {n: {"wall": [...], "cpu": [...]}}}."""
    times = {t: {n: {"wall": [], "cpu": []} for n in BLOCKS} for t in args.trees}
    child = [sys.executable, __file__, "--child", "--rounds", "1", "--batch", str(args.batch),
             "--max-len", str(args.max_len), "--tokens", str(args.tokens)]  # fmt: skip
    for _ in range(args.rounds):
        for tree in args.trees:
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
            got = json.loads(
                subprocess.run(child, env=env, check=True, capture_output=True, text=True).stdout
            )
            for n in BLOCKS:
                for k in ("wall", "cpu"):
                    times[tree][n][k] += got[str(n)][k]
    return times


def table(times: dict) -> dict:
    """Print one row per (tree, block count) and return the rows."""
    rows = {}
    print(f"{'tree':28s} {'blocks':>6s} {'us/token min':>12s} {'median':>8s} {'spread':>7s} "
          f"{'cpu median us':>13s} {'x 1 block':>9s}")  # fmt: skip
    for tree, per_n in times.items():
        for n, t in per_n.items():
            stats = summary(t["wall"], t["cpu"])  # seconds per token in, so its "ms" are ms per token
            row = {k.replace("_ms", "_us"): v * 1e3 for k, v in stats.items() if k != "spread"}
            row["spread"] = stats["spread"]
            rows[f"{tree} n={n}"] = row
        one = rows[f"{tree} n={BLOCKS[0]}"]["median_us"]
        for n in per_n:
            row = rows[f"{tree} n={n}"]
            row["vs_one_block"] = row["median_us"] / one
            print(f"{tree[-28:]:28s} {n:6d} {row['min_us']:12.1f} {row['median_us']:8.1f} {row['spread']:7.2f} "
                  f"{row['cpu_median_us']:13.1f} {row['vs_one_block']:9.2f}")  # fmt: skip
    return rows


def main() -> None:
    args = parse()
    if args.child:
        print(json.dumps(rounds_here(args, args.rounds)))
        return
    times = rounds_trees(args) if args.trees else {"this tree": rounds_here(args, args.rounds)}
    print(f"batch {args.batch}, max_len {args.max_len}, {args.tokens} tokens per round, {args.rounds} "
          f"interleaved rounds; times are per decoded token (us)")  # fmt: skip
    rows = table(times)
    report = {
        "batch": args.batch,
        "max_len": args.max_len,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "blocks": list(BLOCKS),
        "rows_us": rows,
        "device": str(jax.devices()[0].platform),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
