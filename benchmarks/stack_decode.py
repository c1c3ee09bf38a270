"""Per-token decode cost of a BlockStack with a stacked KV cache, against its blocks run one by one.

The model is a TransformerLM (byte vocabulary, d_model 128, 4 heads, d_ff 512) with n = 1, 2, 4
blocks; a batch of `--batch` prompts of 8 tokens is prefilled into a cache of `--max-len`
positions, then `--tokens` greedy one-token steps are timed, the cache donated to each jitted step.
Sides, per n (both give the same tokens, checked):
  stack    `lm_generate_step`: the BlockStack's `lax.scan` over the stacked cache
  blocks   the same step with the n blocks applied one by one, each on its own unstacked cache
           (what the blocks cost; this side does not go through BlockStack)
A row is the per-token wall time (min / median / spread over rounds), the issuing thread's CPU
time, and the median over the same n's `blocks` median (a stack that costs what its blocks cost
is about 1).

Rounds interleave the sides and block counts. With `--trees A B ...` every round runs this script
once per tree (a child process with `PYTHONPATH=tree`, in turn), so two versions of the library
are measured in interleaved rounds on the same machine.

    python benchmarks/stack_decode.py [--rounds 5] [--out benchmarks/results/stack_decode.json]
    python benchmarks/stack_decode.py --trees /path/to/before /path/to/after --rounds 7
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _timing import interleaved, summary  # noqa: E402

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


@functools.partial(jax.jit, donate_argnums=3)
def blocks_step(lm, blocks, tokens, caches, starts, state):
    """`lm_generate_step` with the blocks run one by one, each on its own unstacked cache."""
    from spectrax_core.models._generate import lm_blocks, lm_embed, lm_sample_head
    from spectrax_core.models._sample import Sampler

    x = lm_embed(lm, tokens[:, None] if tokens.ndim == 1 else tokens)
    new = []
    for blk, cache in zip(blocks, caches):
        x, cache = lm_blocks(blk, x, cache, starts)
        new.append(cache)
    token, state = lm_sample_head(lm, x, state, Sampler(), 0)
    return token, new, state


class Decoder:
    """One side's greedy decode as calls of one token step each: `reset` prefills a fresh cache
    (untimed), each call then decodes the next token from the last one's tokens, cache (donated)
    and state; `tokens` keeps every token when given a list."""

    def __init__(self, cache0, step, prompt, batch: int, tokens: int):
        self.cache0, self.step, self.prompt, self.batch, self.n = cache0, step, prompt, batch, tokens
        self.carry, self.tokens = None, None

    def reset(self):
        from spectrax_core.models._sample import gen_state

        state = gen_state(self.batch, self.n + 1, None, ())
        tokens, cache, state = self.step(self.prompt, self.cache0(), state)
        self.carry = jax.block_until_ready((tokens, cache)) + (state,)

    def __call__(self):
        self.carry = self.step(*self.carry)
        if self.tokens is not None:
            self.tokens.append(self.carry[0])
        return self.carry[:2]


def decode_rounds(fns: dict, rounds: int, tokens: int) -> tuple[dict, dict]:
    """Interleaved rounds of `tokens` chained steps per side (a fresh prefill before each, the
    steps issued ahead and the last one waited for): wall and thread CPU seconds per token."""
    return interleaved(fns, rounds, tokens, setup=lambda k: fns[k].reset(), wait="last")


def decoders(args) -> dict:
    """Per (side, block count): a `Decoder` of `args.tokens` greedy tokens after a prefill;
    compiled, and both sides' tokens checked equal."""
    from spectrax_core.models import TransformerLM, init_cache
    from spectrax_core.models._generate import lm_generate_step
    from spectrax_core.models._sample import Sampler

    prompt = jax.random.randint(jax.random.key(1), (args.batch, 8), 0, 256)
    starts = jnp.zeros((args.batch,), jnp.int32)
    out = {}
    for n in BLOCKS:
        lm = TransformerLM.init(
            jax.random.key(0), vocab_size=256, d_model=128, n_layers=n, n_heads=4, d_ff=512
        )
        blocks = [lm.blocks.layer(i) for i in range(n)]
        sides = {
            "stack": (
                lambda lm=lm: init_cache(lm, args.batch, args.max_len),
                lambda t, c, s, lm=lm: lm_generate_step(lm, t, c, starts, s, Sampler(), 0),
            ),
            "blocks": (
                lambda blocks=blocks: [b.init_cache(args.batch, args.max_len) for b in blocks],
                lambda t, c, s, lm=lm, blocks=blocks: blocks_step(lm, blocks, t, c, starts, s),
            ),
        }
        for side, (cache0, step) in sides.items():
            decoder = out[(side, n)] = Decoder(cache0, step, prompt, args.batch, args.tokens)
            decoder.tokens = []
            decode_rounds({side: decoder}, 1, args.tokens)  # compile and keep the tokens
            decoder.tokens = jnp.stack(decoder.tokens)
        same = bool((out[("stack", n)].tokens == out[("blocks", n)].tokens).all())
        assert same, f"{n} blocks: tokens differ"
        for side in sides:
            out[(side, n)].tokens = None
    return out


def rounds_here(args, rounds: int) -> dict:
    """`rounds` interleaved rounds in this process: {"side n=k": {"wall": [...], "cpu": [...]}}."""
    fns = {f"{side} n={n}": fn for (side, n), fn in decoders(args).items()}
    wall, cpu = decode_rounds(fns, rounds, args.tokens)
    return {k: {"wall": wall[k], "cpu": cpu[k]} for k in fns}


def rounds_trees(args) -> dict:
    """Each round runs one child per tree in turn: {tree: {"side n=k": {"wall": [...], "cpu": [...]}}}."""
    times: dict = {t: {} for t in args.trees}
    child = [sys.executable, __file__, "--child", "--rounds", "1", "--batch", str(args.batch),
             "--max-len", str(args.max_len), "--tokens", str(args.tokens)]  # fmt: skip
    for _ in range(args.rounds):
        for tree in args.trees:
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
            got = json.loads(
                subprocess.run(child, env=env, check=True, capture_output=True, text=True).stdout
            )
            for k, t in got.items():
                mine = times[tree].setdefault(k, {"wall": [], "cpu": []})
                mine["wall"] += t["wall"]
                mine["cpu"] += t["cpu"]
    return times


def table(times: dict) -> dict:
    """Print one row per (tree, side, block count) and return the rows (times in us per token)."""
    rows = {}
    print(f"{'tree':20s} {'side':6s} {'blocks':>6s} {'us/token min':>12s} {'median':>8s} {'spread':>7s} "
          f"{'cpu median us':>13s} {'/ blocks':>8s}")  # fmt: skip
    for tree, per_side in times.items():
        for k, t in per_side.items():
            rows[f"{tree} {k}"] = summary(t["wall"], t["cpu"], unit="us")  # seconds per token in
        for n in BLOCKS:
            for side in ("blocks", "stack"):
                row = rows[f"{tree} {side} n={n}"]
                row["vs_blocks"] = row["median_us"] / rows[f"{tree} blocks n={n}"]["median_us"]
                print(f"{tree[-20:]:20s} {side:6s} {n:6d} {row['min_us']:12.1f} {row['median_us']:8.1f} "
                      f"{row['spread']:7.2f} {row['cpu_median_us']:13.1f} "
                      f"{row['vs_blocks']:8.2f}")  # fmt: skip
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
